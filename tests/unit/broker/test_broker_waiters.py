"""broker/waiters.py: the queues of waiting requests and their bounds, without a socket."""

import pytest

from broker import limits as L
from broker import protocol as P
from broker.state import BrokerError
from broker.waiters import Waiter, Waiters


def _acquire(req: int) -> P.AcquireTickets:
    return P.AcquireTickets(req=req, producer_id="p", max_groups=1, min_groups=1, wait_s=1.0)


def _next(req: int) -> P.NextBatch:
    return P.NextBatch(req=req, consumer_id="c", step=1, wait_s=1.0)


def test_a_peer_at_its_bound_loses_its_oldest_waiter_of_either_kind():
    ws = Waiters(L.WaiterLimits(per_peer=2, total=10))
    first, second = Waiter(b"a", _next(1), 0.0, 5.0), Waiter(b"a", _acquire(2), 1.0, 3.0)
    for w in (first, second):
        assert ws.make_room(b"a") is None
        ws.add(w)
    assert ws.leases == [first] and ws.tickets == [second] and ws.next_deadline() == 3.0
    assert ws.make_room(b"b") is None  # another peer is not at its bound
    assert ws.make_room(b"a") is first and ws.limits.evicted == 1
    assert ws.leases == [] and len(ws) == 1
    ws.add(Waiter(b"a", _next(3), 2.0, 4.0))
    assert ws.make_room(b"a") is second  # the oldest is now the ticket waiter


def test_all_peers_together_are_refused_past_the_total():
    ws = Waiters(L.WaiterLimits(per_peer=5, total=2))
    for i, ident in enumerate((b"a", b"b")):
        ws.make_room(ident)
        ws.add(Waiter(ident, _acquire(i), 0.0, 1.0))
    with pytest.raises(BrokerError) as e:
        ws.make_room(b"c")
    assert e.value.code == P.ErrorCode.BUSY and ws.limits.refused == 1


def test_serve_keeps_the_unanswered_and_drops_a_failing_one():
    ws = Waiters()
    ws.add(a := Waiter(b"a", _acquire(1), 0.0, 1.0))
    ws.add(b := Waiter(b"b", _acquire(2), 0.0, 1.0))
    ws.add(Waiter(b"c", _next(3), 0.0, 1.0))
    failed = []

    def ticket(w, now):
        if w is b:
            raise RuntimeError("a bug")
        return False

    ws.serve(0.5, ticket, lambda w, now: now >= 0.5, lambda w, e: failed.append((w, str(e))))
    assert ws.tickets == [a] and ws.leases == [] and failed == [(b, "a bug")]
    assert ws.make_room(b"b") is None and ws.make_room(b"c") is None and len(ws) == 1
