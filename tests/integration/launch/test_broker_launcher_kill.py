"""``kill -9`` of the broker under the launcher, mid-run, without a spool (real system, tiny model): the
job says the broker's groups are gone and stops, and every process it started (engine server
included) is gone within a bounded time.

With a spool (the launcher restarts the broker on it; nothing lost, nothing trained twice) the kill
is part of test_cpu_system's run A, after its server kill: one vLLM start fewer for the suite.
"""

from __future__ import annotations

import pytest
from test_cpu_system import _run  # same folder

STEPS = 8
EXIT_WITHIN_S = 150.0  # driver shutdown: learner, fleet (server stop), Ray; each step has its own timeout
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def without_spool(tmp_path_factory):
    # run.default_spool=false: no spool (the launcher's default puts one in the run directory)
    # no evaluation: the kill is what is tested (an eval of 200 prompts cost ~50 s before the first step)
    return _run(
        tmp_path_factory.mktemp("broker-kill-nospool"),
        ["broker.max_staleness=2", "run.default_spool=false", "run.eval_samples=0"],
        kill_at_step=2,
        kill="broker",
        steps=STEPS,
    )


def test_killed_broker_without_a_spool_stops_the_job_and_leaves_no_process(without_spool):
    r = without_spool
    assert r["killed"], "the broker was never killed"
    assert r["rc"] == 1, r["out"][-4000:]
    assert "spool_dir is not set" in r["out"], r["out"][-2000:]
    assert r["t_exit"] - r["killed"]["t"] < EXIT_WITHIN_S, r["t_exit"] - r["killed"]["t"]
    assert not r["left"], f"processes left after the failed job: {r['left']}"
    assert r["summary"] is not None and r["summary"]["error"]
