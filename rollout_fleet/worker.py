"""Rollout workers: admission tickets in, scored and version-tagged Arrow batches out.

Dataflow of one group::

    broker ticket (step s) -> prompt from the dataset -> fleet.run_group (n samples on the
    least loaded server; retried elsewhere if it dies) -> engine slot released ->
    reward pool scores the n samples (off the generation path) -> Trajectory rows with
    per-segment policy versions -> Arrow batch -> broker.push

Invariants: a ticket yields at most one pushed group; a group is pushed whole (all ``n``
samples) or not at all; the policy version of every token comes from the engine that
produced it (``Sample.segment_versions``); rewards are scored after the engine slot is
freed, so a slow reward function never holds up generation. With DAPO's dynamic sampling
(``filter_groups``) a scored group whose metric is the same for every sample is dropped, counted, and
the ticket's group is generated again from the next prompt (rollout_fleet/shaping.py); overlong
shaping (``overlong``) adjusts the rewards before that test. The read position of the
dataset plus the prompts of groups still in flight form the worker's checkpoint: on
resume those prompts run first, then reading continues where it stopped.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec
import numpy as np

from broker.schema import Trajectory, to_record_batch
from engines.base import BadRequest, EngineError, Sample, SamplingParams
from rollout_fleet.config import SamplingConfig
from rollout_fleet.controller import FleetController
from rollout_fleet.shaping import RAW_METRICS, shape, uniform
from rollout_fleet.status import WorkerStatus

log = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class Prompt:
    prompt_ids: list[int]
    ground_truth: str = ""
    data_source: str = ""
    extra_info: dict[str, Any] = field(default_factory=dict)
    max_tokens: int | None = None  # the dataset row's response budget; None: rollout.sampling.max_tokens


class PromptSource(Protocol):
    def next(self) -> Prompt: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class RewardFailed(RuntimeError):
    """The reward of a sample could not be computed; its group is dropped (never a made-up reward)."""


class RewardScorer(Protocol):
    async def score(self, prompt: Prompt, samples: list[Sample]) -> list[float]: ...


class AsyncProducer:
    """Awaitable calls on the broker's producer client, whichever way it is written.

    A synchronous client (a ZMQ REQ socket is not thread safe) runs on one dedicated
    thread, so calls are serialised and the event loop never blocks on the network.
    """

    def __init__(self, client: Any) -> None:
        self.client = client
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="producer")

    async def _call(self, name: str, *args: Any) -> Any:
        fn = getattr(self.client, name)
        if inspect.iscoroutinefunction(fn):
            return await fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def acquire_tickets(self, max_groups: int, wait_s: float) -> list:
        return await self._call("acquire_tickets", max_groups, wait_s)

    async def push(self, batch) -> Any:
        return await self._call("push", batch)

    async def report_engine_version(self, engine_id: str, version: int) -> Any:
        return await self._call("report_engine_version", engine_id, version)

    async def close(self) -> None:
        close = getattr(self.client, "close", None)
        if close is not None:
            res = close()
            if inspect.isawaitable(res):
                await res
        self._pool.shutdown(wait=False, cancel_futures=True)


class RolloutWorker:
    """Keeps up to ``max_inflight_groups`` per healthy server in flight. Example::

    worker = RolloutWorker(fleet, AsyncProducer(ProducerClient(addr)), prompts, rewards, cfg.sampling,
                           max_inflight_groups=16)
    await worker.run(stop_event)
    """

    def __init__(
        self,
        fleet: FleetController,
        producer: AsyncProducer,
        prompts: PromptSource,
        rewards: RewardScorer,
        sampling: SamplingConfig,
        *,
        max_inflight_groups: int,
        seed: int = 0,
        push_retries: int = 3,
        logprob_retries: int = 2,
        gate: Callable[[], bool] | None = None,
        filter_groups: Any = None,
        overlong: Any = None,
    ) -> None:
        """``gate``: colocated mode's ``() -> may start groups`` (rollout_fleet/colocated_gate.py); while it says
        False no ticket is taken and no group starts. ``filter_groups`` (rollout.filter_groups) and
        ``overlong`` (reward.overlong_buffer): DAPO's dynamic sampling and length penalty, off when None or
        not enabled."""
        self.fleet = fleet
        self.producer = producer
        self.prompts = prompts
        self.rewards = rewards
        self.sampling = sampling
        self.max_inflight_groups = max_inflight_groups
        self.seed = seed
        self.push_retries = push_retries
        self.logprob_retries = logprob_retries
        self.gate = gate
        self.filter_groups = filter_groups if filter_groups is not None and filter_groups.enable else None
        self.overlong = overlong if overlong is not None and overlong.enable else None
        self.groups_generated = 0  # groups scored (pushed, filtered or dropped after scoring)
        self.groups_filtered = 0  # dynamic sampling: uniform groups never pushed
        self.groups_filter_exhausted = 0  # uniform groups pushed anyway after max_num_gen_batches tries
        self.samples_overlong_penalised = 0
        self.tickets_held_at_gate = 0  # tickets that arrived as the gate closed (colocated; 0 under k = 0)
        self._tasks: dict[asyncio.Task, Prompt] = {}
        self._pushing: set[asyncio.Task] = set()  # groups whose generation is over, waiting on the broker's ack
        self._replay: list[Prompt] = []
        self.groups_started = 0
        self.groups_pushed = 0
        self.groups_failed = 0
        self.groups_cancelled = 0  # in flight at shutdown: their tickets were never used
        self.groups_reward_failed = 0
        self.groups_bad_request = 0  # an engine refused the request (4xx): dropped with a reason, not lost
        self.samples_nonfinite_logprob = 0  # samples that failed their group: a non-finite behaviour log-prob
        self.groups_resampled_nonfinite = 0  # groups sampled again on the same ticket for that reason
        self.prompts_requeued_nonfinite = 0  # prompts put back in the replay queue after the retries
        self.tickets_reused_after_drop = 0  # a given-up group's ticket carried the next prompt (see _group)
        self.samples_pushed = 0
        self.samples_truncated = 0  # finish reason 'length': cut at the prompt's limit (see limit())
        self.tokens_pushed = 0
        self.reward_sum = 0.0
        self.idle_s = 0.0

    # -- checkpoint ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        inflight = [p for p in self._tasks.values()] + self._replay
        return {
            "data": self.prompts.state_dict(),
            "replay": [
                {
                    "prompt_ids": list(p.prompt_ids),
                    "ground_truth": p.ground_truth,
                    "data_source": p.data_source,
                    "extra_info": p.extra_info,
                    "max_tokens": p.max_tokens,
                }
                for p in inflight
            ],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.prompts.load_state_dict(state["data"])
        self._replay = [Prompt(**p) for p in state["replay"]]

    def _next_prompt(self) -> Prompt:
        return self._replay.pop(0) if self._replay else self.prompts.next()

    # -- loop ---------------------------------------------------------------------------------
    def capacity(self) -> int:
        healthy = sum(1 for s in self.fleet.servers.values() if s.state == "healthy")
        return max(1, healthy) * self.max_inflight_groups

    async def run(self, stop: asyncio.Event) -> None:
        try:
            while not stop.is_set():
                free = self.capacity() - len(self._tasks)
                if free <= 0:
                    await asyncio.wait(list(self._tasks), timeout=0.5, return_when=asyncio.FIRST_COMPLETED)
                    continue
                t0 = time.monotonic()
                if self.gate is not None and not self.gate():
                    await asyncio.sleep(0.02)
                    if not self._tasks:
                        self.idle_s += time.monotonic() - t0
                    continue
                tickets = await self.producer.acquire_tickets(free, 0.2)
                if self.gate is not None and tickets and not self.gate():  # closed while we waited: hold them
                    self.tickets_held_at_gate += len(tickets)
                    log.warning(
                        "rollout: colocated gate closed with %d tickets just taken; held until it opens", len(tickets)
                    )
                    while not self.gate() and not stop.is_set():  # noqa: ASYNC110 (the gate is a predicate)
                        await asyncio.sleep(0.02)
                if not tickets:
                    if not self._tasks:
                        self.idle_s += time.monotonic() - t0
                    continue
                for ticket in tickets:
                    prompt = self._next_prompt()
                    task = asyncio.create_task(self._group(ticket, prompt), name=f"group-{ticket.ticket_id}")
                    self._tasks[task] = prompt
                    task.add_done_callback(self._done)
                    self.groups_started += 1
        finally:
            await self.cancel_inflight()

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.pop(task, None)
        if not task.cancelled() and task.exception() is not None:
            log.error("rollout: group task failed: %r", task.exception())

    async def cancel_inflight(self) -> int:
        """Cancel groups in flight (shutdown); returns how many were cancelled."""
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5.0)
        self.groups_cancelled += len(tasks)
        return len(tasks)

    @property
    def inflight(self) -> int:
        return len(self._tasks)

    @property
    def generating(self) -> int:
        """Groups in flight that may still use an engine: in flight, less those only waiting on the broker's ack of
        their push (the ack comes back through a thread, so on a busy host it can trail the broker's hand-over of the
        step's batch to the learner, and with it colocated mode's release)."""
        return sum(1 for t in self._tasks if t not in self._pushing)

    # the errors that give up one group (counted by kind in _drop); anything else is a bug and is logged
    GROUP_ERRORS: tuple[type[Exception], ...] = (EngineError, RewardFailed)

    def _drop(self, group_id: str, exc: Exception) -> None:
        """Count and log a group given up for ``exc``, one of :attr:`GROUP_ERRORS`."""
        if isinstance(exc, BadRequest):  # an EngineError whose request is at fault: no server would take it
            self.groups_bad_request += 1
            log.error("rollout: group %s dropped, the engine refused a request: %s", group_id, exc)
        elif isinstance(exc, RewardFailed):
            self.groups_reward_failed += 1
            log.error("rollout: group %s dropped: %s", group_id, exc)
        else:
            self.groups_failed += 1
            log.error("rollout: group %s failed for good: %s", group_id, exc)

    def limit(self, prompt: Prompt) -> int:
        """The longest response of ``prompt``: rollout.sampling.max_tokens, or the row's smaller budget."""
        cap = self.sampling.max_tokens
        return cap if prompt.max_tokens is None else min(int(prompt.max_tokens), cap)

    def _shaped(self, rewards: list[float], samples: list[Sample]) -> list[float]:
        """The rewards to push: with overlong shaping, each plus its length penalty. The penalty is measured
        from rollout.sampling.max_tokens whatever the row's own budget (as verl's DAPO manager measures it
        from max_response_length): a response cut early by its row's budget is not pushed into the buffer."""
        if self.overlong is None:
            return rewards
        out = shape(
            rewards,
            [len(s.token_ids) for s in samples],
            self.sampling.max_tokens,
            self.overlong.len,
            self.overlong.penalty_factor,
        )
        self.samples_overlong_penalised += sum(1 for a, b in zip(out, rewards, strict=True) if a < b)
        return out

    def _keep(self, group_id: str, raw: list[float], shaped: list[float], tries: int) -> bool:
        """Dynamic sampling's verdict on a scored group; counts what it filters."""
        if self.filter_groups is None:
            return True
        if not uniform(raw if self.filter_groups.metric in RAW_METRICS else shaped):
            return True
        limit = self.filter_groups.max_num_gen_batches
        if limit and tries >= limit:
            self.groups_filter_exhausted += 1
            log.error(
                "rollout: group %s still uniform after %d generations (rollout.filter_groups."
                "max_num_gen_batches=%d): pushed anyway; are the prompts too easy or too hard?",
                group_id,
                tries,
                limit,
            )
            return True
        self.groups_filtered += 1
        return False

    # A ticket whose group was given up (an engine or reward failure, or a prompt put back for non-finite
    # log-probs) carries the next prompt, at most this many times, instead of going unused: the broker would
    # grant its slot again only after broker.ticket_timeout_s (600 s by default), and the step waits for it.
    DROPPED_TICKET_REUSES = 2

    async def _group(self, ticket: Any, prompt: Prompt) -> None:
        tries = reuses = 0
        while True:
            tries += 1
            outcome = await self._group_once(ticket, prompt, tries)
            if outcome == "given_up":
                if reuses >= self.DROPPED_TICKET_REUSES or self.prompts is None:
                    return  # the broker grants the slot again when the ticket expires
                reuses, tries = reuses + 1, 0
                self.tickets_reused_after_drop += 1
            elif outcome != "filtered":
                return
            # filtered or given up: the same ticket, the next prompt (now the one in flight for the checkpoint);
            # colocated mode's gate is honoured as for a new ticket. A given-up ticket takes a fresh prompt: one
            # just put back for non-finite log-probs waits in the replay queue for another ticket.
            while self.gate is not None and not self.gate():  # noqa: ASYNC110 (the gate is a predicate)
                await asyncio.sleep(0.02)
            prompt = self.prompts.next() if outcome == "given_up" else self._next_prompt()
            task = asyncio.current_task()
            if task in self._tasks:
                self._tasks[task] = prompt

    async def _group_once(self, ticket: Any, prompt: Prompt, tries: int) -> str:
        """One generation of the ticket's group: ``"pushed"``, ``"filtered"`` (dynamic sampling: generate again),
        ``"given_up"`` (dropped, or its prompt put back: the ticket is free for another prompt) or
        ``"push_failed"``."""
        group_id = f"s{ticket.step}-{ticket.ticket_id}"
        params = SamplingParams(
            n=self.sampling.n,
            max_tokens=self.limit(prompt),
            temperature=self.sampling.temperature,
            top_p=self.sampling.top_p,
            top_k=self.sampling.top_k,
            ignore_eos=self.sampling.ignore_eos,
        )
        t_start = time.time()
        try:
            # the oldest weights that may start a group for this step within the bound
            min_version = int(ticket.min_version)  # the broker's staleness floor for this step
            for attempt in range(self.logprob_retries + 1):
                engine_id, samples = await self.fleet.run_group(group_id, prompt.prompt_ids, params, min_version)
                bad = sum(1 for s in samples if not np.isfinite(s.logprobs).all())
                if not bad:
                    break
                self.samples_nonfinite_logprob += bad
                log.warning(
                    "rollout: group %s: %d of %d samples from %s have non-finite behaviour log-probs "
                    "(attempt %d of %d)",
                    group_id,
                    bad,
                    len(samples),
                    engine_id,
                    attempt + 1,
                    self.logprob_retries + 1,
                )
                if attempt < self.logprob_retries:
                    self.groups_resampled_nonfinite += 1
            else:
                self.prompts_requeued_nonfinite += 1
                self._replay.append(prompt)
                log.error(
                    "rollout: group %s: prompt requeued after %d attempts with non-finite log-probs",
                    group_id,
                    self.logprob_retries + 1,
                )
                return "given_up"
            rewards = await self.rewards.score(prompt, samples)
        except self.GROUP_ERRORS as exc:
            self._drop(group_id, exc)
            return "given_up"
        if len(rewards) != len(samples):
            raise ValueError(f"reward pool returned {len(rewards)} rewards for {len(samples)} samples of {group_id}")
        self.groups_generated += 1
        raw = [float(r) for r in rewards]
        rewards = self._shaped(raw, samples)
        if not self._keep(group_id, raw, rewards, tries):
            return "filtered"
        t_end = time.time()
        trajs = [
            Trajectory(
                traj_id=f"{group_id}/{i}",
                group_id=group_id,
                sample_index=i,
                group_size=len(samples),
                step=int(ticket.step),
                prompt_ids=prompt.prompt_ids,
                response_ids=s.token_ids,
                behaviour_logprobs=s.logprobs,
                segment_starts=s.segment_starts,
                segment_versions=s.segment_versions,
                reward=float(r),
                finish_reason=s.finish_reason,
                engine_id=engine_id,
                data_source=prompt.data_source,
                t_start=t_start,
                t_end=t_end,
            )
            for i, (s, r) in enumerate(zip(samples, rewards, strict=True))
        ]
        return "pushed" if await self._push(group_id, trajs) else "push_failed"

    async def _push(self, group_id: str, trajs: list[Trajectory]) -> bool:
        """Push one whole group (retried); counts it pushed or failed."""
        task = asyncio.current_task()
        self._pushing.add(task)  # generation is over: colocated mode's release does not wait on this group
        try:
            pushed = await self._push_retried(group_id, to_record_batch(trajs))
        finally:
            self._pushing.discard(task)
        if not pushed:
            self.groups_failed += 1
            log.error("rollout: group %s could not be pushed after %d attempts", group_id, self.push_retries)
            return False
        self.groups_pushed += 1
        # pushed: the group is the broker's now, no longer in flight here (capacity, colocated mode's release,
        # the prompts a restart replays), even before its task's done callback runs
        self._tasks.pop(task, None)
        self.samples_pushed += len(trajs)
        self.samples_truncated += sum(1 for t in trajs if t.finish_reason == "length")
        self.tokens_pushed += sum(len(t.response_ids) for t in trajs)
        self.reward_sum += float(sum(t.reward for t in trajs))
        return True

    async def _push_retried(self, group_id: str, batch) -> bool:
        for attempt in range(self.push_retries):
            try:
                await self.producer.push(batch)
                return True
            except (TimeoutError, OSError, RuntimeError) as exc:
                log.warning("rollout: push of %s failed (attempt %d): %s", group_id, attempt + 1, exc)
                await asyncio.sleep(0.2 * (attempt + 1))
        return False

    def status(self) -> dict[str, Any]:
        """:meth:`record` as plain data."""
        return msgspec.to_builtins(self.record())

    def record(self) -> WorkerStatus:
        return WorkerStatus(
            groups_started=self.groups_started,
            groups_pushed=self.groups_pushed,
            groups_failed=self.groups_failed,
            groups_inflight=self.inflight,
            groups_cancelled=self.groups_cancelled,
            groups_reward_failed=self.groups_reward_failed,
            groups_bad_request=self.groups_bad_request,
            samples_truncated=self.samples_truncated,
            samples_nonfinite_logprob=self.samples_nonfinite_logprob,
            groups_resampled_nonfinite=self.groups_resampled_nonfinite,
            prompts_requeued_nonfinite=self.prompts_requeued_nonfinite,
            tickets_reused_after_drop=self.tickets_reused_after_drop,
            samples_pushed=self.samples_pushed,
            tokens_pushed=self.tokens_pushed,
            groups_generated=self.groups_generated,
            groups_filtered=self.groups_filtered,
            groups_filter_exhausted=self.groups_filter_exhausted,
            samples_overlong_penalised=self.samples_overlong_penalised,
            mean_reward=self.reward_sum / self.samples_pushed if self.samples_pushed else None,
            idle_s=round(self.idle_s, 3),
        )
