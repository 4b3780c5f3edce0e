"""The rollout fleet as one process: controller + workers on an asyncio loop (a Ray actor in a run).

It is a plain class so tests can run it in-process; :mod:`launch.ray_actors` wraps it with
``ray.remote`` (an async actor: its methods run concurrently on the actor's event loop,
so ``status`` answers while the workers run) and builds its config from the run config.

Which engine, prompts and rewards it uses follows ``rollout.engine``: ``simulated`` takes
the SIMULATED engine, synthetic prompts and a simulated reward; the others take the
Parquet dataset and the configured reward function.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Protocol

import msgspec

from broker.client import ProducerClient
from broker.config import BrokerConfig
from core.configbase import ModelConfig, RunKeys
from rollout_fleet.config import DataConfig, RewardConfig, RolloutConfig
from rollout_fleet.controller import FleetController
from rollout_fleet.status import FleetStatus, ServerState, WorkerStatus
from rollout_fleet.worker import AsyncProducer, RolloutWorker
from weight_sync.config import WeightSyncConfig

log = logging.getLogger(__name__)


class FleetRunConfig(Protocol):
    """What the fleet reads of the run config (``launch.config.RunConfig`` is one)."""

    @property
    def model(self) -> ModelConfig: ...
    @property
    def data(self) -> DataConfig: ...
    @property
    def reward(self) -> RewardConfig: ...
    @property
    def rollout(self) -> RolloutConfig: ...
    @property
    def broker(self) -> BrokerConfig: ...
    @property
    def weight_sync(self) -> WeightSyncConfig: ...
    @property
    def run(self) -> RunKeys: ...


class FleetService:
    def __init__(self, cfg: FleetRunConfig, broker_address: str, *, slots: dict[int, Any] | None = None,
                 run_dir: str | None = None, launcher=None) -> None:
        self.cfg = cfg
        self.launcher = launcher  # how vLLM servers start (None: child processes on loopback)
        self.broker_address = broker_address
        self.run_dir = run_dir
        self.slots = dict(slots or {})  # server index -> placement slot (node, GPU ids)
        self.simulated = self.cfg.rollout.engine == "simulated"
        self._stop = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._versions_task: asyncio.Task | None = None
        self._t0 = time.monotonic()
        self._tok_hist: list[tuple[float, int]] = []

    def _components(self):
        """(engine factory, a loader of (prompts, rewards)); the loader runs while servers start."""
        r, seed = self.cfg.rollout, self.cfg.run.seed
        if self.simulated:
            from rollout_fleet.engines.simulated import SimulatedFactory
            from rollout_fleet.simulation import SimulatedRewards, SyntheticPrompts

            return SimulatedFactory(r.simulated, seed=seed), lambda: (
                SyntheticPrompts(seed=seed, vocab_size=r.simulated.vocab_size), SimulatedRewards(seed=seed))
        from rollout_fleet.vllm_fleet import VLLMFactory, load_data

        run_dir = self.run_dir or self.cfg.run.run_dir
        if r.engine == "sglang":
            from rollout_fleet.sglang_fleet import SGLangFactory

            return SGLangFactory(self.cfg, run_dir, self.slots), lambda: load_data(self.cfg)
        return VLLMFactory(self.cfg, run_dir, self.slots, launcher=self.launcher), lambda: load_data(self.cfg)

    async def start(self, n_servers: int, indices: list[int] | None = None) -> dict[str, Any]:
        log.info("fleet event loop: %s", type(asyncio.get_running_loop()).__module__)
        factory, loader = self._components()
        data = asyncio.create_task(asyncio.to_thread(loader))  # tokenizing overlaps the servers' start
        self.fleet = FleetController(self.cfg.rollout, factory)
        await asyncio.gather(*(self.fleet.add_server(i) for i in (indices if indices is not None else range(n_servers))))
        prompts, rewards = await data
        await self.fleet.start(0)  # servers are in; start the health loop
        self.producer = AsyncProducer(ProducerClient(self.broker_address, producer_id="fleet",
                                                     curve_keys_dir=self.cfg.broker.curve_keys_dir))
        self.worker = RolloutWorker(self.fleet, self.producer, prompts, rewards, self.cfg.rollout.sampling,
                                    max_inflight_groups=self.cfg.rollout.max_inflight_groups,
                                    max_staleness=self.cfg.broker.max_staleness, seed=self.cfg.run.seed)
        self._task = asyncio.create_task(self.worker.run(self._stop), name="rollout-worker")
        self._versions_task = asyncio.create_task(self._report_versions(), name="engine-versions")
        return self.status_now()

    async def evaluate(self, n: int) -> float | None:
        """Greedy test accuracy through the fleet (None for SIMULATED engines: there is no model)."""
        if self.simulated:
            return None
        from rollout_fleet.vllm_fleet import evaluate

        return await evaluate(self.cfg, self.fleet, n)

    async def stop_workers(self) -> None:
        """Stop taking tickets (before the final evaluation); servers stay up."""
        self._stop.set()
        if self._task is not None:
            await asyncio.wait({self._task}, timeout=30.0)

    async def server_urls(self) -> dict[str, str]:
        """Healthy servers' URLs, for the learner's publisher (its membership follows the fleet)."""
        return {s.engine_id: s.engine.url for s in self.fleet.servers.values()
                if s.state == ServerState.HEALTHY and hasattr(s.engine, "url")}

    async def _report_versions(self) -> None:
        """Learn each server's version (vLLM: from the server) and tell the broker, for per-engine lag."""
        while True:
            for s in list(self.fleet.servers.values()):
                refresh = getattr(s.engine, "refresh_version", None)
                if refresh is not None and s.state == ServerState.HEALTHY:
                    try:
                        await asyncio.wait_for(refresh(), timeout=5.0)
                    except Exception as exc:  # a dead server is the health loop's business
                        log.debug("version refresh of %s failed: %s", s.engine_id, exc)
                try:
                    await self.producer.report_engine_version(s.engine_id, s.engine.weight_version)
                except Exception as exc:  # lag reporting must never stop the fleet
                    log.debug("engine version report failed: %s", exc)
            await asyncio.sleep(0.5)

    async def update_weights(self, version: int, export_path: str | None = None) -> float:
        """Fleet-side choreography of one publish (the SIMULATED publisher calls this)."""
        return await self.fleet.update_fleet(version, export_path)

    async def engines_updated(self, engine_ids: list[str], version: int, relabel: bool = False) -> None:
        """The learner's publisher loaded ``version`` into these servers (vLLM 0.26 cannot report it itself);
        ``relabel``: nothing was loaded, the step changed no weights (not counted as a weight update)."""
        if not relabel:
            self.fleet.weight_updates += 1
        for eid in engine_ids:
            s = self.fleet.servers.get(eid)
            if s is not None and hasattr(s.engine, "_version"):
                s.engine._version = max(s.engine._version, int(version))

    async def set_latest_export(self, version: int, path: str) -> None:
        self.fleet.set_latest_export(version, path)

    async def add_servers(self, indices: list[int], slots: dict[int, Any] | None = None) -> list[str]:
        self.slots.update(slots or {})
        return list(await asyncio.gather(*(self.fleet.add_server(i) for i in indices)))

    async def scale_to(self, n_servers: int) -> list[int]:
        return await self.fleet.scale_to(n_servers)

    async def kill_server(self, engine_id: str) -> None:
        """Fault injection: kill one server as ``kill -9`` would."""
        engine = self.fleet.servers[engine_id].engine
        kill = getattr(engine, "kill", None)
        if kill is None:
            raise ValueError(f"engine {engine_id} cannot be killed from the fleet")
        res = kill()
        if asyncio.iscoroutine(res):
            await res

    async def status(self) -> dict[str, Any]:
        return self.status_now()

    def status_now(self) -> dict[str, Any]:
        """:meth:`record` as plain data (the actor's answer)."""
        return msgspec.to_builtins(self.record())

    def record(self) -> FleetStatus:
        now = time.monotonic()
        w = self.worker.record() if hasattr(self, "worker") else WorkerStatus()
        self._tok_hist.append((now, w.tokens_pushed))
        self._tok_hist = [(t, n) for t, n in self._tok_hist if now - t <= 10.0]
        t_old, n_old = self._tok_hist[0]
        st = self.fleet.record() if hasattr(self, "fleet") else FleetStatus()
        return msgspec.structs.replace(
            st, **msgspec.structs.asdict(w), simulated=self.simulated,
            tok_per_s=(w.tokens_pushed - n_old) / (now - t_old) if now > t_old else None,
            fleet_idle_fraction=w.idle_s / max(1e-9, now - self._t0),
            healthy_servers=sum(1 for s in st.servers if s.state == ServerState.HEALTHY))

    async def stop(self) -> dict[str, Any]:
        self._stop.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(self._task, timeout=10.0)
            except (TimeoutError, asyncio.CancelledError):
                await self.worker.cancel_inflight()
        if self._versions_task is not None:
            self._versions_task.cancel()
        final = self.status_now()
        # a start that failed part-way (a server that never came up) leaves some of these unset
        if hasattr(self, "fleet"):
            await self.fleet.close()
        if hasattr(self, "producer"):
            await self.producer.close()
        return final
