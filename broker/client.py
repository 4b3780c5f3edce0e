"""Asyncio clients of the broker (producer and consumer), their synchronous wrappers, and status.

Each client owns one DEALER socket; many requests may be in flight on it, matched
to replies by ``req``. Every wait has a timeout that names the broker, the
operation and the time waited. Requests that are idempotent on the broker side
(push, next_batch, ack, renew, status, versions) are re-sent after a silent
attempt, so a broker restart on the same address is ridden out within
``timeout_s``. So is ``acquire_tickets``, which is not idempotent: a retry after a reply
that was only late (not lost) may be granted tickets twice; the surplus is never used and
expires after ``ticket_timeout_s``, as do tickets of any reply that was lost. Sending it
once instead would turn the request a broker crash swallowed into a BrokerTimeout that
ends the caller's loop (seen: a fleet that stopped asking after its broker was restarted).

Round trips on the batch path: ``push(batch, want_tickets=n)`` brings back new
tickets with the push reply, and ``ack(lease_id, defer=True)`` sends the ack with
the consumer's next ``next_batch`` (or at ``flush_acks``/``close``), so a step
costs one round trip per side. Requests made in one turn of the event loop leave
together at its end, as one message (a ``Multi``, see broker.protocol): several pushes
started at once, or a consumer asking several steps ahead (``next_batch(s)``,
``next_batch(s + 1)``, ... outstanding together; each deferred ack rides on exactly one
of them), cost one message instead of one each.

Example (producer)::

    prod = ProducerClient("tcp://127.0.0.1:5555", producer_id="worker-0")
    for t in await prod.acquire_tickets(max_groups=4, wait_s=5.0):
        ...                                   # run one prompt group with rows' step = t.step
    reply = await prod.push(batch, want_tickets=1)   # rows of complete groups; waits while the broker is full
    reply.tickets                             # granted with the reply (maybe none)

Example (consumer, from a synchronous torch loop)::

    cons = SyncConsumer("tcp://127.0.0.1:5555", consumer_id="learner")
    lease = cons.next_batch(step=v + 1, wait_s=60)
    ...                                       # optimizer step on lease.batch
    cons.ack(lease.lease_id); cons.report_version(v + 1)
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from dataclasses import dataclass
from typing import cast

import msgspec
import numpy as np
import pyarrow as pa
import zmq

from broker import protocol as P
from broker.protocol import BrokerError, Ticket
from broker.schema import TRAJECTORY_SCHEMA
from core.network import curve_client

log = logging.getLogger(__name__)

__all__ = [
    "ProducerClient",
    "ConsumerClient",
    "SyncConsumer",
    "SyncProducer",
    "Lease",
    "Ticket",
    "BrokerError",
    "BrokerTimeout",
    "ping",
    "get_status",
    "new_event_loop",
]


class BrokerTimeout(TimeoutError):
    """No reply from the broker in time; the message names the broker, the operation and the wait."""


@dataclass(slots=True)
class Lease:
    lease_id: str
    step: int
    batch: pa.RecordBatch  # groups_per_step whole groups, oldest first
    staleness: np.ndarray  # int32 per row: (step - 1) - oldest policy version of the row

    def shards(self, ranks: int) -> list[pa.RecordBatch]:
        """The batch as ``ranks`` shards of whole groups balanced by token count (broker.shards)."""
        from broker.shards import shard_by_tokens

        return shard_by_tokens(self.batch, ranks)


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop where it is installed, the default loop elsewhere."""
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:
        return asyncio.new_event_loop()


def _curve_setup(sock: zmq.Socket, keys_dir: str | None) -> None:
    curve_client(sock, keys_dir)


# Frames sent with copy=False below this size are copied into the message anyway. pyzmq's
# default (64 KiB) sends larger ones zero-copy, which hands every frame's release to its
# garbage-collector thread (a message to that thread and a GIL hand-over per frame).
# Below this threshold the copy is cheaper; well above it, zero-copy is (figures: README, Broker).
COPY_BELOW = 128 << 10
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)  # ints: no enum arithmetic per send


def _expire(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_exception(TimeoutError())


class _Client:
    # Plain (blocking-API) zmq socket driven by the event loop's reader on its FD, not
    # zmq.asyncio: zmq.asyncio wraps every send and recv in futures and poller callbacks,
    # which cost more CPU than the work itself for a batch path that runs per message.
    def __init__(
        self, address: str, *, timeout_s: float, curve_keys_dir: str | None = None, attempt_s: float | None = None
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.address = address
        self.timeout_s = timeout_s
        self.attempt_s = attempt_s if attempt_s is not None else max(1.0, timeout_s / 3)
        self._curve = curve_keys_dir
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self._ctx: zmq.Context | None = None
        self._sock: zmq.Socket | None = None
        # _loop and _fd are set with the socket (_socket), and read only once it exists
        self._loop: asyncio.AbstractEventLoop
        self._fd: int
        self._drain_scheduled = False
        self._outbox: list[tuple[int, list]] = []  # (req, frames) to send at the end of this loop turn
        self._flush_handle: asyncio.Handle | None = None

    def _socket(self) -> zmq.Socket:
        if self._sock is None:  # created lazily inside the running loop
            self._ctx = zmq.Context()
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.copy_threshold = COPY_BELOW
            _curve_setup(sock, self._curve)
            sock.connect(self.address)
            self._sock = sock
            self._loop = asyncio.get_running_loop()
            self._fd = cast(int, sock.getsockopt(zmq.FD))
            self._loop.add_reader(self._fd, self._drain)
        return self._sock

    def _drain(self) -> None:
        """Read every reply queued on the socket. The ZMQ FD is edge-triggered: it signals
        only on a transition, so reads go on until EAGAIN, and sends re-check (_after_send)."""
        self._drain_scheduled = False
        sock = self._sock
        if sock is None:
            return
        while True:
            try:
                frames = P.recv_frames(sock)
            except zmq.Again:
                return
            except zmq.ZMQError as e:
                log.error("broker %s: receive failed: %s", self.address, e)
                return
            try:
                replies = P.split_replies(frames)  # the broker coalesces replies (see broker.protocol)
            except (msgspec.DecodeError, msgspec.ValidationError, P.ProtocolError) as e:
                log.error("undecodable reply from broker %s; ignored: %s", self.address, e)
                continue
            pending = self._pending
            for reply, rest in replies:
                fut = pending.get(reply.req)
                if fut is not None and not fut.done():
                    fut.set_result((reply, rest))

    def _after_send(self) -> None:
        # A send may consume the FD's edge for a reply that arrived meanwhile.
        sock = self._sock
        if not self._drain_scheduled and sock is not None and cast(int, sock.get(_EVENTS)) & _POLLIN:
            self._drain_scheduled = True
            self._loop.call_soon(self._drain)

    def _enqueue(self, req: int, frames: list) -> None:
        """Send at the end of this loop turn, with every other request made in it, as one
        message (a ``Multi`` when there are several; see broker.protocol)."""
        self._outbox.append((req, frames))
        if self._flush_handle is None:
            self._flush_handle = self._loop.call_soon(self._flush, 0.001)

    def _flush(self, pause: float) -> None:
        """Non-blocking send of the outbox; while the DEALER's send queue is at its HWM, try
        again after a pause. A request whose attempt timed out meanwhile is not sent (its
        caller retries under a new ``req``, or gives up)."""
        self._flush_handle = None
        if self._sock is None:
            self._outbox.clear()
            return
        pending = self._pending
        units = [(req, f) for req, f in self._outbox if (fut := pending.get(req)) is not None and not fut.done()]
        self._outbox = []
        if not units:
            return
        if len(units) == 1:
            frames = units[0][1]
        else:
            frames = [P.encode(P.Multi(frames=[len(f) for _, f in units]))]
            for _, f in units:
                frames += f
        try:
            P.send_frames(self._sock, frames)
        except zmq.Again:
            self._outbox = units + self._outbox
            self._flush_handle = self._loop.call_later(pause, self._flush, min(0.05, pause * 2))
            return
        except zmq.ZMQError as e:  # their attempts time out and are retried (or given up)
            log.error("broker %s: send of %d request(s) failed: %s", self.address, len(units), e)
            return
        self._after_send()

    async def _call(self, msg, payload=None, *, wait_s: float = 0.0, retry: bool = True):
        deadline = time.monotonic() + self.timeout_s + wait_s
        op = type(msg).__name__
        self._socket()
        loop = self._loop
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise BrokerTimeout(f"broker {self.address}: no reply to {op} within {self.timeout_s + wait_s:.1f}s")
            msg.req = next(self._ids)
            fut = loop.create_future()
            self._pending[msg.req] = fut
            attempt = remaining if not retry else min(remaining, self.attempt_s + wait_s)
            # One timer per request instead of asyncio.wait_for (a task each): this path
            # runs for every batch, and small batches are dominated by per-call overhead.
            timer = loop.call_later(attempt, _expire, fut)
            try:
                self._enqueue(msg.req, [P.encode(msg)] + ([payload] if payload is not None else []))
                reply, rest = await fut
            except (TimeoutError, asyncio.TimeoutError):
                if not retry:
                    raise BrokerTimeout(f"broker {self.address}: no reply to {op} within {attempt:.1f}s") from None
                log.warning("broker %s: no reply to %s within %.1fs; retrying", self.address, op, attempt)
                continue
            finally:
                timer.cancel()
                self._pending.pop(msg.req, None)
            if isinstance(reply, P.ErrorReply):
                raise BrokerError(reply.code, reply.message, reply.retry_after_s, reply.lease_id)
            return reply, rest

    async def ping(self) -> None:
        await self._call(P.Ping())

    async def status(self) -> dict:
        """Every lag metric of the broker (see broker.metrics.snapshot)."""
        reply, _ = await self._call(P.StatusRequest())
        return {
            "status": reply.status,
            "drops": reply.drops,
            "errors": reply.errors,
            "engine_lag": reply.engine_lag,
            "staleness_hist": reply.staleness_hist,
            "stale_drop_lengths": reply.stale_drop_lengths,
        }

    async def close(self) -> None:
        for task in getattr(self, "_renewers", {}).values():
            task.cancel()
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        self._outbox.clear()
        if self._sock is not None:
            try:
                self._loop.remove_reader(self._fd)
            except (ValueError, OSError, RuntimeError):
                pass  # the loop is closing or the FD is gone already
            self._sock.close(0)
            if self._ctx is not None:
                self._ctx.term()
            self._sock = self._ctx = None
        for fut in self._pending.values():
            if not fut.done():
                fut.cancel()


class ProducerClient(_Client):
    """The rollout side: tickets in, batches of complete groups out."""

    def __init__(
        self, address: str, *, producer_id: str, timeout_s: float = 30.0, curve_keys_dir: str | None = None
    ) -> None:
        super().__init__(address, timeout_s=timeout_s, curve_keys_dir=curve_keys_dir)
        self.producer_id = producer_id

    async def acquire_tickets(self, max_groups: int, wait_s: float, *, min_groups: int = 1) -> list[Ticket]:
        """Up to ``max_groups`` tickets; waits up to ``wait_s`` until ``min(min_groups, max_groups)``
        can be granted at once (fewer round trips), then returns what there is; [] if none came."""
        reply, _ = await self._call(
            P.AcquireTickets(producer_id=self.producer_id, max_groups=max_groups, wait_s=wait_s, min_groups=min_groups),
            wait_s=wait_s,
        )
        return reply.tickets

    async def push(self, batch: pa.RecordBatch, *, want_tickets: int = 0) -> P.PushReply:
        """Send rows of complete groups. While the broker's byte budget is full this waits and
        retries (backpressure) until ``timeout_s``; any refusal raises BrokerError(code, reason).

        ``want_tickets``: also take up to that many tickets that are free right now; they come
        back in ``reply.tickets`` (none while other producers are waiting in acquire_tickets)."""
        payload = P.trajectory_to_ipc(batch)
        deadline = time.monotonic() + self.timeout_s
        backoff = 0.01
        while True:
            try:
                reply, _ = await self._call(P.Push(producer_id=self.producer_id, want_tickets=want_tickets), payload)
                return reply
            except BrokerError as e:
                if e.code != P.ErrorCode.BUSY or time.monotonic() + backoff > deadline:
                    raise
                await asyncio.sleep(max(backoff, e.retry_after_s))
                backoff = min(0.5, backoff * 2)

    async def report_engine_version(self, engine_id: str, version: int) -> None:
        await self._call(P.EngineVersion(engine_id=engine_id, version=version))


class ConsumerClient(_Client):
    """The learner side: leases of whole groups for a step, acked after the optimizer step."""

    def __init__(
        self, address: str, *, consumer_id: str, timeout_s: float = 30.0, curve_keys_dir: str | None = None
    ) -> None:
        super().__init__(address, timeout_s=timeout_s, curve_keys_dir=curve_keys_dir)
        self.consumer_id = consumer_id
        self._renewers: dict[str, asyncio.Task] = {}
        self._deferred: list[str] = []  # acks to send with the next next_batch

    async def next_batch(self, step: int, wait_s: float, *, renew_every_s: float | None = None) -> Lease | None:
        """The batch of learner step ``step``, or None if ``wait_s`` passed without one.

        Deferred acks (``ack(..., defer=True)``) travel with this request and are applied
        before the lookup; if the broker refuses one this raises its BrokerError
        (``lease_expired``: that step used data handed out again; do not count it).
        With ``renew_every_s`` the lease is renewed in the background until it is acked, so
        only the death of this process (or its event loop) lets it expire."""
        try:
            return await self._next_batch(step, wait_s, renew_every_s)
        except BrokerError as e:
            if e.code != P.ErrorCode.STEP_AHEAD:
                raise
        # A step past the broker's window (v + k + 1): this consumer resumed ahead of it (a
        # checkpoint, or a report lost in a broker restart). The consumer owns its version.
        log.warning(
            "broker %s: step %d is ahead of its window; reporting version %d first", self.address, step, step - 1
        )
        await self.report_version(step - 1)
        return await self._next_batch(step, wait_s, renew_every_s)

    async def _next_batch(self, step: int, wait_s: float, renew_every_s: float | None) -> Lease | None:
        # The acks travel with this request only: another next_batch sent meanwhile (several
        # steps requested ahead) does not repeat them. If this one fails they are deferred again.
        acks, self._deferred = self._deferred, []
        try:
            reply, rest = await self._call(
                P.NextBatch(consumer_id=self.consumer_id, step=step, wait_s=wait_s, acks=acks), wait_s=wait_s
            )
        except BrokerError as e:
            done = acks.index(e.lease_id) + 1 if e.lease_id in acks else 0
            # applied up to the refused one, which is refused for good
            self._acks_sent(acks[:done])
            self._deferred[:0] = [a for a in acks[done:] if a not in self._deferred]
            raise
        except BaseException:
            self._deferred[:0] = [a for a in acks if a not in self._deferred]
            raise
        self._acks_sent(acks)
        for lease_id in reply.acks_late:
            log.warning("lease %s had expired but was acked late (its groups were not handed out again)", lease_id)
        if isinstance(reply, P.NoBatch):
            return None
        batches = []
        for frame in rest:  # one Arrow IPC stream per frame (see broker.server._lease_frames)
            for b in P.ipc_to_batches(frame.buffer):
                batches.append(
                    b
                    if b.schema.equals(TRAJECTORY_SCHEMA)
                    else pa.RecordBatch.from_arrays(b.columns, schema=TRAJECTORY_SCHEMA)
                )
        batch = batches[0] if len(batches) == 1 else pa.concat_batches(batches)
        if renew_every_s and reply.lease_id not in self._renewers:
            self._renewers[reply.lease_id] = asyncio.get_running_loop().create_task(
                self._keep_renewing(reply.lease_id, renew_every_s)
            )
        return Lease(reply.lease_id, reply.step, batch, np.frombuffer(reply.staleness, dtype="<i4"))

    def _acks_sent(self, acks: list[str]) -> None:
        for lease_id in acks:
            if (task := self._renewers.pop(lease_id, None)) is not None:
                task.cancel()
        if self._deferred and acks:
            sent = set(acks)
            self._deferred = [a for a in self._deferred if a not in sent]

    async def _keep_renewing(self, lease_id: str, every_s: float) -> None:
        while True:
            await asyncio.sleep(every_s)
            try:
                await self.renew(lease_id)
            except (BrokerError, BrokerTimeout) as e:
                log.warning("renewing lease %s failed: %s", lease_id, e)
                if isinstance(e, BrokerError):
                    return

    async def ack(self, lease_id: str, *, defer: bool = False) -> P.AckReply | None:
        """Raises BrokerError(lease_expired) if the lease's groups went to someone else.

        ``defer=True`` saves a round trip: the ack goes with the next ``next_batch`` (or
        ``flush_acks``/``close``) and returns None now; the lease is kept renewed meanwhile,
        and an ack that never arrives (this process died) is handled by lease expiry."""
        if defer:
            if lease_id not in self._deferred:
                self._deferred.append(lease_id)
            return None
        try:
            reply, _ = await self._call(P.Ack(consumer_id=self.consumer_id, lease_id=lease_id))
        finally:
            self._acks_sent([lease_id])  # stop renewing: acked, refused, or the broker is gone
        return reply

    async def flush_acks(self) -> None:
        """Send every deferred ack now."""
        for lease_id in list(self._deferred):
            await self.ack(lease_id)

    async def close(self, *, flush_acks: bool = True) -> None:
        """``flush_acks=False`` drops deferred acks (as a crash would: their leases expire)."""
        try:
            if flush_acks and self._deferred and self._sock is not None:
                await self.flush_acks()
        finally:
            self._deferred.clear()
            await super().close()

    async def renew(self, lease_id: str) -> None:
        await self._call(P.Renew(lease_id=lease_id))

    async def report_version(self, v: int) -> None:
        await self._call(P.ReportVersion(version=v))


class _LoopThread:
    """An event loop on a private daemon thread, for synchronous callers."""

    def __init__(self) -> None:
        self.loop = new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="broker-client", daemon=True)
        self._thread.start()

    def run(self, coro, timeout: float):
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(timeout)
        except TimeoutError:
            if fut.done():
                raise  # the client's own BrokerTimeout (a TimeoutError), with its message
            fut.cancel()
            raise BrokerTimeout(f"broker client call did not finish within {timeout:.1f}s") from None

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        if not self._thread.is_alive():
            self.loop.close()


class _SyncClient:
    """Runs an asyncio client on a private loop thread, so synchronous code can call it."""

    def __init__(self, client, timeout_s: float) -> None:
        self._lt: _LoopThread | None = _LoopThread()
        self.client = client
        self._slack = timeout_s + 5.0  # the client's own timeout fires first and names the broker

    def _call(self, coro, extra_s: float = 0.0):
        if self._lt is None:
            coro.close()
            raise RuntimeError(f"broker {self.client.address}: this client is closed")
        return self._lt.run(coro, self._slack + extra_s)

    def close(self) -> None:
        if self._lt is None:
            return
        try:
            self._lt.run(self.client.close(), 5.0)
        finally:
            self._lt.stop()
            self._lt = None


class SyncConsumer(_SyncClient):
    """ConsumerClient for synchronous code (the learner's torch loop): same methods, blocking."""

    def __init__(
        self, address: str, *, consumer_id: str, timeout_s: float = 30.0, curve_keys_dir: str | None = None
    ) -> None:
        super().__init__(
            ConsumerClient(address, consumer_id=consumer_id, timeout_s=timeout_s, curve_keys_dir=curve_keys_dir),
            timeout_s,
        )

    def next_batch(self, step: int, wait_s: float, *, renew_every_s: float | None = None) -> Lease | None:
        return self._call(self.client.next_batch(step, wait_s, renew_every_s=renew_every_s), wait_s)

    def ack(self, lease_id: str, *, defer: bool = False) -> P.AckReply | None:
        return self._call(self.client.ack(lease_id, defer=defer))

    def flush_acks(self) -> None:
        return self._call(self.client.flush_acks())

    def close(self, *, flush_acks: bool = True) -> None:
        if self._lt is None:
            return
        try:
            self._lt.run(self.client.close(flush_acks=flush_acks), self._slack)
        finally:
            self._lt.stop()
            self._lt = None

    def renew(self, lease_id: str) -> None:
        return self._call(self.client.renew(lease_id))

    def report_version(self, v: int) -> None:
        return self._call(self.client.report_version(v))

    def status(self) -> dict:
        return self._call(self.client.status())


class SyncProducer(_SyncClient):
    """ProducerClient for synchronous code (tests, scripts): same methods, blocking."""

    def __init__(
        self, address: str, *, producer_id: str, timeout_s: float = 30.0, curve_keys_dir: str | None = None
    ) -> None:
        super().__init__(
            ProducerClient(address, producer_id=producer_id, timeout_s=timeout_s, curve_keys_dir=curve_keys_dir),
            timeout_s,
        )

    def acquire_tickets(self, max_groups: int, wait_s: float, *, min_groups: int = 1) -> list[Ticket]:
        return self._call(self.client.acquire_tickets(max_groups, wait_s, min_groups=min_groups), wait_s)

    def push(self, batch: pa.RecordBatch, *, want_tickets: int = 0) -> P.PushReply:
        return self._call(self.client.push(batch, want_tickets=want_tickets))

    def report_engine_version(self, engine_id: str, version: int) -> None:
        return self._call(self.client.report_engine_version(engine_id, version))


def _sync_request(address: str, msg, timeout_s: float, curve_keys_dir: str | None = None):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        _curve_setup(sock, curve_keys_dir)
        sock.connect(address)
        sock.send(P.encode(msg))
        if not sock.poll(int(timeout_s * 1000)):
            raise BrokerTimeout(f"broker {address}: no reply to {type(msg).__name__} within {timeout_s:.1f}s")
        reply = P.decode_reply(sock.recv_multipart()[0])
        if isinstance(reply, P.ErrorReply):
            raise BrokerError(reply.code, reply.message)
        return reply
    finally:
        sock.close(0)
        ctx.term()


def ping(address: str, timeout_s: float = 2.0, curve_keys_dir: str | None = None) -> bool:
    """True if a broker answers at ``address`` within ``timeout_s``."""
    try:
        _sync_request(address, P.Ping(req=1), timeout_s, curve_keys_dir)
        return True
    except BrokerTimeout:
        return False


def status_reply(address: str, timeout_s: float = 5.0, curve_keys_dir: str | None = None) -> P.StatusReply:
    """The broker's typed status reply (the launcher's view of the broker reads it)."""
    return _sync_request(address, P.StatusRequest(req=1), timeout_s, curve_keys_dir)


def get_status(address: str, timeout_s: float = 5.0, curve_keys_dir: str | None = None) -> dict:
    """The broker's status as plain data (for ``python -m broker status``)."""
    r = status_reply(address, timeout_s, curve_keys_dir)
    return {
        "status": r.status,
        "drops": r.drops,
        "errors": r.errors,
        "engine_lag": r.engine_lag,
        "staleness_hist": r.staleness_hist,
        "stale_drop_lengths": r.stale_drop_lengths,
    }
