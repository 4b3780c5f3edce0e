"""The learner's side of CUDA IPC weight loads (colocated mode on one GPU): :class:`IpcPublisher`.

It stands where :class:`weight_sync.publisher.Publisher` stands for a colocated learner whose servers
share its GPU (``colocate.weight_transport``, see :func:`weight_sync.ipc.choose_transport`), with the
same surface (``engines``, ``add_engine``, ``remove_engine``, ``publish``, ``close``). Dataflow of
``publish(v, tensors)`` (tensors in plan order, on the learner's GPU)::

    [join: export the slots' handles once, ipc_join on every engine (plan checked there)]
    -> ipc_begin(v) on every engine (pause, start_weight_update)
    -> per round: gather the round's buckets, pack each into its slot, fingerprint it, sync the stream
                  -> ipc_load(round) on every engine -> wait for every answer (the engines read the slots)
    -> ipc_end(v) (finish, prefix cache, resume): every engine's checksum must equal ours

Invariants: a slot is rewritten only after every engine answered the round that read it; every call
is bounded by ``timeout_s`` and a failure raises :class:`PublishError` naming the engine, which is
dropped (it stays paused: its weights may be half loaded) and rejoins at the next publish; the other
learner ranks (none on one GPU) would keep draining ``tensors``.
"""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures as cf
import logging
import threading
import time
from collections.abc import Iterable
from typing import Any

import torch

from weight_sync.endpoint import WeightEndpoint
from weight_sync.ipc import IpcInit, IpcLoad, export_slot, gpu_uuid, rounds, slot_of_buckets
from weight_sync.messages import WeightPlan
from weight_sync.plan import bucket_fingerprint, combine_fingerprints, torch_dtype, unpack_bucket
from weight_sync.publish_run import PublishError, PublishReport

log = logging.getLogger(__name__)


class IpcEndpoint(WeightEndpoint):
    """An engine that takes weights from CUDA IPC slots (fleetrl's vLLM backend: engines.vllm.ipc)."""

    @abc.abstractmethod
    async def ipc_join(self, plan: WeightPlan, init: IpcInit, epoch: int) -> None:
        """Check ``plan`` against the engine's parameters and open the slots (raises a plan mismatch by name)."""

    @abc.abstractmethod
    async def ipc_begin(self, version: int) -> None:
        """Hold the engine still for a publish of ``version`` (pause, start the update)."""

    @abc.abstractmethod
    async def ipc_load(self, msg: IpcLoad) -> None:
        """Load one round from the slots; returns once the engine is done reading them."""

    @abc.abstractmethod
    async def ipc_end(self, version: int) -> str:
        """Finish the publish (label, cache, resume); returns the checksum of what the engine loaded."""


class IpcPublisher:
    """CUDA IPC publisher for engines on this process's GPU; ``slots`` buffers of the plan's buckets, reused."""

    backend = "ipc"

    def __init__(
        self,
        plan: WeightPlan,
        *,
        device: str | torch.device,
        slots: int = 3,
        timeout_s: float = 60.0,
        engines: Iterable[IpcEndpoint] = (),
    ) -> None:
        self.plan, self.device, self.timeout_s = plan, torch.device(device), timeout_s
        if self.device.type != "cuda":
            raise ValueError(f"CUDA IPC publishes from a CUDA device, got {self.device}")
        self.bufs = [torch.empty(n, dtype=torch.uint8, device=self.device) for n in slot_of_buckets(plan, slots)]
        self.init = IpcInit(
            gpu_uuid=gpu_uuid(self.device), slots=[export_slot(b) for b in self.bufs], timeout_s=timeout_s
        )
        self.rounds = rounds(len(plan.buckets), len(self.bufs))
        self.sizes = plan.bucket_bytes()
        self.expect = [
            (n, torch.Size(s), torch_dtype(d)) for n, s, d in zip(plan.names, plan.shapes, plan.dtypes, strict=True)
        ]
        self._views: dict[int, list[torch.Tensor]] = {}  # bucket -> typed views of its slot, built once
        self.engines: dict[str, IpcEndpoint] = {}
        self.joined: set[str] = set()
        self.epoch = 0
        self.timeline: list[tuple[str, float]] = []
        self._loop: asyncio.AbstractEventLoop | None = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="weight-sync-ipc-rpc", daemon=True).start()
        for e in engines:
            self.add_engine(e)
        log.info(
            "IPC publisher: %d bucket(s) in %d slot(s) of %.0f MB on GPU %s, %d round(s) a publish",
            len(plan.buckets),
            len(self.bufs),
            sum(self.sizes[: len(self.bufs)]) / 1e6,
            self.init.gpu_uuid,
            len(self.rounds),
        )

    # ---- membership (as Publisher) --------------------------------------------------------------------
    def add_engine(self, client: IpcEndpoint, export_path: str | None = None, version: int = 0) -> None:
        if not isinstance(client, IpcEndpoint):
            raise TypeError(f"engine {client.engine_id} ({type(client).__name__}) takes no CUDA IPC weight loads")
        if client.engine_id in self.engines:
            raise ValueError(f"engine id {client.engine_id!r} is already a weight-sync member")
        if export_path is not None:
            self.call(
                client.load_weights_from_path(export_path, version),
                f"engine {client.engine_id}: load_weights_from_path({export_path}, v{version})",
            )
        self.engines[client.engine_id] = client

    def remove_engine(self, engine_id: str) -> None:
        self.engines.pop(engine_id, None)
        self.joined.discard(engine_id)

    def _rpc_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            raise RuntimeError("IPC weight publisher is closed")
        return self._loop

    def call(self, coro, what: str, timeout_s: float | None = None):
        """Run an engine coroutine on the RPC loop, bounded; a timeout names the call."""
        try:
            loop = self._rpc_loop()
        except RuntimeError:
            coro.close()
            raise
        fut = asyncio.run_coroutine_threadsafe(coro, loop)
        limit = timeout_s or self.timeout_s
        try:
            return fut.result(limit)
        except cf.TimeoutError:
            fut.cancel()
            raise TimeoutError(f"{what}: no answer within {limit:.0f}s") from None

    def _each(self, ids: list[str], step: str, make) -> dict[str, Any]:
        """``make(engine)`` on every engine of ``ids`` at once; waits (bounded) for all, raises naming the failed."""
        loop = self._rpc_loop()
        futs = {eid: asyncio.run_coroutine_threadsafe(make(self.engines[eid]), loop) for eid in ids}
        cf.wait(list(futs.values()), timeout=self.timeout_s)
        failed = {}
        for eid, f in futs.items():
            if not f.done():
                f.cancel()
                failed[eid] = f"no answer within {self.timeout_s:.0f}s"
            elif f.exception() is not None:
                failed[eid] = str(f.exception()) or type(f.exception()).__name__
        if failed:
            for eid in failed:
                self.remove_engine(eid)
            raise PublishError(
                f"IPC publish: {step} failed on " + "; ".join(f"engine {k}: {v}" for k, v in failed.items()),
                list(failed),
            )
        return {eid: f.result() for eid, f in futs.items()}

    # ---- publish --------------------------------------------------------------------------------------
    def publish(self, version: int, tensors: Iterable[tuple[str, torch.Tensor]]) -> PublishReport:
        it = iter(tensors)
        t0 = time.perf_counter()
        self.timeline = [("start", t0)]
        try:
            return self._publish(version, it, t0)
        finally:
            for _ in it:  # after a failure the iterator is drained (FSDP's gathers stay aligned)
                pass

    def _publish(self, version: int, it, t0: float) -> PublishReport:
        new = [eid for eid in self.engines if eid not in self.joined]
        if new:
            self.epoch += 1
            self._each(new, "join", lambda e: e.ipc_join(self.plan, self.init, self.epoch))
            self.joined.update(new)
            self._mark("joined")
        ids = list(self.engines)
        rebuild_s = time.perf_counter() - t0
        if ids:
            self._each(ids, "begin", lambda e: e.ipc_begin(version))
        self._mark("begun")
        prints: list[torch.Tensor] = []
        tl = time.perf_counter()
        for r, loads in enumerate(self.rounds):
            for b, s in loads:
                prints.append(self._pack(b, s, it))
            torch.cuda.current_stream(self.device).synchronize()  # the slots hold the round before the engines read
            self._mark(f"round{r}_packed")
            msg = IpcLoad(version=version, plan_id=self.plan.plan_id, loads=loads, last=r == len(self.rounds) - 1)
            if ids:
                self._each(
                    ids,
                    f"round {r}/{len(self.rounds)} (buckets {[b for b, _ in loads]})",
                    lambda e, msg=msg: e.ipc_load(msg),
                )
            self._mark(f"round{r}_loaded")
        load_s = time.perf_counter() - tl
        checksum = combine_fingerprints(prints)
        acks = self._each(ids, "end", lambda e: e.ipc_end(version)) if ids else {}
        self._mark("acked")
        bad = {eid: c for eid, c in acks.items() if c != checksum}
        if bad:
            for eid in bad:
                self.remove_engine(eid)
            raise PublishError(
                f"IPC publish v{version}: checksum mismatch (ours {checksum}) from "
                + ", ".join(f"engine {k} ({v})" for k, v in bad.items()),
                list(bad),
            )
        dt = time.perf_counter() - t0
        return PublishReport(
            version=version,
            bytes=sum(self.sizes),
            seconds=dt,
            broadcast_seconds=load_s,
            engines=ids,
            checksum=checksum,
            epoch=self.epoch,
            rebuild_seconds=rebuild_s,
            per_engine_checksums=dict(acks),
        )

    @torch.no_grad()
    def _pack(self, b: int, s: int, it) -> torch.Tensor:
        """Gather bucket ``b``'s tensors from ``it`` (checked against the plan) into slot ``s``; its fingerprint."""
        parts = []
        for i in self.plan.buckets[b]:
            name, t = next(it)
            want = self.expect[i]
            if name != want[0] or t.shape != want[1] or t.dtype != want[2]:
                raise ValueError(
                    f"weight source yielded {name} {list(t.shape)} {t.dtype} where plan {self.plan.plan_id} "
                    f"expects {self.plan.names[i]} {self.plan.shapes[i]} {self.plan.dtypes[i]} (index {i})"
                )
            parts.append(t if t.device == self.device else t.to(self.device))
        buf = self.bufs[s][: self.sizes[b]]
        views = self._views.get(b)
        if views is None:
            views = self._views[b] = [v for _, v in unpack_bucket(buf, self.plan, b)]
        torch._foreach_copy_(views, parts)
        return bucket_fingerprint(buf)

    def _mark(self, event: str) -> None:
        self.timeline.append((event, time.perf_counter()))

    def close(self) -> None:
        async def _close_all():
            await asyncio.gather(*(e.close() for e in self.engines.values()), return_exceptions=True)

        if self._loop is not None:
            try:
                asyncio.run_coroutine_threadsafe(_close_all(), self._loop).result(5)
            except Exception:  # noqa: BLE001 - closing is best effort
                pass
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop = None
        self.bufs = []
        torch.cuda.ipc_collect()  # blocks the engines still hold are freed once they let go
