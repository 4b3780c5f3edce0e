"""Supervision of the broker process, and the job's last word on processes and groups.

* :meth:`BrokerSupervisor.check` (called once per driver loop turn): a broker that exited
  is restarted on its spool (``broker.spool_dir``) at the address it had, so every client
  (fleet, learner) reconnects to the same endpoint and retries its idempotent requests;
  the restarted broker replays the spool (every accepted, unacked group is back, live
  leases restored, nothing acked comes back), so the job goes on with no group lost or
  trained twice. Without a spool the groups it held are gone: the job stops with a
  :class:`BrokerGone` that says so (the normal shutdown then ends every process).
* :meth:`BrokerSupervisor.final_status`: the broker's accounting at shutdown; if the broker
  does not answer, the spool is read directly, so groups it holds count as pending
  (queued), not lost.
* :func:`end_engine_groups`: engine servers lead their own process groups
  (``start_new_session``); after the shutdown every process still in one of the groups the
  job ever started is terminated, then killed, so a failed job leaves no engine behind.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

RESTART_ATTEMPTS = 5  # the port may still be held for a moment by the dead process's sockets


class BrokerGone(RuntimeError):
    """The broker died and cannot be brought back with its groups; the message says why."""


class BrokerSupervisor:
    def __init__(self, job, *, max_restarts: int = 10) -> None:
        self.job = job
        self.max_restarts = max_restarts
        self.restarts = 0
        self.spool_dir = job.cfg.broker.spool_dir

    def check(self) -> None:
        bp = self.job.broker
        if bp is None or bp.proc.poll() is None:
            return
        code = bp.proc.returncode
        if not self.spool_dir:
            raise BrokerGone(
                f"the broker process exited (code {code}) and broker.spool_dir is not set, so the "
                "groups it held are gone; stopping the job (set broker.spool_dir to have the "
                "launcher restart it)"
            )
        if self.restarts >= self.max_restarts:
            raise BrokerGone(f"the broker process exited (code {code}) after {self.restarts} restarts; giving up")
        self.restarts += 1
        log.warning(
            "the broker process exited (code %s); restarting it on its spool %s at %s (restart %d)",
            code,
            self.spool_dir,
            bp.address,
            self.restarts,
        )
        self.job.broker = self._restart(bp)

    def _restart(self, old):
        from broker.process import BrokerProcess

        t = time.monotonic()
        err = None
        for attempt in range(RESTART_ATTEMPTS):
            bp = BrokerProcess(
                address=old.address, config=old.options.get("config"), curve_keys_dir=old.options.get("curve_keys_dir")
            )
            try:
                bp.start()
            except RuntimeError as exc:  # e.g. the port not yet free
                err = exc
                time.sleep(0.5 * (attempt + 1))
                continue
            log.info("broker restarted at %s in %.1f s", bp.address, time.monotonic() - t)
            return bp
        raise BrokerGone(f"the broker could not be restarted at {old.address}: {err}")

    def final_status(self) -> dict[str, Any]:
        """The broker's status, or (broker gone, spool set) the accounting read from the spool."""
        bp = self.job.broker
        # a broker whose process has exited is not asked (its status request would wait out its timeout)
        status = self.job._broker_status() if bp is not None and bp.proc.poll() is None else {}
        if status or not self.spool_dir:
            return status
        try:
            return spool_accounting(Path(self.spool_dir))
        except Exception as exc:  # the summary must be written whatever the spool holds
            log.error("reading the spool %s for the summary failed: %s", self.spool_dir, exc)
            return {}


def spool_accounting(root: Path) -> dict[str, Any]:
    """Groups accepted, acked, dropped (by reason) and pending, from a spool on disk (keys as
    launch.broker_view.flatten gives them)."""
    from broker.spool import read_log, read_segments

    batches, _ = read_segments(root)
    records, _ = read_log(root / "log.bin")
    groups: set[str] = set()
    for b in batches:
        groups.update(b.column("group_id").to_pylist())
    acked, drops, done = 0, {}, set()
    for rec in records:
        if rec.kind == "ack":
            acked += len(rec.group_ids)
            done.update(rec.group_ids)
        elif rec.kind == "drop":
            drops[rec.reason] = drops.get(rec.reason, 0) + len(rec.group_ids)
            done.update(rec.group_ids)
    return {
        "groups_accepted": len(groups),
        "groups_acked": acked,
        "queued_groups": len(groups - done),
        "leased_groups": 0,
        "drops": drops,
        "from_spool": True,
    }


def engine_groups(snapshot: dict[str, Any]) -> set[int]:
    """Process-group ids (= server pids) of the engine servers in a driver snapshot."""
    return {int(s["pid"]) for s in snapshot.get("fleet_servers") or [] if s.get("pid")}


def end_engine_groups(pgids: set[int], timeout_s: float = 10.0) -> list[int]:
    """SIGTERM, then SIGKILL, every process still in one of ``pgids``; returns those found."""
    import psutil

    def members() -> list[psutil.Process]:
        # A zombie has exited; only its entry waits for a parent to reap it (an orphan's new parent, PID 1 of
        # a container, may never do so). It holds no GPU memory or port and no signal can end it: not counted.
        out = []
        for p in psutil.process_iter():
            try:
                if os.getpgid(p.pid) in pgids and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(p)
            except (ProcessLookupError, psutil.Error, OSError):
                pass
        return out

    found = members()
    if not found:
        return []

    def desc(p: psutil.Process) -> str:
        try:
            return f"{p.pid} ({p.name()}, {p.status()}, parent {p.ppid()})"
        except psutil.Error:
            return f"{p.pid} (gone)"

    log.warning(
        "shutdown: %d engine process(es) outlived the fleet; ending them: %s", len(found), [desc(p) for p in found]
    )
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for g in pgids:
            try:
                os.killpg(g, sig)
            except (ProcessLookupError, PermissionError):
                pass
        _, alive = psutil.wait_procs(found, timeout=timeout_s if sig == signal.SIGTERM else 5.0)
        if not alive:
            break
        found = alive
    return [p.pid for p in found]
