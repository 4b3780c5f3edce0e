"""A sample whose behaviour log-prob is not finite fails its group, counted; the group is resampled on the
same ticket, and after the retries the prompt goes back to the replay queue (never lost).

Real fleet controller and (SIMULATED) engines; the broker side is an in-memory producer client.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from broker_groups import MemoryProducer
from sim_worker import simulated_worker

from broker.protocol import Ticket
from engines.simulated import SimulatedEngine, SimulatedFactory
from rollout_fleet.worker import Prompt

pytestmark = pytest.mark.timeout(60)


class HolesFactory(SimulatedFactory):
    """Engines whose first ``bad_calls`` generations return a sample with a missing (-inf) log-prob, as
    vLLM's client records a token the server gave no log-prob for."""

    def __init__(self, cfg, bad_calls: int) -> None:
        super().__init__(cfg)
        self.bad_calls = bad_calls

    async def start(self, index: int) -> SimulatedEngine:
        engine = SimulatedEngine(f"sim-{index}", self.cfg, seed=index)
        inner, factory = engine.generate, self

        async def generate(prompt_ids, params):
            out = await inner(prompt_ids, params)
            if factory.bad_calls > 0:
                factory.bad_calls -= 1
                out[1].logprobs[0] = -np.inf
            return out

        engine.generate = generate
        return engine


class Scorer:
    async def score(self, prompt, samples):
        return [float(i % 2) for i in range(len(samples))]


def run(bad_calls: int):
    async def main():
        producer = MemoryProducer()
        factory = lambda sim: HolesFactory(sim, bad_calls)  # noqa: E731
        async with simulated_worker(producer, Scorer(), n=4, max_inflight_groups=4, factory=factory) as worker:
            prompt = Prompt(prompt_ids=[5, 6, 7], ground_truth="x")
            await worker._group(Ticket(step=1, ticket_id=0), prompt)
        return worker, producer, prompt

    return asyncio.run(main())


def test_one_bad_generation_is_resampled_on_the_same_ticket():
    worker, producer, _ = run(bad_calls=1)
    assert worker.samples_nonfinite_logprob == 1 and worker.groups_resampled_nonfinite == 1
    assert worker.groups_pushed == 1 and worker.prompts_requeued_nonfinite == 0 and worker._replay == []
    (batch,) = producer.batches
    assert batch.num_rows == 4
    assert np.isfinite(batch.column("behaviour_logprobs").values.to_numpy()).all()


def test_persistently_bad_prompt_goes_back_to_the_replay_queue():
    worker, producer, prompt = run(bad_calls=10)
    assert worker.samples_nonfinite_logprob == 3  # 1 + logprob_retries (2) attempts, one bad sample each
    assert worker.groups_pushed == 0 and producer.batches == []
    assert worker.prompts_requeued_nonfinite == 1 and worker._replay == [prompt]
    assert worker.status()["prompts_requeued_nonfinite"] == 1
    assert worker._next_prompt() is prompt  # it runs again first
