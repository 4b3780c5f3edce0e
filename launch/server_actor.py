"""One Ray actor per engine server, placed in that server's placement-group bundle.

The fleet controller asks :class:`RayServerLauncher` for server ``i``; it starts an
:class:`EngineServerActor` with ``PlacementGroupSchedulingStrategy(pg_i, bundle 0)`` and the
bundle's GPU count, so Ray puts the actor on the node the plan chose and gives it that bundle's
GPUs. The actor starts the vLLM server process on its own node with exactly the GPUs Ray assigned
(``get_runtime_context().get_accelerator_ids()``), bound to its node's address (loopback on a
one-host job), and reports where it runs. The controller then talks to the server over HTTP at the
address the actor advertised; the actor is only the server's keeper (start, liveness, kill, stop).

Delivery: the server is started with ``die_with_parent``: if the actor dies (its node lost, a
``ray.kill``) the kernel kills the server, so no engine outlives its keeper.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from pathlib import Path
from typing import Any

import ray

from core.network import LOOPBACK
from engines.vllm.server import VLLMServer, VLLMServerArgs

log = logging.getLogger(__name__)


@ray.remote(num_cpus=0, max_restarts=0)
class EngineServerActor:
    def __init__(self) -> None:
        self.server: VLLMServer | None = None

    def start(self, args_data: dict[str, Any], run_dir: str, cache_dir: str, loopback: bool) -> dict[str, Any]:
        ctx = ray.get_runtime_context()
        gpus = [str(g) for g in ctx.get_accelerator_ids().get("GPU", [])]
        ip = ray.util.get_node_ip_address()
        args = VLLMServerArgs(**args_data)
        args.host = LOOPBACK if loopback else ip
        args.die_with_parent = True
        if gpus:  # exactly the bundle's GPUs, as Ray assigned them on this node
            args.env = {**args.env, "CUDA_VISIBLE_DEVICES": ",".join(gpus)}
        self.server = VLLMServer(args, run_dir, cache_dir=cache_dir)
        self.server.start()
        return {
            "url": self.server.url,
            "pid": self.server.pid,
            "node_ip": ip,
            "node_id": ctx.get_node_id(),
            "gpus": gpus,
            "weight_backend": self.server.weight_backend,
            "model_name": self.server.model_name,
            "netns": _netns(),
        }

    def alive(self) -> bool:
        return self.server is not None and self.server.alive

    def kill(self) -> None:
        if self.server is not None:
            self.server.kill()

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None


def _netns() -> str | None:
    try:
        return os.readlink("/proc/self/ns/net")
    except OSError:
        return None


class RemoteServer:
    """The fleet's handle of a server kept by an :class:`EngineServerActor` (what FleetVLLMClient needs)."""

    def __init__(self, actor, info: dict[str, Any], call_timeout_s: float = 60.0) -> None:
        self.actor, self.info, self.call_timeout_s = actor, info, call_timeout_s
        self.url, self.model_name = info["url"], info["model_name"]
        self.weight_backend = info["weight_backend"]
        self.pid = None  # on another node: never a pid the driver's host may signal
        self.remote_pid = info["pid"]
        self._dead = False

    @property
    def alive(self) -> bool:
        return not self._dead  # the HTTP health probes find a dead server; kill/stop mark it here

    def kill(self) -> None:
        """Fault injection: SIGKILL the server on its node (fire and forget: called on the fleet's event loop)."""
        self._dead = True
        self.actor.kill.remote()

    def stop(self) -> None:
        try:
            ray.get(self.actor.stop.remote(), timeout=self.call_timeout_s)
        except Exception as exc:  # its node may be gone: the actor's death took the server with it
            log.warning("stopping server at %s: %s", self.url, exc)
        finally:
            self._dead = True
            ray.kill(self.actor)


class RayServerLauncher:
    """Starts server ``i`` in placement group ``pgs[i]`` (one bundle: the server's TP GPUs)."""

    def __init__(self, pgs: dict[int, Any], gpus: dict[int, int], loopback: bool, startup_timeout_s: float) -> None:
        self.pgs, self.gpus, self.loopback = dict(pgs), dict(gpus), loopback
        self.startup_timeout_s = startup_timeout_s
        self.placed: dict[int, dict[str, Any]] = {}  # index -> where its actor ran (node, GPUs, netns)

    def add(self, pgs: dict[int, Any], gpus: dict[int, int]) -> None:
        self.pgs.update(pgs)
        self.gpus.update(gpus)

    async def start(self, index: int, args: VLLMServerArgs, run_dir: Path, cache_dir: Path) -> RemoteServer:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if index not in self.pgs:
            raise ValueError(f"server {index} has no placement group (placed: {sorted(self.pgs)})")
        actor = EngineServerActor.options(
            name=None,
            num_gpus=self.gpus[index],
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.pgs[index], placement_group_bundle_index=0),
        ).remote()
        try:
            info = await asyncio.wait_for(
                asyncio.wrap_future(
                    actor.start.remote(dataclasses.asdict(args), str(run_dir), str(cache_dir), self.loopback).future()
                ),
                timeout=self.startup_timeout_s + 30,
            )
        except BaseException:
            ray.kill(actor)
            raise
        self.placed[index] = info
        log.info("server %d: actor on node %s, GPUs %s, serving %s", index, info["node_ip"], info["gpus"], info["url"])
        return RemoteServer(actor, info)
