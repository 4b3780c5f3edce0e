"""From ``rollout.env`` to the multi-turn worker's parts, and the greedy episode evaluation of a run."""

from __future__ import annotations

import asyncio
from typing import Any

from engines.base import Sample, SamplingParams
from rollout_fleet.config import EnvConfig
from rollout_fleet.envs.base import EnvFactory, EpisodeLimits, HFCodec
from rollout_fleet.envs.chain_addition import ChainAdditionEnv
from rollout_fleet.envs.episode import run_episode
from rollout_fleet.envs.tools import calculator_env


def env_factory(cfg: EnvConfig) -> EnvFactory:
    if cfg.name == "chain_addition":
        return ChainAdditionEnv
    if cfg.name == "calculator":
        return calculator_env
    raise ValueError(f"rollout.env.name {cfg.name!r} is not known (chain_addition, calculator)")


def limits(cfg: EnvConfig) -> EpisodeLimits:
    return EpisodeLimits(
        max_turns=cfg.max_turns,
        max_tokens=cfg.max_tokens,
        turn_max_tokens=cfg.turn_max_tokens,
        wall_time_s=cfg.wall_time_s,
        env_timeout_s=cfg.env_timeout_s,
    )


def stop_token_ids(tokenizer: Any) -> list[int]:
    """The end-of-turn tokens: ChatML's ``<|im_end|>`` when the vocabulary has it, and EOS."""
    ids = []
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in tokenizer.get_vocab() else None
    for t in (im_end, tokenizer.eos_token_id):
        if t is not None and t not in ids:
            ids.append(int(t))
    return ids


def worker_kwargs(cfg: EnvConfig, model_path: str) -> dict[str, Any]:
    """The keyword arguments :class:`rollout_fleet.envs.worker.MultiTurnWorker` adds to the worker's."""
    codec = HFCodec.from_pretrained(model_path)
    return {
        "env_factory": env_factory(cfg),
        "codec": codec,
        "limits": limits(cfg),
        "stop_token_ids": stop_token_ids(codec.tokenizer),
    }


async def evaluate_episodes(cfg: Any, fleet: Any, n: int) -> float | None:
    """Mean reward of greedy episodes on the first ``n`` test prompts (None without test files)."""
    from rollout_fleet import data as rdata

    if n <= 0 or not cfg.data.test_files:
        return None
    kw = worker_kwargs(cfg.rollout.env, cfg.model.path)
    ds = rdata.from_config(
        cfg.data,
        kw["codec"].tokenizer,
        seed=cfg.run.seed,
        split="test",
        response_tokens=cfg.rollout.sampling.max_tokens,
        max_model_len=cfg.rollout.max_model_len,
    )
    rows = [ds.next() for _ in range(min(n, len(ds)))]
    sem = asyncio.Semaphore(64)

    async def one(i: int, row) -> float:
        turn = iter(range(1 << 30))

        async def generate(context: list[int], params: SamplingParams, min_version: int) -> tuple[str, Sample]:
            engine_id, (s,) = await fleet.run_group(f"eval-{i}/t{next(turn)}", context, params, min_version)
            return engine_id, s

        async with sem:
            ep = await run_episode(
                generate,
                kw["env_factory"](),
                kw["codec"],
                row.prompt_ids.tolist(),
                ground_truth=row.ground_truth,
                extra_info=row.extra_info,
                limits=kw["limits"],
                temperature=0.0,
                stop_token_ids=kw["stop_token_ids"],
            )
        return ep.reward

    scores = await asyncio.gather(*(one(i, r) for i, r in enumerate(rows)))
    return sum(scores) / len(scores)
