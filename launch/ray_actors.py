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
import logging
from pathlib import Path
from typing import Any

import ray

from core.configbase import build
from core.network import is_loopback, write_curve_keys
from engines.vllm.factory import LocalLauncher
from launch.config import RunConfig
from launch.fleet_recovery import MAX_RESTARTS as FLEET_MAX_RESTARTS
from launch.monitor import setup_logging
from launch.netsetup import node_host
from launch.server_actor import RayServerLauncher
from learner.simulated import SimLearner
from rollout_fleet.service import FleetService

log = logging.getLogger(__name__)

try:  # the actors' event loops are created after this module is imported: make them uvloop
    import uvloop

    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
except ImportError:  # uvloop is optional (not on Windows)
    pass


class FleetRunner(FleetService):
    """``pgs`` (server index -> placement group): each server is started by its own actor in its bundle
    (launch/server_actor.py); without, servers are child processes of this one, bound to this node."""

    def __init__(
        self,
        cfg_data: dict[str, Any],
        broker_address: str,
        *,
        slots: dict[int, Any] | None = None,
        run_dir: str | None = None,
        pgs: dict[int, Any] | None = None,
        curve_keys: dict[str, bytes] | None = None,
    ) -> None:
        cfg = build(RunConfig, cfg_data)
        if curve_keys is not None:  # this node may not see the driver's run directory
            write_curve_keys(cfg.broker.curve_keys_dir, curve_keys)
        host = node_host(cfg)
        if pgs:
            launcher = RayServerLauncher(
                pgs, {i: len(slots[i][1]) for i in pgs}, is_loopback(host), cfg.rollout.startup_timeout_s
            )
        else:
            launcher = LocalLauncher(host)
        super().__init__(
            cfg,
            broker_address,
            slots=slots,
            run_dir=run_dir,
            launcher=launcher,
            eval_every=cfg.run.eval_every,
            eval_samples=cfg.run.eval_samples,
            proxy_host=host,
        )

    async def add_placed(self, indices: list[int], slots: dict[int, Any], pgs: dict[int, Any]) -> list[str]:
        """``scale`` on a placed fleet: new servers in their new placement groups."""
        if not isinstance(self.launcher, RayServerLauncher):
            raise ValueError("this fleet was started without placement groups; scale it with add_servers")
        self.launcher.add(pgs, {i: len(slots[i][1]) for i in pgs})
        return await self.add_servers(indices, slots)

    async def placements(self) -> dict[int, dict[str, Any]]:
        """Where each placed server's actor ran: node IP and id, GPUs, network namespace, URL."""
        return dict(self.launcher.placed) if isinstance(self.launcher, RayServerLauncher) else {}


@ray.remote(num_cpus=0, max_restarts=FLEET_MAX_RESTARTS)  # the driver starts a restarted one (launch/fleet_recovery.py)
class FleetActor(FleetRunner):
    def __init__(
        self,
        cfg_data: dict[str, Any],
        broker_address: str,
        run_dir: str,
        slots: dict[int, Any] | None = None,
        pgs: dict[int, Any] | None = None,
        curve_keys: dict[str, bytes] | None = None,
    ) -> None:
        simulated = cfg_data["rollout"]["engine"] == "simulated"
        Path(run_dir).mkdir(parents=True, exist_ok=True)  # this node may not share the driver's disk
        setup_logging(Path(run_dir), "fleet", simulated=simulated)
        super().__init__(cfg_data, broker_address, slots=slots, run_dir=run_dir, pgs=pgs, curve_keys=curve_keys)

    async def ping(self) -> bool:
        return True

    async def status(self) -> dict[str, Any]:
        """The fleet's status, and whether ``start`` ran in this incarnation: Ray may restart a dead fleet actor
        between two of the driver's calls, and the new one answers like an idle fleet (launch/fleet_recovery.py)."""
        return {**self.status_now(), "started_here": hasattr(self, "worker")}

    async def incarnation(self) -> dict[str, Any]:
        """Whether Ray restarted this actor after a death, and whether ``start`` ran in this incarnation."""
        return {
            "reconstructed": ray.get_runtime_context().was_current_actor_reconstructed,
            "started": hasattr(self, "worker"),
        }


@ray.remote(num_cpus=0, max_restarts=0)
class SimLearnerActor(SimLearner):
    def __init__(self, broker_address: str, run_dir: str, step_s: float, max_staleness: int, fleet) -> None:
        setup_logging(Path(run_dir), "learner", simulated=True)
        self._fleet = fleet

        async def publish(version: int) -> None:
            try:
                await self._fleet.update_weights.remote(version)  # the SIMULATED weight sync
            except ray.exceptions.RayActorError as exc:  # the fleet died: a failed publish, the run goes on
                log.warning(
                    "publish of v%d: the fleet actor is gone (%s); its restart loads the learner's "
                    "version (launch/fleet_recovery.py)",
                    version,
                    type(exc).__name__,
                )

        super().__init__(broker_address, step_s=step_s, max_staleness=max_staleness, publish=publish)

    async def status(self) -> dict[str, Any]:  # async: answers while run() is in progress
        return SimLearner.status(self)

    async def stop(self) -> None:
        SimLearner.stop(self)
