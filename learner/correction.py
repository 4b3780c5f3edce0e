"""Rollout correction beyond token-level TIS (verl's ``algorithm.rollout_correction.*``): importance-sampling
weights at token or sequence level, truncated (TIS) or band-limited (IcePop), optionally normalised to mean 1
over the optimizer step, and rejection sampling of tokens or whole sequences by how far the learner's
pre-step policy is from the sampler.

Everything is measured once per step batch, before the first optimizer step, on the log-ratio
``d = prox - mu`` of each trained token (``prox``: the learner's pre-step log-probs, the proximal pass;
``mu``: the behaviour log-probs the engine returned). It needs ``learner.loss.correction=decoupled``: the
ratio ``pi / prox`` stays the clipped PPO ratio and these weights replace decoupled's ``min(exp(d), tis_cap)``
(learner/losses.py). Formulas, with ``exp`` of a value clamped to [-20, 20] (verl's SAFETY_BOUND):

* IS ``token``: ``w_t = exp(d_t)``; ``sequence``: ``w_t = exp(sum_s d_s)`` for every token of the sequence.
  ``is_lower`` unset: truncated, ``min(w, is_upper)``; set: IcePop, ``w`` where ``is_lower <= w <= is_upper``,
  else 0. ``is_batch_normalize``: divided by the mean weight of the optimizer step (token level: over
  tokens; sequence level: over sequences), taken over all data-parallel ranks.
* Rejection rules (:class:`learner.config.RejectionRule`): a statistic per token, ``log_ratio`` = ``d``,
  ``k1`` = ``-d``, ``k2`` = ``d^2 / 2``, ``k3`` = ``exp(d) - 1 - d``; taken per token (``token``) or per
  sequence (``seq_sum`` / ``seq_mean`` / ``seq_max`` / ``seq_min`` of its tokens), kept where
  ``lower <= stat <= upper`` (an unset bound does not bind). A token is trained only if every rule keeps
  it (a sequence rule keeps or rejects all of its tokens). verl's modes are such rules (docs/verl.md):
  ``seq_mean_k1`` with ``0.999_1.001`` is ``k1``/``seq_mean`` within [log 0.999, log 1.001]; its older
  ``geometric`` is ``log_ratio``/``seq_mean``; the veto (a sequence with any token ratio below ``v``)
  is ``log_ratio``/``seq_min`` with lower ``log v``.
* A rejected token leaves the loss and its denominator, as verl's modified response mask: the
  aggregation weights are rebuilt from the kept tokens (token modes: 1 / kept tokens of the optimizer step;
  sequence mode: 1 / (kept tokens of the sequence * sequences of the step)); a sum mode's factor counts
  kept tokens. Sequences whose every token is rejected still count in the step's sequence count (verl's
  global_batch_size is the mini-batch size).

Collective over the default process group when it is initialised (every rank calls :func:`apply` with its
own plans): FSDP only, whole sequences per rank (learner/config.py refuses Megatron and Ulysses with it).

With ``correction=bypass`` (verl's bypass mode with the PPO-clip loss) there is no pre-step pass: the
rejection rules are measured per micro-batch in the loss (learner/losses.py) on ``d = sg(pi) - mu``, the
policy being trained against the sampler, as verl's compute_policy_loss_bypass_mode; a rejected token's
policy term is zeroed but stays in the denominator (verl's batch_num_tokens comes from the unmodified mask);
there is no IS weight (the ratio against the sampler is the correction).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from learner.losses import aggregation_scale, aggregation_weights

SAFETY_BOUND = 20.0
STATISTICS = ("log_ratio", "k1", "k2", "k3")
LEVELS = ("token", "seq_sum", "seq_mean", "seq_max", "seq_min")


def _segments(seq_lens: torch.Tensor) -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(seq_lens.numel(), device=seq_lens.device), seq_lens)


def _seq_reduce(x: torch.Tensor, seq_lens: torch.Tensor, how: str) -> torch.Tensor:
    """Per-sequence sum/mean/max/min of a packed [n] tensor, as [s]."""
    seq_lens = seq_lens.to(x.device)
    seg = _segments(seq_lens)
    s = seq_lens.numel()
    if how == "sum":
        return torch.zeros(s, dtype=x.dtype, device=x.device).index_add(0, seg, x)
    if how == "mean":
        return torch.zeros(s, dtype=x.dtype, device=x.device).index_add(0, seg, x) / seq_lens.clamp(min=1).to(x.dtype)
    fill = float("-inf") if how == "max" else float("inf")
    out = torch.full((s,), fill, dtype=x.dtype, device=x.device).scatter_reduce(
        0, seg, x, reduce="amax" if how == "max" else "amin"
    )
    return torch.where(torch.isinf(out), torch.zeros_like(out), out)  # an empty sequence: 0, as verl


def is_weights(
    d: torch.Tensor, seq_lens: torch.Tensor, level: str, upper: float, lower: float | None = None
) -> torch.Tensor:
    """Per-token IS weights [n] from the log-ratios ``d`` [n] of packed sequences ``seq_lens`` (no normalisation)."""
    d = d.double()
    if level == "token":
        raw = torch.exp(d.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    elif level == "sequence":
        raw = torch.exp(_seq_reduce(d, seq_lens, "sum").clamp(-SAFETY_BOUND, SAFETY_BOUND))[
            _segments(seq_lens.to(d.device))
        ]
    else:
        raise ValueError(f"IS level must be 'token' or 'sequence', got {level!r}")
    if lower is None:
        return raw.clamp(max=upper)
    return torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))


def statistic(d: torch.Tensor, name: str) -> torch.Tensor:
    d = d.double().clamp(-SAFETY_BOUND, SAFETY_BOUND)
    if name == "log_ratio":
        return d
    if name == "k1":
        return -d
    if name == "k2":
        return 0.5 * d * d
    if name == "k3":
        return torch.exp(d) - 1 - d
    raise ValueError(f"rejection statistic must be one of {list(STATISTICS)}, got {name!r}")


def keep_mask(d: torch.Tensor, seq_lens: torch.Tensor, rules: list) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Tokens every rule keeps ([n] bool), and each rule's own keep mask (for its metric).

    ``rules``: objects with ``statistic``, ``level``, ``lower``, ``upper`` (learner.config.RejectionRule).
    """
    keep = torch.ones(d.shape[0], dtype=torch.bool, device=d.device)
    each = []
    for r in rules:
        st = statistic(d, r.statistic)
        if r.level != "token":
            if r.level not in LEVELS:
                raise ValueError(f"rejection level must be one of {list(LEVELS)}, got {r.level!r}")
            st = _seq_reduce(st, seq_lens, r.level.removeprefix("seq_"))[_segments(seq_lens.to(d.device))]
        k = torch.ones_like(keep)
        if r.lower is not None:
            k &= st >= r.lower
        if r.upper is not None:
            k &= st <= r.upper
        each.append(k)
        keep &= k
    return keep, each


def _all_reduce(t: torch.Tensor, op=None) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=op or dist.ReduceOp.SUM)
    return t


def apply(plans: list, rc, *, aggregation: str, loss_scale_factor: int | None = None) -> dict[str, float]:
    """Set ``mb.is_weights`` and rebuild ``mb.weights`` / ``mb.loss_scale`` of every micro-batch; returns the
    step's metrics (verl's ``rollout_corr/*`` names without the prefix).

    ``rc``: learner.config.RolloutCorrectionConfig; ``aggregation``: the loss's effective aggregation.
    Needs ``prox_logp`` on every micro-batch with tokens (``engine.prepare_logprobs`` first).
    """
    # sums over the step batch: tokens, kept tokens, sequences, sequences with a rejected token, IS weight sum,
    # tokens above / below the IS band, then one count per rule
    acc = torch.zeros(7 + len(rc.rejection), dtype=torch.float64)
    w_max = torch.full((1,), float("-inf"), dtype=torch.float64)
    w_min = torch.full((1,), float("inf"), dtype=torch.float64)
    norm_factors = []
    for plan in plans:
        mbs = [mb for mb in plan.micro_batches if mb.seq_lens.numel() and int(mb.seq_lens.sum())]
        per_mb = []
        for mb in mbs:
            if mb.prox_logp is None:
                raise RuntimeError("rollout correction needs the pre-step log-probs: call prepare_logprobs first")
            d = mb.prox_logp.detach().cpu().double() - mb.behaviour_logp.detach().cpu().double()
            lens = mb.seq_lens.cpu()
            keep, each = keep_mask(d, lens, rc.rejection)
            w = (
                is_weights(d, lens, rc.is_level, rc.is_upper, rc.is_lower)
                if rc.is_level != "none"
                else torch.ones_like(d)
            )
            per_mb.append((mb, d, lens, keep, each, w))
        # batch normalisation over the optimizer step, every rank's tokens (or sequences) together
        factor = 1.0
        if rc.is_level != "none" and rc.is_batch_normalize:
            s = torch.zeros(2, dtype=torch.float64)
            for _, _, lens, _, _, w in per_mb:
                if rc.is_level == "token":
                    s += torch.stack([w.sum(), torch.tensor(float(w.numel()), dtype=torch.float64)])
                else:  # one weight per sequence
                    first = torch.cumsum(lens, 0) - lens
                    s += torch.stack([w[first].sum(), torch.tensor(float(lens.numel()), dtype=torch.float64)])
            _all_reduce(s)
            mean = float(s[0] / s[1]) if s[1] > 0 else 0.0
            factor = mean if mean > 1e-8 else 1.0
            norm_factors.append(factor)
        kept = torch.tensor([float(k.sum()) for *_, k, _, _ in per_mb], dtype=torch.float64).sum().reshape(1)
        _all_reduce(kept)
        t_kept = int(kept.item())
        n_seqs = int(plan.stats.get("samples_trained", 0))
        scale = aggregation_scale(aggregation, t_kept, n_seqs, loss_scale_factor) if t_kept else 0.0
        for mb, d, lens, keep, each, w in per_mb:
            seg = _segments(lens)
            kept_lens = torch.zeros(lens.numel(), dtype=torch.int64).index_add(0, seg, keep.long())
            new_w = torch.zeros(d.shape[0])
            if t_kept:
                new_w[keep] = aggregation_weights(kept_lens, aggregation, t_kept, n_seqs)
            dev = mb.weights.device
            mb.weights = new_w.to(dev)
            mb.loss_scale = scale
            mb.is_weights = (w / factor).float().to(dev)
            raw_band = (
                torch.exp(d.clamp(-SAFETY_BOUND, SAFETY_BOUND))
                if rc.is_level != "sequence"
                else torch.exp(_seq_reduce(d, lens, "sum").clamp(-SAFETY_BOUND, SAFETY_BOUND))[seg]
            )
            low = rc.is_lower if rc.is_lower is not None else 1.0 / rc.is_upper
            seq_rejected = torch.zeros(lens.numel(), dtype=torch.int64).index_add(0, seg, (~keep).long()) > 0
            acc[:7] += torch.tensor(
                [
                    d.numel(),
                    float(keep.sum()),
                    lens.numel(),
                    float(seq_rejected.sum()),
                    float(w.sum()),
                    float((raw_band > rc.is_upper).sum()),
                    float((raw_band < low).sum()),
                ],
                dtype=torch.float64,
            )
            for i, k in enumerate(each):
                acc[7 + i] += float((~k).sum())
            if w.numel():
                w_max[0] = max(float(w_max[0]), float(w.max()))
                w_min[0] = min(float(w_min[0]), float(w.min()))
    _all_reduce(acc)
    _all_reduce(w_max, dist.ReduceOp.MAX if dist.is_available() else None)
    _all_reduce(w_min, dist.ReduceOp.MIN if dist.is_available() else None)
    tokens, kept_tok, seqs, seq_rej = (float(x) for x in acc[:4])
    m: dict[str, float] = {
        "rollout_rs_masked_fraction": 1 - kept_tok / tokens if tokens else 0.0,
        "rollout_rs_seq_masked_fraction": seq_rej / seqs if seqs else 0.0,
    }
    for i, r in enumerate(rc.rejection):
        m[f"rollout_rs_{r.name or i}_masked_fraction"] = float(acc[7 + i]) / tokens if tokens else 0.0
    if rc.is_level != "none" and tokens:
        m.update(
            rollout_is_mean=float(acc[4]) / tokens,
            rollout_is_max=float(w_max[0]),
            rollout_is_min=float(w_min[0]),
            rollout_is_ratio_fraction_high=float(acc[5]) / tokens,
            rollout_is_ratio_fraction_low=float(acc[6]) / tokens,
        )
        if norm_factors:
            m["rollout_is_batch_norm_factor"] = sum(norm_factors) / len(norm_factors)
    return m


def verl_rule_bounds(
    mode: str, lower: float | None, upper: float | None
) -> tuple[str, str, float | None, float | None]:
    """(statistic, level, lower, upper) of one verl ``rollout_rs`` option with its ratio/divergence bounds.

    ``token_k1`` / ``seq_sum_k1`` / ``seq_mean_k1`` take ratio bounds (``lower_upper``) compared, as verl does,
    in log space against k1 = -log r; the k2/k3 options take an upper divergence bound; verl's older
    ``token`` / ``sequence`` / ``geometric`` bound the ratio, the sequence product or the geometric mean.
    """
    legacy = {"token": "token", "sequence": "seq_sum", "geometric": "seq_mean"}
    if mode in legacy:
        up = upper if upper is not None else 2.0
        lo = lower if lower is not None else 1.0 / up
        return "log_ratio", legacy[mode], math.log(lo), math.log(up)
    level, _, stat = mode.rpartition("_")
    level = {"token": "token", "seq_sum": "seq_sum", "seq_mean": "seq_mean", "seq_max": "seq_max"}.get(level)
    if level is None or stat not in ("k1", "k2", "k3") or (level == "seq_max" and stat == "k1"):
        raise ValueError(
            f"rollout_rs option {mode!r}: verl has token_k1..k3, seq_sum_k1..k3, seq_mean_k1..k3, "
            "seq_max_k2/k3 (and the older token, sequence, geometric)"
        )
    if stat == "k1":
        if upper is None:
            raise ValueError(f"rollout_rs {mode}: needs a ratio bound")
        lo = lower if lower is not None else 1.0 / upper
        return "k1", level, math.log(lo), math.log(upper)
    if upper is None or lower is not None:
        raise ValueError(f"rollout_rs {mode}: takes one upper divergence bound")
    return stat, level, None, upper
