"""The fleet's reward path (rollout_fleet/prompts_and_rewards.py): the configured pool as configured, the row's
data_source and extra_info reaching the function, and truncated responses penalised when asked."""

from __future__ import annotations

import asyncio
import textwrap
from pathlib import Path

import numpy as np
import pytest

from engines.base import Sample
from launch.config import load_run_config
from rollout_fleet.data import load_tokenizer
from rollout_fleet.prompts_and_rewards import PoolRewards, reward_pool
from rollout_fleet.worker import Prompt

pytestmark = pytest.mark.timeout(60)
REPO = Path(__file__).resolve().parents[3]

MODULE = textwrap.dedent(
    """
    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        return float(solution_str.strip() == ground_truth) + extra_info["bonus"] if data_source == "t" else -1.0
    """
)


def test_the_fleet_pool_is_the_configured_pool():
    cfg = load_run_config(
        "tiny", ["reward.mode=process", "reward.batched=true", "reward.timeout_s=7", "reward.workers=3"]
    )
    pool = reward_pool(cfg)
    try:
        assert (pool.mode, pool.batched, pool.timeout_s, pool.workers) == ("process", True, 7.0, 3)
    finally:
        pool.close()


@pytest.mark.parametrize("on_truncated", ["score", "penalize"])
def test_data_source_and_extra_info_reach_a_verl_function_and_truncation_is_penalised(tmp_path, on_truncated):
    (tmp_path / "score.py").write_text(MODULE)
    cfg = load_run_config(
        "tiny",
        [
            f"reward.function={tmp_path / 'score.py'}:compute_score",
            f"reward.on_truncated={on_truncated}",
            "reward.truncated_reward=-0.5",
        ],
    )
    tok = load_tokenizer(REPO / "models" / "tiny-adder")
    ids = lambda s: np.asarray(tok.encode(s, add_special_tokens=False), dtype=np.int32)  # noqa: E731
    samples = [
        Sample(token_ids=ids("432"), logprobs=np.zeros(3, np.float32), finish_reason="stop"),
        Sample(token_ids=ids("432"), logprobs=np.zeros(3, np.float32), finish_reason="length"),
        Sample(token_ids=ids("431"), logprobs=np.zeros(3, np.float32), finish_reason="stop"),
    ]
    scorer = PoolRewards(reward_pool(cfg), tok, on_truncated=on_truncated, truncated_reward=-0.5)
    prompt = Prompt(prompt_ids=[1], ground_truth="432", data_source="t", extra_info={"bonus": 0.25})
    try:
        got = asyncio.run(scorer.score(prompt, samples))
    finally:
        scorer.pool.close()
    assert got == [1.25, 1.25 if on_truncated == "score" else -0.5, 0.25]
