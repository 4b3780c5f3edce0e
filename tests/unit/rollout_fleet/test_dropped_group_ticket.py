"""A ticket whose group is given up (here: its reward could not be computed) carries the next prompt instead
of going unused, at most ``RolloutWorker.DROPPED_TICKET_REUSES`` times: an unused ticket is granted again only
after ``broker.ticket_timeout_s`` (600 s by default), and its step waits for it.

Real fleet controller and (SIMULATED) engines; the reward function is one that fails for some prompts (bad
input, as a reward server that cannot score them gives); the broker side is an in-memory producer client.
"""

from __future__ import annotations

import asyncio

import pytest
from broker_groups import MemoryProducer
from sim_worker import simulated_worker

from broker.protocol import Ticket
from rollout_fleet.worker import Prompt, RewardFailed, RolloutWorker

pytestmark = pytest.mark.timeout(60)


class Prompts:
    """Prompts 1, 2, 3, ... (prompt ids [n, n, n]), as a dataset would hand them out."""

    def __init__(self) -> None:
        self.handed = 0

    def next(self) -> Prompt:
        self.handed += 1
        return Prompt(prompt_ids=[self.handed] * 3, ground_truth=str(self.handed))

    def state_dict(self):
        return {"handed": self.handed}

    def load_state_dict(self, state):
        self.handed = state["handed"]


class FailsFor:
    """Scores 0/1 alternately, and cannot score the prompts whose ground truth is in ``bad``."""

    def __init__(self, bad: set[str]) -> None:
        self.bad, self.calls = bad, 0

    async def score(self, prompt, samples):
        self.calls += 1
        if prompt.ground_truth in self.bad:
            raise RewardFailed(f"the reward server could not score prompt {prompt.ground_truth}")
        return [float(i % 2) for i in range(len(samples))]


def run(bad: set[str], prompts: Prompts | None):
    async def main():
        producer = MemoryProducer()
        async with simulated_worker(producer, FailsFor(bad), n=2, max_inflight_groups=2, prompts=prompts) as worker:
            await worker._group(Ticket(step=3, ticket_id=7), Prompt(prompt_ids=[0, 0, 0], ground_truth="0"))
        return worker, producer

    return asyncio.run(main())


def test_a_dropped_group_hands_its_ticket_to_the_next_prompt():
    worker, producer = run(bad={"0"}, prompts=Prompts())
    assert worker.groups_reward_failed == 1 and worker.tickets_reused_after_drop == 1
    assert worker.groups_pushed == 1 and len(producer.batches) == 1
    rows = producer.batches[0].to_pylist()
    # the ticket's step and group id, the next prompt's tokens
    assert {r["step"] for r in rows} == {3} and {r["group_id"] for r in rows} == {"s3-7"}
    assert all(r["prompt_ids"] == [1, 1, 1] for r in rows)
    assert worker.status()["tickets_reused_after_drop"] == 1


def test_a_ticket_is_reused_a_bounded_number_of_times():
    prompts = Prompts()
    worker, producer = run(bad={"0", "1", "2", "3", "4"}, prompts=prompts)
    reuses = RolloutWorker.DROPPED_TICKET_REUSES
    assert worker.tickets_reused_after_drop == reuses and worker.groups_reward_failed == reuses + 1
    assert prompts.handed == reuses and producer.batches == [] and worker.groups_pushed == 0


def test_without_a_prompt_source_the_ticket_is_left_to_expire():
    worker, producer = run(bad={"0"}, prompts=None)
    assert worker.groups_reward_failed == 1 and worker.tickets_reused_after_drop == 0 and producer.batches == []
