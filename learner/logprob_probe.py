"""Start-up check that the learner scores the distribution the fleet sampled from.

On the first step batch after the learner starts (or the first one that has any),
the tokens sampled by the very weights the learner holds (staleness 0, ``fresh``)
must get the same log-prob from the learner as the engine reported: anything
else is a configuration bug (vLLM returning raw instead of processed log-probs, a
temperature or truncation the learner does not apply, a dtype or kernel gap
beyond numerics). The mean absolute difference in nats over those tokens is
compared with ``learner.logprob_probe_tolerance``; above it every rank raises the
same error, naming the gap, so the run stops before it trains on a biased ratio.

Collective: every rank calls :func:`check` with its own plans; the sums are
all-reduced over the default group, so all ranks agree on the verdict.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from learner.batch import StepPlan
from learner.engine import TrainingEngine

logger = logging.getLogger(__name__)


# Mean |learner - engine| nats that still counts as agreement. fp32 engines (vLLM CPU) agree with the fp32
# learner to ~1e-6 (measured 4e-7 mean, 8e-6 max in the CPU runs): 0.01 leaves 4 orders of margin. bf16
# engines differ by 0.04-0.06 on average on the GPU machine (bench/results/engines_gpu.md): 0.1, the GPU
# tests' bound. Scoring at the wrong temperature (1.0 against 0.7) measured 0.137 on the tiny model.
FP32_TOLERANCE, BF16_TOLERANCE = 0.01, 0.1


def resolve_tolerance(setting, engine_dtype: str) -> float | None:
    """``learner.logprob_probe_tolerance`` as a number (None: no check) for engines running ``engine_dtype``."""
    if setting != "auto":
        return setting
    return FP32_TOLERANCE if engine_dtype in ("float32", "float") else BF16_TOLERANCE


class LogprobMismatch(RuntimeError):
    """The learner's log-probs of fresh tokens differ from the engine's beyond the tolerance."""


def _pre_step_logprobs(engine: TrainingEngine, plans: list[StepPlan]) -> list[list[torch.Tensor | None]]:
    """Learner log-probs at the current weights per micro-batch: ``prox_logp`` when prepared, else a no-grad
    forward (collective; all ranks run the same micro-batch count per plan). None where this rank has none
    (a Megatron rank off the last pipeline stage)."""
    out = []
    for plan in plans:
        row = []
        for mb in plan.micro_batches:
            if mb.prox_logp is not None:
                row.append(mb.prox_logp.detach())
            else:
                with torch.no_grad():
                    row.append(engine.forward_logprobs(mb, grad=False)[0].detach())
        out.append(row)
    return out


def gap(logp: torch.Tensor, behaviour: torch.Tensor, fresh: torch.Tensor) -> tuple[float, float, int]:
    """(sum, max, count) of |logp - behaviour| over the fresh tokens."""
    d = (logp.float() - behaviour.float().to(logp.device)).abs()[fresh.to(logp.device)]
    return float(d.sum()), float(d.max()) if d.numel() else 0.0, int(d.numel())


def check(engine: TrainingEngine, plans: list[StepPlan], tolerance: float) -> dict[str, float] | None:
    """Compare on the fresh tokens of ``plans``; returns the probe's metrics, None if no rank had a fresh
    token (try again next step), or raises :class:`LogprobMismatch`."""
    needed = any(mb.fresh is not None and bool(mb.fresh.any()) for p in plans for mb in p.micro_batches)
    flag = torch.tensor([float(needed)], device=engine.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if not float(flag):
        return None
    try:
        scored = _pre_step_logprobs(engine, plans)
    except NotImplementedError as exc:  # e.g. Megatron PP > 1 without a proximal pass: every rank raises alike
        logger.warning("log-prob probe skipped: %s", exc)
        return {}
    total, worst, count = 0.0, 0.0, 0
    for plan, row in zip(plans, scored, strict=True):
        for mb, lp in zip(plan.micro_batches, row, strict=True):
            if lp is None or mb.fresh is None or lp.shape != mb.behaviour_logp.shape:
                continue
            s, mx, n = gap(lp, mb.behaviour_logp, mb.fresh)
            total, worst, count = total + s, max(worst, mx), count + n
    sums = torch.tensor([total, float(count)], dtype=torch.float64, device=engine.device)
    mx = torch.tensor([worst], dtype=torch.float64, device=engine.device)
    dist.all_reduce(sums)
    dist.all_reduce(mx, op=dist.ReduceOp.MAX)
    n = int(sums[1])
    if n == 0:
        return None
    mean = float(sums[0]) / n
    result = {"logprob_probe_mean_abs": mean, "logprob_probe_max_abs": float(mx), "logprob_probe_tokens": float(n)}
    if mean > tolerance:
        raise LogprobMismatch(
            f"learner and engine log-probs disagree on {n} staleness-0 tokens: mean |learner - engine| = {mean:.4f} "
            f"nats (max {float(mx):.4f}) > learner.logprob_probe_tolerance={tolerance}. The learner scores "
            f"log_softmax(logits / learner.temperature); the engine must report the log-probs of the distribution it "
            f"sampled (vLLM: --logprobs-mode processed_logprobs; no top_p/top_k truncation), at the same temperature"
        )
    logger.info("log-prob probe: mean |learner - engine| %.2e nats (max %.2e) over %d fresh tokens", mean, float(mx), n)
    return result
