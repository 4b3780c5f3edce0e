"""Ray actor wrappers of the fleet and the simulated learner (imported by the driver only).

:class:`FleetRunner` is the fleet's service (:class:`rollout_fleet.service.FleetService`) built
from the run config as plain data, which is what crosses to the actor's process.

Both are async actors (their methods run concurrently on the actor's event loop), ask for
no CPU (``num_cpus=0``: an actor that asks for a fraction of a GPU also takes a whole CPU otherwise) and log
to ``<run_dir>/logs/<name>.log`` (``log_to_driver`` is off: the driver's terminal belongs
to the live view).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import ray

from core.configbase import build
from launch.config import RunConfig
from launch.monitor import setup_logging
from learner.simulated import SimLearner
from rollout_fleet.service import FleetService

try:  # the actors' event loops are created after this module is imported: make them uvloop
    import uvloop

    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
except ImportError:  # uvloop is optional (not on Windows)
    pass


class FleetRunner(FleetService):
    def __init__(self, cfg_data: dict[str, Any], broker_address: str, *, slots: dict[int, Any] | None = None,
                 run_dir: str | None = None) -> None:
        cfg = build(RunConfig, cfg_data)
        super().__init__(cfg, broker_address, slots=slots, run_dir=run_dir, eval_every=cfg.run.eval_every,
                         eval_samples=cfg.run.eval_samples)


@ray.remote(num_cpus=0, max_restarts=0)
class FleetActor(FleetRunner):
    def __init__(self, cfg_data: dict[str, Any], broker_address: str, run_dir: str,
                 slots: dict[int, Any] | None = None) -> None:
        simulated = cfg_data["rollout"]["engine"] == "simulated"
        setup_logging(Path(run_dir), "fleet", simulated=simulated)
        super().__init__(cfg_data, broker_address, slots=slots, run_dir=run_dir)

    async def ping(self) -> bool:
        return True


@ray.remote(num_cpus=0, max_restarts=0)
class SimLearnerActor(SimLearner):
    def __init__(self, broker_address: str, run_dir: str, step_s: float, max_staleness: int, fleet) -> None:
        setup_logging(Path(run_dir), "learner", simulated=True)
        self._fleet = fleet

        async def publish(version: int) -> None:
            await self._fleet.update_weights.remote(version)  # the SIMULATED weight sync

        super().__init__(broker_address, step_s=step_s, max_staleness=max_staleness, publish=publish)

    async def status(self) -> dict[str, Any]:  # async: answers while run() is in progress
        return SimLearner.status(self)

    async def stop(self) -> None:
        SimLearner.stop(self)
