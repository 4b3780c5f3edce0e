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
  ``w = min(r(prox, mu), tis_cap)`` (the behaviour correction). With
  ``learner.rollout_correction`` on, ``w`` is instead the step's precomputed weight
  (``is_weights``: token or sequence level, truncated or IcePop, rejected tokens
  already out of the aggregation weights; learner/correction.py).
* ``bypass`` (verl's ``rollout_correction.bypass_mode`` with the PPO-clip loss):
  ``ratio = r(pi, mu)`` clipped, no behaviour weight and no proximal pass: the clip
  is the only correction (the engine-vs-learner gap sits in the first ratio).

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
mean no matter how the batch was split; verl's sum modes multiply that mean by a
step-level factor (:func:`aggregation_scale`). ``LossSettings.policy_loss`` swaps
the per-token surrogate for GSPO's or GMPO's sequence-level one (:func:`surrogate`);
``entropy_coeff`` subtracts an entropy bonus. docs/algorithms.md maps each to verl.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from learner import kl
from learner.advantages import sequence_advantages

# exp() of a log-ratio beyond this is treated as this (e^20 ~ 5e8): keeps inf * 0 = nan out of the loss.
LOG_RATIO_CLAMP = 20.0
# The per-token k3 term is clamped to +-this (as verl's low_var_kl): one token whose ratio to the reference
# exploded (k3 grows like exp(d)) would otherwise overflow fp32 and skip the whole optimizer step.
KL_CLAMP = 10.0
# Metric names ending in "_max" combine across micro-batches/ranks with max; all others with sum
# (they are already weighted by aggregation weights that sum to one over the step).
MAX_SUFFIX = "_max"


def group_advantages(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    mode: str,
    drop_uniform: bool,
    eps: float = 1e-6,
    lengths: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample advantages and the mask of samples to keep: learner/advantages.py's estimators.

    ``rewards``: [n] float; ``group_index``: [n] int64 (any labels, equal = same group).
    ``mode``: ``mean`` (A = r - mean_g), ``mean_std`` (A = (r - mean_g) / (std_g + eps),
    std with Bessel's correction, as DeepSeekMath's GRPO; a group of one has std 0) or any
    other of ``learner.advantages.ESTIMATORS`` (the reinforce++ ones need ``lengths``).
    ``drop_uniform``: samples of groups whose rewards are all equal get keep=False
    (their advantage is zero, so they only dilute the normalisation).
    """
    return sequence_advantages(rewards, group_index, mode, drop_uniform, lengths=lengths, eps=eps)


AGGREGATIONS = ("token", "sequence", "token_sum", "seq_mean_token_sum", "seq_mean_token_sum_norm")


def aggregation_weights(seq_lens: torch.Tensor, mode: str, total_tokens: int, total_seqs: int) -> torch.Tensor:
    """Per-token weights of the sequences ``seq_lens`` (response tokens of each); they sum to one over the step.

    ``token``: every token of the step weighs 1 / total_tokens (long answers weigh more).
    ``sequence``: each sequence weighs 1 / total_seqs, shared by its tokens (mean of means).
    The three sum modes weigh tokens as ``token`` and get their size from :func:`aggregation_scale`.
    ``total_*`` count the whole optimizer step across micro-batches and ranks.
    """
    if mode in ("token", "token_sum", "seq_mean_token_sum", "seq_mean_token_sum_norm"):
        return torch.full((int(seq_lens.sum()),), 1.0 / max(total_tokens, 1))
    if mode == "sequence":
        per_seq = 1.0 / (seq_lens.clamp(min=1).double() * max(total_seqs, 1))
        return torch.repeat_interleave(per_seq, seq_lens).float()
    raise ValueError(f"aggregation must be one of {list(AGGREGATIONS)}, got {mode!r}")


def aggregation_scale(mode: str, total_tokens: int, total_seqs: int, loss_scale_factor: int | None = None) -> float:
    """The factor on ``sum(weights * loss)`` that turns the token mean into verl's sum modes.

    With T tokens and S sequences in the optimizer step and token-mean weights 1 / T:
    ``token_sum`` = sum of all token losses = T * mean; ``seq_mean_token_sum`` = (1 / S) * that sum
    = (T / S) * mean; ``seq_mean_token_sum_norm`` (Dr. GRPO) divides that by a constant length
    ``loss_scale_factor`` (verl: that, else the padded response length, i.e. the generation limit).
    Metrics keep the normalised weights, so they stay means whatever the mode.
    """
    if mode in ("token", "sequence"):
        return 1.0
    t, n = max(total_tokens, 1), max(total_seqs, 1)
    if mode == "token_sum":
        return float(t)
    if mode == "seq_mean_token_sum":
        return t / n
    if mode == "seq_mean_token_sum_norm":
        if not loss_scale_factor or loss_scale_factor < 1:
            raise ValueError(
                f"aggregation 'seq_mean_token_sum_norm' needs loss_scale_factor >= 1 (a constant "
                f"length, e.g. rollout.sampling.max_tokens), got {loss_scale_factor!r}"
            )
        return t / (n * loss_scale_factor)
    raise ValueError(f"aggregation must be one of {list(AGGREGATIONS)}, got {mode!r}")


def mean_share(mode: str, kept_tokens: int, kept_seqs: int, all_tokens: int, all_seqs: int) -> float:
    """The factor on an optimizer step's loss that puts samples it skipped back into the loss's mean.

    A skipped sample whose every token loss is zero (a uniform group's, at advantage 0) adds nothing to
    the sums, only to the denominators: ``token`` divides by all tokens (``kept_tokens / all_tokens`` of
    the kept mean), ``sequence`` and the ``seq_mean_*`` modes by all sequences (``kept_seqs / all_seqs``),
    ``token_sum`` by nothing (1). With this factor on :func:`aggregation_scale`'s, the step's gradient
    equals the one of training the skipped samples too.
    """
    if mode not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {list(AGGREGATIONS)}, got {mode!r}")
    if not (0 <= kept_tokens <= all_tokens and 0 <= kept_seqs <= all_seqs):
        raise ValueError(
            f"kept counts ({kept_tokens} tokens, {kept_seqs} sequences) must lie within all "
            f"({all_tokens} tokens, {all_seqs} sequences)"
        )
    if mode == "token":
        return kept_tokens / all_tokens if all_tokens else 1.0
    if mode == "token_sum":
        return 1.0
    return kept_seqs / all_seqs if all_seqs else 1.0


CORRECTIONS = ("none", "tis", "decoupled", "bypass")


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
    policy_loss: str = "vanilla"
    entropy_coeff: float = 0.0
    # bypass only: learner.rollout_correction's rejection rules, measured per micro-batch (learner/correction.py)
    rejection: tuple = ()

    def __post_init__(self) -> None:
        if self.correction not in CORRECTIONS:
            raise ValueError(f"correction must be one of {list(CORRECTIONS)}, got {self.correction!r}")
        if self.policy_loss not in POLICY_LOSSES:
            raise ValueError(f"policy_loss must be one of {list(POLICY_LOSSES)}, got {self.policy_loss!r}")
        if not self.entropy_coeff >= 0:
            raise ValueError(f"entropy_coeff must be >= 0, got {self.entropy_coeff}")
        if not self.clip_ratio_c > 1:
            raise ValueError(f"clip_ratio_c must be > 1 (the dual-clip bound on -A * ratio), got {self.clip_ratio_c}")
        self.kl_estimator = kl.resolve(self.kl_estimator)
        if self.rejection and self.correction != "bypass":
            raise ValueError(
                "per-micro-batch rejection rules are bypass mode's; decoupled measures them once per "
                "step (learner/correction.py apply)"
            )

    @classmethod
    def from_config(cls, cfg, rollout_correction=None) -> LossSettings:
        """``cfg``: learner.loss; ``rollout_correction``: learner.rollout_correction (its rules, with bypass)."""
        rc = rollout_correction
        rules = tuple(rc.rejection) if rc is not None and rc.enable and cfg.correction == "bypass" else ()
        return cls(
            correction=cfg.correction,
            clip_low=cfg.clip_low,
            clip_high=cfg.clip_high,
            clip_ratio_c=cfg.clip_ratio_c,
            tis_cap=cfg.tis_cap,
            kl_coef=cfg.kl_coef,
            kl_estimator=cfg.kl_estimator,
            policy_loss=cfg.policy_loss,
            entropy_coeff=cfg.entropy_coeff,
            rejection=rules,
        )


def needs_proximal(correction: str, recompute_proximal: bool, several_optimizer_steps: bool) -> bool:
    """Whether the learner must recompute its pre-step log-probs (a no-grad forward) before the first optimizer
    step: ``decoupled`` always; ``tis`` when asked (its trust region); ``none`` when a step batch makes
    several optimizer steps (from the second on, ``sg(pi)`` is no longer the pre-step policy); ``bypass`` never
    (its ratio is against the sampler)."""
    if correction == "decoupled":
        return True
    if correction == "tis":
        return recompute_proximal
    if correction == "bypass":
        return False
    return several_optimizer_steps


def _k3(d: torch.Tensor) -> torch.Tensor:
    """exp(d) - d - 1 >= 0: with d = log p - log q and tokens from q, an estimate of KL(q || p)."""
    return torch.exp(d) - d - 1


POLICY_LOSSES = ("vanilla", "gspo", "geo_mean")


def _segments(seq_lens: torch.Tensor | None, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token sequence index [n] and token counts [s] of a packed micro-batch's sequences."""
    if seq_lens is None or int(seq_lens.sum()) != n:
        raise ValueError(
            f"a sequence-level policy loss needs seq_lens summing to the {n} tokens, got "
            f"{None if seq_lens is None else seq_lens.tolist()}"
        )
    lens = seq_lens.to(device)
    return torch.repeat_interleave(torch.arange(lens.numel(), device=device), lens), lens.clamp(min=1)


def _seq_mean(x: torch.Tensor, seg: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    return torch.zeros(lens.numel(), dtype=x.dtype, device=x.device).index_add(0, seg, x) / lens.to(x.dtype)


def surrogate(
    logp: torch.Tensor,
    base: torch.Tensor,
    advantages: torch.Tensor,
    is_w: torch.Tensor,
    s: LossSettings,
    seq_lens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token policy-gradient loss of ``s.policy_loss`` and (ratio, clip_active, dual_active) for metrics.

    ``base``: the log-probs the ratio is taken against (detached); ``is_w``: the detached behaviour weight.

    * ``vanilla``: PPO's clipped token ratio with dual-clip (module docstring).
    * ``gspo`` (GSPO, Zheng et al. 2025): the sequence ratio ``s_i = exp(mean_t(log pi - base))`` used at
      every token as ``sg(s_i) * pi / sg(pi)`` (so each token's gradient is ``s_i * grad log pi``),
      clipped with clip_low/clip_high like PPO, no dual-clip, log-ratio capped at 10 (as verl's
      compute_policy_loss_gspo); the behaviour weight stays per token.
    * ``geo_mean`` (GMPO, Zhao et al. 2025): the geometric mean of the token ratios, each token's
      log-ratio clipped to [-clip_low, clip_high] only on the side that would increase the objective
      (sign of A), times the sequence's mean advantage; the behaviour weight is the sequence's
      geometric mean. The per-sequence loss is put on each of its tokens, so sequence weights
      (effective_aggregation) give the mean over sequences.
    """
    n = logp.shape[0]
    if s.policy_loss == "vanilla":
        ratio = torch.exp((logp - base).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        unclipped = ratio * advantages
        clipped = ratio.clamp(1 - s.clip_low, 1 + s.clip_high) * advantages
        surr = -torch.minimum(unclipped, clipped)
        dual_bound = -s.clip_ratio_c * advantages
        dual_active = (advantages < 0) & (surr > dual_bound)
        # Clipping is active where min() took the clipped term and it differs: there the gradient is zero.
        return is_w * torch.where(dual_active, dual_bound, surr), ratio, clipped < unclipped, dual_active
    seg, lens = _segments(seq_lens, n, logp.device)
    no_dual = torch.zeros(n, dtype=torch.bool, device=logp.device)
    if s.policy_loss == "gspo":
        seq_log = _seq_mean((logp - base).detach(), seg, lens)
        ratio = torch.exp((logp - logp.detach() + seq_log[seg]).clamp(max=10.0))
        loss_un = -advantages * ratio
        loss_cl = -advantages * ratio.clamp(1 - s.clip_low, 1 + s.clip_high)
        return is_w * torch.maximum(loss_un, loss_cl), ratio, loss_cl > loss_un, no_dual
    if s.policy_loss == "geo_mean":
        d = (logp - base).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        sgn = torch.sign(advantages)
        dc = d.clamp(-s.clip_low, s.clip_high)
        d_min = sgn * torch.minimum(sgn * d, sgn * dc)
        seq_ratio = torch.exp(_seq_mean(d_min, seg, lens))
        seq_adv = _seq_mean(advantages.to(logp.dtype), seg, lens)
        # verl's 1e-10 keeps log() finite for a zero weight
        seq_is = torch.exp(_seq_mean(torch.log(is_w + 1e-10), seg, lens))
        pg_seq = -seq_adv * seq_ratio * seq_is
        return pg_seq[seg], seq_ratio[seg], (d != dc) & (advantages != 0), no_dual
    raise ValueError(f"policy_loss must be one of {list(POLICY_LOSSES)}, got {s.policy_loss!r}")


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
    seq_lens: torch.Tensor | None = None,
    loss_scale: float = 1.0,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The weighted loss of one micro-batch and its metrics (all tensors are [n_tokens]).

    ``advantages`` are per token (the sequence's advantage repeated); ``weights``
    from :func:`aggregation_weights`; ``fresh`` (bool) marks tokens sampled by the
    policy version the learner held before this step (staleness 0), whose gap to
    the learner is engine mismatch alone. Returns ``(loss, metrics)``: ``loss`` =
    sum(weights * per-token loss); metrics are weighted sums (or maxima for names
    ending in ``_max``), detached, to be combined over micro-batches and ranks and
    then :func:`finalize_metrics`. ``seq_lens``: the micro-batch's sequences (gspo/geo_mean need them);
    ``loss_scale``: :func:`aggregation_scale` of the step (the sum modes); ``entropy`` must carry its
    gradient when ``s.entropy_coeff > 0`` (the bonus ``-entropy_coeff * entropy`` joins each token's loss,
    aggregated like it, as verl). ``is_weights``: decoupled's behaviour weight precomputed for the step
    (learner/correction.py), used instead of ``min(r(prox, mu), tis_cap)``.
    """
    n = logp.shape[0]
    for name, t in (("behaviour_logp", behaviour_logp), ("advantages", advantages), ("weights", weights)):
        if t.shape != (n,):
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected ({n},) like logp")
    behaviour_logp = behaviour_logp.to(logp.dtype)
    if s.correction == "decoupled" and prox_logp is None:
        raise ValueError("correction='decoupled' needs prox_logp: the learner's log-probs recomputed before the step")
    old = prox_logp.detach().to(logp.dtype) if prox_logp is not None else logp.detach()
    base = old
    if s.correction == "bypass":
        base = behaviour_logp
    if s.correction in ("none", "bypass"):
        is_w = torch.ones_like(logp)
    elif is_weights is not None:
        if s.correction != "decoupled" or is_weights.shape != (n,):
            raise ValueError(
                f"is_weights (shape {tuple(is_weights.shape)}) are decoupled's behaviour weight for "
                f"the {n} tokens; correction={s.correction!r}"
            )
        is_w = is_weights.detach().to(logp.dtype)
    else:
        is_w = torch.exp((old - behaviour_logp).clamp(max=LOG_RATIO_CLAMP)).clamp(max=s.tis_cap).detach()
    pg, ratio, clip_active, dual_active = surrogate(logp, base.detach(), advantages, is_w, s, seq_lens)
    rejected = None
    if s.rejection:  # bypass: verl's rejection on the policy being trained vs the sampler, this micro-batch
        from learner.correction import keep_mask

        if seq_lens is None:
            raise ValueError("bypass rejection rules need seq_lens (sequence-level rules)")
        keep, each = keep_mask((logp.detach() - behaviour_logp).double(), seq_lens, list(s.rejection))
        pg = pg * keep.to(pg.dtype)
        rejected = [~keep, *(~k for k in each)]
    per_token = pg
    if s.entropy_coeff > 0:
        if entropy is None or not entropy.requires_grad and logp.requires_grad:
            raise ValueError(
                f"entropy_coeff={s.entropy_coeff} needs the entropy with its gradient (forward with entropy_grad=True)"
            )
        per_token = per_token - s.entropy_coeff * entropy.to(logp.dtype)
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
        per_token = per_token + s.kl_coef * kl_w * kl_val
    w = weights.to(logp.dtype)
    loss = loss_scale * (w * per_token).sum()

    with torch.no_grad():
        wd = w.detach()
        lp = logp.detach()
        clip_active = clip_active.to(wd.dtype)
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
            "is_weight_max": torch.cat([torch.where(wd > 0, is_w.to(wd.dtype), 0.0), wd.new_zeros(1)]).max(),
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
        if rejected is not None:  # weighted shares of the step's tokens, as the other metrics
            names = ["rollout_rs_masked_fraction"] + [
                f"rollout_rs_{r.name or i}_masked_fraction" for i, r in enumerate(s.rejection)
            ]
            for name, r in zip(names, rejected, strict=True):
                metrics[name] = (wd * r.to(wd.dtype)).sum()
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
