"""Evaluation of the current policy through the fleet: accuracy on the test split with the run's reward.

Engine-independent (any fleet of :class:`rollout_fleet.controller.FleetController`); multi-turn runs
(``rollout.env``) evaluate in :func:`rollout_fleet.envs.registry.evaluate_episodes` instead.
"""

from __future__ import annotations

import asyncio

from engines.base import SamplingParams
from rollout_fleet.prompts_and_rewards import PoolRewards, reward_pool
from rollout_fleet.worker import Prompt


async def evaluate(cfg, fleet, n: int) -> float | None:
    """Accuracy (the configured reward, as in training) on the first ``n`` test prompts, spread over the
    fleet, sampled as ``rollout.eval_sampling`` says (greedy by default; with ``eval_sampling.n`` > 1 the
    mean over each prompt's samples); None when there is nothing to evaluate (no test files, ``n`` = 0)."""
    from rollout_fleet import data as rdata

    if n <= 0 or not cfg.data.test_files:
        return None
    tok = rdata.load_tokenizer(cfg.model.path)
    ds = rdata.from_config(
        cfg.data,
        tok,
        seed=cfg.run.seed,
        split="test",
        response_tokens=cfg.rollout.sampling.max_tokens,
        max_model_len=cfg.rollout.max_model_len,
    )
    rows = [ds.next() for _ in range(min(n, len(ds)))]
    ev = cfg.rollout.eval_sampling
    params = SamplingParams(
        n=ev.n,
        max_tokens=cfg.rollout.sampling.max_tokens,
        temperature=ev.effective_temperature,
        top_p=ev.top_p,
        top_k=ev.top_k,
    )
    scorer = PoolRewards(reward_pool(cfg, workers=1), tok)  # accuracy: a truncated answer is scored as it is
    sem = asyncio.Semaphore(64)
    # only servers at the newest weights present: one that just joined (version 0 until its first
    # publish) must not answer for the trained policy
    newest = max((s.engine.weight_version for s in fleet.servers.values() if s.state == "healthy"), default=0)

    async def one(i: int, row) -> float:
        async with sem:
            _, samples = await fleet.run_group(f"eval-{i}", row.prompt_ids.tolist(), params, min_version=newest)
        p = Prompt(prompt_ids=[], ground_truth=row.ground_truth, data_source=row.data_source, extra_info=row.extra_info)
        scores = await scorer.score(p, samples)
        return sum(scores) / len(scores)

    try:
        scores = await asyncio.gather(*(one(i, r) for i, r in enumerate(rows)))
    finally:
        scorer.pool.close()
    return sum(scores) / len(scores)
