"""KL to the reference as a reward penalty (verl's ``algorithm.use_kl_in_reward``), and its controller.

Per trained token ``t`` of a sample, ``kl_t = f(old_t, ref_t)`` with ``old`` the learner's log-probs before
the step's first optimizer step (the proximal pass) and ``ref`` the frozen reference model's; the token
reward is ``-beta * kl_t`` plus the sample's score on its last token (verl's apply_kl_penalty). Estimators
(``learner.kl_reward.estimator``, verl ``algorithm.kl_penalty``): ``k1`` = old - ref (verl ``kl``), ``k2``
= (old - ref)^2 / 2 (``mse``), ``k3`` = exp(ref - old) - (ref - old) - 1 clamped to [-10, 10]
(``low_var_kl``), ``abs`` = |old - ref|. Here, unlike the KL *loss* (learner/kl.py), k1 is fine: the
penalty is a reward, so its gradient comes through the policy-gradient estimator, not through ``f``.

How the token rewards reach the advantage (as verl's estimators read them):

* outcome estimators (mean, mean_std, rloo, gpg, reinforce_plus_plus_baseline) sum a sample's token
  rewards: ``r' = r - beta * sum_t kl_t``, then the estimator runs on ``r'``;
* ``reinforce_plus_plus`` uses the token-level return (gamma 1): ``G_t = r - beta * sum_{t' >= t} kl_t'``,
  whitened over all trained tokens of the step batch: advantages now differ within a sample.
* ``gae`` (PPO with a critic) takes the token rewards themselves, ``r_t = score * [t last] - beta * kl_t``,
  into GAE (:func:`gae_penalties` hands ``beta * kl_t`` to ``Critic.prepare``), as verl's apply_kl_penalty
  followed by compute_gae_advantage_return; the returns the critic is fitted to include the penalty.

``beta`` comes from a fixed or adaptive controller (Ziegler et al. 2019, verl's AdaptiveKLController):
after each step ``beta *= 1 + clip(kl / target_kl - 1, -0.2, 0.2) * n / horizon`` with ``kl`` the batch
mean of each sample's token-mean KL and ``n`` the number of samples. The coefficient is saved with each
checkpoint (``kl_reward_coef``) and restored on resume.

Advantages are computed on every rank from the whole step batch (learner/batch.py), but each rank holds
log-probs only for its own rows, so the per-row KL sums (and, for reinforce++, the whitening moments) are
all-reduced over the data-parallel group first. FSDP only (the launcher refuses it with Megatron).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import torch
import torch.distributed as dist

from learner.advantages import WHITEN_EPS, sequence_advantages
from learner.batch import StepPlan, _trained_lengths

ESTIMATORS = ("k1", "k2", "k3", "abs")


def kl_penalty(old: torch.Tensor, ref: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL estimate of ``old`` against ``ref`` (both [n] log-probs of the sampled tokens)."""
    d = old.double() - ref.double()
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        return (torch.exp(-d) + d - 1).clamp(-10, 10)
    if estimator == "abs":
        return d.abs()
    raise ValueError(f"kl_reward estimator must be one of {list(ESTIMATORS)}, got {estimator!r}")


class KLController:
    """verl's FixedKLController / AdaptiveKLController: ``value`` is beta."""

    def __init__(self, kind: str, coef: float, target_kl: float = 0.1, horizon: int = 10000) -> None:
        if kind not in ("fixed", "adaptive"):
            raise ValueError(f"kl_reward type must be 'fixed' or 'adaptive', got {kind!r}")
        if kind == "adaptive" and horizon <= 0:
            raise ValueError(f"adaptive kl_reward needs horizon > 0, got {horizon}")
        self.kind, self.value, self.target, self.horizon = kind, float(coef), float(target_kl), int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        if self.kind == "adaptive":
            err = float(np.clip(current_kl / self.target - 1, -0.2, 0.2))
            self.value *= 1 + err * n_steps / self.horizon


def _reverse_cumsum(x: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """Per-sequence suffix sums of a packed [n] tensor."""
    out = torch.empty_like(x)
    s = 0
    for n in lens:
        out[s : s + n] = x[s : s + n].flip(0).cumsum(0).flip(0)
        s += n
    return out


def _all_reduce(t: torch.Tensor) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        # gloo and nccl both reduce float64 on CPU / GPU tensors; the plan's tensors live on CPU here
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def _token_kl(batch: pa.RecordBatch, plans: list[StepPlan], estimator: str):
    """The non-empty micro-batches, their per-token KL ([n] float64 each), every row's KL sum (all-reduced),
    the rows' trained lengths and the batch's current KL (the mean over trained samples of the token-mean)."""
    n = batch.num_rows
    kl_sum = torch.zeros(n, dtype=torch.float64)
    mbs = [mb for p in plans for mb in p.micro_batches if mb.rows]
    per_mb_kl = []
    for mb in mbs:
        if mb.prox_logp is None or mb.ref_logp is None:
            raise RuntimeError("kl_reward needs the pre-step and reference log-probs: call prepare_logprobs first")
        k = kl_penalty(mb.prox_logp.detach().cpu(), mb.ref_logp.detach().cpu(), estimator)
        per_mb_kl.append(k)
        lens = mb.seq_lens.tolist()
        kl_sum[mb.rows] = torch.stack([seg.sum() for seg in torch.split(k, lens)])
    _all_reduce(kl_sum)
    t_len = torch.from_numpy(_trained_lengths(batch).astype(np.int64))
    trained = torch.zeros(n, dtype=torch.bool)
    trained[[r for mb in mbs for r in mb.rows]] = True
    trained = _all_reduce(trained.double()) > 0
    seq_kl = kl_sum / t_len.clamp(min=1)
    current_kl = float(seq_kl[trained].mean()) if bool(trained.any()) else 0.0
    return mbs, per_mb_kl, kl_sum, t_len, current_kl


def gae_penalties(
    batch: pa.RecordBatch, plans: list[StepPlan], *, estimator: str, controller: KLController
) -> tuple[dict[int, torch.Tensor], dict[str, float]]:
    """For ``advantage=gae``: per non-empty micro-batch (keyed by ``id(mb)``) the [n] float64 token penalties
    ``beta * kl_t`` that ``Critic.prepare`` subtracts from the token rewards before GAE; and the metrics.
    Updates the controller (after reading beta, as :func:`apply`). Collective, needs the same log-probs."""
    beta = controller.value
    mbs, per_mb_kl, _, _, current_kl = _token_kl(batch, plans, estimator)
    out = {id(mb): beta * k for mb, k in zip(mbs, per_mb_kl, strict=True)}
    controller.update(current_kl, batch.num_rows)
    return out, {"kl_reward_kl": current_kl, "kl_reward_coef": beta}


def apply(
    batch: pa.RecordBatch,
    plans: list[StepPlan],
    *,
    advantage: str,
    drop_uniform: bool,
    estimator: str,
    controller: KLController,
) -> dict[str, float]:
    """Rewrite every micro-batch's advantages with the KL penalty in the reward; returns metrics.

    Needs ``prox_logp`` and ``ref_logp`` on every micro-batch (``engine.prepare_logprobs`` on every plan),
    collective over the default process group (every rank calls it with its own plans). Not for ``gae``
    (:func:`gae_penalties`: the critic's GAE takes the token rewards).
    """
    if advantage == "gae":
        raise ValueError("kl_reward.apply does not compute GAE: use kl_reward.gae_penalties with Critic.prepare")
    beta = controller.value
    n = batch.num_rows
    mbs, per_mb_kl, kl_sum, t_len, current_kl = _token_kl(batch, plans, estimator)
    rewards = torch.from_numpy(batch.column("reward").to_numpy(zero_copy_only=False).astype(np.float64))
    metrics = {"kl_reward_kl": current_kl, "kl_reward_coef": beta}
    if advantage != "reinforce_plus_plus":
        _, gidx = np.unique(batch.column("group_id").to_numpy(zero_copy_only=False), return_inverse=True)
        adv, _ = sequence_advantages(
            (rewards - beta * kl_sum).float(),
            torch.from_numpy(gidx.astype(np.int64)),
            advantage,
            drop_uniform,
            lengths=t_len,
        )
        for mb in mbs:
            mb.advantages = torch.repeat_interleave(adv[mb.rows], mb.seq_lens).to(mb.advantages.device)
    else:
        returns = []
        mom = torch.zeros(3, dtype=torch.float64)  # token count, sum, sum of squares over all trained tokens
        for mb, k in zip(mbs, per_mb_kl, strict=True):
            lens = mb.seq_lens.tolist()
            g = torch.repeat_interleave(rewards[mb.rows], mb.seq_lens) - beta * _reverse_cumsum(k, lens)
            returns.append(g)
            mom += torch.stack([torch.tensor(float(g.numel()), dtype=torch.float64), g.sum(), (g * g).sum()])
        _all_reduce(mom)
        cnt, s1, s2 = (float(x) for x in mom)
        mu = s1 / max(cnt, 1.0)
        var = (s2 - cnt * mu * mu) / (cnt - 1) if cnt > 1 else 0.0
        for mb, g in zip(mbs, returns, strict=True):
            mb.advantages = ((g - mu) / np.sqrt(max(var, 0.0) + WHITEN_EPS)).float().to(mb.advantages.device)
    controller.update(current_kl, n)
    return metrics
