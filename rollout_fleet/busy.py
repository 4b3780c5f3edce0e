"""When each engine had work: the fleet's side of the busy fractions (shared async mode's measurement).

An engine counts as busy while at least one of the fleet's requests to it is in flight (a group sent
and not yet answered). That is what the fleet can see without the engine's help, and it bounds the
engine's device time from above: a busy engine is running its scheduler, not necessarily the GPU at
full occupancy. launch/busy.py intersects these intervals with the learner's training windows; the
GPU benchmark adds per-process SM utilisation (nvidia-smi pmon) for the device's own view.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class BusyClock:
    """Intervals (unix seconds) during which the depth of nested enter/exit calls was above zero."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self.depth = 0
        self._since: float | None = None
        self.intervals: list[tuple[float, float]] = []

    def enter(self) -> None:
        if self.depth == 0:
            self._since = self._clock()
        self.depth += 1

    def exit(self) -> None:
        if self.depth <= 0:
            raise RuntimeError("BusyClock.exit without a matching enter")
        self.depth -= 1
        if self.depth == 0:
            start, end = self._since, self._clock()
            self._since = None
            if self.intervals and start <= self.intervals[-1][1]:  # back-to-back requests: one busy stretch
                self.intervals[-1] = (self.intervals[-1][0], end)
            else:
                self.intervals.append((start, end))

    def snapshot(self) -> list[tuple[float, float]]:
        """The closed intervals, and the open one up to now."""
        out = list(self.intervals)
        if self._since is not None:
            out.append((self._since, self._clock()))
        return out

    def busy_s(self) -> float:
        return sum(b - a for a, b in self.snapshot())
