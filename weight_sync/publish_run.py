"""One publish on learner rank 0, phase by phase: :class:`PublishRun`, and how it is acknowledged.

:class:`weight_sync.publisher.Publisher` owns the group, the members and the RPC thread; for each
publish it makes a :class:`PublishRun`, which holds what the phases share (the step being done,
the buckets on the wire, their fingerprints, the engines' RPC futures) and runs them in order::

    start_engines -> broadcast (gather, pack, send; at most ``inflight_buckets`` groups of buckets
    on the wire) -> acks.after_broadcast -> drain -> acks.collect -> acks.report

The ack mode is a strategy, chosen once per publish:

- :class:`RpcAcks` (default): each engine's ``update_weights`` answer is its ack; the checksums
  are compared with ours.
- :class:`StagedAcks` (``weight_sync.staging``): engines post their receives (``begin_update``)
  and keep generating; after the broadcast ``commit_update`` loads, and its answers are the acks.
- :class:`GroupAcks` (``weight_sync.acks = "group"``, fleetrl's receivers): the acks are an
  all-gather of every rank's fingerprints, queued behind each receiver's last load; the RPC
  answers are left to ``Publisher.settle`` at the next publish.

Every wait is bounded by ``timeout_s``; a failure in any phase goes to ``Publisher._fail``, which
blames, tears the group down and raises :class:`PublishError`.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures as cf
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from weight_sync import group as wgroup
from weight_sync.config import WeightSyncConfig
from weight_sync.endpoint import WeightEndpoint
from weight_sync.messages import WeightPlan
from weight_sync.plan import SendRing, bucket_fingerprint, combine_fingerprints

log = logging.getLogger("weight_sync.publisher")


class PublishError(RuntimeError):
    """A publish failed; ``blamed`` are the engine ids held responsible (dropped from the group)."""

    def __init__(self, msg: str, blamed: list[str]) -> None:
        super().__init__(msg)
        self.blamed = blamed


@dataclass(kw_only=True, slots=True)
class PublishReport:
    version: int
    bytes: int
    seconds: float
    broadcast_seconds: float
    engines: list[str]
    checksum: str
    epoch: int
    rebuild_seconds: float = 0.0
    per_engine_checksums: dict[str, str] = field(default_factory=dict)


class RunHost(Protocol):
    """What a run reads and calls of the publisher that made it (:class:`weight_sync.publisher.Publisher`):
    declared here so this module does not import the publisher (which imports this one)."""

    cfg: WeightSyncConfig
    plan: WeightPlan
    device: torch.device
    engines: dict[str, WeightEndpoint]
    members: list[str]
    pg: Any
    epoch: int
    world_size: int
    group_acks: bool
    _ring: SendRing | None

    def _mark(self, event: str) -> None: ...
    def _submit(self, coro) -> cf.Future: ...
    def _let_out(self, written: cf.Future) -> None: ...
    def _collect(self, futs: dict[str, cf.Future], timeout_s: float) -> dict[str, str]: ...
    def _check_acks(self, futs: dict[str, cf.Future], step: str) -> None: ...
    def _reject(self, version: int, checksum: str, bad: dict[str, str], where: str) -> None: ...
    def _fail(self, version: int, step: str, err: Exception, futs: dict[str, cf.Future]): ...
    def _acks_to_host(self, work, gathered: torch.Tensor) -> AcksIn: ...
    def _group_acked(
        self,
        version: int,
        futs: dict[str, cf.Future],
        gathered: torch.Tensor,
        t0: float,
        sent: int,
        broadcast_s: float,
        rebuild_s: float,
    ) -> PublishReport: ...


class PublishRun:
    """Publish ``version`` from ``tensors`` (name, full tensor in plan order) to the publisher's members."""

    def __init__(self, pub: RunHost, version: int, tensors: Iterator, t0: float, rebuild_s: float) -> None:
        self.pub, self.version, self.it, self.t0, self.rebuild_s = pub, version, tensors, t0, rebuild_s
        if pub._ring is None:
            raise RuntimeError(f"publish of v{version} before a group was joined (the send ring is made on join)")
        self.ring: SendRing = pub._ring
        self.plan, self.depth, self.dev = pub.plan, pub.cfg.inflight_buckets, pub.device
        self.timeout_s = pub.cfg.timeout_s
        self.mark = pub._mark
        self.prints: list[torch.Tensor] = []
        self.sent = 0
        self.step = "start"
        self.inflight: collections.deque = collections.deque()  # per group on the wire: [(bucket, work, buffer)]
        self.futs: dict[str, cf.Future] = {}
        self.written: cf.Future | None = None
        self.broadcast_s = 0.0
        staged = pub.cfg.staging
        group = pub.group_acks and not staged and pub.pg is not None
        self.acks: AckMode = StagedAcks() if staged else GroupAcks() if group else RpcAcks()

    def run(self) -> PublishReport:
        self.start_engines()
        tb = time.perf_counter()
        try:
            self.broadcast()
            self.acks.after_broadcast(self)
            self.drain()
            self.broadcast_s = time.perf_counter() - tb
            self.acks.collect(self)
        except Exception as e:  # noqa: BLE001 - becomes a PublishError naming the peer
            self.pub._fail(self.version, self.step, e, self.futs)
        return self.acks.report(self)

    # ---- phases ---------------------------------------------------------------------------
    def start_engines(self) -> None:
        """Start every member's side of the publish. Engines that can be started from this thread are
        (no hop to the RPC thread); the others' requests go out from the RPC loop."""
        looped = False
        for eid in self.pub.members:
            engine = self.pub.engines[eid]
            try:
                fut = self.acks.send_now(engine, self.version, self.plan.plan_id)
            except Exception as e:  # noqa: BLE001 - a client that raises instead of failing its future
                fut = cf.Future()
                fut.set_exception(e)
            if fut is None:
                fut, looped = self.pub._submit(self.acks.request(engine, self.version, self.plan.plan_id)), True
            self.futs[eid] = fut
        self.mark("requests_sent")
        # done once the loop has run each request's first step
        self.written = self.pub._submit(asyncio.sleep(0)) if looped else None

    def broadcast(self) -> None:
        # The first bucket's broadcast is issued before waiting for the requests to leave: it waits on
        # the device for the engines' receives, and its issue overlaps the RPC thread's wake-up.
        self.send(0)
        if self.written is not None:
            self.pub._let_out(self.written)
            self.mark("requests_written")
        for g in range(1, len(self.ring.groups)):
            self.send(g)

    def send(self, g: int) -> None:
        """Gather group ``g``, pack it, put it on the wire behind at most ``depth - 1`` others."""
        plan, ring, dev = self.plan, self.ring, self.dev
        parts = []
        for b in ring.groups[g]:
            self.step = f"gather bucket {b}/{len(plan.buckets)}"
            for i in plan.buckets[b]:
                name, t = next(self.it)
                want = ring.expect[i]
                if name != want[0] or t.shape != want[1] or t.dtype != want[2]:
                    raise ValueError(
                        f"weight source yielded {name} {list(t.shape)} {t.dtype} where plan "
                        f"{plan.plan_id} expects {plan.names[i]} {plan.shapes[i]} {plan.dtypes[i]} "
                        f"(index {i})"
                    )
                parts.append(t if t.device == dev else t.to(dev))
        bufs = ring.pack(g, parts)
        # Bounded memory: at most `depth` groups are on the wire; the packing of this one
        # (already queued on the device) overlaps with them.
        while len(self.inflight) >= self.depth:
            self.retire()
        works = []
        pg = self.pub.pg
        for b, buf in zip(ring.groups[g], bufs, strict=True):
            self.step = f"broadcast bucket {b}/{len(plan.buckets)}"
            if pg is not None:
                works.append((b, wgroup.broadcast_async(pg, buf), buf))  # buf lives until sent
                self.mark(f"bucket{b}_issued")
            self.prints.append(bucket_fingerprint(buf))  # reads buf while the broadcast sends it
            self.sent += buf.numel()
        if works:
            self.inflight.append(works)

    def retire(self) -> None:
        """Wait (bounded) for the oldest group's broadcasts on the wire."""
        for b, work, _buf in self.inflight.popleft():
            self.step = f"broadcast bucket {b}/{len(self.plan.buckets)}"
            wgroup.wait_work(work, time.monotonic() + self.timeout_s, self.step, check=self.watch)
            self.mark(f"bucket{b}_sent")

    def drain(self) -> None:
        while self.inflight:
            self.retire()

    def watch(self, work=None) -> None:
        """Between polls of a wait: fail fast on a failed RPC, unless the awaited ``work`` is done meanwhile."""
        if work is None or not work.is_completed():
            self.pub._check_acks(self.futs, self.step)


class AckMode:
    """How the engines acknowledge a publish; see the module docstring."""

    def send_now(self, engine: WeightEndpoint, version: int, plan_id: str) -> cf.Future | None:
        """The engine's request written from the publishing thread, if its client can (``send_update``)."""
        return engine.send_update(version, plan_id)

    def request(self, engine: WeightEndpoint, version: int, plan_id: str):
        """The engine's request as a coroutine for the RPC loop."""
        return engine.update_weights(version, plan_id)

    def after_broadcast(self, run: PublishRun) -> None:
        """Right after the last bucket is issued, before the wire drains."""

    def collect(self, run: PublishRun) -> None:
        """After the wire drained: wait for the acks (bounded); raise if any engine failed."""

    def report(self, run: PublishRun) -> PublishReport:
        raise NotImplementedError


class RpcAcks(AckMode):
    """Each engine's answer to its update request is its ack: the checksum of what it loaded."""

    checksum = ""

    def collect(self, run: PublishRun) -> None:
        self.checksum = combine_fingerprints(run.prints)  # its device-to-host copy overlaps the engines' last load
        run.mark("checksum")
        run.step = "acknowledge"
        failed = run.pub._collect(run.futs, run.timeout_s)
        run.mark("acked")
        failed = self.commit(run, failed)
        if failed:
            raise RuntimeError("; ".join(f"{k}: {v}" for k, v in failed.items()))

    def commit(self, run: PublishRun, failed: dict[str, str]) -> dict[str, str]:
        return failed

    def report(self, run: PublishRun) -> PublishReport:
        pub, checksum = run.pub, self.checksum
        acks = {eid: f.result() for eid, f in run.futs.items()}
        bad = {eid: c for eid, c in acks.items() if c and c != checksum}
        if bad:
            pub._reject(run.version, checksum, bad, "")
        dt = time.perf_counter() - run.t0
        # DEBUG: the learner logs each publish itself; a line here costs this thread time of its own (its
        # write releases the GIL, and getting it back waits on the RPC thread).
        log.debug(
            "published v%d: %.1f MB to %d engines in %.3fs (broadcast %.3fs, %.0f MB/s)",
            run.version,
            run.sent / 1e6,
            len(run.futs),
            dt,
            run.broadcast_s,
            run.sent / 1e6 / max(run.broadcast_s, 1e-9),
        )
        return PublishReport(
            version=run.version,
            bytes=run.sent,
            seconds=dt,
            broadcast_seconds=run.broadcast_s,
            engines=list(run.futs),
            checksum=checksum,
            epoch=pub.epoch,
            rebuild_seconds=run.rebuild_s,
            per_engine_checksums=acks,
        )


class StagedAcks(RpcAcks):
    """Engines post their receives and go on generating; after the broadcast they load at the commit,
    whose answers are the acks."""

    def send_now(self, engine: WeightEndpoint, version: int, plan_id: str) -> cf.Future | None:
        return None  # the receives are posted by begin_update, on the RPC loop

    def request(self, engine: WeightEndpoint, version: int, plan_id: str):
        return engine.begin_update(version, plan_id)

    def commit(self, run: PublishRun, failed: dict[str, str]) -> dict[str, str]:
        if failed:
            return failed
        run.step = "commit"
        pub = run.pub
        run.futs = {eid: pub._submit(pub.engines[eid].commit_update(run.version)) for eid in pub.members}
        failed = pub._collect(run.futs, run.timeout_s)
        run.mark("committed")
        return failed


class GroupAcks(AckMode):
    """The acks are every rank's fingerprints, all-gathered right behind the last bucket; the RPC
    answers are checked later (``Publisher.settle``)."""

    acks_in: AcksIn | None = None

    def after_broadcast(self, run: PublishRun) -> None:
        # Every rank's fingerprints, each receiver's queued behind its last load: the acks, on the wire
        # right behind the last bucket (our own row is the checksum of what we sent). Their arrival
        # also means every broadcast before them is done (one stream, in order): wait for them, not
        # bucket by bucket, and spin a little, since they are due when the last bucket is.
        pub = run.pub
        mine = torch.stack(run.prints)
        gathered = torch.empty((pub.world_size, *mine.shape), dtype=mine.dtype, device=mine.device)
        acks_in = self.acks_in = pub._acks_to_host(wgroup.all_gather_async(pub.pg, gathered, mine), gathered)
        run.step = (
            "acknowledge (group)"
            if not run.inflight
            else f"broadcast bucket {run.inflight[0][0][0]}/{len(run.plan.buckets)}, then acknowledge (group)"
        )
        # (spinning only on CUDA: on gloo the RPC thread and gloo's need the GIL this loop would hold)
        wgroup.wait_work(
            acks_in,
            time.monotonic() + run.timeout_s,
            run.step,
            max_sleep_s=5e-5,
            check=lambda: run.watch(acks_in),
            spin_s=5e-3 if acks_in.copied is not None else 0.0,
        )
        run.mark("acked")
        if acks_in.copied is not None:
            run.inflight.clear()  # NCCL: one stream, in order, so every broadcast before the acks is done

    def report(self, run: PublishRun) -> PublishReport:
        assert self.acks_in is not None  # after_broadcast sets it before the report
        return run.pub._group_acked(
            run.version, run.futs, self.acks_in.host, run.t0, run.sent, run.broadcast_s, run.rebuild_s
        )


class AcksIn:
    """The group's acks as :func:`weight_sync.group.wait_work` sees them: done once they are on the host (the
    copy behind the all-gather, on CUDA); a failed all-gather raises its error as soon as it is known."""

    def __init__(self, work, host: torch.Tensor, copied: torch.cuda.Event | None) -> None:
        self.work, self.host, self.copied = work, host, copied
        self._checked = False

    def is_completed(self) -> bool:
        if self.copied is None:
            return self.work.is_completed()
        if self.copied.query():
            return True
        if not self._checked and self.work.is_completed():  # done, or failed: then wait() raises its error
            self._checked = True
            self.work.wait()
        return False

    def wait(self) -> None:
        self.work.wait()
