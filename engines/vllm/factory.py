"""The fleet's real parts: vLLM servers, the Parquet dataset, the reward pool, and evaluation.

Adapters between the fleet (rollout_fleet.controller / worker) and the pieces other
packages own: :class:`VLLMFactory` starts :class:`VLLMServer` processes and hands out
:class:`FleetVLLMClient` (a VLLMClient that also learns the version its server holds,
because with vLLM the weights arrive from the learner's publisher, not through the
fleet); :class:`DatasetPrompts` and :class:`PoolRewards` wrap PromptDataset and RewardPool.
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path
from typing import Any

from rollout_fleet.engines.base import EngineError, Sample, SamplingParams
from rollout_fleet.engines.vllm import VLLMClient, VLLMServer, VLLMServerArgs
from rollout_fleet.engines.vllm_lora import lora_server_settings
from rollout_fleet.rewards import RewardError
from rollout_fleet.worker import Prompt, RewardFailed
from weight_sync.adapter_publisher import ADAPTER_PREFIX, adapter_publish
from weight_sync.config import NCCL_ENV

log = logging.getLogger(__name__)
REPO_ROOT = Path(__file__).resolve().parent.parent


class FleetVLLMClient(VLLMClient):
    """The fleet's client of one server: generation, health, and the version the server holds."""

    server: VLLMServer | None = None

    @property
    def pid(self) -> int | None:
        return self.server.pid if self.server is not None else None

    async def refresh_version(self) -> int:
        """Ask the server which weights it holds (the publisher loads them, not this client)."""
        v = await self.server_weight_version()
        try:
            self._version = max(self._version, int(v)) if v is not None else self._version
        except ValueError:
            pass  # the initial label (e.g. the model path) means version 0
        return self._version

    @property
    def alive(self) -> bool:
        """False once the server process has exited (no need to wait for an HTTP timeout)."""
        return self.server is None or self.server.alive

    def kill(self) -> None:
        """Fault injection: SIGKILL the server process (as ``kill -9`` would)."""
        if self.server is None:
            raise ValueError(f"engine {self.engine_id} is attached (rollout.urls): the fleet does not own it")
        log.warning("killing vLLM server %s (pid %s) with SIGKILL", self.engine_id, self.server.pid)
        self.server.kill()


class ServerFactory:
    """What the fleet asks of an engine factory besides ``start(index)``: restart and stop a server.

    Clients are named ``<engine>-<index>`` and hold their server process in ``.server``.
    """

    async def start(self, index: int):
        raise NotImplementedError

    async def restart(self, engine):
        index = int(engine.engine_id.rsplit("-", 1)[1])
        await self.stop(engine)
        return await self.start(index)

    async def stop(self, engine) -> None:
        await engine.close()
        if engine.server is not None:  # None: attached (rollout.urls), not ours to stop
            await asyncio.to_thread(engine.server.stop)


class LocalLauncher:
    """Starts a server as a child process of the fleet, bound to ``host`` (a one-host job, or CPU fleets)."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host

    async def start(self, index: int, args: VLLMServerArgs, run_dir: Path, cache_dir: Path) -> VLLMServer:
        args.host = self.host
        server = VLLMServer(args, run_dir, cache_dir=cache_dir)
        await asyncio.to_thread(server.start)  # blocks until /health answers (40-80 s on CPU)
        return server


class VLLMFactory(ServerFactory):
    """Starts vLLM servers through ``launcher`` (local child processes, or one Ray actor per placement
    bundle: launch/server_actor.py), or with ``rollout.urls`` attaches to servers already running.

    Attach mode: server ``i`` is ``rollout.urls[i]``; the fleet probes it, sends it work, and the
    learner's publisher joins it to weight sync (it must run fleetrl's server command: the worker
    extension, ``--weight-transfer-config '{"backend": "fleetrl"}'``, ``VLLM_SERVER_DEV_MODE=1``).
    The fleet never starts, restarts or stops one: a "restart" waits for it to answer ``/health``
    again, and stop only closes the client.
    """

    def __init__(self, cfg, run_dir: Path, slots: dict[int, Any], launcher=None) -> None:
        self.cfg, self.run_dir, self.slots = cfg, Path(run_dir), slots
        self.launcher = launcher or LocalLauncher()
        self.urls = list(cfg.rollout.urls)
        self.cache_dir = Path(os.environ.get("FLEETRL_CACHE_DIR", REPO_ROOT / ".cache"))  # warm compiles across runs

    def _server_args(self, index: int) -> VLLMServerArgs:
        r = self.cfg.rollout
        env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        if index in self.slots:  # GPU: the slot's devices (CPU runs have no slots)
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in self.slots[index][1])
            # every process of the weight-sync group must agree (the learner sets the same)
            env.update({k: os.environ.get(k, v) for k, v in NCCL_ENV.items()})
        if adapter_publish(self.cfg):  # LoRA: the policy arrives as adapters loaded at runtime
            env.update(lora_server_settings(self.cfg.learner.lora.rank)[1])
        args = VLLMServerArgs(model=self.cfg.model.path, dtype=self.cfg.model.dtype,
                              max_model_len=r.max_model_len, tensor_parallel_size=r.tensor_parallel_size,
                              gpu_memory_utilization=r.gpu_memory_utilization, max_num_seqs=r.max_num_seqs,
                              seed=self.cfg.run.seed + index, enforce_eager=r.enforce_eager,
                              startup_timeout_s=r.startup_timeout_s, extra_args=self._extra_args(index), env=env,
                              # vLLM's own nccl backend only when asked for (and on GPU); else fleetrl's
                              weight_backend="auto" if self.cfg.weight_sync.nccl_impl == "vllm" else "fleetrl")
        return args

    def _server(self, index: int) -> VLLMServer:
        """The server process ``index`` would be, as the local launcher builds it (its command, env)."""
        return VLLMServer(self._server_args(index), self.run_dir / f"vllm-{index}", cache_dir=self.cache_dir / "vllm-server")

    def _extra_args(self, index: int) -> list[str]:
        args = list(self.cfg.rollout.vllm_server_args)
        c = self.cfg.colocate
        # a server with a GPU slot runs on CUDA (this actor may see no GPU of its own)
        if c.enabled and c.sleep_level(index in self.slots) and "--enable-sleep-mode" not in args:
            args.append("--enable-sleep-mode")  # colocated: the engines sleep while the learner trains
        if adapter_publish(self.cfg):
            args += lora_server_settings(self.cfg.learner.lora.rank)[0]
        return args

    def _adapter_prefix(self) -> str | None:
        return ADAPTER_PREFIX if adapter_publish(self.cfg) else None

    async def start(self, index: int) -> FleetVLLMClient:
        if self.urls:
            return await self._attach(index)
        server = await self.launcher.start(index, self._server_args(index), self.run_dir / f"vllm-{index}",
                                           self.cache_dir / "vllm-server")
        client = FleetVLLMClient(f"vllm-{index}", server.url, model=server.model_name,
                                 weight_backend=server.weight_backend, adapter_prefix=self._adapter_prefix(),
                                 request_timeout_s=self.cfg.rollout.request_timeout_s)
        client.server = server
        return client

    async def _attach(self, index: int) -> FleetVLLMClient:
        if not 0 <= index < len(self.urls):
            raise ValueError(f"attach mode (rollout.urls) has {len(self.urls)} server(s); there is no server "
                             f"{index} to attach, and the fleet starts none of its own")
        url = self.urls[index].rstrip("/")
        client = FleetVLLMClient(f"vllm-{index}", url, model=self.cfg.model.path, weight_backend="fleetrl",
                                 request_timeout_s=self.cfg.rollout.request_timeout_s,
                                 adapter_prefix=self._adapter_prefix())
        deadline = asyncio.get_running_loop().time() + self.cfg.rollout.startup_timeout_s
        while True:
            try:
                if await client.health():
                    break
            except Exception as exc:  # not up (yet): keep asking until the limit
                log.debug("attached server %s: health failed: %s", url, exc)
            if asyncio.get_running_loop().time() > deadline:
                await client.close()
                raise EngineError(f"attached server {url} (rollout.urls[{index}]) did not answer /health "
                                  f"within {self.cfg.rollout.startup_timeout_s:.0f} s")
            await asyncio.sleep(1.0)
        r = await client._request("GET", "/v1/models", timeout_s=30.0)
        served = [m["id"] for m in r.json().get("data", [])]
        if not served:
            await client.close()
            raise EngineError(f"attached server {url} serves no model (GET /v1/models)")
        client.model = served[0]  # the name it serves under (--served-model-name), not our path
        log.info("fleet: attached vllm-%d at %s serving %r (not started, never restarted by the fleet)",
                 index, url, client.model)
        return client


class DatasetPrompts:
    """PromptDataset (shuffled epochs, checkpointable position) as the worker's PromptSource."""

    def __init__(self, dataset) -> None:
        self.ds = dataset

    def next(self) -> Prompt:
        row = self.ds.next()
        return Prompt(prompt_ids=row.prompt_ids.tolist(), ground_truth=row.ground_truth, data_source=row.data_source,
                      extra_info=row.extra_info)

    def state_dict(self) -> dict[str, Any]:
        return self.ds.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ds.load_state_dict(state)


class PoolRewards:
    """Decodes responses and scores them in the RewardPool (threads/processes off the event loop).

    The reward function sees the row's ``data_source`` and ``extra_info`` besides the ground
    truth. A truncated response (finish reason ``length``) is scored, or with
    ``on_truncated="penalize"`` given ``truncated_reward`` instead (``mask``: scored, and the
    learner leaves it out of the loss).
    """

    def __init__(self, pool, tokenizer, *, on_truncated: str = "score", truncated_reward: float = 0.0) -> None:
        self.pool, self.tok = pool, tokenizer
        self.on_truncated, self.truncated_reward = on_truncated, truncated_reward

    def text(self, s: Sample) -> str:
        return self.tok.decode(s.token_ids.tolist(), skip_special_tokens=True)

    async def score(self, prompt: Prompt, samples: list[Sample]) -> list[float]:
        extra = {"data_source": prompt.data_source, "extra_info": prompt.extra_info}
        items = [(self.text(s), prompt.ground_truth, f"sample {i}", extra) for i, s in enumerate(samples)]
        if self.pool.batched:
            try:
                out = list(await self.pool.score_batch(items))
            except RewardError as err:
                raise RewardFailed(f"batched reward failed for the group: {err}") from err
        else:
            out = await self.pool.score_many(items)
        bad = [r for r in out if not isinstance(r, float | int)]
        if bad:
            # never train on a made-up reward: the group is dropped and counted by the worker
            raise RewardFailed(f"reward failed for {len(bad)} of {len(out)} samples: {bad[0]}")
        if self.on_truncated == "penalize":
            out = [self.truncated_reward if s.finish_reason == "length" else r for s, r in zip(samples, out, strict=True)]
        return [float(r) for r in out]


def reward_pool(cfg, workers: int | None = None):
    """The configured reward pool; ``reward.function: default`` is checked against the data's sources first."""
    from rollout_fleet.rewards import RewardPool

    r = cfg.reward
    return RewardPool(r.function, workers=workers or r.workers, timeout_s=r.timeout_s, mode=r.mode, batched=r.batched)


def check_reward_sources(cfg, *datasets) -> None:
    if cfg.reward.function == "default":
        from rollout_fleet.scorers import check_sources

        check_sources({row.data_source for ds in datasets for row in ds.rows})


def load_data(cfg) -> tuple[DatasetPrompts, PoolRewards]:
    """The training prompts (tokenized) and the reward pool."""
    from rollout_fleet import data as rdata

    if cfg.rollout.engine not in ("vllm", "sglang"):
        raise ValueError(f"launch/cluster.py runs rollout.engine 'vllm', 'sglang' or 'simulated'; "
                         f"got {cfg.rollout.engine!r}")
    tok = rdata.load_tokenizer(cfg.model.path)
    ds = rdata.from_config(cfg.data, tok, seed=cfg.run.seed, response_tokens=cfg.rollout.sampling.max_tokens,
                           max_model_len=cfg.rollout.max_model_len)
    check_reward_sources(cfg, ds)
    return DatasetPrompts(ds), PoolRewards(reward_pool(cfg), tok, on_truncated=cfg.reward.on_truncated,
                                           truncated_reward=cfg.reward.truncated_reward)


async def evaluate(cfg, fleet, n: int) -> float | None:
    """Accuracy (the configured reward, as in training) on the first ``n`` test prompts, spread over the
    fleet, sampled as ``rollout.eval_sampling`` says (greedy by default; with ``eval_sampling.n`` > 1 the
    mean over each prompt's samples); None when there is nothing to evaluate (no test files, ``n`` = 0)."""
    from rollout_fleet import data as rdata

    if n <= 0 or not cfg.data.test_files:
        return None
    tok = rdata.load_tokenizer(cfg.model.path)
    ds = rdata.from_config(cfg.data, tok, seed=cfg.run.seed, split="test",
                           response_tokens=cfg.rollout.sampling.max_tokens, max_model_len=cfg.rollout.max_model_len)
    rows = [ds.next() for _ in range(min(n, len(ds)))]
    ev = cfg.rollout.eval_sampling
    params = SamplingParams(n=ev.n, max_tokens=cfg.rollout.sampling.max_tokens, temperature=ev.effective_temperature,
                            top_p=ev.top_p, top_k=ev.top_k)
    scorer = PoolRewards(reward_pool(cfg, workers=1), tok)  # accuracy: a truncated answer is scored as it is
    sem = asyncio.Semaphore(64)
    # only servers at the newest weights present: one that just joined (version 0 until its first
    # publish) must not answer for the trained policy
    newest = max((s.engine.weight_version for s in fleet.servers.values() if s.state == "healthy"), default=0)

    async def one(i: int, row) -> float:
        async with sem:
            _, samples = await fleet.run_group(f"eval-{i}", row.prompt_ids.tolist(), params, min_version=newest)
        p = Prompt(prompt_ids=[], ground_truth=row.ground_truth, data_source=row.data_source, extra_info=row.extra_info)
        scores = await scorer.score(p, samples)
        return sum(scores) / len(scores)

    try:
        scores = await asyncio.gather(*(one(i, r) for i, r in enumerate(rows)))
    finally:
        scorer.pool.close()
    return sum(scores) / len(scores)
