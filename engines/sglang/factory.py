"""The fleet's SGLang servers: :class:`SGLangFactory` starts them on the fleet's GPUs and hands out
:class:`FleetSGLangClient`.

``rollout.engine: sglang`` swaps these in for the vLLM ones of :mod:`engines.vllm.factory`::

    fleet actor:   SGLangFactory.start(i) -> SGLangServer on the slot's GPUs -> FleetSGLangClient
    learner rank 0: Publisher(nccl_impl="sglang") -> engines.sglang.weights.SGLangPublishClient (one per server)
"""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path
from typing import Any

from core.http_client import free_port
from engines.base import ServerFactory, adapter_versions
from engines.sglang.generation import SGLangGenerationClient
from engines.sglang.lora import DECODER_LINEAR_MODULES, sglang_lora_server_args
from engines.sglang.server import SGLangServer, SGLangServerArgs
from weight_sync.adapter_publisher import ADAPTER_PREFIX, adapter_publish
from weight_sync.config import NCCL_ENV

log = logging.getLogger(__name__)


class FleetSGLangClient(SGLangGenerationClient):
    """The fleet's client of one SGLang server: generation, health, the server process."""

    server: SGLangServer | None = None

    @property
    def pid(self) -> int | None:
        return self.server.proc.pid if self.server is not None and self.server.proc is not None else None

    @property
    def alive(self) -> bool:
        return self.server is None or self.server.proc is None or self.server.proc.poll() is None

    async def refresh_version(self) -> int:
        """The version label the last update left on the server (``/model_info``)."""
        r = await self.http.get(self.url + "/model_info", timeout=5.0)
        v = r.json().get("weight_version") if r.status_code == 200 else None
        try:
            self._version = max(self._version, int(v))  # type: ignore[arg-type]  # None: TypeError, below
        except (TypeError, ValueError):
            pass  # the initial label ("default") means version 0
        return self._version

    def kill(self) -> None:
        """Fault injection: SIGKILL the server's process group (as ``kill -9`` would)."""
        if self.pid is not None:
            log.warning("killing SGLang server %s (pid %d) with SIGKILL", self.engine_id, self.pid)
            os.killpg(self.pid, signal.SIGKILL)


class SGLangFactory(ServerFactory):
    """Starts one SGLang server per fleet slot (GPU ids from the slot) and hands out its client."""

    def __init__(self, cfg, run_dir: str | Path, slots: dict[int, Any]) -> None:
        self.cfg, self.run_dir, self.slots = cfg, Path(run_dir), slots

    def _args(self, index: int) -> SGLangServerArgs:
        r = self.cfg.rollout
        if index not in self.slots:
            raise ValueError(
                "rollout.engine=sglang needs GPUs: SGLang has no CPU build (run with --rollout-gpus N --learner-gpus M)"
            )
        gpus = [int(g) for g in self.slots[index][1]]
        dtype = self.cfg.model.dtype if self.cfg.model.dtype != "auto" else "bfloat16"
        log_dir = self.run_dir / f"sglang-{index}"
        log_dir.mkdir(parents=True, exist_ok=True)
        return SGLangServerArgs(
            model=str(Path(self.cfg.model.path).resolve()),
            gpus=gpus,
            port=free_port(),
            tensor_parallel_size=r.tensor_parallel_size,
            mem_fraction_static=r.gpu_memory_utilization,
            max_running_requests=r.max_num_seqs,
            dtype=dtype,
            seed=self.cfg.run.seed + index,
            radix_cache=False,
            # colocated: the engine frees its GPU memory while the learner trains (rollout_fleet/colocated_gate.py)
            memory_saver=self.cfg.colocate.enabled and self.cfg.colocate.sleep_level(cuda=True) > 0,
            extra_args=["--context-length", str(r.max_model_len), *r.sglang_server_args, *self._lora_args()],
            env={
                **{k: os.environ.get(k, v) for k, v in NCCL_ENV.items()},
                "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
            },
            log_path=str(log_dir / "sglang_server.log"),
        )

    def _lora_args(self) -> list[str]:
        """LoRA with resident engines (weight_sync.adapter_publisher.adapter_publish): the server takes each policy
        version as an adapter at runtime, sized for the learner's rank and modules, keeping
        ``broker.max_staleness + 1`` versions (at least 2)."""
        if not adapter_publish(self.cfg):
            return []
        lora = self.cfg.learner.lora
        modules = DECODER_LINEAR_MODULES if lora.target_modules == "all-linear" else lora.target_modules
        return sglang_lora_server_args(lora.rank, modules, adapter_versions(self.cfg.broker.max_staleness))

    def client(self, index: int, url: str) -> FleetSGLangClient:
        """The fleet's client of server ``index`` at ``url``."""
        return FleetSGLangClient(
            f"sglang-{index}",
            url,
            radix_cache=False,
            timeout_s=self.cfg.rollout.request_timeout_s,
            adapter_prefix=ADAPTER_PREFIX if adapter_publish(self.cfg) else None,  # requests name the adapter
            adapter_versions=adapter_versions(self.cfg.broker.max_staleness),
        )

    async def start(self, index: int) -> FleetSGLangClient:
        server = SGLangServer(self._args(index))
        await server.start(timeout_s=self.cfg.rollout.startup_timeout_s)
        client = self.client(index, server.url)
        client.server = server
        return client
