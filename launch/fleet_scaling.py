"""``scale`` on a running job: the fleet grows or shrinks while training goes on.

Grow (returns at once)::

    scale(N) --placement groups for the new servers (seconds)--> fleet.add_placed / add_servers
        |                                                          (a vLLM start: minutes on CPU)
        '--> answer {"servers_before", "servers_after", "starting": [engine ids]}
    driver loop: poll() each round --start done--> placement.json rewritten; a failed start
                                                    gives its bundle back and is logged

While a server starts, ``status`` lists it as ``starting``; it joins the fleet once it answers
and gets work from the next publish on (weight sync sends it the learner's weights). The driver's
loop, and with it ``status``, the live view, the learner's health checks, the broker supervisor and
the autoscaler, never waits for a server start.

Shrink: drains the least loaded servers (no new group; their in-flight groups end, bounded by
``rollout.request_timeout_s``), then gives their bundles back; it refuses while servers are still
starting. Every pending start has a deadline (``rollout.startup_timeout_s`` plus a margin); at
shutdown the driver waits for pending starts before stopping the fleet, so none outlives the job.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from launch.placement import Slot
from rollout_fleet.status import engine_name

log = logging.getLogger(__name__)
MARGIN_S = 120.0  # beyond rollout.startup_timeout_s: the keeper actor's own start and Ray's scheduling


@dataclass(slots=True)
class PendingStart:
    ref: Any  # the fleet actor's add call
    indices: list[int]
    placed: bool  # the indices own placement groups (given back if their start fails)
    started: float = field(default_factory=time.monotonic)


class FleetScaler:
    """The driver's part of ``scale``: targets, placement groups, pending starts. Example::

    scaler = FleetScaler(job)
    scaler.scale(4)      # {"servers_before": 2, "servers_after": 4, "starting": ["vllm-2", "vllm-3"]}
    scaler.poll()        # every driver round: finishes the starts that ended
    """

    def __init__(self, job) -> None:
        self.job = job
        self.pending: list[PendingStart] = []
        self.events: list[dict[str, Any]] = []  # every start that ended: ids, seconds, ok / error

    @property
    def starting(self) -> list[int]:
        return [i for p in self.pending for i in p.indices]

    def scale(self, rollout_gpus: int) -> dict[str, Any]:
        job, cfg = self.job, self.job.cfg
        if job.stop_requested:
            raise ValueError("the job is stopping: scale refused")
        if cfg.colocate.enabled:
            raise ValueError("a colocated fleet shares the learner's GPUs and cannot be scaled on its own")
        if cfg.rollout.urls:
            raise ValueError("the fleet is attached to rollout.urls: it neither starts nor stops servers")
        tp = cfg.rollout.tensor_parallel_size
        placed = bool(job.placement.plan.servers)  # GPU (or simulated GPU) fleet: one placement group per server
        if placed:
            if rollout_gpus % tp:
                raise ValueError(f"--rollout-gpus {rollout_gpus} is not a multiple of TP {tp}")
            target = rollout_gpus // tp
        else:
            target = rollout_gpus  # CPU: the number of servers
        servers = job._get(job.fleet.status.remote(), 30.0, "fleet status")["servers"]
        n_now = len(servers)  # servers still starting are listed (state "starting"): they count
        if job.placement.server_actors:  # servers the fleet dropped (their node was lost) give their bundles back
            live = {int(s["engine_id"].rsplit("-", 1)[1]) for s in servers}
            job.placement.release(
                [i for i in list(job.placement.server_slots) if i not in live and i not in self.starting]
            )
        answer: dict[str, Any] = {"servers_before": n_now, "servers_after": target}
        if target > n_now:
            if placed:
                indices = self._grow(target - n_now)
                slots = {
                    i: (job.placement.server_slots[i].node_id, list(job.placement.server_slots[i].gpu_ids))
                    for i in indices
                }
                ref = (
                    job.fleet.add_placed.remote(indices, slots, job.placement.server_pgs(indices))
                    if job.placement.server_actors
                    else job.fleet.add_servers.remote(indices, slots)
                )
            else:
                first = max((s["index"] for s in servers), default=-1) + 1
                indices = list(range(first, first + target - n_now))
                ref = job.fleet.add_servers.remote(indices, {})
            self.pending.append(PendingStart(ref, indices, placed))
            answer["starting"] = [engine_name(cfg.rollout.engine, i) for i in indices]
            log.info("fleet scaling from %d to %d servers: starting %s", n_now, target, answer["starting"])
        elif target < n_now:
            if self.pending:
                raise ValueError(f"servers {self.starting} are still starting; scale down once they joined")
            removed = job._get(job.fleet.scale_to.remote(target), cfg.rollout.request_timeout_s, "fleet drain")
            job.placement.release(removed)
            log.info("fleet scaled from %d to %d servers (drained %s)", n_now, target, removed)
            job._write_placement()
        return answer

    def _grow(self, k: int) -> list[int]:
        """Placement groups for ``k`` new servers on the free GPUs of the cluster as it is now."""
        import ray

        job = self.job
        nodes, pin = job.placement.nodes(ray)
        job.placement.pin.update(pin)  # a node that joined since the start (a host brought back)
        # the learner's, the reward servers' and the live rollout servers' GPUs are taken
        held = job.placement.plan.learner + job.placement.plan.rewards + list(job.placement.server_slots.values())
        used = {(s.node_id, g) for s in held for g in s.gpu_ids}
        tp = job.cfg.rollout.tensor_parallel_size
        new: list[int] = []
        next_index = max(job.placement.server_slots, default=-1) + 1
        for n in nodes:
            free = [g for g in range(n.gpus) if (n.node_id, g) not in used]
            while len(new) < k and len(free) >= tp:
                job.placement.add_server_pg(next_index, Slot(n.node_id, tuple(free[:tp])))
                free = free[tp:]
                new.append(next_index)
                next_index += 1
        if len(new) < k:
            job.placement.release(new)
            raise ValueError(f"cannot add {k} servers of TP {tp}: only {len(new)} fit on the free GPUs")
        try:
            job.placement.wait_pgs(ray, [job.placement.pgs[f"server-{i}"] for i in new])
        except Exception:
            job.placement.release(new)
            raise
        job.placement.pin_server_gpus(ray, new)
        return new

    def poll(self) -> None:
        """Finish the starts that ended (or ran past their deadline); never raises for a failed start."""
        if not self.pending:
            return
        import ray

        deadline_s = self.job.cfg.rollout.startup_timeout_s + MARGIN_S
        for p in list(self.pending):
            done, _ = ray.wait([p.ref], timeout=0)
            late = not done and time.monotonic() - p.started > deadline_s
            if not done and not late:
                continue
            self.pending.remove(p)
            self._finish(p, timed_out=late)

    def _finish(self, p: PendingStart, *, timed_out: bool) -> None:
        import ray

        job = self.job
        ids = [engine_name(job.cfg.rollout.engine, i) for i in p.indices]
        event: dict[str, Any] = {"servers": ids, "seconds": round(time.monotonic() - p.started, 1)}
        try:
            if timed_out:
                ray.cancel(p.ref)
                raise TimeoutError(f"not up within {event['seconds']:.0f} s")
            job._get(p.ref, 30.0, "fleet add")
            event["ok"] = True
            log.info("fleet: %s started and joined in %.0f s", ids, event["seconds"])
        except Exception as exc:  # the job goes on with the servers it has
            event["ok"], event["error"] = False, f"{type(exc).__name__}: {exc}"
            log.error("fleet: starting %s failed: %s", ids, event["error"])
            if p.placed:
                try:
                    joined = {
                        s["index"]
                        for s in job._get(job.fleet.status.remote(), 30.0, "fleet status")["servers"]
                        if s["state"] != "starting"
                    }
                except Exception as status_exc:
                    log.warning("fleet status after a failed start: %s", status_exc)
                    joined = set()
                job.placement.release([i for i in p.indices if i not in joined])
        self.events.append(event)
        try:
            job._write_placement()
        except Exception as exc:
            log.warning("placement.json not rewritten: %s", exc)

    def wait(self, timeout_s: float) -> None:
        """At shutdown: let pending starts end (each has its own deadline) so that none outlives the job."""
        if not self.pending:
            return
        import ray

        log.info("waiting up to %.0f s for starting servers %s before stopping the fleet", timeout_s, self.starting)
        ray.wait([p.ref for p in self.pending], num_returns=len(self.pending), timeout=timeout_s)
        for p in list(self.pending):
            self.pending.remove(p)
            self._finish(p, timed_out=not ray.wait([p.ref], timeout=0)[0])
