"""``kill -9`` of the fleet actor (the Ray actor of the controller and the rollout workers) in a SIMULATED
launcher run: Ray restarts it, the driver starts it again at the learner's version
(launch/fleet_recovery.py), and the run finishes every step with the bound held, nothing lost and no
process left. The same recovery with vLLM CPU servers is exercised by the chaos soak (tests/chaos/).
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
STEPS = 60
pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]  # a Ray start and a launcher run: about 25 s


def _fleet_actor(driver: int) -> int | None:
    for p in psutil.Process(driver).children(recursive=True):
        try:
            if "ray::FleetActor" in " ".join(p.cmdline()):
                return p.pid
        except psutil.Error:
            pass
    return None


def _status(run_dir: Path) -> dict | None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run(
        [sys.executable, "launch/cluster.py", "status", "--run-dir", str(run_dir), "--json"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return json.loads(r.stdout) if r.returncode == 0 else None


def test_a_killed_fleet_actor_is_restarted_and_the_run_finishes(tmp_path):
    run_dir = tmp_path / "run"
    summary = tmp_path / "summary.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "launch/cluster.py",
        "--rollout-gpus",
        "2",
        "--learner-gpus",
        "1",
        "--simulate",
        "--max-steps",
        str(STEPS),
        "--summary",
        str(summary),
        "--run-dir",
        str(run_dir),
        "--no-live",
        "rollout.simulated.learner_step_s=0.1",
        "broker.groups_per_step=4",
        "broker.max_staleness=1",
    ]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: set[int] = set()
    killed = None
    try:
        deadline = time.monotonic() + 240
        while killed is None and time.monotonic() < deadline and proc.poll() is None:
            seen |= descendants(proc.pid)
            st = _status(run_dir) if (run_dir / "control.json").exists() else None
            if st is not None and 3 <= st["step"] < STEPS - 20:
                killed = {"pid": _fleet_actor(proc.pid), "step": st["step"]}
                assert killed["pid"] is not None, "no fleet actor process found"
                os.kill(killed["pid"], signal.SIGKILL)
            time.sleep(0.5)
        assert killed is not None, "the run never reached step 3 with room left for the kill"
        while proc.poll() is None and time.monotonic() < deadline + 120:
            seen |= descendants(proc.pid)
            time.sleep(0.5)
        out = proc.communicate(timeout=30)[0]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(60)
    assert proc.returncode == 0, out[-4000:]
    s = json.loads(summary.read_text())
    assert s["steps"] == STEPS and s["groups_lost"] == 0 and s["bound_violations"] == 0, s
    assert s["max_staleness_seen"] <= 1
    log = (run_dir / "logs" / "driver.log").read_text()
    assert "fleet actor died" in log and "fleet back in service" in log, log[-3000:]
    assert s["fleet_restarts"][0]["back_s"] > 0, s["fleet_restarts"]
    assert killed["pid"] not in {p.pid for p in psutil.process_iter()} or not alive([killed["pid"]])
    time.sleep(2.0)
    assert not alive(seen), [" ".join(psutil.Process(p).cmdline())[:150] for p in alive(seen)]
