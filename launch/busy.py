"""Generation and training busy fractions of a run: what each side did with the wall time it had.

Inputs: the learner's per-step log (``metrics/learner_steps.jsonl``: each step's training start in unix
seconds and its compute seconds, host clock and on CUDA the learner stream's event span, learner/busy.py)
and the fleet's per-engine busy intervals (rollout_fleet/busy.py: a group in flight). The window is the
learner's run, from its start to its last step; everything is clipped to it. Figures::

    training_busy_fraction      sum(compute seconds) / window      (host clock)
    training_gpu_busy_fraction  sum(CUDA event spans) / window     (None on CPU)
    generation_busy_fraction    mean over engines of busy time / window
    overlap_fraction            time both a training step and some engine were busy / window
    steps_per_s                 steps / window

With engine and learner on one GPU, the overlap is time both had work queued; the GPU time-slices
between the two processes, so it is not time both computed (docs/shared_gpu.md).
"""

from __future__ import annotations

import json
from pathlib import Path

Interval = tuple[float, float]


def union(intervals: list[Interval]) -> list[Interval]:
    out: list[Interval] = []
    for a, b in sorted((float(a), float(b)) for a, b in intervals if b > a):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def clip(intervals: list[Interval], lo: float, hi: float) -> list[Interval]:
    return [(max(a, lo), min(b, hi)) for a, b in intervals if min(b, hi) > max(a, lo)]


def length(intervals: list[Interval]) -> float:
    return sum(b - a for a, b in union(intervals))


def intersect(x: list[Interval], y: list[Interval]) -> list[Interval]:
    x, y = union(x), union(y)
    out, i, j = [], 0, 0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if b > a:
            out.append((a, b))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return out


def busy_fractions(steps: list[dict], engines: dict[str, list[Interval]]) -> dict | None:
    """The figures of the module docstring from the learner's step rows and the engines' busy intervals."""
    steps = [r for r in steps if "train_start_unix" in r and "compute_seconds" in r]
    if not steps:
        return None
    lo, hi = float(steps[0]["t0_unix"]), float(steps[-1]["t_unix"])
    window = hi - lo
    if window <= 0:
        return None
    train = clip([(r["train_start_unix"], r["train_start_unix"] + r["compute_seconds"]) for r in steps], lo, hi)
    gpu = [r["gpu_compute_seconds"] for r in steps if "gpu_compute_seconds" in r]
    per_engine = {eid: length(clip(iv, lo, hi)) / window for eid, iv in sorted(engines.items())}
    any_engine = clip([iv for ivs in engines.values() for iv in ivs], lo, hi)
    return {
        "window_s": round(window, 3),
        "steps_per_s": round(len(steps) / window, 5),
        "training_busy_fraction": round(length(train) / window, 4),
        "training_gpu_busy_fraction": round(sum(gpu) / window, 4) if len(gpu) == len(steps) else None,
        "generation_busy_fraction": round(sum(per_engine.values()) / len(per_engine), 4) if per_engine else None,
        "generation_busy_fraction_per_engine": {k: round(v, 4) for k, v in per_engine.items()},
        "overlap_fraction": round(length(intersect(train, any_engine)) / window, 4),
    }


def read_steps(run_dir: Path, since_unix: float = 0.0) -> list[dict]:
    """This launch's rows of ``metrics/learner_steps.jsonl`` (a resumed run's file has earlier ones too)."""
    p = Path(run_dir) / "metrics" / "learner_steps.jsonl"
    if not p.exists():
        return []
    rows = [json.loads(x) for x in p.read_text().splitlines() if x.strip()]
    return [r for r in rows if r.get("t0_unix", 0.0) >= since_unix]
