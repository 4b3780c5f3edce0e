"""``launch/cluster.py --dry-run --nodes ...``: the plan a run would place, printed without starting anything."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from launch.config import load_run_config
from launch.dry_run import described_nodes, plan

REPO = Path(__file__).resolve().parents[3]


def test_plan_for_a_described_cluster_keeps_roles_apart_and_tp_inside_a_node():
    cfg = load_run_config("tiny", ["rollout.tensor_parallel_size=2"])
    out = plan(cfg, described_nodes("8,8,8,8"), {}, rollout_gpus=16, learner_gpus=16, address="10.213.0.1:6379")
    assert [s["node"] for s in out["learner"]] == ["n0", "n1"]
    assert len(out["servers"]) == 8 and {s["node"] for s in out["servers"]} == {"n2", "n3"}
    assert all(len(s["gpus"]) == 2 for s in out["servers"])
    used = [(s["node"], g) for s in out["learner"] + out["servers"] for g in s["gpus"]]
    assert len(used) == len(set(used)) == 32


def test_cli_prints_json_and_refuses_what_does_not_fit():
    cmd = [
        sys.executable,
        "launch/cluster.py",
        "--dry-run",
        "--nodes",
        "2,2,2",
        "--rollout-gpus",
        "4",
        "--learner-gpus",
        "2",
        "--json-plan",
        "network.host=127.0.0.1",
    ]
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert [s["node"] for s in out["servers"]] == ["n1", "n1", "n2", "n2"] and out["curve_zmq"] is False
    p = subprocess.run(
        cmd[:3] + ["--nodes", "1,1", "--rollout-gpus", "4", "--learner-gpus", "2"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 2 and "but the cluster has 2" in p.stderr


def test_nodes_spec_is_checked():
    with pytest.raises(ValueError, match="GPUs per node"):
        described_nodes("8,x")
