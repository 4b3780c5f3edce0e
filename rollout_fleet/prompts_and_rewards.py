"""The worker's prompt source and reward scorer in a real run: the Parquet dataset and the reward pool.

Adapters between the rollout worker (:mod:`rollout_fleet.worker`'s ``PromptSource`` and scorer) and the
pieces that hold the data: :class:`DatasetPrompts` wraps :class:`rollout_fleet.data.PromptDataset`,
:class:`PoolRewards` wraps :class:`rollout_fleet.rewards.RewardPool`; :func:`load_data` builds both from the
run config. Engine-independent: the same for vLLM and SGLang fleets (:mod:`rollout_fleet.service`).
"""

from __future__ import annotations

from typing import Any

from engines.base import Sample
from rollout_fleet.rewards import RewardError
from rollout_fleet.worker import Prompt, RewardFailed


class DatasetPrompts:
    """PromptDataset (shuffled epochs, checkpointable position) as the worker's PromptSource."""

    def __init__(self, dataset) -> None:
        self.ds = dataset

    def next(self) -> Prompt:
        row = self.ds.next()
        return Prompt(
            prompt_ids=row.prompt_ids.tolist(),
            ground_truth=row.ground_truth,
            data_source=row.data_source,
            extra_info=row.extra_info,
            max_tokens=row.max_tokens,
        )

    def state_dict(self) -> dict[str, Any]:
        return self.ds.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ds.load_state_dict(state)


class PoolRewards:
    """Decodes responses and scores them in the RewardPool (threads/processes off the event loop).

    The reward function sees the row's ``data_source`` and ``extra_info`` besides the ground
    truth. A truncated response (finish reason ``length``) is scored, or with
    ``on_truncated="penalize"`` given ``truncated_reward`` instead (``mask``: scored, and the
    learner leaves it out of the loss).
    """

    def __init__(self, pool, tokenizer, *, on_truncated: str = "score", truncated_reward: float = 0.0) -> None:
        self.pool, self.tok = pool, tokenizer
        self.on_truncated, self.truncated_reward = on_truncated, truncated_reward

    def text(self, s: Sample) -> str:
        return self.tok.decode(s.token_ids.tolist(), skip_special_tokens=True)

    async def score(self, prompt: Prompt, samples: list[Sample]) -> list[float]:
        extra = {"data_source": prompt.data_source, "extra_info": prompt.extra_info}
        items = [(self.text(s), prompt.ground_truth, f"sample {i}", extra) for i, s in enumerate(samples)]
        if self.pool.batched:
            try:
                out = list(await self.pool.score_batch(items))
            except RewardError as err:
                raise RewardFailed(f"batched reward failed for the group: {err}") from err
        else:
            out = await self.pool.score_many(items)
        bad = [r for r in out if not isinstance(r, float | int)]
        if bad:
            # never train on a made-up reward: the group is dropped and counted by the worker
            raise RewardFailed(f"reward failed for {len(bad)} of {len(out)} samples: {bad[0]}")
        if self.on_truncated == "penalize":
            out = [
                self.truncated_reward if s.finish_reason == "length" else r for s, r in zip(samples, out, strict=True)
            ]
        return [float(r) for r in out]


def reward_pool(cfg, workers: int | None = None):
    """The configured reward pool; ``reward.function: default`` is checked against the data's sources first."""
    from rollout_fleet.rewards import RewardPool

    r = cfg.reward
    return RewardPool(r.function, workers=workers or r.workers, timeout_s=r.timeout_s, mode=r.mode, batched=r.batched)


def check_reward_sources(cfg, *datasets) -> None:
    if cfg.reward.function == "default":
        from rollout_fleet.scorers import check_sources

        check_sources({row.data_source for ds in datasets for row in ds.rows})


def load_data(cfg) -> tuple[DatasetPrompts, PoolRewards]:
    """The training prompts (tokenized) and the reward pool."""
    from rollout_fleet import data as rdata

    if cfg.rollout.engine not in ("vllm", "sglang"):
        raise ValueError(
            f"launch/cluster.py runs rollout.engine 'vllm', 'sglang' or 'simulated'; got {cfg.rollout.engine!r}"
        )
    tok = rdata.load_tokenizer(cfg.model.path)
    ds = rdata.from_config(
        cfg.data,
        tok,
        seed=cfg.run.seed,
        response_tokens=cfg.rollout.sampling.max_tokens,
        max_model_len=cfg.rollout.max_model_len,
    )
    check_reward_sources(cfg, ds)
    return DatasetPrompts(ds), PoolRewards(
        reward_pool(cfg), tok, on_truncated=cfg.reward.on_truncated, truncated_reward=cfg.reward.truncated_reward
    )
