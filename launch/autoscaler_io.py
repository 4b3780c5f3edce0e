"""The autoscaler's I/O: observations from the job's snapshot in, ``scale`` calls out, a log of both.

:class:`rollout_fleet.autoscaler.Autoscaler` decides; this carries a decision out through the same
``Job.scale`` the ``scale`` command uses and records it (with its reason, the signals and the
outcome) in ``autoscale.jsonl`` in the run directory and the run's summary, and what it saw every
second (observation and windowed signals) in ``metrics/autoscale_signals.jsonl``. A failed scale is
logged and recorded, never fatal: the next decision comes after the cooldown.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any

from launch.snapshot import JobSnapshot
from rollout_fleet.autoscaler import Autoscaler, Observation
from rollout_fleet.status import ServerState

log = logging.getLogger(__name__)
_LIVE = (ServerState.HEALTHY, ServerState.RESTARTING, ServerState.DEAD, ServerState.STARTING)
SIGNALS_JSONL = Path("metrics") / "autoscale_signals.jsonl"
TRACE_EVERY_S = 1.0


def observation(snap: JobSnapshot, groups_per_step: int, max_staleness: int, max_inflight: int) -> Observation:
    live = [s for s in snap.fleet.servers if s.state in _LIVE]
    return Observation(
        servers=len(live),
        starting=sum(s.state == ServerState.STARTING for s in live),
        learner_wait_s=snap.learner.learner_wait_s,
        inflight_groups=sum(s.inflight_groups for s in live),
        slots=len(live) * max_inflight,
        queued_groups=snap.queue_groups or 0,
        # what the bound lets the broker hold besides the step being trained (leased)
        queue_capacity_groups=groups_per_step * max(1, max_staleness),
        groups_pushed=snap.fleet.groups_pushed,
    )


class Elastic:
    def __init__(self, job) -> None:
        self.job = job
        self.scaler = Autoscaler(job.cfg.rollout.autoscale)
        self.log: list[dict[str, Any]] = []
        self._t0 = time.monotonic()
        self._traced: float | None = None

    def tick(self, snap: JobSnapshot, now: float | None = None) -> dict[str, Any] | None:
        now = time.monotonic() - self._t0 if now is None else now
        cfg = self.job.cfg
        obs = observation(snap, cfg.broker.groups_per_step, cfg.broker.max_staleness, cfg.rollout.inflight_groups())
        d = self.scaler.observe(now, obs)
        if self._traced is None or now - self._traced >= TRACE_EVERY_S:
            self._traced = now
            self._trace(now, obs, snap)
        if d is None:
            return None
        entry = {**dataclasses.asdict(d), "learner_step": snap.learner.step}
        log.info("autoscale: %s %d -> %d servers at %.0f s: %s", d.action, d.servers_before, d.target, d.at, d.reason)
        units = d.target * cfg.rollout.tensor_parallel_size if self.job.placement.plan.servers else d.target
        t = time.monotonic()
        try:
            entry["result"] = self.job.scale(units)
            entry["ok"] = True
        except Exception as exc:  # the job goes on; the next decision waits out the cooldown
            entry["ok"], entry["error"] = False, f"{type(exc).__name__}: {exc}"
            log.error("autoscale: %s to %d failed: %s", d.action, d.target, entry["error"])
        entry["scale_s"] = round(time.monotonic() - t, 3)
        self.log.append(entry)
        with open(self.job.run_dir / "autoscale.jsonl", "a") as f:
            f.write(json.dumps(entry) + "\n")
        return entry

    def _trace(self, now: float, obs: Observation, snap: JobSnapshot) -> None:
        """What the autoscaler saw (``metrics/autoscale_signals.jsonl``): why it decided, or why not."""
        s = self.scaler.signals
        row = {
            "t": round(now, 2),
            "learner_step": snap.learner.step,
            **dataclasses.asdict(obs),
            "signals": None if s is None else dataclasses.asdict(s),
            "ceiling": self.scaler.ceiling,
        }
        path = self.job.run_dir / SIGNALS_JSONL
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")
