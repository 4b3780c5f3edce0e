"""BrokerState and its spool: unit cases, and a hypothesis state machine over random interleavings.

The state machine drives the real state and the real spool (files in a temporary
directory, restarts replay them) and checks the three promises of the broker:
(a) no consumed group violates the staleness bound, (b) no accepted trajectory is
lost (each is finally acked exactly once or dropped with a counted reason), (c) none
is part of two acked leases.
"""

import shutil
import tempfile

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from broker.protocol import ErrorCode
from broker.spool import Spool, export_parquet
from broker.state import BrokerError, BrokerState
from tests.support.broker_groups import make_groups

pytestmark = pytest.mark.timeout(120)


def new_state(k=1, G=2, journal=None, budget=1 << 30, lease_timeout_s=10.0, ticket_timeout_s=20.0):
    return BrokerState(
        max_staleness=k,
        groups_per_step=G,
        lease_timeout_s=lease_timeout_s,
        ticket_timeout_s=ticket_timeout_s,
        byte_budget_bytes=budget,
        journal=journal,
    )


def test_tickets_follow_the_admission_rule():
    s = new_state(k=1, G=2)
    t = s.acquire("w", 10, now=0)
    assert [x.step for x in t] == [1, 1, 2, 2]  # steps v+1 .. v+k+1, exactly G each
    assert s.acquire("w", 1, now=0) == []
    s.accept("w", make_groups(["a", "b"], step=1, version=0), now=1)
    lease = s.lease("L", 1, now=2)
    s.ack(lease.lease_id, now=3)
    assert s.version == 1
    assert [x.step for x in s.acquire("w", 10, now=4)] == [3, 3]


def test_tickets_carry_the_staleness_floor_the_lease_enforces():
    """Each ticket names the oldest weights version its group may be sampled with (the workers read it
    there); a group whose oldest row is one version below that floor is dropped at its lease, one at the
    floor is trained."""
    assert [(x.step, x.min_version) for x in new_state(k=1, G=1).acquire("w", 10, now=0)] == [(1, 0), (2, 0)]
    granted = new_state(k=1, G=1)
    granted.set_version(3)
    tickets = granted.acquire("w", 10, now=0)
    assert [(x.step, x.min_version) for x in tickets] == [(4, 2), (5, 3)]  # step - k - 1
    s = new_state(k=1, G=1)  # the same broker, its slots filled by pushes instead
    s.set_version(3)
    s.accept("w", make_groups(["below"], step=4, version=tickets[0].min_version - 1), now=0)
    s.accept("w", make_groups(["at"], step=4, version=tickets[0].min_version), now=0)
    lease = s.lease("L", 4, now=0)
    assert lease.group_ids == ["at"] and lease.staleness.max() == 1 and s.counters.drops["stale"] == 1


def test_k0_is_synchronous():
    s = new_state(k=0, G=1)
    assert [x.step for x in s.acquire("w", 5, now=0)] == [1]
    s.accept("w", make_groups(["a"], step=1, version=0), now=0)
    assert s.acquire("w", 5, now=0) == []  # nothing for step 2 before step 1 is consumed
    s.ack(s.lease("L", 1, now=0).lease_id, now=0)
    assert [x.step for x in s.acquire("w", 5, now=0)] == [2]


def test_expired_ticket_is_granted_again_so_a_run_never_stalls():
    s = new_state(k=0, G=1, ticket_timeout_s=5)
    assert len(s.acquire("dead", 1, now=0)) == 1
    assert s.acquire("alive", 1, now=1) == []
    s.tick(now=6)
    assert [x.step for x in s.acquire("alive", 1, now=6)] == [1]
    assert s.counters.tickets_expired == 1
    # the dead producer's late push finds every slot taken: refused, not silently dropped
    with pytest.raises(BrokerError) as e:
        s.accept("dead", make_groups(["late"], step=1, version=0), now=7)
    assert e.value.code == ErrorCode.NO_TICKET


def test_stale_groups_are_dropped_never_leased():
    s = new_state(k=1, G=1)
    s.accept("w", make_groups(["old"], step=1, version=0), now=0)
    s.accept("w", make_groups(["new"], step=1, version=2), now=0)
    s.set_version(3)  # the window: a step past v + k + 1 is refused until the version is reported
    lease = s.lease("L", 4, now=0)  # trained at version 3: 'old' has staleness 3 > 1
    assert lease.group_ids == ["new"] and lease.staleness.tolist() == [1, 1]
    assert s.counters.drops["stale"] == 1 and not s.has_seen("x") and s.has_seen("old")


def test_stale_drops_are_counted_by_response_length_bucket():
    from broker.state import length_bucket

    assert [length_bucket(n) for n in (0, 1, 2, 3, 64, 65, 1000)] == [1, 1, 2, 4, 64, 128, 1024]
    s = new_state(k=1, G=2)
    s.accept("w", make_groups(["long", "short"], step=1, version=0, resp_len=300), now=0)
    s.accept("w", make_groups(["tiny"], step=2, version=0, resp_len=20), now=0)
    s.set_version(2)
    # step 3 is trained at version 2: every group (version 0) has staleness 2 > 1 and is dropped
    assert s.lease("L", 3, now=0) is None
    assert dict(s.counters.stale_drop_lengths) == {512: 4, 32: 2}  # two rows a group


def test_incomplete_groups_duplicates_and_budget():
    s = new_state(k=3, G=1, budget=60_000)
    with pytest.raises(BrokerError) as e:
        s.accept("w", make_groups(["a"], step=1, version=0, group_size=3).slice(0, 2), now=0)
    assert e.value.code == ErrorCode.INCOMPLETE_GROUP
    b = make_groups(["a", "b"], step=1, version=0, resp_len=1000)
    assert s.accept("w", b, now=0) == (2, 4, 0)
    assert s.accept("w", b, now=0) == (0, 0, 2)  # a retried push is not stored twice
    with pytest.raises(BrokerError) as e:
        s.accept("w", make_groups(["c", "d"], step=1, version=0, resp_len=1000), now=0)
    assert e.value.code == ErrorCode.BUSY and e.value.retry_after_s > 0
    with pytest.raises(BrokerError) as e:
        s.accept("w", make_groups([f"x{i}" for i in range(9)], step=1, version=0, resp_len=1000), now=0)
    assert e.value.code == ErrorCode.TOO_LARGE


def test_lease_expiry_redelivery_and_late_acks():
    s = new_state(k=5, G=1, lease_timeout_s=10)
    s.accept("w", make_groups(["a", "b"], step=1, version=0), now=0)
    l1 = s.lease("L", 1, now=0)
    assert s.lease("L", 1, now=1) is l1  # a retried request gets the same lease
    s.tick(now=11)  # the learner died
    # late ack, groups not handed out again yet: honoured
    assert s.ack(l1.lease_id, now=12) == (False, True)
    l2 = s.lease("L", 2, now=12)
    s.tick(now=30)
    l3 = s.lease("L2", 2, now=30)
    assert l3.group_ids == l2.group_ids and l3.lease_id != l2.lease_id
    with pytest.raises(BrokerError) as e:  # the groups went to l3: l2's ack must fail
        s.ack(l2.lease_id, now=31)
    assert e.value.code == ErrorCode.LEASE_EXPIRED
    assert s.ack(l3.lease_id, now=31) == (False, False)
    assert s.ack(l3.lease_id, now=32) == (True, False)
    with pytest.raises(BrokerError) as e:
        s.ack("nope", now=33)
    assert e.value.code == ErrorCode.UNKNOWN_LEASE


def test_outstanding_requests_never_move_the_version_back(tmp_path):
    """A consumer waiting for steps 3 and 4 at once: the server retries both on every loop
    iteration (lower step first); the version must go 0 -> 3 and stay, in memory and in the
    spool's log, and a later request for an old step must not lower it either."""
    from broker.spool import read_log

    sp = Spool(tmp_path, fsync="never")
    s = new_state(k=4, G=1, journal=sp)
    seen = []
    for _ in range(3):  # three loop iterations with nothing to serve
        assert s.lease("L", 3, now=0) is None
        seen.append(s.version)
        assert s.lease("L", 4, now=0) is None
        seen.append(s.version)
    assert seen == [2, 3, 3, 3, 3, 3]
    s.accept("w", make_groups(["a"], step=1, version=2), now=0)
    assert s.lease("L", 2, now=0) is not None and s.version == 3  # served, still not lowered
    s.set_version(1)  # the explicit report (a restored checkpoint) may set it back
    assert s.version == 1
    sp.close()
    versions = [r.step for r in read_log(tmp_path / "log.bin")[0] if r.kind == "version"]
    assert versions == [2, 3, 1]


def test_spool_restart_restores_pending_and_live_leases(tmp_path):
    sp = Spool(tmp_path, fsync="always")
    s = new_state(k=2, G=1, journal=sp)
    s.accept("w", make_groups(["a", "b", "c"], step=1, version=0), now=0)
    acked = s.lease("L", 1, now=0)
    s.ack(acked.lease_id, now=0)
    live = s.lease("L", 2, now=0)
    sp.close()
    sp2 = Spool(tmp_path, fsync="always")
    s2 = new_state(k=2, G=1, journal=sp2)
    rec = sp2.recover()
    s2.restore(rec.batches, rec.records, now=100)
    assert set(s2.pending) == {"b", "c"} and s2.version == 1
    assert s2.lease("L", 2, now=100).lease_id == live.lease_id  # same lease after the restart
    assert s2.ack(live.lease_id, now=101) == (False, False)
    assert s2.ack(acked.lease_id, now=101) == (True, False)
    sp2.close()
    out = tmp_path / "x.parquet"
    assert export_parquet(tmp_path, out) == 6
    import pyarrow.parquet as pq

    t = pq.read_table(out)
    fate = dict(zip(t.column("group_id").to_pylist(), t.column("status").to_pylist(), strict=True))
    assert fate == {"a": "acked", "b": "acked", "c": "pending"}
    assert export_parquet(tmp_path, out, steps=(2, 5)) == 0


def test_torn_spool_tail_is_ignored(tmp_path):
    sp = Spool(tmp_path, fsync="never")
    s = new_state(k=2, G=1, journal=sp)
    s.accept("w", make_groups(["a"], step=1, version=0), now=0)
    s.accept("w", make_groups(["b"], step=1, version=0), now=0)
    s.lease("L", 1, now=0)
    sp.commit()  # as the server does once per loop iteration, before its replies
    sp._close_segment()
    os_fd = sp._log_fd
    sp._log_fd = None
    import os

    os.close(os_fd)
    seg = next((tmp_path / "segments").glob("*.arrows"))
    data = seg.read_bytes()
    seg.write_bytes(data[: len(data) - 300])  # kill -9 in the middle of the second batch
    with open(tmp_path / "log.bin", "ab") as f:
        f.write(b"\x10\x00\x00\x00garbage")
    sp2 = Spool(tmp_path)
    rec = sp2.recover()
    assert rec.torn_log_bytes > 0 and len(rec.records) == 1
    s2 = new_state(k=2, G=1, journal=sp2)
    s2.restore(rec.batches, rec.records, now=0)
    assert set(s2.pending) == {"a"} and s2.leased_groups == 1
    sp2.close()


class BrokerMachine(RuleBasedStateMachine):
    """Random interleavings of produce, consume, ack, version bumps, consumer crash and restart."""

    @initialize(k=st.integers(0, 2), G=st.integers(1, 3), gsize=st.integers(1, 2))
    def setup(self, k, G, gsize):
        self.dir = tempfile.mkdtemp(prefix="broker-hyp-")
        self.k, self.G, self.gsize = k, G, gsize
        self.now = 0.0
        self._open()
        self.versions: dict[str, int] = {}  # accepted group -> oldest version of its rows
        self.acked: dict[str, str] = {}  # group -> the lease that consumed it
        self.dropped: set[str] = set()
        self.leases: dict[str, list[str]] = {}  # leases handed out, not yet acked by us
        self.tickets: dict[str, list] = {"p0": [], "p1": []}
        self.n = 0

    def _open(self):
        self.spool = Spool(self.dir, fsync="never")
        self.state = new_state(k=self.k, G=self.G, journal=self.spool, lease_timeout_s=10, ticket_timeout_s=15)
        rec = self.spool.recover()
        self.state.restore(rec.batches, rec.records, self.now)
        real_drop = self.spool.on_drop

        def on_drop(reason, gids):
            assert reason == "stale"
            self.dropped.update(gids)
            real_drop(reason, gids)

        self.spool.on_drop = on_drop

    def teardown(self):
        if hasattr(self, "spool"):
            self.spool.close()
            shutil.rmtree(self.dir, ignore_errors=True)

    @rule(p=st.sampled_from(["p0", "p1"]), n=st.integers(1, 3))
    def acquire(self, p, n):
        got = self.state.acquire(p, n, self.now)
        for t in got:
            assert t.step <= self.state.version + self.k + 1
        self.tickets[p] += got

    @rule(p=st.sampled_from(["p0", "p1"]), lag=st.integers(0, 3), groups=st.integers(1, 2))
    def produce(self, p, lag, groups):
        step = self.tickets[p][0].step if self.tickets[p] else self.state.version + 1
        gids = [f"g{self.n + i}" for i in range(groups)]
        self.n += groups
        version = max(0, self.state.version - lag)
        try:
            accepted, _, _ = self.state.accept(
                p, make_groups(gids, step=step, version=version, group_size=self.gsize), self.now
            )
        except BrokerError as e:
            assert e.code == ErrorCode.NO_TICKET
            return
        assert accepted == groups
        del self.tickets[p][:groups]
        self.versions.update({g: version for g in gids})

    @precondition(lambda self: self.versions)
    @rule(data=st.data())
    def repush(self, data):
        gid = data.draw(st.sampled_from(sorted(self.versions)))
        got = self.state.accept(
            "p0", make_groups([gid], step=1, version=self.versions[gid], group_size=self.gsize), self.now
        )
        assert got == (0, 0, 1)

    @precondition(lambda self: len(self.versions) >= 2)
    @rule(data=st.data())
    def repush_several(self, data):
        """A push of several groups already accepted (pending, acked or dropped) stores none."""
        gids = data.draw(st.lists(st.sampled_from(sorted(self.versions)), min_size=2, max_size=3, unique=True))
        batch = pa.concat_batches(
            [make_groups([g], step=1, version=self.versions[g], group_size=self.gsize) for g in gids]
        )
        assert self.state.accept("p0", batch, self.now) == (0, 0, len(gids))

    @rule(c=st.sampled_from(["c0", "c1"]), ahead=st.integers(0, 2))
    def consume(self, c, ahead):
        step = self.state.version + 1 + ahead
        if ahead > self.k and not self.state.has_lease(c, step):
            with pytest.raises(BrokerError) as e:  # outside the admission window
                self.state.lease(c, step, self.now)
            assert e.value.code == ErrorCode.STEP_AHEAD
            return
        lease = self.state.lease(c, step, self.now)
        if lease is None:
            return
        assert len(lease.group_ids) == self.G
        for gid in lease.group_ids:
            assert (step - 1) - self.versions[gid] <= self.k, "(a) a consumed group violates the bound"
            assert gid not in self.acked
        assert int(lease.staleness.max()) <= self.k
        self.leases[lease.lease_id] = lease.group_ids

    @precondition(lambda self: self.leases)
    @rule(data=st.data())
    def ack(self, data):
        lid = data.draw(st.sampled_from(sorted(self.leases)))
        gids = self.leases.pop(lid)
        try:
            dup, _late = self.state.ack(lid, self.now)
        except BrokerError as e:
            assert e.code == ErrorCode.LEASE_EXPIRED
            return
        if dup:
            assert all(self.acked.get(g) == lid for g in gids)
            return
        for g in gids:
            assert g not in self.acked, "(c) a trajectory was consumed by two steps"
            assert g not in self.dropped
            self.acked[g] = lid

    @rule(v=st.integers(0, 2))
    def version_bump(self, v):
        self.state.set_version(self.state.version + v)

    @rule(dt=st.sampled_from([0.5, 3.0, 11.0, 16.0]))
    def time_passes(self, dt):  # 11 s: consumers that did not ack are dead; 16 s: ticket holders too
        self.now += dt
        self.state.tick(self.now)

    @rule()
    def restart(self):
        self.spool.close()
        self._open()
        self.tickets = {"p0": [], "p1": []}  # tickets are not durable; pushes may still find room

    @invariant()
    def nothing_lost(self):
        if not hasattr(self, "state"):
            return
        pending = set(self.state.pending)
        done = set(self.acked) | self.dropped
        assert pending | done == set(self.versions), "(b) an accepted trajectory went missing"
        assert not pending & done
        assert not set(self.acked) & self.dropped

    def drain(self):
        """At the end every pending group is acked or dropped: nothing sits forever."""
        self.now += 100
        self.state.tick(self.now)
        while True:
            lease = self.state.lease("final", self.state.version + 1, self.now)
            if lease is None:
                break
            self.leases[lease.lease_id] = lease.group_ids
            for g in lease.group_ids:
                assert g not in self.acked
                self.acked[g] = lease.lease_id
            self.state.ack(lease.lease_id, self.now)
        top = self.state.version + self.k + 10 + max(self.versions.values(), default=0)
        self.state.set_version(top - 1)
        self.state.lease("final", top, self.now)
        assert not self.state.pending
        assert set(self.acked) | self.dropped == set(self.versions)


class DrainingMachine(BrokerMachine):
    def teardown(self):
        if hasattr(self, "state"):
            self.drain()
        super().teardown()


TestBrokerStateMachine = DrainingMachine.TestCase
TestBrokerStateMachine.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
