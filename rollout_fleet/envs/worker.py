"""The rollout worker of multi-turn episodes: the single-turn worker's loop, one episode group per ticket.

Dataflow of one group::

    broker ticket (step s) -> prompt -> n episodes (run_episode_group), every turn a request of
    one sample through fleet.run_group (least loaded server at a version >= the turn before's;
    retried elsewhere if it dies) -> episodes -> Trajectory rows with the loss mask and
    per-turn policy versions -> Arrow batch -> broker.push

Invariants (beyond the single-turn worker's): a group is pushed whole or not at all; a group
whose episode fails is dropped and counted under its reason in ``env_errors``
(``env_step``, ``env_step_timeout``, ``wall_time``, ...), never pushed with a made-up reward.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any

import msgspec
import numpy as np

from broker.schema import Trajectory
from engines.base import Sample, SamplingParams
from rollout_fleet.envs.base import Codec, EnvError, EnvFactory, EpisodeLimits
from rollout_fleet.envs.episode import Episode, run_episode_group
from rollout_fleet.status import WorkerStatus
from rollout_fleet.worker import Prompt, RolloutWorker

log = logging.getLogger(__name__)


class MultiTurnWorker(RolloutWorker):
    """A :class:`RolloutWorker` whose groups are episodes of ``env_factory``'s environments. Example::

    worker = MultiTurnWorker(fleet, producer, prompts, None, cfg.sampling, max_inflight_groups=8,
                             env_factory=ChainAdditionEnv, codec=HFCodec.from_pretrained(m),
                             limits=EpisodeLimits(max_turns=3, max_tokens=40, turn_max_tokens=8, wall_time_s=60))
    """

    def __init__(
        self,
        *args: Any,
        env_factory: EnvFactory,
        codec: Codec,
        limits: EpisodeLimits,
        stop_token_ids: list[int] | None = None,
        **kw: Any,
    ) -> None:
        super().__init__(*args, **kw)
        self.env_factory, self.codec, self.limits = env_factory, codec, limits
        self.stop_token_ids = list(stop_token_ids or [])
        self.env_errors: Counter[str] = Counter()  # groups dropped, by the reason of their failing episode
        self.episode_ends: Counter[str] = Counter()  # done / max_turns / max_tokens
        self.turns = 0

    GROUP_ERRORS = (*RolloutWorker.GROUP_ERRORS, EnvError)

    def _drop(self, group_id: str, exc: Exception) -> None:
        if isinstance(exc, EnvError):
            self.env_errors[exc.reason] += 1
            log.error("rollout: group %s dropped, an episode failed: %s", group_id, exc)
        else:
            super()._drop(group_id, exc)

    def _generate(self, group_id: str):
        turn_no = iter(range(1 << 30))

        async def generate(context: list[int], params: SamplingParams, min_version: int) -> tuple[str, Sample]:
            engine_id, (sample,) = await self.fleet.run_group(
                f"{group_id}/t{next(turn_no)}", context, params, min_version
            )
            return engine_id, sample

        return generate

    async def _group_once(self, ticket: Any, prompt: Prompt, tries: int) -> str:
        """One group of episodes on the ticket (RolloutWorker._group hands a given-up ticket the next prompt)."""
        group_id = f"s{ticket.step}-{ticket.ticket_id}"
        min_version = int(ticket.min_version)
        try:
            episodes = await run_episode_group(
                self.sampling.n,
                self._generate(group_id),
                self.env_factory,
                self.codec,
                prompt.prompt_ids,
                ground_truth=prompt.ground_truth,
                extra_info=prompt.extra_info,
                limits=self.limits,
                temperature=self.sampling.temperature,
                top_p=self.sampling.top_p,
                stop_token_ids=self.stop_token_ids,
                min_version=min_version,
            )
        except self.GROUP_ERRORS as exc:
            self._drop(group_id, exc)
            return "given_up"
        bad = sum(1 for e in episodes if not np.isfinite(e.logprobs).all())
        if bad:  # a token the engine gave no log-prob for: the prompt runs again later, counted
            self.samples_nonfinite_logprob += bad
            self.prompts_requeued_nonfinite += 1
            self._replay.append(prompt)
            log.error(
                "rollout: group %s: %d episodes hold non-finite behaviour log-probs; prompt requeued", group_id, bad
            )
            return "given_up"
        self.turns += sum(len(e.turn_spans) for e in episodes)
        self.episode_ends.update(e.end for e in episodes)
        rows = episode_rows(episodes, group_id, int(ticket.step), prompt.data_source)
        return "pushed" if await self._push(group_id, rows) else "push_failed"

    def record(self) -> WorkerStatus:
        return msgspec.structs.replace(
            super().record(), env_errors=dict(self.env_errors), episode_ends=dict(self.episode_ends), turns=self.turns
        )


def episode_rows(episodes: list[Episode], group_id: str, step: int, data_source: str) -> list[Trajectory]:
    """The trajectory rows of one group of episodes."""
    t_end = time.time()
    return [
        Trajectory(
            traj_id=f"{group_id}/{i}",
            group_id=group_id,
            sample_index=i,
            group_size=len(episodes),
            step=step,
            prompt_ids=e.prompt_ids,
            response_ids=e.token_ids,
            behaviour_logprobs=e.logprobs,
            segment_starts=e.segment_starts,
            segment_versions=e.segment_versions,
            reward=e.reward,
            finish_reason=e.finish_reason,
            engine_id=e.engine_ids[0] if e.engine_ids else "",
            data_source=data_source,
            t_start=e.t_start,
            t_end=t_end,
            loss_mask=e.loss_mask,
        )
        for i, e in enumerate(episodes)
    ]
