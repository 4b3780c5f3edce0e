"""The broker's pure core: admission tickets, groups, leases, acks, stale drops, byte budget.

No sockets and no clock of its own (every method takes ``now``), so the property
tests drive it directly; :mod:`broker.server` wraps it in a ZMQ loop. The
semantics are stated in :mod:`broker.server`'s docstring; the short version:

* supply = outstanding tickets + pending groups (queued or leased); demand =
  ``groups_per_step * (k + 1)`` (steps ``v+1 .. v+k+1``). A ticket is granted
  while supply < demand, labelled with step ``v + 1 + supply // G``, so every
  step gets exactly ``G`` tickets and each label is ``<= v + k + 1``.
* a lease for step ``s`` takes the ``G`` oldest queued groups (by label, then
  arrival); a group whose staleness ``(s - 1) - oldest version`` exceeds ``k``
  for any row is dropped with reason ``stale``.
* acked groups are gone for good; an expired lease's groups are queued again.
* every number a peer puts into the state is bounded by it first (nothing is journaled
  before): a push's step lies in ``1 .. peak + k + 1`` and its rows' versions in
  ``0 .. peak + k + 1`` (``peak``: the highest learner version this state has had, so no
  ticket or policy version beyond that can exist), a lease's step in ``1 .. v + k + 1``
  (the admission window; a consumer that resumed further ahead reports its version
  first), versions in ``0 .. broker.limits.MAX_VERSION``. So every staleness fits int32.

A *journal* (the spool, or None) sees every change before it is visible, so a
restart from the journal restores exactly the accepted, unacked groups.
"""

from __future__ import annotations

import heapq
import logging
import os
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import pyarrow as pa

from broker import limits as L
from broker.groups import Group, split_groups
from broker.protocol import BrokerError, ErrorCode, Ticket, min_version
from broker.schema import TRAJECTORY_SCHEMA, ArrowDataError, BatchView, SchemaError, inspect_batch

log = logging.getLogger(__name__)


class Journal(Protocol):
    def on_accept(self, batch: pa.RecordBatch, payload=None) -> None: ...
    def on_lease(self, lease_id: str, step: int, consumer_id: str, group_ids: list[str]) -> None: ...
    def on_ack(self, lease_id: str, step: int, group_ids: list[str]) -> None: ...
    def on_expire(self, lease_id: str) -> None: ...
    def on_drop(self, reason: str, group_ids: list[str]) -> None: ...
    def on_version(self, version: int) -> None: ...


@dataclass(slots=True)
class Lease:
    lease_id: str
    step: int
    consumer_id: str
    group_ids: list[str]
    batches: list[pa.RecordBatch]
    staleness: np.ndarray  # int32 per row, in batch order
    deadline: float
    payloads: list = field(default_factory=list)  # per group: its pushed IPC frame, or None


@dataclass(slots=True)
class _TicketRec:
    producer_id: str
    step: int
    deadline: float


@dataclass(slots=True)
class Counters:
    produced_groups: int = 0
    produced_rows: int = 0
    produced_bytes: int = 0
    leased_groups: int = 0
    acked_groups: int = 0
    acked_rows: int = 0
    redelivered_groups: int = 0
    tickets_granted: int = 0
    tickets_fulfilled: int = 0
    tickets_expired: int = 0
    unticketed_groups: int = 0
    late_acks: int = 0
    duplicate_acks: int = 0
    drops: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    drops_rows: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    staleness_hist: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    # rows dropped as stale by response length (key: the power-of-two upper bound of the bucket): long answers
    # take longest to generate, so they are the ones a staleness bound drops, and a mean hides it
    stale_drop_lengths: dict[int, int] = field(default_factory=lambda: defaultdict(int))


def length_bucket(n: int) -> int:
    """The power-of-two upper bound of the bucket of a response of ``n`` tokens (0 and 1 share bucket 1)."""
    return 1 << max(0, int(n) - 1).bit_length()


class BrokerState:
    """The broker's bookkeeping. Example::

    st = BrokerState(max_staleness=1, groups_per_step=2, lease_timeout_s=30, ticket_timeout_s=60,
                     byte_budget_bytes=1 << 30)
    tickets = st.acquire("w0", 2, now=0.0)     # two tickets for step 1
    st.accept("w0", batch, now=1.0)            # rows of two complete groups with step=1
    lease = st.lease("learner", 1, now=2.0)    # both groups, staleness per row
    st.ack(lease.lease_id, now=3.0)            # gone for good; version is now 1
    """

    def __init__(
        self,
        *,
        max_staleness: int,
        groups_per_step: int,
        lease_timeout_s: float,
        ticket_timeout_s: float,
        byte_budget_bytes: int,
        journal: Journal | None = None,
        max_expired_leases: int = 4096,
    ) -> None:
        self.k = max_staleness
        self.G = groups_per_step
        self.lease_timeout_s = lease_timeout_s
        self.ticket_timeout_s = ticket_timeout_s
        self.byte_budget = byte_budget_bytes
        self.journal = journal
        self.version = 0
        self.peak_version = 0  # the highest version ever set (report_version may go back)
        self.engine_versions = L.EngineVersions()
        self.counters = Counters()
        self.pending: dict[str, Group] = {}  # accepted, not acked, not dropped
        self.pending_bytes = 0
        self._queue: list[tuple[int, int, str]] = []  # heap of (label, seq, group_id); lazily pruned
        self._done: set[str] = set()  # acked or dropped group ids
        self._tickets: dict[int, _TicketRec] = {}
        # (producer, step) -> its ticket ids, oldest first: a push finds its tickets without
        # a scan of all outstanding ones (up to G * (k + 1)) per push
        self._tickets_of: dict[tuple[str, int], list[int]] = {}
        self._leases: dict[str, Lease] = {}
        self._lease_by_key: dict[tuple[str, int], str] = {}
        self._acked_leases: set[str] = set()
        self._expired: OrderedDict[str, Lease] = OrderedDict()
        self._max_expired = max_expired_leases
        self._epoch = os.urandom(4).hex()  # lease ids stay unique across broker restarts
        self._next_ticket = int.from_bytes(os.urandom(3), "little") << 20
        self._next_lease = 0
        self._seq = 0
        # A lower bound of every lease and ticket deadline, so tick() (once per server loop
        # iteration) scans them only when one may have passed.
        self._min_deadline = float("inf")

    # -- derived ---------------------------------------------------------------------------------
    @property
    def queued_groups(self) -> int:
        return sum(1 for g in self.pending.values() if g.lease_id is None)

    @property
    def leased_groups(self) -> int:
        return sum(len(lease.group_ids) for lease in self._leases.values())

    @property
    def outstanding_tickets(self) -> int:
        return len(self._tickets)

    def _supply(self) -> int:
        return len(self._tickets) + len(self.pending)

    def _demand(self) -> int:
        return self.G * (self.k + 1)

    def free_slots(self) -> int:
        """Tickets that acquire() would grant now."""
        return max(0, self._demand() - self._supply())

    # -- admission -------------------------------------------------------------------------------
    def acquire(self, producer_id: str, max_groups: int, now: float) -> list[Ticket]:
        if max_groups < 1:
            raise BrokerError(ErrorCode.BAD_REQUEST, f"max_groups must be >= 1, got {max_groups}")
        out: list[Ticket] = []
        while len(out) < max_groups and (supply := self._supply()) < self._demand():
            step = self.version + 1 + supply // self.G
            tid = self._next_ticket
            self._next_ticket += 1
            self._tickets[tid] = _TicketRec(producer_id, step, now + self.ticket_timeout_s)
            self._tickets_of.setdefault((producer_id, step), []).append(tid)
            out.append(Ticket(tid, step, min_version(step, self.k)))
        if out:
            self._min_deadline = min(self._min_deadline, now + self.ticket_timeout_s)
        self.counters.tickets_granted += len(out)
        return out

    def accept(
        self,
        producer_id: str,
        batch: pa.RecordBatch,
        now: float,
        payload_bytes: int | None = None,
        payload=None,
        view: BatchView | None = None,
    ) -> tuple[int, int, int]:
        """Take a pushed batch. Returns (groups, rows, duplicate groups); all or nothing.

        ``payload`` (the IPC frame the batch was read from) is kept with a group that is
        the whole batch, so a lease can hand the same bytes on without serialising again.
        ``view``: the batch's view from :func:`broker.schema.inspect_batches` when the
        caller validated it already (with other batches); otherwise it is validated here."""
        if view is None:
            try:
                view = inspect_batch(batch)
            except ArrowDataError as e:
                raise BrokerError(ErrorCode.BAD_ARROW, str(e)) from None
            except SchemaError as e:
                raise BrokerError(ErrorCode.BAD_SCHEMA, str(e)) from None
        if not batch.schema.equals(TRAJECTORY_SCHEMA):  # e.g. nullable fields: same data, our schema
            batch = pa.RecordBatch.from_arrays(batch.columns, schema=TRAJECTORY_SCHEMA)
        groups = split_groups(batch, payload_bytes, view)
        if len(groups) == 1:
            return self._accept_one(producer_id, groups[0], batch, payload)
        fresh = [g for g in groups if g.group_id not in self.pending and g.group_id not in self._done]
        dups = len(groups) - len(fresh)
        if not fresh:
            self.counters.drops["duplicate"] += dups
            return 0, 0, dups
        for g in fresh:
            self._check_window(g)
        nbytes = sum(g.nbytes for g in fresh)
        self._check_room(nbytes)
        # Plan tickets before changing anything, so a refused push leaves no trace.
        taken: dict[int, int] = {}
        used, unticketed, supply = [], 0, self._supply()
        for g in fresh:
            tids = self._tickets_of.get((producer_id, g.label))
            k = taken.get(g.label, 0)
            if tids is not None and k < len(tids):
                used.append(tids[-1 - k])  # the newest first, as before
                taken[g.label] = k + 1
            elif supply < self._demand():
                unticketed += 1
                supply += 1
            else:
                raise self._no_ticket(producer_id, g)
        if self.journal is not None:
            if dups:
                self.journal.on_accept(pa.concat_batches([g.batch for g in fresh]))
            else:  # the pushed frame too: the spool may write its bytes as they came
                self.journal.on_accept(batch, payload)
        for tid in used:
            self._drop_ticket(tid)
        rows = 0
        for g in fresh:
            self._add(g)
            rows += g.batch.num_rows
        c = self.counters
        c.tickets_fulfilled += len(used)
        c.unticketed_groups += unticketed
        c.produced_groups += len(fresh)
        c.produced_rows += rows
        c.produced_bytes += nbytes
        if dups:
            c.drops["duplicate"] += dups
        return len(fresh), rows, dups

    def _accept_one(self, producer_id: str, g: Group, batch: pa.RecordBatch, payload) -> tuple[int, int, int]:
        """accept() of a push that is one whole group (the usual case), with the same checks
        in the same order, without the per-group lists."""
        c = self.counters
        if g.group_id in self.pending or g.group_id in self._done:
            c.drops["duplicate"] += 1
            return 0, 0, 1
        self._check_window(g)
        nbytes = g.nbytes
        self._check_room(nbytes)
        tids = self._tickets_of.get((producer_id, g.label))
        if not tids and self._supply() >= self._demand():
            raise self._no_ticket(producer_id, g)
        if self.journal is not None:
            self.journal.on_accept(batch, payload)
        if tids:
            self._drop_ticket(tids[-1])  # the newest first, as accept() does
            c.tickets_fulfilled += 1
        else:
            c.unticketed_groups += 1
        g.payload = payload
        self._add(g)
        rows = g.batch.num_rows
        c.produced_groups += 1
        c.produced_rows += rows
        c.produced_bytes += nbytes
        return 1, rows, 0

    def window_top(self) -> int:
        """The highest step a ticket can carry, and the highest policy version a row can
        have: ``peak + k + 1`` (a version above the learner's cannot exist yet; the slack of
        ``k + 1`` covers a report still on its way)."""
        return self.peak_version + self.k + 1

    def _check_window(self, g: Group) -> None:
        """Refuse a group whose step or versions this state cannot have issued (before it is
        journaled: a refused push never reaches the spool)."""
        top = self.window_top()
        if not 1 <= g.label <= top:
            raise BrokerError(
                ErrorCode.BAD_REQUEST,
                f"group {g.group_id!r} has step {g.label}, outside the "
                f"admission window 1..{top} (learner version {self.version}, k={self.k})",
            )
        if g.vmax > top:
            raise BrokerError(
                ErrorCode.BAD_REQUEST,
                f"group {g.group_id!r} has policy version {g.vmax}, ahead "
                f"of the learner (version {self.peak_version}; at most {top} accepted)",
            )

    def has_lease(self, consumer_id: str, step: int) -> bool:
        """Whether (consumer, step) holds a live lease (a retried next_batch gets it again)."""
        return (consumer_id, step) in self._lease_by_key

    def check_lease_step(self, step: int) -> None:
        """A lease's step must lie in the admission window ``1 .. v + k + 1``."""
        if not 1 <= step <= self.version + self.k + 1:
            raise BrokerError(
                ErrorCode.STEP_AHEAD,
                f"step {step} is outside the admission window 1.."
                f"{self.version + self.k + 1} (learner version {self.version}, k={self.k}); a "
                "consumer that resumed ahead reports its version first",
            )

    def _check_room(self, nbytes: int) -> None:
        """Refuse a push of ``nbytes`` that the byte budget cannot hold (ever, or now)."""
        if nbytes > self.byte_budget:
            raise BrokerError(
                ErrorCode.TOO_LARGE,
                f"push of {nbytes} bytes exceeds the whole byte budget of {self.byte_budget}; push smaller batches",
            )
        if self.pending_bytes + nbytes > self.byte_budget:
            raise BrokerError(
                ErrorCode.BUSY,
                f"byte budget full ({self.pending_bytes} of {self.byte_budget} bytes held); retry later",
                retry_after_s=0.05,
            )

    def _no_ticket(self, producer_id: str, g: Group) -> BrokerError:
        return BrokerError(
            ErrorCode.NO_TICKET,
            f"group {g.group_id!r} for step {g.label}: producer "
            f"{producer_id!r} holds no ticket for that step (expired?) and all "
            f"{self._demand()} slots are taken; acquire a ticket first",
        )

    def _add(self, g: Group) -> None:
        g.seq = self._seq
        self._seq += 1
        self.pending[g.group_id] = g
        self.pending_bytes += g.nbytes
        heapq.heappush(self._queue, (g.label, g.seq, g.group_id))

    # -- consumption -----------------------------------------------------------------------------
    def lease(self, consumer_id: str, step: int, now: float) -> Lease | None:
        """The batch of learner step ``step`` (trained at version ``step - 1``), or None if short."""
        if (lid := self._lease_by_key.get((consumer_id, step))) is not None:
            return self._leases[lid]  # a retried request: the same lease again
        self.check_lease_step(step)
        if step - 1 > self.version:
            # Only forward: a consumer with several requests outstanding (steps s, s+1, ...)
            # would otherwise move v back and forth on every retry of the lower one.
            self.set_version(step - 1)
        picked: list[Group] = []
        stale: list[Group] = []
        taken: set[str] = set()
        while self._queue and len(picked) < self.G:
            label, seq, gid = heapq.heappop(self._queue)
            g = self.pending.get(gid)
            if g is None or g.lease_id is not None or g.seq != seq or gid in taken:
                continue  # acked, dropped, leased since it was queued, or a second entry of one group
            taken.add(gid)
            if g.vmin < min_version(step, self.k):  # its oldest row is more than k versions behind
                stale.append(g)
                continue
            picked.append(g)
        if stale:
            self._drop(stale, "stale")
        if len(picked) < self.G:
            for g in picked:
                heapq.heappush(self._queue, (g.label, g.seq, g.group_id))
            return None
        lid = f"{self._epoch}-{self._next_lease}"
        self._next_lease += 1
        gids = [g.group_id for g in picked]
        if self.journal is not None:
            self.journal.on_lease(lid, step, consumer_id, gids)
        hist = self.counters.staleness_hist
        if all(g.vmin == g.vmax for g in picked):  # the usual case: one version per group
            rows = [g.batch.num_rows for g in picked]
            per_group = [(step - 1) - g.vmin for g in picked]
            staleness = (
                np.full(rows[0], per_group[0], np.int32)
                if len(picked) == 1
                else np.repeat(np.array(per_group, np.int32), rows)
            )
            for s_, n in zip(per_group, rows, strict=True):
                hist[s_] += n
        else:
            staleness = np.concatenate([(step - 1) - g.versions for g in picked]).astype(np.int32)
            for s_, n in zip(*np.unique(staleness, return_counts=True), strict=True):
                hist[int(s_)] += int(n)
        lease = Lease(
            lid,
            step,
            consumer_id,
            gids,
            [g.batch for g in picked],
            staleness,
            now + self.lease_timeout_s,
            [g.payload for g in picked],
        )
        for g in picked:
            g.lease_id = lid
        self._min_deadline = min(self._min_deadline, lease.deadline)
        self._leases[lid] = lease
        self._lease_by_key[(consumer_id, step)] = lid
        self.counters.leased_groups += len(picked)
        return lease

    def _drop(self, groups: list[Group], reason: str) -> None:
        if self.journal is not None:
            self.journal.on_drop(reason, [g.group_id for g in groups])
        for g in groups:
            self._forget(g)
            self.counters.drops[reason] += 1
            self.counters.drops_rows[reason] += g.batch.num_rows
            if reason == "stale":
                for n in np.diff(g.batch.column("response_ids").offsets.to_numpy()):
                    self.counters.stale_drop_lengths[length_bucket(n)] += 1
        log.info("dropped %d group(s): %s", len(groups), reason)

    def _forget(self, g: Group) -> None:
        del self.pending[g.group_id]
        self.pending_bytes -= g.nbytes
        self._done.add(g.group_id)

    def ack(self, lease_id: str, now: float) -> tuple[bool, bool]:
        """Mark a lease's groups consumed. Returns (duplicate, late)."""
        lease = self._leases.pop(lease_id, None)
        late = False
        if lease is None:
            if lease_id in self._acked_leases:
                self.counters.duplicate_acks += 1
                return True, False
            lease = self._expired.get(lease_id)
            if lease is None:
                raise BrokerError(
                    ErrorCode.UNKNOWN_LEASE, f"lease {lease_id!r} is unknown to this broker", lease_id=lease_id
                )
            if not all((g := self.pending.get(gid)) is not None and g.lease_id is None for gid in lease.group_ids):
                raise BrokerError(
                    ErrorCode.LEASE_EXPIRED,
                    f"lease {lease_id!r} (step {lease.step}) expired and "
                    "some of its groups were handed out again or dropped; do not count this step",
                    lease_id=lease_id,
                )
            del self._expired[lease_id]
            late = True
            self.counters.late_acks += 1
        else:
            self._lease_by_key.pop((lease.consumer_id, lease.step), None)
        if self.journal is not None:
            self.journal.on_ack(lease_id, lease.step, lease.group_ids)
        self._acked_leases.add(lease_id)
        for gid in lease.group_ids:
            g = self.pending[gid]
            self._forget(g)
            self.counters.acked_groups += 1
            self.counters.acked_rows += g.batch.num_rows
        if lease.step > self.version:
            self.set_version(lease.step)
        return False, late

    def renew(self, lease_id: str, now: float) -> None:
        lease = self._leases.get(lease_id)
        if lease is None:
            code = ErrorCode.LEASE_EXPIRED if lease_id in self._expired else ErrorCode.UNKNOWN_LEASE
            raise BrokerError(code, f"lease {lease_id!r} is not live; it cannot be renewed", lease_id=lease_id)
        lease.deadline = now + self.lease_timeout_s

    def set_version(self, version: int) -> None:
        if not 0 <= version <= L.MAX_VERSION:
            raise BrokerError(ErrorCode.BAD_REQUEST, f"version must lie in 0..{L.MAX_VERSION}, got {version}")
        if version == self.version:
            return
        if version < self.version:
            log.warning("learner version went back from %d to %d (restored checkpoint?)", self.version, version)
        if self.journal is not None:
            self.journal.on_version(version)
        self.version = version
        self.peak_version = max(self.peak_version, version)

    def set_engine_version(self, engine_id: str, version: int, now: float = 0.0) -> None:
        """Bounded: at most broker.limits.MAX_ENGINES ids, each forgotten ENGINE_TTL_S after
        its last report (see broker.limits.EngineVersions)."""
        if not 0 <= version <= L.MAX_VERSION:
            raise BrokerError(ErrorCode.BAD_REQUEST, f"version must lie in 0..{L.MAX_VERSION}, got {version}")
        self.engine_versions.set(engine_id, version, now)

    # -- time ------------------------------------------------------------------------------------
    def tick(self, now: float) -> None:
        """Expire leases (their groups are queued again) and unfulfilled tickets."""
        if now < self._min_deadline:
            return
        for lid in [lid for lid, lease in self._leases.items() if lease.deadline <= now]:
            lease = self._leases.pop(lid)
            self._lease_by_key.pop((lease.consumer_id, lease.step), None)
            if self.journal is not None:
                self.journal.on_expire(lid)
            for gid in lease.group_ids:
                g = self.pending[gid]
                g.lease_id = None
                heapq.heappush(self._queue, (g.label, g.seq, gid))
            self.counters.redelivered_groups += len(lease.group_ids)
            self._expired[lid] = lease
            while len(self._expired) > self._max_expired:
                self._expired.popitem(last=False)
            log.warning(
                "lease %s (step %d, consumer %s) expired; %d groups queued again",
                lid,
                lease.step,
                lease.consumer_id,
                len(lease.group_ids),
            )
        dead = [tid for tid, t in self._tickets.items() if t.deadline <= now]
        for tid in dead:
            self._drop_ticket(tid)
        self.counters.tickets_expired += len(dead)
        ds = [lease.deadline for lease in self._leases.values()] + [t.deadline for t in self._tickets.values()]
        self._min_deadline = min(ds) if ds else float("inf")

    def _drop_ticket(self, tid: int) -> None:
        t = self._tickets.pop(tid)
        key = (t.producer_id, t.step)
        tids = self._tickets_of[key]
        if tids[-1] == tid:  # the usual case: accept() uses the newest first
            tids.pop()
        else:
            tids.remove(tid)
        if not tids:
            del self._tickets_of[key]

    def next_deadline(self) -> float | None:
        """No lease or ticket expires before this (it may be earlier than the first that does)."""
        return self._min_deadline if self._min_deadline != float("inf") else None

    # -- recovery --------------------------------------------------------------------------------
    def restore(self, batches: list[pa.RecordBatch], records: list, now: float) -> None:
        """Rebuild from a spool: accepted batches in order, then the log records (see broker.spool)."""
        journal, self.journal = self.journal, None  # replaying must not write the journal again
        try:
            done: set[str] = set()
            leases: dict[str, tuple[int, str, list[str]]] = {}
            expired: dict[str, tuple[int, str, list[str]]] = {}  # kept so a late ack is judged as before
            for rec in records:
                if rec.kind == "lease":
                    leases[rec.lease_id] = (rec.step, rec.consumer_id, rec.group_ids)
                elif rec.kind == "expire":
                    if (ended := leases.pop(rec.lease_id, None)) is not None:
                        expired[rec.lease_id] = ended
                elif rec.kind == "ack":
                    leases.pop(rec.lease_id, None)
                    expired.pop(rec.lease_id, None)
                    done.update(rec.group_ids)
                    self._acked_leases.add(rec.lease_id)
                elif rec.kind == "drop":
                    done.update(rec.group_ids)
                elif rec.kind == "version":
                    self.version = rec.step
                    self.peak_version = max(self.peak_version, rec.step)
            c = self.counters
            for rec in records:  # totals continue across restarts (the launcher's accounting reads them)
                if rec.kind == "ack":
                    c.acked_groups += len(rec.group_ids)
                elif rec.kind == "drop":
                    c.drops[rec.reason] += len(rec.group_ids)
            seen: set[str] = set()
            for batch in batches:
                for g in split_groups(batch):
                    if g.group_id not in seen:
                        seen.add(g.group_id)
                        c.produced_groups += 1
                        c.produced_rows += g.batch.num_rows
                    if g.group_id in done:
                        self._done.add(g.group_id)
                    elif g.group_id not in self.pending:
                        self._add(g)
            for lid, (step, consumer_id, gids) in leases.items():
                gs = [pg for gid in gids if (pg := self.pending.get(gid)) is not None and pg.lease_id is None]
                if len(gs) == len(gids):  # every group of the lease is pending and unleased
                    staleness = np.concatenate([(step - 1) - g.versions for g in gs]).astype(np.int32)
                    lease = Lease(
                        lid,
                        step,
                        consumer_id,
                        gids,
                        [g.batch for g in gs],
                        staleness,
                        now + self.lease_timeout_s,
                        [None] * len(gs),
                    )
                    for g in gs:
                        g.lease_id = lid
                    self._min_deadline = min(self._min_deadline, lease.deadline)
                    self._leases[lid] = lease
                    self._lease_by_key[(consumer_id, step)] = lid
            for lid, (step, consumer_id, gids) in list(expired.items())[-self._max_expired :]:
                self._expired[lid] = Lease(lid, step, consumer_id, gids, [], np.zeros(0, np.int32), 0.0)
            log.info(
                "restored %d pending groups (%d leased) and %d done; version %d",
                len(self.pending),
                self.leased_groups,
                len(self._done),
                self.version,
            )
        finally:
            self.journal = journal

    # -- status ----------------------------------------------------------------------------------
    def has_seen(self, group_id: str) -> bool:
        return group_id in self.pending or group_id in self._done

    def engine_lag(self) -> dict[str, int]:
        return {e: self.version - v for e, v in self.engine_versions.items()}

    def expire_engines(self, now: float) -> None:
        self.engine_versions.expire(now)
