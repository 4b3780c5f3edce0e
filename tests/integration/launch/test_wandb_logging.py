"""W&B logging from the driver, offline (``WANDB_MODE=offline``, no network), on a short SIMULATED run.

The run's ``.wandb`` file is read back record by record (W&B's log format: a 7-byte file
header, then 32 KiB blocks of records with a 7-byte header each, every record a
``wandb_internal_pb2.Record`` protobuf), so the test sees exactly what would be synced.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from procs import alive, descendants

REPO = Path(__file__).resolve().parents[3]
STEPS = 20
BLOCK = 32768
HEADER = struct.Struct("<IHB")  # checksum, length, type
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def read_wandb_records(path: Path) -> list:
    """Every protobuf Record in a ``run-*.wandb`` file."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B log (header {data[:7]!r})"
    pos, out, parts = 7, [], []
    while pos + HEADER.size <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER.size:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = HEADER.unpack_from(data, pos)
        if kind == 0 and length == 0:  # zero padding at the end of a block
            pos += left
            continue
        pos += HEADER.size
        parts.append(data[pos : pos + length])
        pos += length
        if kind in (FULL, LAST):
            rec = pb.Record()
            rec.ParseFromString(b"".join(parts))
            out.append(rec)
            parts = []
    return out


def history(records: list) -> list[dict]:
    rows = []
    for r in records:
        if r.WhichOneof("record_type") == "history":
            rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item})
    return rows


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_simulated_run_logs_its_scalars_to_wandb_offline(tmp_path):
    pytest.importorskip("wandb")
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
    }
    env.pop("WANDB_API_KEY", None)
    cmd = [
        sys.executable,
        "launch/cluster.py",
        "--rollout-gpus",
        "2",
        "--learner-gpus",
        "2",
        "--simulate",
        "--max-steps",
        str(STEPS),
        "--summary",
        str(tmp_path / "s.json"),
        "--run-dir",
        str(tmp_path),
        "--no-live",
        "rollout.simulated.learner_step_s=0.05",
        "broker.groups_per_step=4",
        "run.wandb.project=fleetrl-test",
        "run.wandb.name=sim-wandb",
    ]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: set[int] = set()
    try:
        while proc.poll() is None:
            seen |= descendants(proc.pid)
            time.sleep(0.3)
        out = proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:]
    assert json.loads((tmp_path / "s.json").read_text())["steps"] == STEPS

    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, f"expected one offline W&B run (one per job), found {runs}"
    records = read_wandb_records(runs[0])
    kinds = {r.WhichOneof("record_type") for r in records}
    assert {"run", "history", "exit"} <= kinds, kinds  # opened, logged, finished (wandb.finish)
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert run.project == "fleetrl-test" and run.display_name == "sim-wandb" and "SIMULATED" in run.tags

    rows = history(records)
    keys = set().union(*rows)
    # the scalars TensorBoard gets, under the same names (SIMULATED runs carry the prefix)
    for k in (
        "simulated/learner/step",
        "simulated/learner/idle_fraction",
        "simulated/rollout/servers",
        "simulated/rollout/tokens_per_s",
        "simulated/broker/queue_groups",
        "simulated/rollout/staleness_max_versions",
    ):
        assert k in keys, f"{k} missing from the W&B history (keys {sorted(keys)})"
    steps = [row["_step"] for row in rows]
    assert steps == sorted(steps) and len(set(steps)) == len(steps)
    assert max(row.get("simulated/learner/step", 0) for row in rows) == STEPS
    assert all(row["simulated/rollout/servers"] == 2 for row in rows if "simulated/rollout/servers" in row)

    time.sleep(1.0)  # the W&B service process ends with the driver
    left = alive(seen)
    assert not left, [psutil.Process(p).cmdline() for p in left]
