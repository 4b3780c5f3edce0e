"""A group whose generation is over but whose push the broker has not yet acked is in flight (capacity, the
prompts a restart replays) and not generating: colocated mode's release counts only generating groups. Under
k = 0 the learner can hold a step's batch, and release the fleet, before the ack of its last push has come back
through the producer's thread (a fresh-clone CI run saw 2 such groups counted at a release).

Real fleet controller on (SIMULATED) engines; the broker side is an in-memory producer whose push waits on an
event, as a slow ack does.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
from broker_groups import MemoryProducer
from sim_worker import simulated_worker

from broker.protocol import Ticket
from rollout_fleet.worker import Prompt

pytestmark = pytest.mark.timeout(60)


class SlowAck(MemoryProducer):
    def __init__(self) -> None:
        super().__init__()
        self.entered, self.ack = threading.Event(), threading.Event()

    def push(self, batch):
        self.entered.set()
        assert self.ack.wait(30), "the test never released the ack"
        return super().push(batch)


class Rewards:
    async def score(self, prompt, samples):
        return [float(i % 2) for i in range(len(samples))]


def test_a_group_waiting_on_its_ack_is_in_flight_but_not_generating():
    async def main():
        producer = SlowAck()
        async with simulated_worker(producer, Rewards(), n=2, max_inflight_groups=2) as worker:
            prompt = Prompt(prompt_ids=[1, 1, 1], ground_truth="1")
            task = asyncio.create_task(worker._group(Ticket(step=1, ticket_id=0), prompt))
            worker._tasks[task] = prompt  # as RolloutWorker.run registers a started group
            seen = {"before": (worker.inflight, worker.generating)}
            assert await asyncio.to_thread(producer.entered.wait, 10), "the group never reached its push"
            await asyncio.sleep(0.05)  # the worker's task is parked on the push's future
            seen["waiting_on_ack"] = (worker.inflight, worker.generating)
            producer.ack.set()
            await asyncio.wait_for(task, 10)
            seen["acked"] = (worker.inflight, worker.generating)
        return worker, producer, seen

    worker, producer, seen = asyncio.run(main())
    assert seen["before"] == (1, 1)
    assert seen["waiting_on_ack"] == (1, 0)  # in flight until the broker has it, but no longer generating
    assert seen["acked"] == (0, 0) and worker.groups_pushed == 1 and len(producer.batches) == 1
