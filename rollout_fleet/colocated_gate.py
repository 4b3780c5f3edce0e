"""The fleet's side of colocated mode: a gate the rollout worker obeys, and sleep / wake of the engines.

Dataflow of one step ``s`` (the learner's rank 0 drives it through the fleet actor, see core/colocate_config.py)::

    learner has step s's batch -> release(s): gate closed -> wait for groups in flight (none under
        max_staleness 0; counted if any) -> every healthy engine sleeps (vLLM /sleep?level=L, L > 0)
    learner trains -> wake(s, 'weights'): engines' weights back (/wake_up?tags=weights)
    learner publishes v=s -> wake(s, 'rest'): KV cache back (/wake_up?tags=kv_cache), a due evaluation
        (run.eval_every) on the new weights, gate open

SGLang engines do the same through their memory release (engines/sglang/handle.py):
/release_memory_occupation of kv_cache and weights, /resume_memory_occupation of weights, then of kv_cache.

Invariant: while the gate is closed the worker starts no group; :class:`SyncGate` records every
closed window and the groups that were still generating when it closed (a group only waiting on the broker's
ack of its push does not count: the learner may have its rows before that ack is back), so the run's summary can show
that the fleet generated nothing while the learner trained. On CPU (level 0) only the gate acts.
From the sleep to the KV cache's wake the fleet's stall detector is held (``FleetController.hold``):
a sleeping server answers nothing by design.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

log = logging.getLogger(__name__)
ASLEEP = "colocated sleep"  # the fleet's stall-clock hold from a release to the next wake


@dataclass(kw_only=True, slots=True)
class SyncGate:
    """Pure state of the synchronous schedule: open (the fleet may start groups) or closed; no clock of its own."""

    is_open: bool = True
    closed_since: float | None = None
    windows: list[tuple[int, float, float]] = field(default_factory=list)  # (step, closed at, opened at)
    inflight_at_close: int = 0  # groups still running when a release closed the gate (0 under k = 0)
    step: int = 0

    def close(self, step: int, now: float, inflight: int) -> None:
        if not self.is_open:
            raise RuntimeError(f"colocated gate closed twice (step {self.step}, then step {step})")
        self.is_open, self.closed_since, self.step = False, now, step
        self.inflight_at_close += inflight

    def open(self, now: float) -> None:
        if self.is_open:
            raise RuntimeError(f"colocated gate opened twice (after step {self.step})")
        self.windows.append((self.step, self.closed_since, now))
        self.is_open, self.closed_since = True, None


class ColocatedEngines:
    """Sleep and wake of a fleet's engines around the learner's step, behind the :class:`SyncGate`."""

    def __init__(
        self, fleet, worker, *, level: int, timeout_s: float, evaluate=None, eval_every: int = 0, max_steps: int = 0
    ) -> None:
        """``fleet``: the FleetController; ``worker``: the RolloutWorker (its ``inflight``); ``evaluate``: an
        async ``() -> float | None`` run at the wake of every ``eval_every``-th step before ``max_steps``."""
        if level not in (0, 1, 2):
            raise ValueError(f"sleep level must be 0, 1 or 2, got {level}")
        self.fleet, self.worker, self.level, self.timeout_s = fleet, worker, level, timeout_s
        self.evaluate, self.eval_every, self.max_steps = evaluate, eval_every, max_steps
        self.gate = SyncGate()
        self.eval_history: list[dict[str, float]] = []
        self.sleep_s: list[float] = []
        self.wake_s: list[float] = []

    def _engines(self) -> list:
        return [s.engine for s in self.fleet.servers.values() if s.state == "healthy"]

    async def _each(self, what: str, fn) -> float:
        t0 = time.monotonic()
        engines = self._engines()
        try:
            await asyncio.wait_for(asyncio.gather(*(fn(e) for e in engines)), timeout=self.timeout_s)
        except TimeoutError:
            raise TimeoutError(
                f"colocated {what} of engines {[e.engine_id for e in engines]} took over "
                f"{self.timeout_s:.0f} s (colocate.timeout_s)"
            ) from None
        return time.monotonic() - t0

    async def release(self, step: int) -> dict[str, float]:
        self.gate.close(step, time.monotonic(), self.worker.generating)
        t0 = time.monotonic()
        if self.worker.inflight:
            log.warning(
                "colocated release of step %d: %d groups still in flight; waiting for them", step, self.worker.inflight
            )
        while self.worker.inflight and time.monotonic() - t0 < self.timeout_s:  # noqa: ASYNC110 (polled count)
            await asyncio.sleep(0.01)
        drain = time.monotonic() - t0
        sleep = 0.0
        if self.level:
            self.fleet.hold(ASLEEP)  # asleep, a server answers nothing by design: no stall
            sleep = await self._each("sleep", lambda e: e.sleep(self.level))
            self.sleep_s.append(sleep)
        return {"drain_seconds": drain, "sleep_seconds": sleep, "inflight": float(self.gate.inflight_at_close)}

    async def wake(self, version: int, phase: str) -> dict[str, float]:
        if phase == "weights":
            t = await self._each("wake (weights)", lambda e: e.wake_up(["weights"])) if self.level else 0.0
            return {"seconds": t}
        if phase != "rest":
            raise ValueError(f"wake phase must be 'weights' or 'rest', got {phase!r}")
        t = await self._each("wake (kv cache)", lambda e: e.wake_up(["kv_cache"])) if self.level else 0.0
        if self.level:
            self.wake_s.append(t)
            self.fleet.unhold(ASLEEP)
        out = {"seconds": t}
        due = self.eval_every and version % self.eval_every == 0 and version < self.max_steps
        if due and self.evaluate is not None:
            t0 = time.monotonic()
            acc = await self.evaluate()
            if acc is not None:
                self.eval_history.append({"step": version, "accuracy": acc})
                log.info("eval accuracy at step %d: %.3f", version, acc)
            out["eval_seconds"] = time.monotonic() - t0
        self.gate.open(time.monotonic())
        return out

    def summary(self) -> dict:
        """What the run summary shows of the schedule."""
        return {
            "sleep_level": self.level,
            "steps_released": len(self.gate.windows),
            "groups_inflight_at_release": self.gate.inflight_at_close,
            "sleep_seconds_mean": sum(self.sleep_s) / len(self.sleep_s) if self.sleep_s else None,
            "wake_seconds_mean": sum(self.wake_s) / len(self.wake_s) if self.wake_s else None,
        }
