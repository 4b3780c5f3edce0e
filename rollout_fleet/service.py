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
from core.colocate_config import ColocateConfig
from core.configbase import ModelConfig, RunKeys
from rollout_fleet import position
from rollout_fleet.config import DataConfig, RewardConfig, RolloutConfig
from rollout_fleet.controller import FleetController
from rollout_fleet.reward_models import ModelRewardScorer
from rollout_fleet.reward_models import from_config as reward_model_scorer
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
    @property
    def colocate(self) -> ColocateConfig: ...


class FleetService:
    def __init__(
        self,
        cfg: FleetRunConfig,
        broker_address: str,
        *,
        slots: dict[int, Any] | None = None,
        run_dir: str | None = None,
        eval_every: int = 0,
        eval_samples: int = 0,
        launcher=None,
        proxy_host: str = "127.0.0.1",
    ) -> None:
        """``eval_every`` / ``eval_samples``: colocated mode's evaluations during the run (run.eval_every),
        which it runs at the wake after those steps, never while the learner trains. ``launcher``: how vLLM
        servers start (None: child processes on loopback). ``proxy_host``: where ``rollout.proxy`` binds."""
        self.cfg = cfg
        self.launcher = launcher
        self.eval_every, self.eval_samples = eval_every, eval_samples
        self.colocated = None  # rollout_fleet.colocated_gate.ColocatedEngines when colocate.enabled
        self.broker_address = broker_address
        self.run_dir = run_dir
        self.slots = dict(slots or {})  # server index -> placement slot (node, GPU ids)
        self.simulated = self.cfg.rollout.engine == "simulated"
        self.proxy_host = proxy_host
        self.proxy = None  # rollout_fleet.proxy.ChatProxy with rollout.proxy
        self._stop = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._versions_task: asyncio.Task | None = None
        self._t0 = time.monotonic()
        self._tok_hist: list[tuple[float, int]] = []

    def _components(self):
        """(engine factory, a loader of (prompts, rewards)); the loader runs while servers start."""
        r, seed = self.cfg.rollout, self.cfg.run.seed
        if self.simulated:
            from engines.simulated import SimulatedFactory
            from rollout_fleet.simulated_data import SimulatedRewards, SyntheticPrompts

            return SimulatedFactory(r.simulated, seed=seed), lambda: (
                SyntheticPrompts(seed=seed, vocab_size=r.simulated.vocab_size),
                SimulatedRewards(seed=seed),
            )
        from engines.vllm.factory import VLLMFactory
        from rollout_fleet.prompts_and_rewards import load_data

        run_dir = self.run_dir or self.cfg.run.run_dir
        if r.engine == "sglang":
            from engines.sglang.factory import SGLangFactory

            return SGLangFactory(self.cfg, run_dir, self.slots), lambda: load_data(self.cfg)
        return VLLMFactory(self.cfg, run_dir, self.slots, launcher=self.launcher), lambda: load_data(self.cfg)

    async def start(
        self, n_servers: int, indices: list[int] | None = None, catch_up: int | None = None
    ) -> dict[str, Any]:
        """``catch_up``: a fleet restarted mid-run (launch/fleet_recovery.py), with the learner's version then:
        its servers load the learner's latest export (RUN_DIR/export/latest; SIMULATED engines: that version)
        before they take work, as a restarted server does."""
        log.info("fleet event loop: %s", type(asyncio.get_running_loop()).__module__)
        factory, loader = self._components()
        data = asyncio.create_task(asyncio.to_thread(loader))  # tokenizing overlaps the servers' start
        self.fleet = FleetController(self.cfg.rollout, factory)
        if catch_up is not None:
            latest = (
                (catch_up, f"simulated://v{catch_up}") if self.simulated else position.latest_export(self._run_dir())
            )
            if latest is not None:
                self.fleet.set_latest_export(*latest)
                log.info("restarted fleet: servers load v%d (%s) before taking work", *latest)
        await asyncio.gather(
            *(self.fleet.add_server(i) for i in (indices if indices is not None else range(n_servers)))
        )
        prompts, rewards = await data
        if self.cfg.reward.model is not None:  # a judge or reward-model server scores instead
            rewards = reward_model_scorer(self.cfg.reward.model, self.cfg.model.path)
            # the launcher's reward servers start beside the fleet's: no group before they answer
            await rewards.model.wait_ready(self.cfg.reward.model.server.startup_timeout_s)
            log.info("reward model: %d server(s) healthy: %s", len(rewards.model.urls), rewards.model.urls)
        await self.fleet.start(0)  # servers are in; start the health loop
        if self.cfg.rollout.proxy is not None:
            await self._start_proxy()
        self.producer = AsyncProducer(
            ProducerClient(self.broker_address, producer_id="fleet", curve_keys_dir=self.cfg.broker.curve_keys_dir)
        )
        worker_cls, extra = (
            RolloutWorker,
            {"filter_groups": self.cfg.rollout.filter_groups, "overlong": self.cfg.reward.overlong_buffer},
        )
        if self.cfg.rollout.env is not None:  # multi-turn episodes (rollout_fleet/envs)
            from rollout_fleet.envs.registry import worker_kwargs
            from rollout_fleet.envs.worker import MultiTurnWorker

            worker_cls, extra = MultiTurnWorker, worker_kwargs(self.cfg.rollout.env, self.cfg.model.path)
        elif self.cfg.rollout.proxy is not None and self.cfg.rollout.proxy.agent:  # OpenAI-client agents
            from rollout_fleet.envs.agent_worker import AgentWorker, resolve_agent

            worker_cls, extra = AgentWorker, {"proxy": self.proxy, "agent": resolve_agent(self.cfg.rollout.proxy.agent)}
        self.worker = worker_cls(
            self.fleet,
            self.producer,
            prompts,
            rewards,
            self.cfg.rollout.sampling,
            max_inflight_groups=self.cfg.rollout.inflight_groups(),  # resolved at launch (GPU or CPU)
            seed=self.cfg.run.seed,
            gate=self._colocated_gate(),
            **extra,
        )
        state = None if self.simulated else position.load(self._run_dir())
        if state is not None:  # a re-run on this run directory: the data continues where it stopped
            self.worker.load_state_dict(state)
            log.info("fleet data position restored: %s, %d prompts to replay", state["data"], len(state["replay"]))
        self._task = asyncio.create_task(self.worker.run(self._stop), name="rollout-worker")
        self._versions_task = asyncio.create_task(self._report_versions(), name="engine-versions")
        return self.status_now()

    async def _start_proxy(self) -> None:
        """The OpenAI-compatible proxy in front of the fleet (one for all servers: each request goes to the
        server the controller picks, never one behind the version the episode's last turn used)."""
        from rollout_fleet import data as rdata
        from rollout_fleet.envs.agent_worker import fleet_generate
        from rollout_fleet.envs.registry import stop_token_ids
        from rollout_fleet.proxy import ChatProxy

        p = self.cfg.rollout.proxy
        tok = await asyncio.to_thread(rdata.load_tokenizer, self.cfg.model.path)
        self.proxy = ChatProxy(
            fleet_generate(self.fleet),
            tok,
            model_name=self.cfg.model.path,
            stop_token_ids=stop_token_ids(tok),
            default_max_tokens=p.max_tokens,
            max_sessions=p.max_sessions,
        )
        url = await self.proxy.start(self.proxy_host, p.port)
        log.info("OpenAI-compatible proxy at %s (agent: %s)", url, p.agent)

    def _colocated_gate(self):
        c = self.cfg.colocate
        if not c.synchronous:  # shared async mode has no gate: the fleet runs on under the staleness bound
            return None
        from rollout_fleet.colocated_gate import ColocatedEngines

        level = c.sleep_level(bool(self.slots))  # servers with GPU slots run on CUDA
        self.colocated = ColocatedEngines(
            self.fleet,
            None,
            level=level,
            timeout_s=c.timeout_s,
            evaluate=lambda: self.evaluate(self.eval_samples),
            eval_every=self.eval_every,
            max_steps=self.cfg.run.max_steps,
        )
        log.info("colocated mode: synchronous, engines sleep at level %d while the learner trains", level)
        return lambda: self.colocated.gate.is_open

    def _need_colocated(self):
        if self.colocated is None:
            raise RuntimeError("colocated release/wake called on a fleet without colocate.enabled")
        self.colocated.worker = self.worker
        return self.colocated

    async def colocated_release(self, step: int) -> dict[str, float]:
        """Colocated mode: close the gate and put the engines to sleep (the learner trains step ``step``)."""
        return await self._need_colocated().release(step)

    async def colocated_wake(self, version: int, phase: str) -> dict[str, float]:
        """Colocated mode: wake the engines' weights ('weights') or the rest and open the gate ('rest')."""
        return await self._need_colocated().wake(version, phase)

    async def busy_intervals(self) -> dict[str, list[tuple[float, float]]]:
        """Per engine, when it had a group in flight (unix seconds; rollout_fleet/busy.py)."""
        return self.fleet.busy_intervals() if hasattr(self, "fleet") else {}

    async def colocated_summary(self) -> dict[str, Any]:
        """Colocated mode's schedule figures and its evaluations during the run (empty when off)."""
        if self.colocated is None:
            return {}
        return {**self.colocated.summary(), "eval_history": list(self.colocated.eval_history)}

    async def evaluate(self, n: int) -> float | None:
        """Greedy test accuracy through the fleet (None for SIMULATED engines: there is no model)."""
        if self.simulated:
            return None
        if self.cfg.rollout.env is not None:
            from rollout_fleet.envs.registry import evaluate_episodes

            return await evaluate_episodes(self.cfg, self.fleet, n)
        from rollout_fleet.evaluation import evaluate

        return await evaluate(self.cfg, self.fleet, n)

    async def stop_workers(self) -> None:
        """Stop taking tickets (before the final evaluation); servers stay up."""
        self._stop.set()
        if self._task is not None:
            await asyncio.wait({self._task}, timeout=30.0)

    async def server_urls(self) -> dict[str, str]:
        """Healthy servers' URLs, for the learner's publisher (its membership follows the fleet); none before
        ``start`` (a fleet actor restarted mid-run answers before the driver starts it again)."""
        if not hasattr(self, "fleet"):
            return {}
        return {
            s.engine_id: s.engine.url
            for s in self.fleet.servers.values()
            if s.state == ServerState.HEALTHY and hasattr(s.engine, "url")
        }

    def _run_dir(self) -> str:
        return self.run_dir or self.cfg.run.run_dir

    def _save_position(self) -> None:
        if not self.simulated and hasattr(self, "worker"):
            try:
                position.save(self._run_dir(), self.worker.state_dict())
            except OSError as exc:  # the next save retries; the run goes on
                log.warning("saving the fleet's data position failed: %s", exc)

    async def _report_versions(self) -> None:
        """Learn each server's version (vLLM: from the server) and tell the broker, for per-engine lag;
        save the data position (rollout_fleet/position.py) on the way."""
        while True:
            self._save_position()
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
        """Fleet-side choreography of one publish (the SIMULATED publisher calls this). Before ``start`` (a
        restarted fleet actor) there is no server to update: its start loads the learner's version."""
        if not hasattr(self, "fleet"):
            log.warning("publish of v%d to a fleet not started (restarted): nothing to update", version)
            return 0.0
        return await self.fleet.update_fleet(version, export_path)

    async def engines_updated(self, engine_ids: list[str], version: int, relabel: bool = False) -> None:
        """The learner's publisher loaded ``version`` into these servers (vLLM 0.26 cannot report it itself);
        ``relabel``: nothing was loaded, the step changed no weights (not counted as a weight update)."""
        if not hasattr(self, "fleet"):  # a restarted fleet actor not started again: its start catches up
            return
        if not relabel:
            self.fleet.weight_updates += 1
        for eid in engine_ids:
            s = self.fleet.servers.get(eid)
            if s is not None:
                s.engine.record_version(version)

    async def set_latest_export(self, version: int, path: str) -> None:
        if hasattr(self, "fleet"):  # a restarted fleet actor not started again reads export/latest at its start
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
        if hasattr(self, "worker") and isinstance(self.worker.rewards, ModelRewardScorer):
            # reward.model: its throughput and failures in the live view
            w = msgspec.structs.replace(w, reward_model=self.worker.rewards.model.status())
        self._tok_hist.append((now, w.tokens_pushed))
        self._tok_hist = [(t, n) for t, n in self._tok_hist if now - t <= 10.0]
        t_old, n_old = self._tok_hist[0]
        st = self.fleet.record() if hasattr(self, "fleet") else FleetStatus()
        if self.proxy is not None:
            st = msgspec.structs.replace(st, proxy_url=self.proxy.url, proxy=dict(self.proxy.counts))
        return msgspec.structs.replace(
            st,
            **msgspec.structs.asdict(w),
            simulated=self.simulated,
            tok_per_s=(w.tokens_pushed - n_old) / (now - t_old) if now > t_old else None,
            fleet_idle_fraction=w.idle_s / max(1e-9, now - self._t0),
            healthy_servers=sum(1 for s in st.servers if s.state == ServerState.HEALTHY),
        )

    async def stop(self, drain_s: float = 10.0) -> dict[str, Any]:
        """Stop: the loop gets ``drain_s`` to end on its own, then the groups in flight are cancelled (0 when
        they cannot end: the broker they push to is gone)."""
        self._save_position()  # before in-flight groups are cancelled: their prompts run first next time
        self._stop.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(self._task, timeout=drain_s)
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
        if self.proxy is not None:
            await self.proxy.stop()
        if hasattr(self, "worker") and isinstance(self.worker.rewards, ModelRewardScorer):
            await self.worker.rewards.model.close()
        return final
