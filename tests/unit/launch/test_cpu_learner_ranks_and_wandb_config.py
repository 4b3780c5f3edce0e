"""Config of the multi-rank learner (learner.cpu_processes) and of W&B logging (run.wandb)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from core.configbase import ConfigError
from launch.config import load_run_config

REPO = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.timeout(60)


def test_defaults_one_cpu_rank_and_no_wandb():
    cfg = load_run_config("tiny")
    assert cfg.learner.cpu_processes == 1 and cfg.run.wandb is None


def test_wandb_section_from_dotted_overrides():
    cfg = load_run_config("tiny", ["run.wandb.project=fleet", "run.wandb.mode=offline", "run.wandb.tags=[a, b]"])
    w = cfg.run.wandb
    assert (w.project, w.mode, w.tags, w.entity, w.name) == ("fleet", "offline", ["a", "b"], None, None)


@pytest.mark.parametrize(
    "override, named",
    [
        ("run.wandb.mode=sometimes", "mode"),
        ("run.wandb.projct=x", "projct"),
        ("run.wandb.entity=e", "project"),  # a section without a project: the required key is named
        ("learner.cpu_processes=0", "cpu_processes"),
    ],
)
def test_bad_values_name_the_key(override, named):
    with pytest.raises(ConfigError, match=named):
        load_run_config("tiny", [override])


def test_cpu_processes_with_gpus_fails_before_anything_starts():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    p = subprocess.run(
        [
            sys.executable,
            "launch/cluster.py",
            "--rollout-gpus",
            "2",
            "--learner-gpus",
            "2",
            "--recipe",
            "tiny",
            "learner.cpu_processes=2",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 2 and "learner.cpu_processes=2 is for --learner-gpus 0" in p.stderr, p.stderr
