"""The requests the broker holds until it can answer them: acquires waiting for free slots (tickets)
and next_batch requests waiting for a step's groups (leases), within the bounds of
:class:`broker.limits.WaiterLimits`.

The server decides what answers a waiter; this module keeps the two queues in arrival order, the
count of each peer's waiters, and the eviction and refusal rules, so that no peer can make the
broker hold more than ``per_peer`` of its requests, nor all peers more than ``total``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from broker import limits as L
from broker import protocol as P
from broker.state import BrokerError


@dataclass
class Waiter:
    ident: bytes
    msg: Any  # a P.AcquireTickets in the ticket queue, a P.NextBatch in the lease queue
    t0: float
    deadline: float
    acks_duplicate: list = field(default_factory=list)  # results of a NextBatch's piggybacked acks
    acks_late: list = field(default_factory=list)


class Waiters:
    def __init__(self, limits: L.WaiterLimits | None = None) -> None:
        self.limits = limits or L.WaiterLimits()
        self.tickets: list[Waiter] = []  # AcquireTickets, oldest first
        self.leases: list[Waiter] = []  # NextBatch, oldest first
        self._per_peer: dict[bytes, int] = defaultdict(int)

    def __len__(self) -> int:
        return len(self.tickets) + len(self.leases)

    def next_deadline(self) -> float | None:
        return min((w.deadline for w in (*self.tickets, *self.leases)), default=None)

    def make_room(self, ident: bytes) -> Waiter | None:
        """Room for one more waiter of ``ident``. A peer at its bound loses its oldest waiter, most
        likely a request it has retried since: that waiter is returned, for the caller to answer now.
        Raises ``busy`` when all peers together are at the total bound."""
        wl = self.limits
        if self._per_peer.get(ident, 0) >= wl.per_peer:
            oldest = min((w for w in (*self.tickets, *self.leases) if w.ident == ident), key=lambda w: w.t0)
            self.tickets = [w for w in self.tickets if w is not oldest]
            self.leases = [w for w in self.leases if w is not oldest]
            self._forget(oldest)
            wl.evicted += 1
            return oldest
        if len(self) >= wl.total:
            wl.refused += 1
            raise BrokerError(
                P.ErrorCode.BUSY, f"{wl.total} requests are waiting already; retry later", retry_after_s=0.5
            )
        return None

    def add(self, w: Waiter) -> None:
        """Queue ``w`` (after :meth:`make_room`): an AcquireTickets waits for tickets, a NextBatch for a lease."""
        (self.tickets if type(w.msg) is P.AcquireTickets else self.leases).append(w)
        self._per_peer[w.ident] += 1

    def serve(
        self,
        now: float,
        serve_ticket: Callable[[Waiter, float], bool],
        serve_lease: Callable[[Waiter, float], bool],
        on_error: Callable[[Waiter, Exception], None],
    ) -> None:
        """Offer every waiter, oldest first, to its server function, which answers it and returns True,
        or returns False to keep it waiting. One that raises (a bug) goes to ``on_error`` and is gone;
        the others are served as usual."""
        for name, serve in (("tickets", serve_ticket), ("leases", serve_lease)):
            keep = []
            for w in getattr(self, name):
                try:
                    done = serve(w, now)
                except Exception as e:
                    on_error(w, e)
                    done = True
                if done:
                    self._forget(w)
                else:
                    keep.append(w)
            setattr(self, name, keep)

    def _forget(self, w: Waiter) -> None:
        n = self._per_peer[w.ident] - 1
        if n > 0:
            self._per_peer[w.ident] = n
        else:
            self._per_peer.pop(w.ident, None)
