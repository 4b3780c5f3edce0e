"""A rollout worker's test bench: a real :class:`FleetController` with one SIMULATED engine, a real
:class:`RolloutWorker` over it, and the broker side a producer client the test gives (an in-memory one:
``broker_groups.MemoryProducer``)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from engines.simulated import SimulatedFactory
from rollout_fleet.config import RolloutConfig, SamplingConfig, SimulatedEngineConfig
from rollout_fleet.controller import FleetController
from rollout_fleet.worker import AsyncProducer, RolloutWorker

# fast, short responses: a group is a few milliseconds of simulated generation
SIM = SimulatedEngineConfig(tokens_per_s=50_000.0, length_median=8, length_sigma=0.3)


@asynccontextmanager
async def simulated_worker(
    producer: Any,
    rewards: Any,
    *,
    n: int,
    max_inflight_groups: int,
    prompts: Any = None,
    factory: Callable[[SimulatedEngineConfig], SimulatedFactory] = SimulatedFactory,
) -> AsyncIterator[RolloutWorker]:
    """The worker (``n`` samples a group, up to 16 tokens each) on a started one-engine fleet built by
    ``factory(SIM)``; the fleet and the producer are closed on exit."""
    fleet = FleetController(RolloutConfig(engine="simulated", health_interval_s=0.1, simulated=SIM), factory(SIM))
    await fleet.start(1)
    worker = RolloutWorker(
        fleet,
        AsyncProducer(producer),
        prompts=prompts,
        rewards=rewards,
        sampling=SamplingConfig(n=n, max_tokens=16),
        max_inflight_groups=max_inflight_groups,
    )
    try:
        yield worker
    finally:
        await fleet.close()
        await worker.producer.close()
