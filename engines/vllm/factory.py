"""The fleet's vLLM servers: :class:`VLLMFactory` starts them (or attaches to running ones) and hands out
:class:`FleetVLLMClient`.

A :class:`FleetVLLMClient` is the generation client that also owns its server process (``pid``, ``alive``,
``kill`` for fault injection) and learns the version its server holds by asking it, because with vLLM the
weights arrive from the learner's publisher, not through the fleet. Where the server runs is the launcher's
choice: a child process of the fleet (:class:`LocalLauncher`) or a Ray actor per placement bundle
(``launch/server_actor.py``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from pathlib import Path
from typing import Any

from engines.base import EngineError, ServerFactory, adapter_versions
from engines.vllm.generation import VLLMGenerationClient
from engines.vllm.lora import lora_server_settings
from engines.vllm.server import VLLMServer, VLLMServerArgs, shared_cache_dir, tokenizer_eos_ids
from weight_sync.adapter_publisher import ADAPTER_PREFIX, adapter_publish
from weight_sync.config import NCCL_ENV

log = logging.getLogger(__name__)


class FleetVLLMClient(VLLMGenerationClient):
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
        self.cache_dir = shared_cache_dir()  # warm compiles across runs

    def _server_args(self, index: int) -> VLLMServerArgs:
        r = self.cfg.rollout
        env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        if index in self.slots:  # GPU: the slot's devices (CPU runs have no slots)
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in self.slots[index][1])
            # every process of the weight-sync group must agree (the learner sets the same)
            env.update({k: os.environ.get(k, v) for k, v in NCCL_ENV.items()})
        if adapter_publish(self.cfg):  # LoRA: the policy arrives as adapters loaded at runtime
            env.update(lora_server_settings(self.cfg.learner.lora.rank, self._adapter_versions())[1])
        args = VLLMServerArgs(
            model=self.cfg.model.path,
            dtype=self.cfg.model.dtype,
            max_model_len=r.max_model_len,
            tensor_parallel_size=r.tensor_parallel_size,
            gpu_memory_utilization=r.gpu_memory_utilization,
            max_num_seqs=r.max_num_seqs,
            seed=self.cfg.run.seed + index,
            enforce_eager=r.enforce_eager,
            startup_timeout_s=r.startup_timeout_s,
            extra_args=self._extra_args(index),
            env=env,
            # vLLM's own nccl backend only when asked for (and on GPU); else fleetrl's
            weight_backend="auto" if self.cfg.weight_sync.nccl_impl == "vllm" else "fleetrl",
            skip_tokenizer_init=True,  # token ids in and out: the clients name EOS (self.eos_token_ids)
        )
        return args

    @functools.cached_property
    def eos_token_ids(self) -> list[int]:
        """The EOS vLLM takes from the model's tokenizer, which the fleet's servers do not load: every client
        adds it to the stop ids of a request that does not ``ignore_eos``."""
        return tokenizer_eos_ids(self.cfg.model.path)

    def _server(self, index: int) -> VLLMServer:
        """The server process ``index`` would be, as the local launcher builds it (its command, env)."""
        return VLLMServer(self._server_args(index), self.run_dir / f"vllm-{index}", cache_dir=self.cache_dir)

    def _extra_args(self, index: int) -> list[str]:
        args = list(self.cfg.rollout.vllm_server_args)
        c = self.cfg.colocate
        # a server with a GPU slot runs on CUDA (this actor may see no GPU of its own)
        if c.enabled and c.sleep_level(index in self.slots) and "--enable-sleep-mode" not in args:
            args.append("--enable-sleep-mode")  # colocated: the engines sleep while the learner trains
        if adapter_publish(self.cfg):
            args += lora_server_settings(self.cfg.learner.lora.rank, self._adapter_versions())[0]
        return args

    def _adapter_versions(self) -> int:
        return adapter_versions(self.cfg.broker.max_staleness)

    def _adapter_prefix(self) -> str | None:
        return ADAPTER_PREFIX if adapter_publish(self.cfg) else None

    async def start(self, index: int) -> FleetVLLMClient:
        if self.urls:
            return await self._attach(index)
        server = await self.launcher.start(
            index, self._server_args(index), self.run_dir / f"vllm-{index}", self.cache_dir
        )
        client = FleetVLLMClient(
            f"vllm-{index}",
            server.url,
            model=server.model_name,
            adapter_prefix=self._adapter_prefix(),
            adapter_versions=self._adapter_versions(),
            request_timeout_s=self.cfg.rollout.request_timeout_s,
            eos_token_ids=await asyncio.to_thread(lambda: self.eos_token_ids),
        )
        client.server = server
        return client

    async def _attach(self, index: int) -> FleetVLLMClient:
        if not 0 <= index < len(self.urls):
            raise ValueError(
                f"attach mode (rollout.urls) has {len(self.urls)} server(s); there is no server "
                f"{index} to attach, and the fleet starts none of its own"
            )
        url = self.urls[index].rstrip("/")
        client = FleetVLLMClient(
            f"vllm-{index}",
            url,
            model=self.cfg.model.path,
            request_timeout_s=self.cfg.rollout.request_timeout_s,
            adapter_prefix=self._adapter_prefix(),
            adapter_versions=self._adapter_versions(),
            # the same EOS the server takes from its tokenizer (harmless twice; needed if it runs without one)
            eos_token_ids=await asyncio.to_thread(lambda: self.eos_token_ids),
        )
        deadline = asyncio.get_running_loop().time() + self.cfg.rollout.startup_timeout_s
        while True:
            try:
                if await client.health():
                    break
            except Exception as exc:  # not up (yet): keep asking until the limit
                log.debug("attached server %s: health failed: %s", url, exc)
            if asyncio.get_running_loop().time() > deadline:
                await client.close()
                raise EngineError(
                    f"attached server {url} (rollout.urls[{index}]) did not answer /health "
                    f"within {self.cfg.rollout.startup_timeout_s:.0f} s"
                )
            await asyncio.sleep(1.0)
        r = await client._request("GET", "/v1/models", timeout_s=30.0)
        served = [m["id"] for m in r.json().get("data", [])]
        if not served:
            await client.close()
            raise EngineError(f"attached server {url} serves no model (GET /v1/models)")
        client.model = served[0]  # the name it serves under (--served-model-name), not our path
        log.info(
            "fleet: attached vllm-%d at %s serving %r (not started, never restarted by the fleet)",
            index,
            url,
            client.model,
        )
        return client
