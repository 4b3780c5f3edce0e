"""The publisher: learner rank 0 broadcasts each new policy to every engine over a dedicated group.

Dataflow of ``publish(v, tensors)`` (``tensors`` yields (name, full tensor) in
plan order; with FSDP every learner rank iterates it, because each item is an
all-gather, and only rank 0 sends)::

    rank 0:  [rebuild if membership changed] -> engines.send_update(v) from this thread
             (or update_weights(v), async RPCs on the RPC thread's loop) -> gather b0 -> bcast b0
             -> [wait until the loop's requests are written] -> gather b1 -> bcast b1 || gather b2
             ... -> acks
             (at most ``inflight_buckets`` groups of buckets on the wire, a group being the
             buckets that share one send slot (see :class:`weight_sync.plan.SendRing`); completion is polled,
             see :func:`weight_sync.group.wait_work`)
             -> compare every engine's checksum with our own
             group acks (``cfg.acks = "group"``, fleetrl's receivers): the acks are an all-gather of
             every rank's fingerprints, queued behind each receiver's last load; the RPC answers are
             collected by :meth:`Publisher.settle` at the next publish
             staged (``cfg.staging``): engines.begin_update(v) instead, and after the last
             bucket engines.commit_update(v), whose answers are the acks: an engine
             generates through the whole broadcast and pauses only for its commit
    rank>0:  gather b0, b1, ... (drain the iterator; keeps FSDP collectives aligned)

Invariants and what happens when a peer dies:
- Every wait is bounded by ``timeout_s`` (join, each bucket, the acks). A
  failure or timeout raises :class:`PublishError` naming the step and the
  engine(s) to blame (those that fail a health probe: dead or stuck; if none
  does, those whose RPC failed); the group is torn down so survivors blocked in a receive fail at
  once; the blamed engines are dropped; the next publish first rebuilds the
  group (new epoch) with the survivors. Nothing waits without a limit.
- After a failure rank 0 keeps draining ``tensors`` so the other learner ranks
  never hang in a gather.
- The plan is fixed; it is announced once per epoch in ``init_weight_transfer``.
- A late joiner (:meth:`add_engine`) first loads the latest export from disk,
  then joins at the next rebuild; until then it is not in the group.

Threads: the engines' RPCs run on an event loop on a thread of the publisher's
own (``weight-sync-rpc``). Handing it a request costs a wake-up of that thread
(``bench/rpc_wakeup.py`` measures it), before the engine even
hears of the publish: an engine client with :meth:`WeightEndpoint.send_update`
(fleetrl's standalone receiver) has its request written from the publishing
thread instead, and its answer read on a thread of its own. Group acks keep the
answers off the critical path.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from core.http_client import EngineErrorCode, free_port
from weight_sync import group as wgroup
from weight_sync.config import WeightSyncConfig
from weight_sync.endpoint import WeightEndpoint
from weight_sync.messages import GroupInfo, WeightPlan
from weight_sync.plan import SendRing, fingerprints_checksum
from weight_sync.publish_run import AcksIn, PublishError, PublishReport, PublishRun
from weight_sync.sglang_group import publisher_group

__all__ = ["PublishError", "PublishReport", "Publisher"]

log = logging.getLogger(__name__)


class Publisher:
    """Weight publisher; construct on every learner rank, with ``engines`` on rank 0 only."""

    def __init__(
        self,
        cfg: WeightSyncConfig,
        plan: WeightPlan,
        *,
        rank: int = 0,
        engines: Iterable[WeightEndpoint] = (),
        device: str = "cpu",
        group_factory: Callable[[GroupInfo], Any] | None = None,
    ) -> None:
        """``group_factory(info)`` opens rank 0 of a group that hosts its own rendezvous on ``info.master_port``
        (a fresh port each epoch), e.g. vLLM's NCCL group; by default gloo/NCCL groups use our TCP store and
        ``nccl_impl='vllm'`` uses :class:`weight_sync.vllm_nccl.VllmNcclGroup`."""
        self.cfg, self.plan, self.rank = cfg, plan, rank
        self.backend = cfg.backend if cfg.backend != "auto" else ("nccl" if torch.cuda.is_available() else "gloo")
        self.device = torch.device(device)
        self._vllm_nccl = self.backend == "nccl" and cfg.nccl_impl == "vllm"
        self._factory = group_factory
        if self._factory is None and self._vllm_nccl:
            from weight_sync.vllm_nccl import VllmNcclGroup

            self._factory = lambda g: VllmNcclGroup.open(
                g.master_addr, g.master_port, g.world_size, cfg.timeout_s, self.device
            )
        self.timeline: list[tuple[str, float]] = []  # (event, time.perf_counter()) of the last publish
        self.engines: dict[str, WeightEndpoint] = {}
        self.members: list[str] = []  # engine ids in the current epoch's group
        self.epoch = 0
        self.pg = None
        self._dirty = True
        self._store: dist.TCPStore | None = None  # hosted here unless a group factory is given
        self._loop: asyncio.AbstractEventLoop | None = None  # the RPC loop's thread; None once closed
        self._ring: SendRing | None = None
        self.group_acks = False  # this epoch's publishes are acknowledged through the group
        self.world_size = 1
        self._offsets: dict[str, int] = {}  # engine id -> its first rank in this epoch
        self._unsettled: tuple[int, dict[str, cf.Future], str] | None = None  # RPCs of a group-acked publish
        self._ack_host: torch.Tensor | None = None  # pinned: where the gathered acks land
        if rank != 0:
            return
        for e in engines:
            self._add(e)
        self._store = None if self._factory else wgroup.host_store(cfg.master_addr, cfg.master_port, cfg.timeout_s)
        # uvloop where installed: each publish waits on this loop (the engines' start RPCs going out, and
        # their acks coming back unless the group carries them), and its wake-ups are cheaper.
        try:
            import uvloop

            loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
        except ImportError:
            loop = asyncio.new_event_loop()
        self._loop = loop
        threading.Thread(target=loop.run_forever, name="weight-sync-rpc", daemon=True).start()

    # ---- membership -------------------------------------------------------------
    def _add(self, client: WeightEndpoint) -> None:
        if client.engine_id in self.engines:
            raise ValueError(f"engine id {client.engine_id!r} is already a weight-sync member")
        if self.cfg.staging and not client.supports_staging:
            raise ValueError(
                f"weight_sync.staging is on but engine {client.engine_id} ({type(client).__name__}) "
                "takes no staged publish (vLLM with fleetrl's backend and the standalone receiver do)"
            )
        self.engines[client.engine_id] = client
        self._dirty = True

    def add_engine(self, client: WeightEndpoint, export_path: str | None = None, version: int = 0) -> None:
        """A late joiner: load the latest export first (if given), then join at the next rebuild."""
        if export_path is not None:
            self.call(
                client.load_weights_from_path(export_path, version),
                self.cfg.timeout_s,
                f"engine {client.engine_id}: load_weights_from_path({export_path}, v{version})",
            )
        self._add(client)

    def remove_engine(self, engine_id: str) -> None:
        self.engines.pop(engine_id, None)
        self._dirty = True

    # ---- async RPCs from sync code ---------------------------------------------------
    def _submit(self, coro) -> cf.Future:
        if self._loop is None:
            coro.close()
            raise RuntimeError("weight-sync publisher is closed")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _hosted_store(self) -> dist.TCPStore:
        if self._store is None:
            raise RuntimeError("weight-sync publisher: no store is hosted here (a group factory was given)")
        return self._store

    @staticmethod
    def _let_out(written: cf.Future) -> None:
        """Wait (briefly) until the engines' requests are written. Until then the RPC thread competes for
        the GIL with this one, which goes on packing buckets, and a request that leaves late delays the
        engines' posted receives, hence the wire."""
        try:
            written.result(1.0)
        except cf.TimeoutError:
            pass  # a loop this busy is slow anyway; the RPCs' own timeouts still hold

    def call(self, coro, timeout_s: float, what: str):
        """Run an engine coroutine on the publisher's RPC loop (clients are bound to it), bounded."""
        fut = self._submit(coro)
        try:
            return fut.result(timeout_s)
        except cf.TimeoutError:
            fut.cancel()
            raise TimeoutError(f"{what}: no answer within {timeout_s:.0f}s") from None

    # ---- group ------------------------------------------------------------------------
    def rebuild(self) -> float:
        """Open a new epoch with the current engines; an engine that fails to join is dropped."""
        t0 = time.perf_counter()
        wgroup.close_group(self.pg)
        self.pg = None
        for _attempt in range(3):
            self.epoch += 1
            ids = list(self.engines)
            offsets, world = {}, 1
            for eid in ids:
                offsets[eid] = world
                world += self.engines[eid].group_ranks
            # vLLM's NCCL workers rendezvous through a store that rank 0 hosts itself: a fresh port per epoch.
            port = free_port(self.cfg.master_addr) if self._factory else self._hosted_store().port
            acks = self._group_acks_possible(ids)
            infos = {
                eid: GroupInfo(
                    master_addr=self.cfg.master_addr,
                    master_port=port,
                    rank_offset=offsets[eid],
                    world_size=world,
                    backend=self.backend,
                    group_epoch=self.epoch,
                    group_acks=acks,
                )
                for eid in ids
            }
            futs = {eid: self._submit(self.engines[eid].init_weight_transfer(infos[eid], self.plan)) for eid in ids}
            own = GroupInfo(
                master_addr=self.cfg.master_addr,
                master_port=infos[ids[0]].master_port if ids else 0,
                rank_offset=0,
                world_size=world,
                backend=self.backend,
                group_epoch=self.epoch,
                group_acks=acks,
            )
            try:
                pg = self._open_group(own) if ids else None
                failed = self._collect(futs, self.cfg.timeout_s)
            except Exception as e:  # noqa: BLE001 - the join failed; find who did not come
                failed = self._collect(futs, 1.0) or {
                    eid: f"did not join: {e}" for eid, f in futs.items() if not f.done()
                }
                pg = None
            if not failed:
                self.pg, self.members, self._dirty = pg, ids, False
                self.group_acks, self.world_size, self._offsets = acks, world, offsets
                log.info(
                    "weight-sync epoch %d: %d engines, world %d, acks through the %s, joined in %.2fs",
                    self.epoch,
                    len(ids),
                    world,
                    "group" if acks else "RPCs",
                    time.perf_counter() - t0,
                )
                return time.perf_counter() - t0
            wgroup.close_group(pg)
            for eid, why in failed.items():
                log.error("weight-sync epoch %d: dropping engine %s: %s", self.epoch, eid, why)
                self.engines.pop(eid, None)
        raise PublishError(f"weight-sync group could not be rebuilt after 3 epochs (last {self.epoch})", [])

    def _group_acks_possible(self, ids: list[str]) -> bool:
        """Acks through the group need fleetrl's receivers on every rank and a group fleetrl made (vLLM's
        built-in backend and SGLang's own update run no all-gather of ours); a staged publish's commit
        RPC is its ack anyway."""
        own_group = self._factory is None and self.cfg.nccl_impl != "sglang"
        return (
            self.cfg.acks == "group"
            and own_group
            and not self.cfg.staging
            and bool(ids)
            and all(self.engines[eid].supports_group_acks for eid in ids)
        )

    def _open_group(self, own: GroupInfo):
        if self._factory is not None:
            return self._factory(own)
        if self.cfg.nccl_impl == "sglang":  # NCCL, or gloo in colocated mode (one GPU, two processes)
            # SGLang's workers join our store under their own key prefixes and run no collective at join
            return wgroup.TorchGroup(publisher_group(self._hosted_store(), own, self.cfg.timeout_s))
        return wgroup.TorchGroup(wgroup.make_group(self._hosted_store(), own, 0, self.cfg.timeout_s))

    def _collect(self, futs: dict[str, cf.Future], timeout_s: float) -> dict[str, str]:
        """Wait (bounded) for RPCs; map engine id -> reason for those that failed or timed out."""
        if futs:
            cf.wait(list(futs.values()), timeout=timeout_s)
        failed = {eid: f"no answer within {timeout_s:.0f}s" for eid, f in futs.items() if not f.done()}
        failed.update(_errors(futs))
        return failed

    # ---- publish ----------------------------------------------------------------------
    def publish(self, version: int, tensors: Iterable[tuple[str, torch.Tensor]]) -> PublishReport | None:
        """Send ``version`` to every member; rank 0 returns a report, other ranks ``None``."""
        it = iter(tensors)
        if self.rank != 0:
            for _ in it:
                pass
            return None
        t0 = time.perf_counter()
        self.timeline = [("start", t0)]
        try:
            self.settle()
            rebuild_s = self.rebuild() if self._dirty else 0.0
            return self._publish(version, it, t0, rebuild_s)
        finally:
            for _ in it:  # after a failure, keep the other learner ranks' gathers going
                pass

    def _publish(self, version: int, it, t0: float, rebuild_s: float) -> PublishReport:
        if self._ring is None:
            self._ring = SendRing(
                self.plan, self.cfg.inflight_buckets + 1, self.device, int(self.cfg.bucket_mb * (1 << 20))
            )
        return PublishRun(self, version, it, t0, rebuild_s).run()

    def _acks_to_host(self, work, gathered: torch.Tensor) -> AcksIn:
        """On CUDA, queue the gathered acks' copy to the host right behind the all-gather (the current stream
        waits for it on the device), so that when the host sees the copy done the rows are already here."""
        if not gathered.is_cuda:
            return AcksIn(work, gathered, None)
        if self._ack_host is None or self._ack_host.shape != gathered.shape:
            self._ack_host = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
        work.wait()  # NCCL: orders the current stream after the all-gather; the host goes on
        self._ack_host.copy_(gathered, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        return AcksIn(work, self._ack_host, copied)

    def _group_acked(
        self,
        version: int,
        futs: dict[str, cf.Future],
        gathered: torch.Tensor,
        t0: float,
        sent: int,
        broadcast_s: float,
        rebuild_s: float,
    ) -> PublishReport:
        """Check the gathered fingerprints (on the host): every rank of every engine must match ours (row 0).
        The engines' RPC answers are left to :meth:`settle` (called by the next publish)."""
        rows = gathered.numpy()
        checksum = fingerprints_checksum(rows[0])
        if (rows == rows[0]).all():  # the usual case: one comparison for every rank
            self._mark("checksum")
            return self._group_report(
                version, futs, checksum, {eid: checksum for eid in self.members}, t0, sent, broadcast_s, rebuild_s
            )
        acks, bad = {}, {}
        for eid in self.members:
            first = self._rank_of(eid)
            theirs = {
                fingerprints_checksum(rows[r])
                for r in range(first, first + self.engines[eid].group_ranks)
                if not (rows[r] == rows[0]).all()
            }
            acks[eid] = ",".join(sorted(theirs)) or checksum
            if theirs:
                bad[eid] = acks[eid]
        self._mark("checksum")
        if bad:
            for f in futs.values():
                f.cancel()
            self._reject(version, checksum, bad, " in the group acks")
        return self._group_report(version, futs, checksum, acks, t0, sent, broadcast_s, rebuild_s)

    def _group_report(
        self,
        version: int,
        futs: dict[str, cf.Future],
        checksum: str,
        acks: dict[str, str],
        t0: float,
        sent: int,
        broadcast_s: float,
        rebuild_s: float,
    ) -> PublishReport:
        self._unsettled = (version, futs, checksum)
        dt = time.perf_counter() - t0
        log.debug(
            "published v%d: %.1f MB to %d engines in %.3fs (broadcast %.3fs), acked through the group",
            version,
            sent / 1e6,
            len(futs),
            dt,
            broadcast_s,
        )
        return PublishReport(
            version=version,
            bytes=sent,
            seconds=dt,
            broadcast_seconds=broadcast_s,
            engines=list(futs),
            checksum=checksum,
            epoch=self.epoch,
            rebuild_seconds=rebuild_s,
            per_engine_checksums=acks,
        )

    def settle(self, timeout_s: float | None = None) -> dict[str, str]:
        """Collect the RPC answers of the last group-acked publish (bounded; by then they are normally in).

        An engine whose answer is an error, or a checksum other than its group ack, is dropped: the next
        publish rebuilds the group without it. Returns engine id -> what went wrong. A publish calls this
        first; call it yourself before talking to the engines outside a publish (their answer to the
        update may still be on its way)."""
        if self._unsettled is None:
            return {}
        version, futs, checksum = self._unsettled
        self._unsettled = None
        failed = self._collect(futs, self.cfg.timeout_s if timeout_s is None else timeout_s)
        for f in futs.values():
            f.cancel()  # those that did not answer in time
        for eid, f in futs.items():
            if eid not in failed and f.result() != checksum:
                failed[eid] = f"answered checksum {f.result()} after its group ack of {checksum}"
        for eid, why in failed.items():
            log.error("weight-sync: dropping engine %s after v%d: %s", eid, version, why)
            self.remove_engine(eid)
        return failed

    def _reject(self, version: int, checksum: str, bad: dict[str, str], where: str) -> None:
        """Drop the engines whose checksum (``bad``: engine id -> theirs) differs from ours, and raise."""
        for eid in bad:
            self.remove_engine(eid)
        raise PublishError(
            f"publish v{version}: checksum mismatch{where} (ours {checksum}) from "
            + ", ".join(f"engine {k} ({v})" for k, v in bad.items()),
            list(bad),
        )

    def _mark(self, event: str) -> None:
        self.timeline.append((event, time.perf_counter()))

    @staticmethod
    def _check_acks(futs: dict[str, cf.Future], step: str) -> None:
        """Fail fast if an engine's RPC already died (e.g. its process was killed)."""
        for eid, why in _errors(futs).items():
            raise RuntimeError(f"engine {eid} failed during '{step}': {why}")

    def _fail(self, version: int, step: str, err: Exception, futs: dict[str, cf.Future]):
        """Blame, tear down, drop, and raise; survivors rejoin at the next publish.

        Whom to blame: an engine that is dead or stuck fails a health probe, so every engine is probed
        (in parallel, bounded). If some fail it, they are blamed; an engine whose receive failed because
        the group broke under it (a receiver's error at a receive or the acks' step) is then a victim,
        not a cause, even if its error came in first: a stuck peer makes the others' transport fail too.
        If every engine answers its probe, those whose RPC failed are blamed, preferring failures outside
        the transport (a load, a checksum)."""
        grace = min(2.0, self.cfg.timeout_s)
        errors = _errors(futs)
        if not errors and futs:
            cf.wait(list(futs.values()), timeout=grace, return_when=cf.FIRST_EXCEPTION)
            errors = _errors(futs)
        probes = {eid: self._submit(asyncio.wait_for(self.engines[eid].health(), grace)) for eid in futs}
        unhealthy = []
        for eid, p in probes.items():
            try:
                healthy = p.result(grace + 1)
            except Exception:  # noqa: BLE001 - a probe that fails is an unhealthy engine
                healthy = False
            if not healthy:
                unhealthy.append(eid)
        if unhealthy:
            blamed = {eid: errors.get(eid, "failed its health probe") for eid in unhealthy}
        else:
            blamed = {eid: why for eid, why in errors.items() if not _in_transport(futs[eid], why)} or errors
        wgroup.close_group(self.pg)
        self.pg = None
        for f in futs.values():
            f.cancel()
        for eid in blamed:
            self.engines.pop(eid, None)
        self._dirty = True
        who = (
            ", ".join(f"engine {eid} (rank {self._rank_of(eid)}): {why}" for eid, why in blamed.items())
            or "no engine identified (all answered health probes)"
        )
        cause = "" if any(why in str(err) for why in blamed.values()) else f"; cause: {err}"
        raise PublishError(
            f"publish v{version} aborted at '{step}' (epoch {self.epoch}); blamed: {who}{cause}", list(blamed)
        ) from err

    def _rank_of(self, eid: str) -> int:
        return self._offsets.get(eid, -1)

    def close(self) -> None:
        if self._unsettled is not None:
            self.settle(timeout_s=min(5.0, self.cfg.timeout_s))
        wgroup.close_group(self.pg)
        self.pg = None
        if self._loop is not None:

            async def _close_all():
                await asyncio.gather(*(e.close() for e in self.engines.values()), return_exceptions=True)

            try:
                self._submit(_close_all()).result(5)
            except Exception:  # noqa: BLE001 - closing is best effort
                pass
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop = None


def _in_transport(fut: cf.Future, why: str) -> bool:
    """True for an engine's error raised in the group's transport: a group broken by another peer fails
    every receiver there. Its code says so when the receiver answers in fleetrl's own messages (the
    standalone receiver: :class:`weight_sync.receiver.ReceiveError`); an error that came through a foreign
    server's error page (vLLM's, SGLang's) carries only its text, which names the step the receiver
    failed at."""
    exc = None if fut.cancelled() else fut.exception()
    code = getattr(exc, "code", EngineErrorCode.UNKNOWN)
    if code in (EngineErrorCode.TRANSPORT, EngineErrorCode.LOAD):
        return code == EngineErrorCode.TRANSPORT
    return "failed at 'receive bucket" in why or "failed at 'acknowledge" in why


def _errors(futs: dict[str, cf.Future]) -> dict[str, str]:
    """Engine id -> error, for the finished RPCs that failed (a cancelled one counts as failed)."""
    out = {}
    for eid, f in futs.items():
        if f.done():
            if f.cancelled():
                out[eid] = "cancelled"
            elif f.exception() is not None:
                out[eid] = str(f.exception()) or type(f.exception()).__name__
    return out
