"""The whole control plane at full size, SIMULATED: 32 + 32 fake GPUs on Ray, real broker.

One run of ``launch/cluster.py --simulate`` serves every assertion: placement, admission
(the bound held), the lag view and summary, ``status`` and ``scale`` from another process
while it runs, and a clean exit with no process left behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from procs import alive, descendants

REPO = Path(__file__).resolve().parents[3]
STEPS = 300


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "launch/cluster.py", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def sim_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("simrun")
    summary = run_dir / "summary-out.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "launch/cluster.py",
        "--rollout-gpus",
        "32",
        "--learner-gpus",
        "32",
        "--simulate",
        "--max-steps",
        str(STEPS),
        "--summary",
        str(summary),
        "--run-dir",
        str(run_dir),
        "--no-live",
        "rollout.simulated.learner_step_s=0.02",
        "broker.groups_per_step=16",
    ]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: set[int] = set()
    control: dict = {}
    try:
        deadline = time.monotonic() + 180
        while not (run_dir / "control.json").exists():
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "the job never opened its control endpoint"
            seen |= descendants(proc.pid)
            time.sleep(0.5)
        seen |= descendants(proc.pid)
        st = _cli("status", "--run-dir", str(run_dir), "--json")
        control["status"] = json.loads(st.stdout) if st.returncode == 0 else st.stderr
        control["status_text"] = _cli("status", "--run-dir", str(run_dir)).stdout
        sc = _cli("scale", "--rollout-gpus", "16", "--run-dir", str(run_dir))
        control["scale_down"] = json.loads(sc.stdout) if sc.returncode == 0 else sc.stderr
        sc = _cli("scale", "--rollout-gpus", "24", "--run-dir", str(run_dir))
        control["scale_up"] = json.loads(sc.stdout) if sc.returncode == 0 else sc.stderr
        st = _cli("status", "--run-dir", str(run_dir), "--json")
        control["status_after"] = json.loads(st.stdout) if st.returncode == 0 else st.stderr
        seen |= descendants(proc.pid)
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(30)
    time.sleep(1.0)
    yield {
        "rc": proc.returncode,
        "out": out,
        "summary": json.loads(summary.read_text()),
        "control": control,
        "seen": seen,
        "run_dir": run_dir,
    }


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_simulated_run_holds_the_bound_and_reports(sim_run):
    assert sim_run["rc"] == 0, sim_run["out"][-3000:]
    s = sim_run["summary"]
    assert s["simulated"] is True and "SIMULATED" in s["note"]
    assert s["steps"] == STEPS
    assert s["max_staleness"] == 2 and 0 <= s["max_staleness_seen"] <= 2 and s["bound_violations"] == 0
    assert s["groups_consumed"] == STEPS * 16
    assert s["groups_lost"] == 0
    assert s["groups_produced"] >= s["groups_consumed"]
    assert len(s["reward_per_step"]) == STEPS
    assert sum(s["staleness_hist"].values()) == STEPS * 16 * 8  # every consumed sample is in the lag view
    assert s["eval_accuracy_before"] is None and s["eval_accuracy_after"] is None  # no model: not measured
    for key in ("groups_dropped", "wall_s", "learner_idle_fraction", "fleet_idle_fraction"):
        assert key in s


def test_status_and_scale_while_running(sim_run):
    c = sim_run["control"]
    st = c["status"]
    assert isinstance(st, dict), st
    assert st["simulated"] is True and len(st["servers"]) == 32
    assert all(x["engine_id"].startswith("sim-") for x in st["servers"])
    assert "staleness histogram" in c["status_text"] and "SIMULATED" in c["status_text"]
    assert c["scale_down"] == {"ok": True, "servers_before": 32, "servers_after": 16}, c["scale_down"]
    # a grow answers at once with what it started; those servers are listed (starting, then healthy)
    up = c["scale_up"]
    assert {k: up[k] for k in ("ok", "servers_before", "servers_after")} == {
        "ok": True,
        "servers_before": 16,
        "servers_after": 24,
    }, up
    assert len(up["starting"]) == 8 and all(x.startswith("sim-") for x in up["starting"]), up
    assert len(c["status_after"]["servers"]) == 24
    assert {x["state"] for x in c["status_after"]["servers"]} <= {"healthy", "starting"}
    assert [e["ok"] for e in sim_run["summary"]["scale_starts"]] == [True]


def test_lag_view_and_metrics_populated(sim_run):
    run_dir = sim_run["run_dir"]
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert json.loads((run_dir / "metrics.json").read_text())["prometheus"].startswith("http://127.0.0.1:")
    log = (run_dir / "logs" / "fleet.log").read_text().splitlines()
    assert log and all("[SIMULATED]" in line for line in log)


def test_no_process_left_behind(sim_run):
    assert sim_run["seen"], "no child process was observed"
    left = alive(sim_run["seen"])
    assert not left, [psutil.Process(p).cmdline() for p in left]
    assert not (sim_run["run_dir"] / "control.json").exists()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ctrl_c_shuts_everything_down(tmp_path):
    """SIGINT (Ctrl-C) mid-run: a summary marked interrupted, and no process or control file left."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "launch/cluster.py",
        "--rollout-gpus",
        "8",
        "--learner-gpus",
        "8",
        "--simulate",
        "--max-steps",
        "100000",
        "--summary",
        str(tmp_path / "s.json"),
        "--run-dir",
        str(tmp_path),
        "--no-live",
    ]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: set[int] = set()
    try:
        deadline = time.monotonic() + 180
        while True:
            seen |= descendants(proc.pid)
            st = _cli("status", "--run-dir", str(tmp_path), "--json") if (tmp_path / "control.json").exists() else None
            if st is not None and st.returncode == 0 and json.loads(st.stdout)["step"] >= 5:
                break
            assert proc.poll() is None and time.monotonic() < deadline, "the job did not get to step 5"
            time.sleep(0.5)
        seen |= descendants(proc.pid)
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130
    s = json.loads((tmp_path / "s.json").read_text())
    assert s["error"] == "interrupted" and s["steps"] >= 5 and s["groups_lost"] == 0
    time.sleep(1.0)
    left = alive(seen)
    assert seen and not left, [psutil.Process(p).cmdline() for p in left]
    assert not (tmp_path / "control.json").exists()
