"""DAPO in the fleet: overlong shaping by hand, and dynamic sampling end to end.

The dynamic-sampling test runs the real broker process over ZMQ, the real fleet controller with
(SIMULATED) engines and the real rollout worker loop; only the reward is a rule of the test: two of
every three prompts give a uniform group. Every step the consumer leases must still hold
``groups_per_step`` groups, none of them uniform, and the worker must have counted what it filtered.
"""

from __future__ import annotations

import asyncio

import pytest

from broker.client import ConsumerClient, ProducerClient, new_event_loop
from broker.process import BrokerProcess
from engines.simulated import SimulatedFactory
from rollout_fleet.config import (
    FilterGroupsConfig,
    OverlongBufferConfig,
    RolloutConfig,
    SamplingConfig,
    SimulatedEngineConfig,
)
from rollout_fleet.controller import FleetController
from rollout_fleet.shaping import overlong_penalty, shape, uniform
from rollout_fleet.worker import AsyncProducer, Prompt, RolloutWorker

pytestmark = pytest.mark.timeout(90)


def test_overlong_penalty_by_hand():
    # max_tokens 16, buffer 4: free up to 12 tokens, then -1/4 per token down to -1.0 at 16
    assert overlong_penalty(10, 16, 4, 1.0) == 0.0
    assert overlong_penalty(12, 16, 4, 1.0) == 0.0
    assert overlong_penalty(14, 16, 4, 1.0) == pytest.approx(-0.5)
    assert overlong_penalty(16, 16, 4, 0.5) == pytest.approx(-0.5)  # penalty_factor scales the ramp
    assert shape([1.0, 1.0, 0.0], [8, 15, 16], 16, 4, 1.0) == pytest.approx([1.0, 0.25, -1.0])
    with pytest.raises(ValueError, match="overlong buffer"):
        overlong_penalty(3, 16, 17, 1.0)
    with pytest.raises(ValueError, match="len"):
        OverlongBufferConfig(enable=True, len=0)


def test_uniform_groups_as_verl():
    assert uniform([1.0, 1.0, 1.0]) and uniform([0.0, 0.0])
    assert not uniform([1.0, 0.0]) and not uniform([1.0])  # verl keeps a group of one


def test_run_config_checks_the_buffer_against_max_tokens():
    from launch.config import RunConfig

    with pytest.raises(ValueError, match="overlong_buffer.len=32 exceeds"):
        RunConfig.model_validate(
            {
                "model": {"path": "models/tiny-adder"},
                "data": {"train_files": ["x.parquet"]},
                "run": {"eval_samples": 0},
                "rollout": {"engine": "simulated", "sampling": {"max_tokens": 16}},
                "broker": {"max_staleness": 0},
                "reward": {"overlong_buffer": {"enable": True, "len": 32}},
                "learner": {"loss": {"correction": "none"}},
            }
        )


class CountingPrompts:
    """Prompt k carries k; the scorer below decides from it whether its group is uniform."""

    def __init__(self) -> None:
        self.k = 0

    def next(self) -> Prompt:
        self.k += 1
        return Prompt(prompt_ids=[3 + self.k % 50, 7], ground_truth=str(self.k))

    def state_dict(self):
        return {"k": self.k}

    def load_state_dict(self, state) -> None:
        self.k = state["k"]


class RuleScorer:
    """Prompts k % 3 == 0 get rewards 1, 0, 1, 0 (a signal); the others all 1 or all 0 (uniform)."""

    async def score(self, prompt, samples):
        k = int(prompt.ground_truth)
        if k % 3 == 0:
            return [float(i % 2) for i in range(len(samples))]
        return [float(k % 3 == 1)] * len(samples)


def test_dynamic_sampling_fills_every_step_with_non_uniform_groups():
    g, steps = 4, 3
    bp = BrokerProcess(groups_per_step=g, max_staleness=4).start()

    async def main():
        sim = SimulatedEngineConfig(tokens_per_s=50_000.0, length_median=6, length_sigma=0.3)
        fleet = FleetController(
            RolloutConfig(engine="simulated", health_interval_s=0.1, simulated=sim), SimulatedFactory(sim)
        )
        await fleet.start(1)
        producer = AsyncProducer(ProducerClient(bp.address, producer_id="fleet", timeout_s=10))
        worker = RolloutWorker(
            fleet,
            producer,
            CountingPrompts(),
            RuleScorer(),
            SamplingConfig(n=4, max_tokens=16),
            max_inflight_groups=4,
            filter_groups=FilterGroupsConfig(enable=True, metric="acc"),
        )
        stop = asyncio.Event()
        run = asyncio.create_task(worker.run(stop))
        cons = ConsumerClient(bp.address, consumer_id="learner", timeout_s=10)
        leased = []
        try:
            for step in range(1, steps + 1):
                lease = await cons.next_batch(step, wait_s=30.0)
                assert lease is not None, f"step {step} never filled"
                leased.append(lease.batch)
                await cons.ack(lease.lease_id)
                await cons.report_version(step)
        finally:
            stop.set()
            await run
            await cons.close()
            await producer.close()
            await fleet.close()
        return worker, leased

    try:
        with asyncio.Runner(loop_factory=new_event_loop) as r:
            worker, leased = r.run(main())
    finally:
        bp.stop()
    for batch in leased:
        groups: dict[str, list[float]] = {}
        for gid, rew in zip(batch.column("group_id").to_pylist(), batch.column("reward").to_pylist(), strict=True):
            groups.setdefault(gid, []).append(rew)
        assert len(groups) == g, "a step must be full"
        assert not any(uniform(v) for v in groups.values()), f"a uniform group reached a step: {groups}"
    # two prompts in three are uniform: every pushed group needed about three generations
    assert worker.groups_filtered >= 2 * steps * g - 2
    # groups scored but cancelled at the stop before their push are the only gap (at most the 4 in flight)
    assert 0 <= worker.groups_generated - worker.groups_filtered - worker.groups_pushed <= 4
    st = worker.status()
    assert st["groups_filtered"] == worker.groups_filtered and st["groups_filter_exhausted"] == 0


def test_metric_choice_and_the_generation_limit():
    def worker(**kw):
        return RolloutWorker(
            None,
            None,
            None,
            None,
            SamplingConfig(n=2, max_tokens=16),
            max_inflight_groups=1,
            filter_groups=FilterGroupsConfig(enable=True, **kw),
        )

    w = worker(metric="acc")
    # raw scores uniform, shaped ones not (one sample ran into the overlong buffer): acc filters it ...
    assert not w._keep("g", [1.0, 1.0], [1.0, 0.5], tries=1) and w.groups_filtered == 1
    # ... seq_reward (the shaped reward) keeps it
    assert worker(metric="seq_reward")._keep("g", [1.0, 1.0], [1.0, 0.5], tries=1)
    w = worker(max_num_gen_batches=2)
    assert not w._keep("g", [0.0, 0.0], [0.0, 0.0], tries=1)
    assert w._keep("g", [0.0, 0.0], [0.0, 0.0], tries=2)  # the limit: pushed anyway, counted
    assert (w.groups_filtered, w.groups_filter_exhausted) == (1, 1)
