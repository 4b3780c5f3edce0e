"""Megatron layout checks: every violation is a clear error before any process starts (CPU)."""

import subprocess
import sys
from pathlib import Path

import pytest

from core.configbase import ConfigError
from learner.config import MegatronConfig

REPO = Path(__file__).resolve().parents[3]
QWEN_05B = {"num_attention_heads": 14, "num_key_value_heads": 2, "num_hidden_layers": 24}


def test_valid_layouts_pass():
    MegatronConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2).check_layout(8, QWEN_05B)
    MegatronConfig(tensor_model_parallel_size=1, pipeline_model_parallel_size=4).check_layout(4, QWEN_05B)


@pytest.mark.parametrize(
    ("tp", "pp", "gpus", "sp", "needle"),
    [
        (2, 2, 6, False, "2 x 2 = 4 does not divide --learner-gpus 6"),
        (4, 1, 4, False, "does not divide the model's 14 attention heads"),
        (4, 1, 4, False, "does not divide the model's 2 key/value heads"),
        (1, 5, 5, False, "pipeline_model_parallel_size=5 does not divide the model's 24 layers"),
        (1, 1, 1, True, "sequence_parallel=true needs tensor_model_parallel_size > 1"),
        (1, 1, 0, False, "needs GPUs, but --learner-gpus is 0"),
    ],
)
def test_each_violation_is_named(tp, pp, gpus, sp, needle):
    cfg = MegatronConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, sequence_parallel=sp)
    with pytest.raises(ConfigError) as e:
        cfg.check_layout(gpus, QWEN_05B)
    assert needle in str(e.value)


def test_launcher_rejects_a_bad_layout_before_starting_anything():
    p = subprocess.run(
        [
            sys.executable,
            "launch/cluster.py",
            "--learner-gpus",
            "3",
            "--rollout-gpus",
            "1",
            "learner.engine=megatron",
            "learner.megatron.tensor_model_parallel_size=2",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 2
    assert "2 x 1 = 2 does not divide --learner-gpus 3" in p.stderr
    assert "Ray" not in p.stderr  # nothing was started
