"""The learner's side of the busy fractions: how long each step's training computed, on the host clock
and, on CUDA, between two events on the learner's stream.

The CUDA span runs from an event recorded before the step's first kernel to one after its last; it
includes any gap in which the stream waited for the host (a lower bound on neither side: with another
process time-slicing the GPU it also includes the other's slices). Reading it synchronises the
stream once per step, after the optimizer step, where the loop reads its metrics anyway.

``compiled_graphs``: the graphs torch.compile made during the step (0 once the compiled blocks have met every
shape they will meet). A step whose compute is many times its neighbours' with a non-zero count was
recompiling; the reason is in the learner's log (``learner.fastpath.compile_blocks`` turns on torch's
recompile log).
"""

from __future__ import annotations

import sys
import time

import torch


def _graphs_compiled() -> int:
    """How many graphs torch.compile has made in this process so far (none if it was never imported)."""
    utils = sys.modules.get("torch._dynamo.utils")
    return int(utils.counters["stats"]["unique_graphs"]) if utils is not None else 0


class StepTimer:
    """Started at the beginning of a step's training; :meth:`stop` gives its metrics (seconds)."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.graphs0 = _graphs_compiled()
        self._events = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            self._events = (start, end)

    def stop(self) -> dict[str, float]:
        out = {
            "learner/compute_seconds": time.perf_counter() - self.t0,
            "learner/compiled_graphs": float(_graphs_compiled() - self.graphs0),
        }
        if self._events is not None:
            start, end = self._events
            end.record()
            end.synchronize()
            out["learner/gpu_compute_seconds"] = start.elapsed_time(end) / 1000.0
            # what the learner really held, against shared async mode's estimate (core/shared_gpu.py)
            out["learner/gpu_max_reserved_gib"] = torch.cuda.max_memory_reserved() / (1 << 30)
        return out
