"""The autoscaler's I/O: observations from the job's snapshot in, ``scale`` calls out, a log of both.

:class:`rollout_fleet.autoscale.Autoscaler` decides; this carries a decision out through the same
``Job.scale`` the ``scale`` command uses and records it (with its reason, the signals and the
outcome) in ``autoscale.jsonl`` in the run directory and the run's summary. A failed scale is logged
and recorded, never fatal: the next decision comes after the cooldown.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from typing import Any

from launch.snapshot import JobSnapshot
from rollout_fleet.autoscale import Autoscaler, Observation
from rollout_fleet.status import ServerState

log = logging.getLogger(__name__)
_LIVE = (ServerState.HEALTHY, ServerState.RESTARTING, ServerState.DEAD, ServerState.STARTING)


def observation(snap: JobSnapshot, groups_per_step: int, max_staleness: int, max_inflight: int) -> Observation:
    live = [s for s in snap.fleet.servers if s.state in _LIVE]
    return Observation(servers=len(live), learner_wait_s=snap.learner.learner_wait_s,
                       inflight_groups=sum(s.inflight_groups for s in live), slots=len(live) * max_inflight,
                       queued_groups=snap.queue_groups or 0,
                       # what the bound lets the broker hold besides the step being trained (leased)
                       queue_capacity_groups=groups_per_step * max(1, max_staleness))


class Elastic:
    def __init__(self, job) -> None:
        self.job = job
        self.scaler = Autoscaler(job.cfg.rollout.autoscale)
        self.log: list[dict[str, Any]] = []
        self._t0 = time.monotonic()

    def tick(self, snap: JobSnapshot, now: float | None = None) -> dict[str, Any] | None:
        now = time.monotonic() - self._t0 if now is None else now
        cfg = self.job.cfg
        d = self.scaler.observe(now, observation(snap, cfg.broker.groups_per_step, cfg.broker.max_staleness,
                                                 cfg.rollout.max_inflight_groups))
        if d is None:
            return None
        entry = {**dataclasses.asdict(d), "learner_step": snap.learner.step}
        log.info("autoscale: %s %d -> %d servers at %.0f s: %s", d.action, d.servers_before, d.target, d.at, d.reason)
        units = d.target * cfg.rollout.tensor_parallel_size if self.job.placement.servers else d.target
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
