"""bench/e2e.py end to end on CPU, one short case: it runs launch/cluster.py, collects the run's summary
and per-step learner log, and writes the JSON and the PNG; no process outlives it.

One case keeps the test inside its time budget (each case is a vLLM CPU start, 40-80 s): the
colocated case runs in test_cpu_system.py (run B), and the analysis across cases (target, time to
target, headline) is checked on made-up runs in tests/unit/launch/test_colocated.py.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from procs import alive, descendants

REPO = Path(__file__).resolve().parents[3]
STEPS = 5
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture
def out_dir():
    # short: vLLM binds ipc sockets under the run directory (sun_path holds 107 characters)
    d = Path(tempfile.mkdtemp(prefix="e2e-", dir="/tmp"))
    yield d / "e2e"
    shutil.rmtree(d, ignore_errors=True)


def test_e2e_bench_runs_a_case_and_writes_json_and_png(out_dir):
    out = out_dir
    cmd = [
        sys.executable,
        "bench/e2e.py",
        "--out-dir",
        str(out),
        "--cases",
        "async_k1",
        "--steps",
        str(STEPS),
        "--eval-every",
        "2",
        "--eval-samples",
        "50",
        "--correction",
        "tis",
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env={
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        },
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    seen: set[int] = set()
    try:
        while proc.poll() is None:
            seen |= descendants(proc.pid)
            time.sleep(1.0)
        text = proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    time.sleep(2.0)
    left = alive(seen)
    assert proc.returncode == 0, text[-3000:] + (out / "async_k1_s0.log").read_text()[-3000:]
    assert not left, left
    res = json.loads((out / "e2e.json").read_text())
    assert res["failed"] == {} and res["steps"] == STEPS
    r = res["runs"]["async_k1_s0"]
    assert r["steps"] == STEPS
    # before, the evaluations during the run (every 2 steps, one at a time), after; learner wall time grows
    steps = [p["step"] for p in r["curve"]]
    assert steps[0] == 0 and steps[-1] == STEPS and len(steps) >= 3 and steps == sorted(steps), steps
    ts = [p["t"] for p in r["curve"]]
    assert ts == sorted(ts) and ts[-1] == pytest.approx(r["learner_wall_s"], abs=0.005) and ts[-1] > 0  # rounded
    assert all(0.0 <= p["accuracy"] <= 1.0 for p in r["curve"])
    assert r["staleness_max"] <= 1 and 0.0 <= r["staleness_mean"] <= 1.0
    assert len(r["mismatch_kl_k3_per_step"]) == STEPS and all(math.isfinite(x) for x in r["mismatch_kl_k3_per_step"])
    for k in ("samples_per_s", "generated_tok_per_s", "learner_tok_per_s"):
        assert r[k] > 0, k
    # the sample budget (the wall is rounded to 0.01 s of several seconds: 1 % covers it)
    assert r["samples_per_s"] * r["learner_wall_s"] == pytest.approx(STEPS * 32 * 8, rel=0.01)
    # no colocated case: no target, no headline (said, not made up)
    assert res["per_seed"]["0"]["target_accuracy"] is None and res["headline"]["mean"] is None
    assert (out / "e2e.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
