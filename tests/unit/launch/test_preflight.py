"""Checks before anything starts (launch/preflight.py and the config): what used to break a first run
27-30 s in now stops the launcher at once with exit code 2 and a message that says what to change."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from launch.cluster import main
from launch.config import load_run_config
from launch.preflight import preflight

pytestmark = pytest.mark.timeout(120)


def _run(capsys, *args: str) -> tuple[int, str]:
    rc = main(["--rollout-gpus", "0", "--learner-gpus", "0", "--recipe", "tiny", *args])
    return rc, capsys.readouterr().err


def test_prompt_plus_response_over_the_model_length_names_the_longest_prompt(capsys):
    rc, err = _run(capsys, "rollout.max_model_len=16", "rollout.sampling.max_tokens=10")
    assert rc == 2
    assert "prompts too long for rollout.max_model_len=16 - rollout.sampling.max_tokens=10 = 6 tokens" in err
    assert "data/addition/train.parquet:" in err and "the longest row" in err
    assert "raise rollout.max_model_len to at least" in err and "data.filter_overlong_prompts=true" in err


def test_filter_overlong_prompts_skips_and_counts_them():
    cfg = load_run_config(
        "tiny", ["rollout.max_model_len=16", "rollout.sampling.max_tokens=10", "data.filter_overlong_prompts=true"]
    )
    counts = preflight(cfg)
    rows = pq.ParquetFile(cfg.data.train_files[0]).metadata.num_rows
    assert counts["train_skipped_overlong"] > 0 and counts["train"] > 0
    assert counts["train"] + counts["train_skipped_overlong"] == rows  # every row kept or counted


def test_one_sample_per_prompt_and_missing_test_files_stop_the_launcher(capsys):
    rc, err = _run(capsys, "rollout.sampling.n=1")
    assert rc == 2 and "rollout.sampling.n=1: GRPO scores each sample against the others" in err
    rc, err = _run(capsys, "data.test_files=[]")
    assert rc == 2 and "data.test_files is empty but the run evaluates" in err


def test_default_reward_without_a_scorer_for_the_data_source(tmp_path, capsys):
    rows = [
        {
            "prompt": [{"role": "user", "content": "1+1="}],
            "reward_model": {"ground_truth": "2"},
            "data_source": "my/new_task",
        }
    ]
    path = tmp_path / "t.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    rc, err = _run(capsys, f"data.train_files=[{path}]", f"data.test_files=[{path}]", "reward.function=default")
    assert rc == 2 and "'default' has no scorer for data_source 'my/new_task'" in err


def test_a_reward_function_that_does_not_import_stops_the_launcher(capsys):
    rc, err = _run(capsys, "reward.function=no_such_module_xyz:score")
    assert rc == 2 and "cannot import module 'no_such_module_xyz'" in err
