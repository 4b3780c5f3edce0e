"""``kill -9`` of the broker under the launcher, mid-run, with and without a spool (real system, tiny model).

* With ``broker.spool_dir``: the launcher restarts the broker on its spool at the same
  address; the fleet and the learner reconnect and the run finishes every step with no
  group lost and none trained twice, checked against the spool's own rows (the same
  accounting as test_cpu_system's run A).
* Without: the job says the broker's groups are gone and stops, and every process it
  started (engine server included) is gone within a bounded time.

Each run costs a vLLM CPU start (40-80 s); few steps, and after test_cpu_system in the
suite's order (files run alphabetically: this one first, then it) never two servers at once.
"""

from __future__ import annotations

import pytest
from test_cpu_system import (  # tests/integration, on sys.path under pytest
    GROUPS,
    _run,
    check_accounting,
    spool_rows,
)

STEPS = 8
EXIT_WITHIN_S = 150.0  # driver shutdown: learner, fleet (server stop), Ray; each step has its own timeout
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def with_spool(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("broker-kill-spool")
    out = _run(run_dir, ["broker.max_staleness=2", f"broker.spool_dir={run_dir / 'spool'}"], kill_at_step=3,
               kill="broker", steps=STEPS)
    out["spool"] = spool_rows(run_dir / "spool", run_dir / "spool.parquet")
    return out


@pytest.fixture(scope="module")
def without_spool(tmp_path_factory, with_spool):  # after the first: one vLLM server at a time
    # run.default_spool=false: no spool (the launcher's default puts one in the run directory)
    return _run(tmp_path_factory.mktemp("broker-kill-nospool"), ["broker.max_staleness=2", "run.default_spool=false"],
                kill_at_step=2,
                kill="broker", steps=STEPS)


def test_killed_broker_with_a_spool_is_restarted_and_the_run_loses_nothing(with_spool):
    r = with_spool
    assert r["killed"], "the broker was never killed (the run ended before step 3?)"
    assert r["rc"] == 0, r["out"][-4000:]
    s = r["summary"]
    assert s["broker_restarts"] == 1 and s["steps"] == STEPS
    assert s["groups_lost"] == 0 and s["bound_violations"] == 0
    check_accounting(s, r["spool"], k=2)
    assert s["groups_consumed"] == STEPS * GROUPS
    assert not r["left"], r["left"]


def test_killed_broker_without_a_spool_stops_the_job_and_leaves_no_process(without_spool):
    r = without_spool
    assert r["killed"], "the broker was never killed"
    assert r["rc"] == 1, r["out"][-4000:]
    assert "spool_dir is not set" in r["out"], r["out"][-2000:]
    assert r["t_exit"] - r["killed"]["t"] < EXIT_WITHIN_S, r["t_exit"] - r["killed"]["t"]
    assert not r["left"], f"processes left after the failed job: {r['left']}"
    assert r["summary"] is not None and r["summary"]["error"]
