"""The rollout worker of agents written against the OpenAI client: each sample is one agent run
through the recording proxy (rollout_fleet/proxy.py); the proxy's record is the trajectory.

Dataflow of one group::

    ticket (step s) -> prompt -> n agent runs, each with base_url .../s/<group>.<i>/v1
        -> the agent's chat completions -> proxy -> fleet.run_group (one sample per call)
        -> the agent returns its reward -> proxy.pop(<group>.<i>) -> Trajectory rows -> push

Invariants: a group is pushed whole or not at all; an agent that raises, returns a non-finite
or non-numeric reward, or never called the proxy drops its group, counted in ``env_errors``
(``agent``, ``agent_reward``, ``agent_no_request``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from broker.schema import Trajectory
from engines.base import Sample, SamplingParams
from rollout_fleet.proxy import ChatProxy
from rollout_fleet.status import WorkerStatus
from rollout_fleet.worker import Prompt, RolloutWorker

log = logging.getLogger(__name__)

Agent = Callable[[str, Prompt], Awaitable[float]]  # (base_url, prompt) -> reward


def fleet_generate(fleet: Any) -> Callable[[list[int], SamplingParams, int], Awaitable[tuple[str, Sample]]]:
    """The proxy's engine: one sample per request through the fleet controller."""
    counter = iter(range(1 << 62))

    async def generate(context: list[int], params: SamplingParams, min_version: int) -> tuple[str, Sample]:
        engine_id, (sample,) = await fleet.run_group(f"proxy-{next(counter)}", context, params, min_version)
        return engine_id, sample

    return generate


def resolve_agent(name: str) -> Agent:
    """``rollout.proxy.agent`` ('package.module:function') as the async agent it names."""
    import importlib
    import inspect

    module_name, _, attr = name.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"rollout.proxy.agent {name!r}: {type(exc).__name__}: {exc}") from None
    if not inspect.iscoroutinefunction(fn):
        raise ValueError(f"rollout.proxy.agent {name!r} must be an async function (base_url, prompt) -> reward")
    return fn


class AgentWorker(RolloutWorker):
    """Runs ``agent`` ``n`` times per ticket against ``proxy`` (whose engine is :func:`fleet_generate`)."""

    def __init__(self, *args: Any, proxy: ChatProxy, agent: Agent, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.proxy, self.agent = proxy, agent
        self.env_errors: Counter[str] = Counter()  # groups dropped, by reason
        self.turns = 0

    async def _group_once(self, ticket: Any, prompt: Prompt, tries: int) -> str:
        """One group of agent episodes on the ticket (RolloutWorker._group hands a given-up ticket the next
        prompt)."""
        group_id = f"s{ticket.step}-{ticket.ticket_id}"
        floor = int(ticket.min_version)
        sids = [f"{group_id}.{i}" for i in range(self.sampling.n)]  # one path segment: no "/"
        for sid in sids:
            self.proxy.floors[sid] = floor
        t0 = time.time()
        try:
            results = await asyncio.gather(
                *(self.agent(f"{self.proxy.url}/s/{sid}/v1", prompt) for sid in sids), return_exceptions=True
            )
            reason = None
            for sid, r in zip(sids, results, strict=True):
                if isinstance(r, BaseException):
                    reason, detail = "agent", f"{type(r).__name__}: {r}"
                elif not isinstance(r, int | float) or not math.isfinite(r):
                    reason, detail = "agent_reward", f"reward {r!r} is not a finite number"
                elif sid not in self.proxy.sessions:
                    reason, detail = "agent_no_request", "the agent never called the proxy"
                if reason:
                    break
            if reason:
                self.env_errors[reason] += 1
                log.error("rollout: group %s dropped, an agent failed (%s): %s", group_id, reason, detail)
                return "given_up"
            records = [self.proxy.pop(sid) for sid in sids]
        finally:
            for sid in sids:
                self.proxy.sessions.pop(sid, None)
                self.proxy.floors.pop(sid, None)
        self.turns += sum(r.turns for r in records)
        t_end = time.time()
        trajs = [
            Trajectory(
                traj_id=f"{group_id}/{i}",
                group_id=group_id,
                sample_index=i,
                group_size=len(records),
                step=int(ticket.step),
                prompt_ids=r.prompt_ids,
                response_ids=r.response_ids,
                behaviour_logprobs=r.behaviour_logprobs,
                segment_starts=r.segment_starts,
                segment_versions=r.segment_versions,
                reward=float(reward),
                finish_reason=r.finish_reason,
                engine_id=r.engine_ids[0],
                data_source=prompt.data_source,
                t_start=t0,
                t_end=t_end,
                loss_mask=r.loss_mask,
            )
            for i, (r, reward) in enumerate(zip(records, results, strict=True))
        ]
        return "pushed" if await self._push(group_id, trajs) else "push_failed"

    def record(self) -> WorkerStatus:
        return msgspec.structs.replace(super().record(), env_errors=dict(self.env_errors), turns=self.turns)
