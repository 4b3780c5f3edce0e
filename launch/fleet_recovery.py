"""The fleet actor dies mid-run (``kill -9``, a crash): Ray restarts it, the driver starts it again.

Dataflow::

    fleet actor process dies   (its vLLM servers are child processes: orphaned, still running)
      -> Ray restarts the actor (FleetActor's max_restarts): __init__ again, same arguments, same handle
         (the learner ranks' handle stays valid)
      -> the driver's next fleet call fails (RayActorError), or its status answer says it was never
         started (``started_here``: Ray restarted it between two calls): FleetRecovery.on_death
           ends the dead fleet's engine servers (their process groups, from the last snapshots, and
           those still starting: orphaned_engines)
      -> FleetRecovery.poll, once per driver loop, never blocking:
           the restarted actor answers ``incarnation`` -> ``start(n, indices, catch_up=<learner version>)``:
           its servers start, load RUN_DIR/export/latest before taking work (the late-joiner path),
           its data position (fleet_state.json) is restored: the prompts in flight at the last
           save are replayed first
      -> the learner trains on the groups the broker holds meanwhile; its next publish finds the
         new server in the fleet's membership (launch/learner_ranks.py _RayFleet)

What is kept: every group the broker accepted (the broker and the spool are not touched). The
groups in flight in the dead actor never reached the broker; their tickets expire after
``broker.ticket_timeout_s`` (until then they count against the window: the fleet runs with fewer
tickets), and their prompts are replayed from the saved position. Nothing is trained twice: a
group id is its ticket's, and a dead actor's ticket is never used again.

Every wait has a limit: the restarted actor must answer within ``RESTART_WAIT_S`` and its start
finish within ``rollout.startup_timeout_s`` more; more than ``MAX_RESTARTS`` deaths end the job
(JobFailed, naming the fleet), as does an actor that is not back within ``RESTART_WAIT_S``. A death
during the job's start (Ray's memory monitor has killed the fleet actor there) is recovered the same
way, without a version to catch up to (``initial``).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

MAX_RESTARTS = 3  # fleet actor deaths a run survives (FleetActor's max_restarts)
RESTART_WAIT_S = 120.0  # from the death to the restarted actor answering (a Ray worker start, loaded host)


class FleetRecovery:
    """The driver's side of a fleet actor restart (``job``: launch.driver.Job)."""

    def __init__(self, job) -> None:
        self.job = job
        self.restarts = 0
        self.since: float | None = None  # monotonic time of the death now being recovered from
        self.died_unix: float | None = None
        self._probe = None  # ObjectRef of the restarted actor's ``incarnation``
        self._start = None  # ObjectRef of its ``start``
        self.initial = False  # the death being recovered from came during the job's start
        self.result: dict[str, Any] | None = None  # the restarted fleet's answer to ``start``
        self.log: list[dict[str, Any]] = []  # each recovery: when, how long, what was ended

    @property
    def active(self) -> bool:
        return self.since is not None

    def on_death(self, exc: BaseException, initial: bool = False) -> None:
        """The fleet actor did not answer because it died; begin (or go on with) a recovery. ``initial``: it
        died during the job's start (its restart starts like the first one, with no version to catch up to)."""
        from launch.broker_supervisor import end_engine_groups
        from launch.job_placement import JobFailed

        if self.active:
            return
        if self.restarts >= MAX_RESTARTS:
            raise JobFailed(
                f"fleet actor died a {self.restarts + 1}th time (at most {MAX_RESTARTS} restarts): {exc}"
            ) from None
        self.restarts += 1
        self.initial = initial
        self.since, self.died_unix = time.monotonic(), time.time()
        self._probe = self._start = None
        # its servers were its child processes: orphaned now, they would hold CPU, memory and ports (those in
        # its last snapshots, and those still starting, which no snapshot shows yet)
        orphans = set(self.job.engine_pgids) | orphaned_engines(self.job.run_dir)
        ended = end_engine_groups(orphans) if orphans else []
        self.job.engine_pgids -= orphans
        log.error(
            "fleet actor died (%s); restart %d of %d: ended %d engine process(es) it left, waiting for Ray "
            "to restart it",
            type(exc).__name__,
            self.restarts,
            MAX_RESTARTS,
            len(ended),
        )
        self.log.append({"died_unix": round(self.died_unix, 3), "engine_processes_ended": len(ended)})

    def poll(self) -> None:
        """One non-blocking step of the recovery; raises JobFailed when it cannot finish."""
        import ray

        from launch.job_placement import JobFailed

        if not self.active:
            return
        job = self.job
        waited = time.monotonic() - self.since
        if self._start is None:
            if self._probe is None:
                self._probe = job.fleet.incarnation.remote()
            done, _ = ray.wait([self._probe], timeout=0)
            if not done:
                if waited > RESTART_WAIT_S:
                    raise JobFailed(f"fleet actor not back within {RESTART_WAIT_S:.0f} s of its death")
                return
            try:
                inc = ray.get(self._probe)
            except ray.exceptions.RayActorError as exc:  # still restarting (or not restarted at all): ask again
                self._probe = None
                if waited > RESTART_WAIT_S:
                    raise JobFailed(f"fleet actor not back within {RESTART_WAIT_S:.0f} s of its death: {exc}") from None
                return
            if inc["started"]:  # it answers as the started fleet: it did not die (a call failed on the way)
                log.warning(
                    "fleet actor answers as started (%s): no restart needed; its health loop restarts "
                    "the servers ended above",
                    inc,
                )
                self.log[-1]["false_alarm"] = True
                self.since, self._probe = None, None
                return
            n = job.placement.n_servers()
            # the learner's policy version now; None at the job's start (a resumed run's export may be ahead)
            version = None if self.initial else job.snapshot.learner.step if job.snapshot is not None else 0
            self._start = job.fleet.start.remote(n, list(range(n)), catch_up=version)
            log.warning("fleet actor restarted (%.1f s after its death); starting its %d server(s)", waited, n)
            return
        done, _ = ray.wait([self._start], timeout=0)
        if not done:
            if waited > RESTART_WAIT_S + job.cfg.rollout.startup_timeout_s:
                raise JobFailed(
                    "restarted fleet actor: start not done within "
                    f"{RESTART_WAIT_S + job.cfg.rollout.startup_timeout_s:.0f} s of its death"
                )
            return
        try:
            self.result = ray.get(self._start)
        except Exception as exc:
            raise JobFailed(f"restarted fleet actor failed to start: {exc}") from None
        back = time.monotonic() - self.since
        self.log[-1]["back_s"] = round(back, 2)
        log.warning("fleet back in service %.1f s after its death (restart %d)", back, self.restarts)
        self.since, self._probe, self._start = None, None, None

    def wait(self, timeout_s: float) -> dict[str, Any] | None:
        """Until a recovery in progress is done (the end of the run needs a started fleet); the restarted
        fleet's answer to ``start``, or None if none was in progress."""
        t_end = time.monotonic() + timeout_s
        while self.active:
            if time.monotonic() > t_end:
                from launch.job_placement import JobFailed

                raise JobFailed(f"fleet recovery not done within {timeout_s:.0f} s")
            self.poll()
            time.sleep(0.25)
        return self.result


ENGINE_COMMANDS = ("vllm.entrypoints.openai.api_server", "sglang.launch_server")


def orphaned_engines(run_dir) -> set[int]:
    """Engine servers of ``run_dir`` whose starter died: group leaders (an engine server leads its own process
    group) running an engine command, naming the run directory (launch.resume._of_run), whose parent is no
    Ray worker any more (a live fleet, server or reward-server actor is its parent while it lives)."""
    import psutil

    from launch.resume import _of_run

    out = set()
    for p in psutil.process_iter():
        try:
            cmd = " ".join(p.cmdline())
            if not any(c in cmd for c in ENGINE_COMMANDS) or os.getpgid(p.pid) != p.pid:
                continue
            if _ray_parent(p) or not _of_run(p.pid, Path(run_dir).resolve()):
                continue
            out.add(p.pid)
        except (psutil.Error, OSError):
            pass
    return out


def _ray_parent(p) -> bool:
    """Whether ``p``'s parent is a live Ray worker (a dying or zombie one is not)."""
    import psutil

    try:
        parent = p.parent()
        return (
            parent is not None
            and parent.status() != psutil.STATUS_ZOMBIE
            and " ".join(parent.cmdline()).startswith("ray::")
        )
    except psutil.Error:
        return False


def engine_groups_of_run(run_dir) -> set[int]:
    """Process groups of every engine process of ``run_dir`` still running: servers and their engine cores
    and workers (``VLLM::``), whoever started them. For the end of a job: none may outlive it, even one
    whose group leader is gone (a ``kill -9``-ed server's engine core lives on) or that no snapshot showed
    (a server still starting when the job failed)."""
    import psutil

    from launch.resume import _of_run

    root = Path(run_dir).resolve()
    out = set()
    for p in psutil.process_iter():
        try:
            cmd = " ".join(p.cmdline())
            if (any(c in cmd for c in ENGINE_COMMANDS) or cmd.startswith(("VLLM::", "sglang::"))) and _of_run(
                p.pid, root
            ):
                out.add(os.getpgid(p.pid))
        except (psutil.Error, OSError):
            pass
    out.discard(os.getpgrp())  # never the caller's own group (the driver's)
    return out
