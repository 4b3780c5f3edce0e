"""A Ctrl-C that lands while the driver logs the learner's rows to W&B loses none of them (launch/monitor.py).

The driver's SIGINT handler raises KeyboardInterrupt wherever the driver is. A CI run (2026-12-07) had it land
in the middle of one tick's rows: steps 6-8 of that launch never reached W&B (the reader had moved past them),
step 9, read at close, did. Here a real offline W&B run takes the rows; the interrupt is raised from its
second log call, then the monitor closes as the driver's shutdown does. The driver's part runs in a fresh
interpreter, as the driver does: W&B keeps process-wide state that other tests of this pytest process touch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.launch.test_wandb_logging import history, read_wandb_records

pytest.importorskip("wandb")
REPO = Path(__file__).resolve().parents[3]

DRIVER = """
import sys
from pathlib import Path
from launch.monitor import Monitor, WandbConfig, WandbWriter

run_dir = Path(sys.argv[1])
writer = WandbWriter(WandbConfig(project="fleetrl-test", mode="offline"), run_dir, simulated=True, run_config={})
real, calls = writer.add_scalars, []

def interrupted_once(values, step):
    calls.append(step)
    if len(calls) == 2:  # the second row of the tick: as a Ctrl-C between two logs
        raise KeyboardInterrupt
    real(values, step)

writer.add_scalars = interrupted_once
mon = Monitor(run_dir, simulated=True, tensorboard=False, live=False, prometheus=False, wandb=writer, learner_rows_from=0)
try:
    mon._learner_to_wandb()
    sys.exit("no KeyboardInterrupt was raised")
except KeyboardInterrupt:
    pass
mon.close()  # the driver's shutdown: the rows not yet logged go now
print("calls", calls)
"""


def test_rows_read_before_a_ctrl_c_reach_wandb_at_close(tmp_path):
    from launch.observe import LEARNER_JSONL

    jsonl = tmp_path / LEARNER_JSONL
    jsonl.parent.mkdir(parents=True)
    rows = [{"event": "start", "step": 1, "wall_time": 0.0}]
    rows += [{"step": s, "wall_time": float(s), "metrics": {"learner/loss_total": 0.1 * s}} for s in range(1, 6)]
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_SILENT": "true"}
    env.pop("WANDB_MODE", None)
    out = subprocess.run(
        [sys.executable, "-c", DRIVER, str(tmp_path)], cwd=REPO, env=env, capture_output=True, text=True, timeout=180
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]

    (run_file,) = sorted((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    logged = {row["_step"] for row in history(read_wandb_records(run_file)) if "learner/loss_total" in row}
    assert logged == {1, 2, 3, 4, 5}, (logged, out.stdout[-1000:])
