"""The launcher's view of a spool when its broker is gone: pending groups count as queued, not lost."""

from __future__ import annotations

from broker.spool import Spool
from broker.state import BrokerState
from launch.broker_supervisor import engine_groups, spool_accounting
from tests.support.broker_groups import make_groups


def test_spool_accounting_counts_accepted_acked_dropped_and_pending(tmp_path):
    sp = Spool(tmp_path, fsync="never")
    s = BrokerState(
        max_staleness=1,
        groups_per_step=2,
        lease_timeout_s=10,
        ticket_timeout_s=10,
        byte_budget_bytes=1 << 30,
        journal=sp,
    )
    s.accept("w", make_groups(["a", "b"], step=1, version=0), now=0)
    s.ack(s.lease("L", 1, now=0).lease_id, now=0)
    s.accept("w", make_groups(["old"], step=2, version=0), now=0)
    s.accept("w", make_groups(["c", "d"], step=2, version=1), now=0)
    s.set_version(2)
    assert s.lease("L", 3, now=0) is not None  # 'old' is 2 behind at step 3: dropped stale
    s.accept("w", make_groups(["e"], step=3, version=2), now=0)
    sp.close()
    view = spool_accounting(tmp_path)
    assert view == {
        "groups_accepted": 6,
        "groups_acked": 2,
        "queued_groups": 3,
        "leased_groups": 0,
        "drops": {"stale": 1},
        "from_spool": True,
    }  # c, d leased (not acked) and e: pending


def test_engine_groups_are_the_server_pids_of_a_snapshot():
    snap = {"fleet_servers": [{"engine_id": "vllm-0", "pid": 123}, {"engine_id": "vllm-1", "pid": None}]}
    assert engine_groups(snap) == {123} and engine_groups({}) == set()


def test_end_engine_groups_ends_live_members_and_passes_over_zombies():
    """Two real process groups: one alive (ended), one whose leader exited unreaped (a zombie: not counted)."""
    import subprocess
    import sys
    import time

    import psutil

    from launch.broker_supervisor import end_engine_groups

    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    dead = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while psutil.Process(dead.pid).status() != psutil.STATUS_ZOMBIE:  # exited, not yet reaped by us
            assert time.monotonic() < deadline, "the short-lived child did not exit"
            time.sleep(0.05)
        found = end_engine_groups({live.pid, dead.pid}, timeout_s=10.0)
        assert found == [live.pid]
        # ended (psutil's wait reaped our child, so Popen cannot read its status: the pid is gone instead)
        live.wait(10)
        assert not psutil.pid_exists(live.pid)
    finally:
        for p in (live, dead):
            if p.poll() is None:
                p.kill()
            p.wait(10)
