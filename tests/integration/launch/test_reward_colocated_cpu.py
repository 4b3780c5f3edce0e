"""A colocated run (``--colocate``, CPU) with a reward server of its own (``reward.model.server.colocated``): the
launcher starts one vLLM CPU judge (the tiny model, serving ``tiny-judge``), waits until it is healthy, and only
then starts the rollout server (two vLLM servers never start side by side on a shared device). The judge's
answer is forced to YES or NO (``extra_body``: vLLM structured outputs), scored 0.95 / 0.05: rewards no
Python reward function of the run gives, so every reward in the broker's spool must be one of them.
Slow (two vLLM CPU servers, one launcher run, ~70 s on 2 cores): kept out of ``make test``'s time budget,
it runs only with ``FLEETRL_SLOW_EXTRA=1``."""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from datetime import datetime
from pathlib import Path

import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

REPO = Path(__file__).resolve().parents[3]
pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(600),
    pytest.mark.skipif(
        os.environ.get("FLEETRL_SLOW_EXTRA") != "1",
        reason="a launcher run with two vLLM CPU servers: FLEETRL_SLOW_EXTRA=1 runs it",
    ),
]
JUDGE = {
    "kind": "judge",
    "model": "tiny-judge",
    "template": "{response}+0=",
    "verdict": "(YES|NO)",
    "scores": {"YES": 0.95, "NO": 0.05},
    "max_tokens": 4,
    "timeout_s": 30,
    "extra_body": {"structured_outputs": {"choice": ["YES", "NO"]}},
    "server": {"max_model_len": 64, "enforce_eager": True, "colocated": True},
}
_T = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})")


def _when(log: Path, needle: str) -> datetime:
    for line in log.read_text().splitlines():
        if needle in line and (m := _T.match(line)):
            return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f")
    raise AssertionError(f"{needle!r} not in {log}")


def test_a_colocated_judge_starts_first_and_scores_every_sample():
    # a short run directory: vLLM's ZMQ socket paths under it must stay within 107 characters
    tmp_path = Path(tempfile.mkdtemp(prefix="rjc", dir="/tmp"))
    run = tmp_path / "run"
    cmd = [
        sys.executable,
        "launch/cluster.py",
        "--colocate",
        "--recipe",
        "tiny",
        "--max-steps",
        "3",
        "--no-live",
        "--run-dir",
        str(run),
        "--summary",
        str(tmp_path / "out.json"),
        "run.eval_samples=0",
        f"reward.model={json.dumps(JUDGE)}",
    ]
    p = subprocess.run(
        cmd,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    s = json.loads((tmp_path / "out.json").read_text())
    assert s["steps"] == 3 and s["groups_lost"] == 0 and s["colocated"]["steps_released"] == 3
    rm = s["reward_model"]
    assert rm["calls_ok"] > 0 and rm["calls_failed"] == 0 and rm["failures"] == {}
    rewards = collections.Counter()
    for f in (run / "spool").rglob("*"):
        if f.is_file():
            try:
                with pa.memory_map(str(f)) as m:
                    for b in ipc.open_stream(m):
                        rewards.update(round(x, 2) for x in b.column("reward").to_pylist())
            except (pa.ArrowInvalid, OSError):  # the spool also holds non-stream files (log.bin)
                continue
    assert rewards and set(rewards) <= {0.05, 0.95}, rewards
    placed = json.loads((run / "placement.json").read_text())["reward_servers"]
    assert len(placed) == 1 and placed[0]["gpus"] == [] and placed[0]["served_model_name"] == "tiny-judge"
    healthy = _when(run / "logs" / "driver.log", "reward server 0 healthy")
    rollout = _when(run / "logs" / "fleet.log", "vLLM server pid")
    assert healthy < rollout, (healthy, rollout)  # the judge was up before the rollout server started
