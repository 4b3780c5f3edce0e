"""GRPO advantages and the clipped policy loss with an explicit off-policy correction.

Pure functions on flat token tensors (one entry per response token of a packed
micro-batch), so the FSDP and Megatron engines share them and tests can check
them against hand-computed numbers.

Corrections (``LossConfig.correction``), with ``pi`` the policy being trained,
``mu`` the sampler (behaviour log-probs stored with each sample), ``prox`` the
learner's policy before the first optimizer step of this step batch (recomputed
once, no grad), ``r(x, y) = exp(x - y)``:

* ``none``: verl's PPO: ``ratio = r(pi, prox)`` clipped, no behaviour weight. The ratio's base is the
  learner's own log-probs of the batch before its first optimizer step (the proximal pass when there are
  several optimizer steps; with one, ``sg(pi)`` itself), never the sampler's: the engine-vs-learner gap
  (bf16, kernels) would otherwise already sit in the first ratio and clip tokens that never moved. It
  ignores that the sampler differed from the learner, so it is only legal on-policy (k = 0).
* ``tis``: truncated importance sampling. Without ``prox`` (``recompute_proximal``
  off): ``ratio = r(pi, sg(pi)) = 1`` with the gradient of ``log pi``, weighted by
  ``w = min(r(sg(pi), mu), tis_cap)``: a truncated-IS policy gradient with no
  trust region. With ``prox`` it is the same objective as ``decoupled``.
* ``decoupled`` (AReaL's decoupled PPO): ``ratio = r(pi, prox)`` clipped (the
  trust region, measured against weights the learner really held),
  ``w = min(r(prox, mu), tis_cap)`` (the behaviour correction).

The clip binds only once ``pi`` has moved from ``prox``: with several optimizer
steps per step batch (``learner.ppo_mini_batch_size`` / ``ppo_epochs``,
learner/minibatch.py). With one step the ratio is exactly 1 where the gradient is
taken and ``decoupled`` equals ``tis``.

Per token: ``pg = -w * min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)``;
for ``A < 0`` it is further capped at ``-w * clip_ratio_c * A`` (dual-clip, Ye et
al. 2020), so a token whose ratio exploded cannot dominate the step. The
log-ratio is clamped to +-LOG_RATIO_CLAMP before ``exp`` (no inf * 0 = nan).
Plus ``kl_coef * min(r(pi, mu), tis_cap) * kl_term`` (learner/kl.py states the
gradient direction of each estimator). Tokens are combined with aggregation
weights (:func:`aggregation_weights`) that sum to one over the *optimizer step*
(all micro-batches, all ranks), so summing each micro-batch's loss gives the
mean no matter how the batch was split.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from learner import kl

# exp() of a log-ratio beyond this is treated as this (e^20 ~ 5e8): keeps inf * 0 = nan out of the loss.
LOG_RATIO_CLAMP = 20.0
# The per-token k3 term is clamped to +-this (as verl's low_var_kl): one token whose ratio to the reference
# exploded (k3 grows like exp(d)) would otherwise overflow fp32 and skip the whole optimizer step.
KL_CLAMP = 10.0
# Metric names ending in "_max" combine across micro-batches/ranks with max; all others with sum
# (they are already weighted by aggregation weights that sum to one over the step).
MAX_SUFFIX = "_max"


def group_advantages(
    rewards: torch.Tensor, group_index: torch.Tensor, mode: str, drop_uniform: bool, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-normalised advantages (GRPO) and the mask of samples to keep.

    ``rewards``: [n] float; ``group_index``: [n] int64 (any labels, equal = same group).
    ``mode``: ``mean`` (A = r - mean_g) or ``mean_std`` (A = (r - mean_g) / (std_g + eps),
    std with Bessel's correction, as DeepSeekMath's GRPO; a group of one has std 0).
    ``drop_uniform``: samples of groups whose rewards are all equal get keep=False
    (their advantage is zero, so they only dilute the normalisation).
    """
    if mode not in ("mean", "mean_std"):
        raise ValueError(f"advantage mode must be 'mean' or 'mean_std', got {mode!r}")
    if rewards.shape != group_index.shape or rewards.dim() != 1:
        raise ValueError(f"rewards {tuple(rewards.shape)} and group_index {tuple(group_index.shape)} must be equal 1-D shapes")
    rewards = rewards.double()
    _, inv = torch.unique(group_index, return_inverse=True)
    n_groups = int(inv.max()) + 1 if inv.numel() else 0
    count = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, inv, torch.ones_like(rewards))
    mean = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, inv, rewards) / count
    centred = rewards - mean[inv]
    sq = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, inv, centred**2)
    std = torch.sqrt(sq / (count - 1).clamp(min=1))
    adv = centred / (std[inv] + eps) if mode == "mean_std" else centred
    # Exact comparison: a group is uniform only if every reward equals its first.
    gmax = torch.zeros(n_groups, dtype=torch.float64).scatter_reduce_(0, inv, rewards, "amax", include_self=False)
    gmin = torch.zeros(n_groups, dtype=torch.float64).scatter_reduce_(0, inv, rewards, "amin", include_self=False)
    uniform = (gmax == gmin)[inv]
    keep = ~uniform if drop_uniform else torch.ones_like(uniform)
    return adv.float(), keep


def aggregation_weights(seq_lens: torch.Tensor, mode: str, total_tokens: int, total_seqs: int) -> torch.Tensor:
    """Per-token weights of the sequences ``seq_lens`` (response tokens of each).

    ``token``: every token of the step weighs 1 / total_tokens (long answers weigh more).
    ``sequence``: each sequence weighs 1 / total_seqs, shared by its tokens (mean of means).
    ``total_*`` count the whole optimizer step across micro-batches and ranks.
    """
    if mode == "token":
        return torch.full((int(seq_lens.sum()),), 1.0 / max(total_tokens, 1))
    if mode == "sequence":
        per_seq = 1.0 / (seq_lens.clamp(min=1).double() * max(total_seqs, 1))
        return torch.repeat_interleave(per_seq, seq_lens).float()
    raise ValueError(f"aggregation must be 'token' or 'sequence', got {mode!r}")


@dataclass(kw_only=True, slots=True)
class LossSettings:
    """The loss part of ``LossConfig`` as plain values (no pydantic in the hot path)."""

    correction: str
    clip_low: float = 0.2
    clip_high: float = 0.28
    clip_ratio_c: float = 3.0
    tis_cap: float = 2.0
    kl_coef: float = 0.0
    kl_estimator: str = "k3"

    def __post_init__(self) -> None:
        if self.correction not in ("none", "tis", "decoupled"):
            raise ValueError(f"correction must be 'none', 'tis' or 'decoupled', got {self.correction!r}")
        if not self.clip_ratio_c > 1:
            raise ValueError(f"clip_ratio_c must be > 1 (the dual-clip bound on -A * ratio), got {self.clip_ratio_c}")
        self.kl_estimator = kl.resolve(self.kl_estimator)

    @classmethod
    def from_config(cls, cfg) -> LossSettings:
        return cls(correction=cfg.correction, clip_low=cfg.clip_low, clip_high=cfg.clip_high,
                   clip_ratio_c=cfg.clip_ratio_c, tis_cap=cfg.tis_cap, kl_coef=cfg.kl_coef,
                   kl_estimator=cfg.kl_estimator)


def needs_proximal(correction: str, recompute_proximal: bool, several_optimizer_steps: bool) -> bool:
    """Whether the learner must recompute its pre-step log-probs (a no-grad forward) before the first optimizer
    step: ``decoupled`` always; ``tis`` when asked (its trust region); ``none`` when a step batch makes
    several optimizer steps (from the second on, ``sg(pi)`` is no longer the pre-step policy)."""
    if correction == "decoupled":
        return True
    if correction == "tis":
        return recompute_proximal
    return several_optimizer_steps


def _k3(d: torch.Tensor) -> torch.Tensor:
    """exp(d) - d - 1 >= 0: with d = log p - log q and tokens from q, an estimate of KL(q || p)."""
    return torch.exp(d) - d - 1


def policy_loss(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    s: LossSettings,
    prox_logp: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    fresh: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The weighted loss of one micro-batch and its metrics (all tensors are [n_tokens]).

    ``advantages`` are per token (the sequence's advantage repeated); ``weights``
    from :func:`aggregation_weights`; ``fresh`` (bool) marks tokens sampled by the
    policy version the learner held before this step (staleness 0), whose gap to
    the learner is engine mismatch alone. Returns ``(loss, metrics)``: ``loss`` =
    sum(weights * per-token loss); metrics are weighted sums (or maxima for names
    ending in ``_max``), detached, to be combined over micro-batches and ranks and
    then :func:`finalize_metrics`.
    """
    n = logp.shape[0]
    for name, t in (("behaviour_logp", behaviour_logp), ("advantages", advantages), ("weights", weights)):
        if t.shape != (n,):
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected ({n},) like logp")
    behaviour_logp = behaviour_logp.to(logp.dtype)
    if s.correction == "decoupled" and prox_logp is None:
        raise ValueError("correction='decoupled' needs prox_logp: the learner's log-probs recomputed before the step")
    old = prox_logp.detach().to(logp.dtype) if prox_logp is not None else logp.detach()
    log_ratio = (logp - old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    if s.correction == "none":
        is_w = torch.ones_like(logp)
    else:
        is_w = torch.exp((old - behaviour_logp).clamp(max=LOG_RATIO_CLAMP)).clamp(max=s.tis_cap).detach()
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - s.clip_low, 1 + s.clip_high) * advantages
    surrogate = -torch.minimum(unclipped, clipped)
    dual_bound = -s.clip_ratio_c * advantages
    dual_active = (advantages < 0) & (surrogate > dual_bound)
    pg = is_w * torch.where(dual_active, dual_bound, surrogate)
    per_token = pg
    kl_val = None
    if s.kl_coef > 0:
        if ref_logp is None:
            raise ValueError(f"kl_coef={s.kl_coef} needs ref_logp (the reference model's log-probs)")
        kl_val = kl.kl_term(logp, ref_logp.to(logp.dtype), s.kl_estimator)
        if s.kl_estimator == "k3":
            kl_val = kl_val.clamp(-KL_CLAMP, KL_CLAMP)
        # Tokens come from mu: weight by pi/mu (detached, truncated) so the KL gradient is pi's (learner/kl.py).
        # `none` treats the sampler as the policy (verl): no weight there either.
        if s.correction == "none":
            kl_w = torch.ones_like(logp)
        else:
            kl_w = torch.exp((logp.detach() - behaviour_logp).clamp(max=LOG_RATIO_CLAMP)).clamp(max=s.tis_cap)
        per_token = pg + s.kl_coef * kl_w * kl_val
    w = weights.to(logp.dtype)
    loss = (w * per_token).sum()

    with torch.no_grad():
        wd = w.detach()
        lp = logp.detach()
        # Clipping is active where min() took the clipped term and it differs: there the gradient is zero.
        clip_active = (clipped.detach() < unclipped.detach()).to(wd.dtype)
        # Tokens come from mu, so KL(mu || pi) = E_mu[log mu - log pi]; k3 is its non-negative estimator.
        d = lp - behaviour_logp
        # Engine mismatch vs drift: the learner's pre-step log-probs (prox when computed) against mu, split by
        # whether the token came from the version the learner held (fresh: mismatch only) or an older one.
        k3_pre = _k3(old - behaviour_logp)
        fr = fresh.to(wd.dtype) if fresh is not None else torch.zeros_like(wd)
        metrics = {
            "loss_total": loss.detach(),
            "loss_policy": (wd * pg.detach()).sum(),
            "clip_frac": (wd * clip_active).sum(),
            "clip_dual_frac": (wd * dual_active.to(wd.dtype)).sum(),
            "ratio_mean": (wd * ratio.detach()).sum(),
            "is_weight_mean": (wd * is_w).sum(),
            # Weight-zero tokens (the empty micro-batches that keep ranks in step) do not count; importance
            # weights are >= 0, so masking them to 0 (and a 0 appended for an empty batch) keeps the max without
            # a host sync per micro-batch.
            "is_weight_max": torch.cat([torch.where(wd > 0, is_w.to(wd.dtype), 0.0),
                                        wd.new_zeros(1)]).max(),
            "mismatch_kl_k3": (wd * _k3(d)).sum(),
            "mismatch_logp_diff": (wd * (behaviour_logp - lp)).sum(),
            "fresh_token_frac": (wd * fr).sum(),
            "mismatch_kl_k3_fresh": (wd * fr * k3_pre).sum(),
            "drift_kl_k3": (wd * (1 - fr) * k3_pre).sum(),
        }
        if kl_val is not None:
            metrics["loss_kl"] = (wd * kl_val.detach()).sum()
        if entropy is not None:
            metrics["entropy"] = (wd * entropy.detach().to(wd.dtype)).sum()
    return loss, metrics


def finalize_metrics(m: dict[str, float]) -> dict[str, float]:
    """Turn the fresh/stale weighted sums into means over those tokens (after the reduction over ranks)."""
    out = dict(m)
    frac = out.get("fresh_token_frac")
    if frac is not None:
        out["mismatch_kl_k3_fresh"] = out["mismatch_kl_k3_fresh"] / frac if frac > 0 else float("nan")
        out["drift_kl_k3"] = out["drift_kl_k3"] / (1 - frac) if frac < 1 else float("nan")
    return out


def combine_metrics(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Combine per-micro-batch metrics: sum, or max for ``*_max`` names."""
    out: dict[str, torch.Tensor] = {}
    for m in parts:
        for k, v in m.items():
            if k not in out:
                out[k] = v.clone()
            elif k.endswith(MAX_SUFFIX):
                out[k] = torch.maximum(out[k], v)
            else:
                out[k] = out[k] + v
    return out
