"""GRPO advantages and the clipped policy loss with an explicit off-policy correction.

Pure functions on flat token tensors (one entry per response token of a packed
micro-batch), so the FSDP and Megatron engines share them and tests can check
them against hand-computed numbers.

Corrections (``LossConfig.correction``), with ``pi`` the policy being trained,
``mu`` the sampler (behaviour log-probs stored with each sample), ``old`` the
learner's policy before this optimizer step, ``r(x, y) = exp(x - y)``:

* ``none``: plain PPO that treats the sampler as the old policy:
  ``ratio = r(pi, mu)`` clipped, no weight. Only legal on-policy (k = 0).
* ``tis``: truncated importance sampling on the behaviour/learner ratio:
  ``ratio = r(pi, old)`` clipped, ``w = min(r(old, mu), tis_cap)`` (detached).
  ``old`` is the recomputed pre-step log-prob if given, else the training
  forward's own detached log-prob (the same policy: one optimizer step per batch).
* ``decoupled`` (AReaL's decoupled PPO): the proximal policy is the learner's
  policy before this step, recomputed without grad and passed in; ``ratio =
  r(pi, prox)`` clipped, ``w = min(r(prox, mu), tis_cap)``. It requires the
  recomputed log-probs, so the trust region is measured against weights the
  learner really holds rather than against a stale sampler.

The per-token objective is ``-w * min(ratio * A, clip(ratio, 1 - clip_low, 1 +
clip_high) * A)`` plus ``kl_coef * KL(pi || ref)`` (k1 or k3 estimator). Tokens
are combined with aggregation weights (:func:`aggregation_weights`) that sum to
one over the *whole step* (all micro-batches, all ranks), so summing each
micro-batch's loss gives the global mean no matter how the batch was split.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from tokens sampled by pi (Schulman's k1/k3)."""
    if estimator == "k1":
        return logp - ref_logp
    if estimator == "k3":
        d = ref_logp - logp
        return torch.exp(d) - d - 1
    raise ValueError(f"kl_estimator must be 'k1' or 'k3', got {estimator!r}")


@dataclass(kw_only=True, slots=True)
class LossSettings:
    """The loss part of ``LossConfig`` as plain values (no pydantic in the hot path)."""

    correction: str
    clip_low: float = 0.2
    clip_high: float = 0.28
    tis_cap: float = 2.0
    kl_coef: float = 0.0
    kl_estimator: str = "k3"

    def __post_init__(self) -> None:
        if self.correction not in ("none", "tis", "decoupled"):
            raise ValueError(f"correction must be 'none', 'tis' or 'decoupled', got {self.correction!r}")

    @classmethod
    def from_config(cls, cfg) -> LossSettings:
        return cls(correction=cfg.correction, clip_low=cfg.clip_low, clip_high=cfg.clip_high,
                   tis_cap=cfg.tis_cap, kl_coef=cfg.kl_coef, kl_estimator=cfg.kl_estimator)


def policy_loss(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    s: LossSettings,
    prox_logp: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The weighted loss of one micro-batch and its metrics (all tensors are [n_tokens]).

    ``advantages`` are per token (the sequence's advantage repeated); ``weights``
    from :func:`aggregation_weights`. Returns ``(loss, metrics)``: ``loss`` =
    sum(weights * per-token loss); metrics are weighted sums (or maxima for names
    ending in ``_max``), detached, to be combined over micro-batches and ranks.
    """
    n = logp.shape[0]
    for name, t in (("behaviour_logp", behaviour_logp), ("advantages", advantages), ("weights", weights)):
        if t.shape != (n,):
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected ({n},) like logp")
    behaviour_logp = behaviour_logp.to(logp.dtype)
    if s.correction == "decoupled" and prox_logp is None:
        raise ValueError("correction='decoupled' needs prox_logp: the learner's log-probs recomputed before the step")
    old = prox_logp.detach() if prox_logp is not None else logp.detach()
    if s.correction == "none":
        ratio = torch.exp(logp - behaviour_logp)
        is_w = torch.ones_like(logp)
    else:
        ratio = torch.exp(logp - old)
        is_w = torch.exp(old - behaviour_logp).clamp(max=s.tis_cap).detach()
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - s.clip_low, 1 + s.clip_high) * advantages
    pg = -is_w * torch.minimum(unclipped, clipped)
    per_token = pg
    kl = None
    if s.kl_coef > 0:
        if ref_logp is None:
            raise ValueError(f"kl_coef={s.kl_coef} needs ref_logp (the reference model's log-probs)")
        kl = kl_estimate(logp, ref_logp.to(logp.dtype), s.kl_estimator)
        per_token = pg + s.kl_coef * kl
    w = weights.to(logp.dtype)
    loss = (w * per_token).sum()

    with torch.no_grad():
        wd = w.detach()
        lp = logp.detach()
        # Clipping is active where min() took the clipped term and it differs: there the gradient is zero.
        clip_active = (clipped.detach() < unclipped.detach()).to(wd.dtype)
        # Tokens come from mu, so KL(mu || pi) = E_mu[log mu - log pi]; k3 is its non-negative estimator.
        d = lp - behaviour_logp
        metrics = {
            "loss_total": loss.detach(),
            "loss_policy": (wd * pg.detach()).sum(),
            "clip_frac": (wd * clip_active).sum(),
            "ratio_mean": (wd * ratio.detach()).sum(),
            "is_weight_mean": (wd * is_w).sum(),
            # Weight-zero tokens (the empty micro-batches that keep ranks in step) do not count.
            "is_weight_max": is_w[wd > 0].max() if bool((wd > 0).any()) else torch.zeros((), dtype=wd.dtype),
            "mismatch_kl_k3": (wd * (torch.exp(d) - d - 1)).sum(),
            "mismatch_logp_diff": (wd * (behaviour_logp - lp)).sum(),
        }
        if kl is not None:
            metrics["loss_kl"] = (wd * kl.detach()).sum()
        if entropy is not None:
            metrics["entropy"] = (wd * entropy.detach().to(wd.dtype)).sum()
    return loss, metrics


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
