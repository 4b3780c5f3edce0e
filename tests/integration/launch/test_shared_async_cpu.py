"""Shared asynchronous mode on CPU through launch/cluster.py (``--colocate --async``): one run.

On this machine "shared" means the learner process and the vLLM CPU server run on the same host at
once (no gate, no sleep), as they would share a GPU. The run must take the mode's own code path:
the summary and the learner log name it (mode label, no colocated gate, the host memory split, the
publish over gloo), and it must learn (eval before/after), keep the staleness bound (k = 2, read
back from the broker's spool, not from the summary alone), lose no group, generate while the learner
trains (the opposite of colocated sync's invariant, with the same window check) and leave no process.
"""

from __future__ import annotations

import json
import os

import pytest
from test_cpu_system import _learned, _overlaps, _run, check_accounting, spool_rows

# 45 steps: at 30 the eval gain over 200 prompts was +0.025 to +0.08 across five runs here (2026-12-07; one
# fresh-clone run fell under the +0.04 that _learned asks), at 45 +0.085 and +0.125, for ~25 s more
STEPS = int(os.environ.get("FLEETRL_SHARED_ASYNC_TEST_STEPS", "45"))
K = 2
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("cpu-shared-async")
    out = _run(
        run_dir,
        [f"broker.max_staleness={K}", f"broker.spool_dir={run_dir / 'spool'}", "run.eval_every=0"],
        steps=STEPS,
        flags=("--colocate", "--async"),
    )
    out["spool"] = spool_rows(run_dir / "spool", run_dir / "spool.parquet")
    return out


def test_shared_async_run_is_the_mode_that_ran(run):
    assert run["rc"] == 0, run["out"][-4000:]
    s = run["summary"]
    assert s["mode"] == "shared-async" and "colocated" not in s
    (split,) = s["memory_split"]
    assert split["device"] == "host (CPU)" and split["engine_fraction"] + split["learner_fraction"] <= 1
    logs = run["run_dir"] / "logs"
    fleet_log = (logs / "fleet.log").read_text()
    assert "colocated mode: synchronous" not in fleet_log  # no gate
    learner_log = (logs / "learner.log").read_text()
    assert "weight sync: backend gloo" in learner_log and "CUDA IPC" not in learner_log


def test_shared_async_learns_within_the_bound_and_loses_nothing(run):
    s = run["summary"]
    assert s["steps"] == STEPS and s["simulated"] is False
    assert s["max_staleness"] == K and s["max_staleness_seen"] <= K and s["bound_violations"] == 0
    assert s["groups_lost"] == 0
    assert run["spool"], "no spool rows"
    check_accounting(s, run["spool"], K)
    _learned(s)


def test_fleet_generates_while_the_learner_trains(run):
    rows = [json.loads(x) for x in (run["run_dir"] / "metrics" / "learner_steps.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert len(_overlaps(rows)) >= STEPS // 2  # colocated sync has none (test_cpu_system.py)
    assert any(r["staleness_max_versions"] >= 1 for r in rows)
    b = run["summary"]["busy"]
    # both sides measured in the learner's window; on a shared host the overlap is real time both worked
    assert 0 < b["training_busy_fraction"] < 1 and 0 < b["generation_busy_fraction"] <= 1
    assert b["overlap_fraction"] > 0 and b["training_gpu_busy_fraction"] is None  # CPU: no CUDA events
    assert b["steps_per_s"] == pytest.approx(STEPS / b["window_s"], rel=1e-3)  # rounded to 5 digits


def test_no_process_left_behind(run):
    assert not run["left"], run["left"]
