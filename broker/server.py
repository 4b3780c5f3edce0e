"""The broker process: one ZMQ ROUTER socket, one thread, a BrokerState and an optional spool.

Dataflow::

    rollout workers (DEALER)                                        learner (DEALER)
      acquire(max, wait, min) --> tickets for step s <= v+k+1
      push(Arrow IPC, want) ----> validate -> whole groups -> [spool] -> queue
                   <-- reply + up to `want` new tickets
                                  next_batch(s, wait, acks) <-- acks applied, then lease: G groups, oldest first
                                  ack(lease)                <-- after the optimizer step (or with the next next_batch)
                                  report_version(v)         <-- after each step

On the batch path a step costs one round trip per side: a push reply carries new
tickets, a next_batch carries the acks of earlier leases. Messages, not bytes, are
what costs CPU here (each wakes libzmq's I/O threads at both ends), so requests made
in one event-loop turn of a client arrive as one ``Multi`` message, and all replies
to one peer in one loop iteration of the broker leave as one message, leases with
their frames included (see :mod:`broker.protocol`). Each request in a ``Multi`` is
handled and answered as if it had come alone, in order; only validation is shared:
the batches of its pushes are checked together (:func:`broker.schema.inspect_batches`,
which also finds, for all of them in one numpy pass, each one that is exactly one whole
group, the usual push, so :func:`broker.groups.split_groups` need not look at its rows),
and a batch that fails is then checked alone, so its push alone gets the error.

Semantics (``v``: learner version, ``k``: max_staleness, ``G``: groups_per_step):

* **Admission.** A ticket is granted while supply (outstanding tickets + groups
  held) is below ``G * (k + 1)``, labelled with step ``v + 1 + supply // G``: each
  step gets exactly ``G`` tickets and only steps ``s <= v + k + 1`` get any. With
  ``k = 0`` this is the synchronous baseline. Tickets come from ``acquire`` (which
  may wait for ``min_groups`` free slots at once) or with a push reply
  (``want_tickets``; only while no producer waits in ``acquire``, so those go first).
  A ticket not fulfilled within
  ``ticket_timeout_s`` (its producer died) expires and its slot is granted again,
  so a run never stalls on a dead worker. A push is matched to the pushing
  producer's tickets by step; a group whose ticket expired (or that was granted by
  a previous broker incarnation) is still accepted while there is a free slot,
  otherwise refused with ``no_ticket`` (an error reply, never a silent drop).
  Tickets whose grant never reached the producer (a lost reply) also just expire.
* **Consumption.** ``next_batch(s)`` raises ``v`` to ``s - 1`` (never lowers it, so
  several requests outstanding from one consumer cannot move it back and forth; only
  ``report_version`` sets it back, e.g. after a checkpoint restore) and hands out ``G``
  complete groups (pushes hold whole groups only: ``incomplete_group``), oldest
  first (by admission step, then arrival). A group with any row whose staleness
  ``(s - 1) - segment_versions[0]`` exceeds ``k`` is dropped with reason ``stale``
  and never handed out. With fewer than ``G`` fresh groups the request waits up to
  ``wait_s`` and then gets ``NoBatch``.
* **Leases.** A batch is leased, not removed. The same (consumer, step) asked
  again gets the same lease (a retried request). A lease not acked or renewed
  within ``lease_timeout_s`` expires: its groups go back to the front of the queue
  and are re-checked for staleness when next handed out, under a new lease id.
* **Exactly once into optimizer steps.** A group leaves the broker only by one
  ack or one ``stale`` drop. Acking a live lease consumes its groups and sets
  ``v = max(v, s)``; acking it again returns ``duplicate``. Acking an *expired*
  lease succeeds (``late``) only if all its groups are still queued (in no live
  lease, not acked, not dropped; also after a restart); otherwise it is refused
  with ``lease_expired`` and the caller
  must not count that step (the learner treats it as fatal and resumes from its
  checkpoint). So no trajectory is ever part of two acked leases. Consumers that
  may hold a lease longer than the timeout call ``renew``.
* **Piggybacked acks.** ``next_batch(s, acks=[...])`` applies each ack exactly as an
  ``Ack`` message would, in order, when the request arrives (before it waits), and
  reports duplicates and late acks in its reply. If one is refused the whole reply
  is that ``ErrorReply`` (acks before it stay applied; the batch is not looked up).
  A deferred ack is only an ack that is sent later: until it arrives the lease is
  live (the client keeps renewing it), and if it never arrives (the consumer died)
  the lease expires and its groups are handed out again, as for any unacked lease.
  Between the optimizer step and the next request a crash therefore redelivers the
  step's data, which the learner's checkpoint-then-ack order already allows for.
* **Durability** (``spool_dir``). Accepted batches, leases, acks, expiries, drops and
  version changes are written before the state changes and before any reply
  (see :mod:`broker.spool` for fsync). After ``kill -9`` and a restart on the same
  spool every accepted, unacked group is back (live leases restored with a fresh
  timeout, so an ack that races the crash is honoured), and nothing acked or
  dropped comes back. Without a spool a restart starts empty.
* **Backpressure and high-water marks.** The broker holds at most
  ``byte_budget_mb`` of trajectories; a push over it gets ``busy`` with
  ``retry_after_s`` and the client retries until its timeout: producers are
  slowed, never dropped. The ROUTER socket has ``socket_hwm`` messages each way:
  when its receive queue is full, libzmq stops reading that peer's TCP pipe and
  the client's DEALER send queue fills and then blocks (clients time out).
  Replies are sent non-blocking with ROUTER_MANDATORY: a reply to a peer that is
  gone or whose queue is full is counted (``errors{reply_undeliverable}``) and
  dropped; every request is idempotent, so the client's retry gets it again.
  Messages larger than ``max_message_mb`` make libzmq close that connection.
* **Bad input.** A frame that is not a message header, a payload that is not
  Arrow IPC (truncated, garbage, absurd length prefix), an unknown type, another
  protocol version, a batch failing ``broker.schema.validate_batch``, or any
  other refusal gets an ``ErrorReply`` with a code from
  :class:`broker.protocol.ErrorCode` and a counter ``errors{code}``; the loop
  goes on serving everyone else. Garbage at the TCP level either fails the ZMTP
  handshake (libzmq closes that connection) or is read by libzmq as legacy ZMTP
  1.0 frames, which then get ``bad_frame`` replies like any other bad frame.
* **Bounds.** Every field a peer sends is range-checked when decoded or before it
  changes anything (see :mod:`broker.limits` and :mod:`broker.state`): a refused value
  gets its error code and is never spooled. No exception from one request, nor from
  answering a waiter, leaves the loop: it becomes an ``internal`` reply for that request
  and a rate-limited log line. A peer holds at most ``MAX_WAITERS_PER_PEER`` waiting
  requests (its oldest is answered early, as if its wait had ended) and all peers
  together ``MAX_WAITERS`` (then ``busy``), and no wait outlives ``MAX_WAIT_S``, so the
  waiters of a peer that disconnected (the bundled libzmq has no ROUTER_NOTIFY to tell)
  are bounded in number and time; engine ids are kept for at most ``MAX_ENGINES`` ids and
  ``ENGINE_TTL_S``; refusals are logged at most once per code per ``LOG_INTERVAL_S``,
  with the count of those suppressed. Each bound has a metric.
* **Security.** Binds to 127.0.0.1 unless another address is configured. With
  ``curve_keys_dir`` the socket is a CurveZMQ server (keys from
  ``python -m broker keys DIR``) and only client public keys in ``DIR/clients``
  may connect.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pyarrow as pa
import zmq

from broker import limits as L
from broker import protocol as P
from broker.config import BrokerConfig
from broker.metrics import Hist, Rates, snapshot, start_metrics_server
from broker.schema import JOINT_MAX_BYTES, TRAJECTORY_SCHEMA, inspect_batches
from broker.spool import Spool
from broker.state import BrokerError, BrokerState
from broker.waiters import Waiter, Waiters
from core.signals import SignalFlag

log = logging.getLogger(__name__)

MAX_READS_PER_ITERATION = 256


def _ms(seconds: float) -> int:
    return max(0, int(seconds * 1000))


class BrokerServer:
    """The broker loop. Example::

    server = BrokerServer(BrokerConfig(address="tcp://127.0.0.1:0"))
    address = server.bind()          # tcp://127.0.0.1:PORT
    server.serve(stop_event)         # until stop_event is set (or SIGTERM via broker.__main__)
    """

    def __init__(self, cfg: BrokerConfig) -> None:
        self.cfg = cfg
        self.spool = Spool(cfg.spool_dir, fsync=cfg.fsync) if cfg.spool_dir else None
        self.state = BrokerState(
            max_staleness=cfg.max_staleness,
            groups_per_step=cfg.groups_per_step,
            lease_timeout_s=cfg.lease_timeout_s,
            ticket_timeout_s=cfg.ticket_timeout_s,
            byte_budget_bytes=int(cfg.byte_budget_mb * (1 << 20)),
        )
        self.errors: dict[str, int] = defaultdict(int)
        self.ticket_wait = Hist()
        self.learner_wait = Hist()
        self.rates = Rates()
        self.t_start = time.monotonic()
        self.latest_snapshot: dict | None = None
        self.metrics_httpd = None
        self.metrics_port: int | None = None
        self.waiters = Waiters()
        self.rlog = L.RateLimitedLog(log)
        self._bugs_seen: set[str] = set()  # internal errors logged with their traceback (see _internal)
        self._out: list[list] = []
        self._ctx = zmq.Context()
        self._sock: zmq.Socket | None = None
        self._auth = None
        self.address: str | None = None

    # -- setup -----------------------------------------------------------------------------------
    def bind(self) -> str:
        if self.spool is not None:
            rec = self.spool.recover()
            self.state.restore(rec.batches, rec.records, time.monotonic())
            if rec.quarantined:
                log.warning(
                    "%d spool record(s) failed validation and were quarantined (see %s/quarantine)",
                    rec.quarantined,
                    self.cfg.spool_dir,
                )
            self.state.journal = self.spool
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.RCVHWM, self.cfg.socket_hwm)
        sock.setsockopt(zmq.SNDHWM, self.cfg.socket_hwm)
        sock.setsockopt(zmq.MAXMSGSIZE, int(self.cfg.max_message_mb * (1 << 20)))
        if self.cfg.curve_keys_dir:
            self._setup_curve(sock, Path(self.cfg.curve_keys_dir))
        address = self.cfg.address
        if address.startswith("tcp://") and address.endswith(":0"):
            address = address[:-2] + ":*"
        sock.bind(address)
        self._sock = sock
        self.address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        if self.cfg.metrics_port is not None:
            self.latest_snapshot = snapshot(self)
            # the metrics endpoint binds the broker's own interface (loopback unless the job spans hosts)
            host = self.address.split("://")[-1].rsplit(":", 1)[0] if self.address.startswith("tcp://") else "127.0.0.1"
            self.metrics_port = start_metrics_server(self, self.cfg.metrics_port, addr=host.strip("[]"))
        log.info(
            "broker bound to %s (k=%d, G=%d, spool=%s)",
            self.address,
            self.cfg.max_staleness,
            self.cfg.groups_per_step,
            self.cfg.spool_dir,
        )
        return self.address

    def _setup_curve(self, sock: zmq.Socket, keys: Path) -> None:
        from core.network import curve_server

        self._auth = curve_server(sock, keys, self._ctx)

    # -- loop ------------------------------------------------------------------------------------
    def serve(self, stop: threading.Event | SignalFlag | None = None) -> None:
        stop = stop or threading.Event()
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        next_snap = 0.0
        while not stop.is_set():
            now = time.monotonic()
            timeout = 0.05
            if (d := self.waiters.next_deadline()) is not None:
                timeout = min(timeout, d - now)
            if (d := self.state.next_deadline()) is not None:
                timeout = min(timeout, d - now)
            if poller.poll(_ms(timeout)):
                for _ in range(MAX_READS_PER_ITERATION):
                    try:
                        frames = P.recv_frames(self._sock)
                    except zmq.Again:
                        break
                    self._handle_safely(frames)
            now = time.monotonic()
            self.state.tick(now)
            self.state.expire_engines(now)
            self.waiters.serve(now, self._serve_ticket_waiter, self._serve_lease_waiter, self._waiter_failed)
            if self.spool is not None:
                self.spool.commit()
            self._flush()
            if now >= next_snap and self.cfg.metrics_port is not None:
                self.latest_snapshot = snapshot(self)
                next_snap = now + 0.5
        self.close()

    def close(self) -> None:
        if self.spool is not None:
            self.spool.close()
            self.spool = None
        if self.metrics_httpd is not None:
            self.metrics_httpd.shutdown()
            self.metrics_httpd = None
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
        self._ctx.term()

    def _reply(self, ident: bytes, msg, *payload) -> None:
        self._out.append([ident, P.encode(msg), *payload])

    def _error(
        self, ident: bytes, req: int, code: str, message: str, retry_after_s: float = 0.0, lease_id: str = ""
    ) -> None:
        self.errors[code] += 1
        if code != P.ErrorCode.BUSY:
            self.rlog.warning(code, "refused request %d: %s: %s", req, code, message[:300])
        self._reply(
            ident, P.ErrorReply(req=req, code=code, message=message, retry_after_s=retry_after_s, lease_id=lease_id)
        )

    def _flush(self) -> None:
        # The replies to one peer go out as one message, in order (see broker.protocol):
        # every message sent wakes libzmq's I/O threads, which on a busy machine costs more
        # than the work of a small reply.
        out = self._out
        if len(out) == 1:
            self._send(out[0])
        elif out:
            grouped: dict[bytes, list] = {}
            for frames in out:
                if (g := grouped.get(frames[0])) is None:
                    grouped[frames[0]] = frames
                else:
                    g.extend(frames[1:])
            for frames in grouped.values():
                self._send(frames)
        self._out = []

    def _send(self, frames: list) -> None:
        try:
            P.send_frames(self._sock, frames)
        except (zmq.Again, zmq.ZMQError) as e:
            self.errors["reply_undeliverable"] += 1
            log.debug("reply undeliverable: %s", e)

    # -- requests --------------------------------------------------------------------------------
    def _handle_safely(self, frames: list[zmq.Frame]) -> None:
        """_handle, with any exception it lets out (a bug) answered as ``internal``."""
        try:
            self._handle(frames)
        except Exception as e:
            self._internal(frames[0].bytes, 0, e)

    def _internal(self, ident: bytes, req: int, e: Exception) -> None:
        # A bug, never a client's mistake (those all have their own codes): each distinct one
        # (exception type and the line that raised it) is logged with its traceback the first
        # time, then rate-limited to one line.
        tb = e.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        where = f"{tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}" if tb is not None else "?"
        key = f"{type(e).__name__}@{where}"
        if key not in self._bugs_seen and len(self._bugs_seen) < 256:
            self._bugs_seen.add(key)
            log.error(
                "internal error handling a request (a broker bug; first time at %s): %s: %s",
                where,
                type(e).__name__,
                e,
                exc_info=e,
            )
        else:
            self.rlog.log(
                logging.ERROR,
                "internal",
                "internal error handling a request: %s: %s (at %s)",
                type(e).__name__,
                e,
                where,
            )
        try:
            self._error(ident, req, P.ErrorCode.INTERNAL, f"{type(e).__name__}: {str(e)[:300]}")
        except Exception:  # not even the error reply encodes: count it, send nothing
            self.errors["reply_unencodable"] += 1

    def _handle(self, frames: list[zmq.Frame]) -> None:
        ident = frames[0].bytes
        if len(frames) < 2:
            self._error(ident, 0, P.ErrorCode.BAD_FRAME, "message has no header frame")
            return
        msg = self._decode(ident, frames[1])
        if msg is None:
            return
        if type(msg) is not P.Multi:
            self._handle_one(ident, msg, frames[1:])
            return
        counts = msg.frames
        if not 1 <= len(counts) <= P.MAX_MULTI or min(counts) < 1 or sum(counts) != len(frames) - 2:
            self._error(
                ident,
                msg.req,
                P.ErrorCode.BAD_FRAME,
                f"multi announces {len(counts)} requests in {sum(counts)} frames (each >= 1, at most "
                f"{P.MAX_MULTI} requests); the message has {len(frames) - 2}",
            )
            return
        subs, i = [], 2
        for n in counts:
            part = frames[i : i + n]
            i += n
            subs.append((self._decode(ident, part[0]), part))
        prepared = self._prepare_pushes(subs)
        for j, (sub, part) in enumerate(subs):
            if sub is None:
                continue
            if type(sub) is P.Multi:
                self._error(ident, sub.req, P.ErrorCode.BAD_REQUEST, "a multi cannot hold another multi")
                continue
            self._handle_one(ident, sub, part, prepared.get(j))

    @staticmethod
    def _prepare_pushes(subs: list) -> dict:
        """Parse the pushes of one message and validate their batches together (see
        broker.schema.inspect_batches): index -> (batches, view or None) or the parse error."""
        prepared: dict[int, Any] = {}
        chunks: list[list[int]] = [[]]
        chunk_bytes = 0
        for j, (sub, part) in enumerate(subs):
            if type(sub) is not P.Push or len(part) != 2:
                continue
            try:
                batches = P.ipc_to_batches(part[1].buffer)
            except P.ProtocolError as e:
                prepared[j] = e
                continue
            prepared[j] = (batches, None)
            size = len(part[1])
            if len(batches) == 1:
                if chunk_bytes + size > JOINT_MAX_BYTES:
                    chunks.append([])
                    chunk_bytes = 0
                chunks[-1].append(j)
                chunk_bytes += size
        for joint in chunks:
            if len(joint) < 2:
                continue
            try:
                views = inspect_batches([prepared[j][0][0] for j in joint], sum(len(subs[j][1][1]) for j in joint))
            except Exception:  # each push is then validated on its own, with its own error
                log.debug("joint validation failed; validating pushes one by one", exc_info=True)
                views = None
            if views is not None:
                for j, view in zip(joint, views, strict=True):
                    prepared[j] = (prepared[j][0], view)
        return prepared

    def _decode(self, ident: bytes, header: zmq.Frame):
        try:
            return P.decode_request(header.buffer)
        except P.ProtocolError as e:
            self._error(ident, 0, e.code, e.message)
            return None

    def _handle_one(self, ident: bytes, msg, frames: list, prepared=None) -> None:
        """One request: ``frames`` is its header and payload frames; ``prepared``: see
        _prepare_pushes."""
        req = msg.req
        try:
            expect = 2 if type(msg) is P.Push else 1  # header (+ one Arrow IPC frame for a push)
            if len(frames) != expect:
                raise P.ProtocolError(
                    P.ErrorCode.BAD_FRAME,
                    f"{type(msg).__name__} takes {expect - 1} payload frame(s), got {len(frames) - 1}",
                )
            self._dispatch(ident, msg, frames, prepared)
        except P.ProtocolError as e:
            self._error(ident, req, e.code, e.message)
        except BrokerError as e:
            self._error(ident, req, e.code, e.message, e.retry_after_s, e.lease_id)
        except Exception as e:  # a bug must not take the broker down for everyone
            self._internal(ident, req, e)

    def _dispatch(self, ident: bytes, msg, frames, prepared=None) -> None:
        now = time.monotonic()
        st = self.state
        if isinstance(msg, P.Push):
            payload = frames[1]
            if isinstance(prepared, Exception):
                raise prepared
            batches, view = prepared if prepared is not None else (P.ipc_to_batches(payload.buffer), None)
            if not batches:
                raise P.ProtocolError(P.ErrorCode.BAD_FRAME, "Arrow IPC stream holds no record batch")
            batch = batches[0] if len(batches) == 1 else pa.concat_batches(batches)
            # The frame itself (not a view of it) is kept: sending a zmq.Frame again shares
            # its buffer by reference count, with no copy and no zero-copy bookkeeping.
            groups, rows, dups = st.accept(
                msg.producer_id,
                batch,
                now,
                payload_bytes=len(payload.buffer),
                payload=payload if len(batches) == 1 else None,
                view=view,
            )
            tickets = []
            if msg.want_tickets and not self.waiters.tickets:  # producers waiting for tickets go first
                tickets = st.acquire(msg.producer_id, msg.want_tickets, now)
            self._reply(ident, P.PushReply(req=msg.req, groups=groups, rows=rows, duplicates=dups, tickets=tickets))
        elif isinstance(msg, P.AcquireTickets):
            self._room_for_waiter(ident)
            self.waiters.add(Waiter(ident, msg, now, now + msg.wait_s))
        elif isinstance(msg, P.NextBatch):
            self._room_for_waiter(ident)
            w = Waiter(ident, msg, now, now + msg.wait_s)
            for lease_id in msg.acks:  # before the lookup: acked groups free their slots at once
                dup, late = st.ack(lease_id, now)
                if dup:
                    w.acks_duplicate.append(lease_id)
                elif late:
                    w.acks_late.append(lease_id)
            if not st.has_lease(msg.consumer_id, msg.step):  # a retried request gets its lease
                st.check_lease_step(msg.step)
            self.waiters.add(w)
        elif isinstance(msg, P.Ack):
            dup, late = st.ack(msg.lease_id, now)
            self._reply(ident, P.AckReply(req=msg.req, duplicate=dup, late=late))
        elif isinstance(msg, P.Renew):
            st.renew(msg.lease_id, now)
            self._reply(ident, P.OkReply(req=msg.req))
        elif isinstance(msg, P.ReportVersion):
            st.set_version(msg.version)
            self._reply(ident, P.OkReply(req=msg.req))
        elif isinstance(msg, P.EngineVersion):
            st.set_engine_version(msg.engine_id, msg.version, now)
            self._reply(ident, P.OkReply(req=msg.req))
        elif isinstance(msg, P.StatusRequest):
            snap = self.latest_snapshot = snapshot(self)
            self._reply(
                ident,
                P.StatusReply(
                    req=msg.req,
                    status=snap["status"],
                    drops=snap["drops"],
                    errors=snap["errors"],
                    engine_lag=snap["engine_lag"],
                    staleness_hist=snap["staleness_hist"],
                    stale_drop_lengths=snap["stale_drop_lengths"],
                ),
            )
        elif isinstance(msg, P.Ping):
            self._reply(ident, P.OkReply(req=msg.req))
        else:  # decode_request only returns known types
            raise AssertionError(f"unhandled message {msg!r}")

    # -- waiters ---------------------------------------------------------------------------------
    def _room_for_waiter(self, ident: bytes) -> None:
        """Make room for one more waiter of ``ident`` (its oldest is answered now), or refuse it (``busy``)."""
        evicted = self.waiters.make_room(ident)
        if evicted is not None:
            self._answer_empty(evicted)

    def _answer_empty(self, w: Waiter) -> None:
        """The answer a waiter gets when its wait ends with nothing."""
        if type(w.msg) is P.AcquireTickets:
            self._reply(w.ident, P.TicketsReply(req=w.msg.req, tickets=[]))
        else:
            self._reply(
                w.ident,
                P.NoBatch(
                    req=w.msg.req,
                    queued_groups=self.state.queued_groups,
                    acks_duplicate=w.acks_duplicate,
                    acks_late=w.acks_late,
                ),
            )

    def _waiter_failed(self, w: Waiter, e: Exception) -> None:
        self._internal(w.ident, w.msg.req, e)

    def _serve_ticket_waiter(self, w: Waiter, now: float) -> bool:
        """True when ``w`` was answered (or refused)."""
        if now < w.deadline and self.state.free_slots() < min(w.msg.min_groups, w.msg.max_groups):
            return False
        try:
            tickets = self.state.acquire(w.msg.producer_id, w.msg.max_groups, now)
        except BrokerError as e:
            self._error(w.ident, w.msg.req, e.code, e.message)
            return True
        if tickets or now >= w.deadline:
            if tickets:
                self.ticket_wait.observe(now - w.t0)
            self._reply(w.ident, P.TicketsReply(req=w.msg.req, tickets=tickets))
            return True
        return False

    def _serve_lease_waiter(self, w: Waiter, now: float) -> bool:
        try:
            lease = self.state.lease(w.msg.consumer_id, w.msg.step, now)
        except BrokerError as e:
            self._error(w.ident, w.msg.req, e.code, e.message, e.retry_after_s, e.lease_id)
            return True
        if lease is not None:
            self.learner_wait.observe(now - w.t0)
            payload = _lease_frames(lease)
            self._reply(
                w.ident,
                P.LeaseReply(
                    req=w.msg.req,
                    lease_id=lease.lease_id,
                    step=lease.step,
                    groups=len(lease.group_ids),
                    staleness=lease.staleness.astype("<i4").tobytes(),
                    frames=len(payload),
                    acks_duplicate=w.acks_duplicate,
                    acks_late=w.acks_late,
                ),
                *payload,
            )
            return True
        if now >= w.deadline:
            self._answer_empty(w)
            return True
        return False


def _lease_frames(lease) -> list:
    """One IPC stream frame per run of groups: a group pushed alone goes out as the very
    frame it came in (zero copy); other groups (slices of bigger pushes, or recovered
    from the spool) are serialised together."""
    frames, run = [], []
    for batch, payload in zip(lease.batches, lease.payloads, strict=True):
        if payload is None:
            run.append(batch)
            continue
        if run:
            frames.append(P.batch_to_ipc(run, TRAJECTORY_SCHEMA))
            run = []
        frames.append(payload)
    if run:
        frames.append(P.batch_to_ipc(run, TRAJECTORY_SCHEMA))
    return frames


def _keep_freed_memory() -> None:
    """glibc: keep freed trajectory buffers for reuse instead of returning them to the OS.

    Every batch is allocated by libzmq's I/O thread and freed at its ack, from another
    thread; with glibc's defaults a freed frame of a megabyte is unmapped or trimmed, so
    the next one faults in (and the kernel zeroes) fresh pages, a large share of the
    broker's CPU for megabyte batches (README, Broker). The process holds up to its byte budget
    of trajectories anyway. Only for the broker process (``python -m broker``), not for
    programs that import the clients."""
    import ctypes

    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(M_MMAP_THRESHOLD, 32 << 20)  # glibc's largest: 32 MiB
        libc.mallopt(M_TRIM_THRESHOLD, 256 << 20)
    except (OSError, AttributeError):
        pass  # not glibc: its defaults stay


def run_server(cfg: BrokerConfig, *, on_bound=None) -> None:
    """Bind, announce, serve until SIGTERM/SIGINT (used by ``python -m broker``)."""
    _keep_freed_memory()
    server = BrokerServer(cfg)
    stop = SignalFlag()  # not a threading.Event: its lock can deadlock nested handlers (core/signals.py)
    signal.signal(signal.SIGTERM, stop.handler)
    signal.signal(signal.SIGINT, stop.handler)
    address = server.bind()
    if on_bound is not None:
        on_bound(server, address)
    server.serve(stop)
    log.info("broker stopped")
