"""Publishing a LoRA policy: only the adapter crosses from learner to engines.

Collective on the learner ranks (the adapters are gathered from their shards); rank 0 then::

    engine.export_adapter(root/v<version>)        peft folder: adapter_config.json + adapter_model.safetensors
    every endpoint: load_adapter(folder, version) concurrently, each within timeout_s

An engine that fails or times out is named in the :class:`AdapterPublishError` (the others took the version).
Folders older than the ``keep`` newest are deleted: a server loads an adapter into memory, so only a server
that joins late reads one again. The folder must be readable by the servers (one host or a shared filesystem).

Example::

    pub = AdapterPublisher([client], root=run_dir / "adapters")
    learner = Learner(engine, cfg, source=source, publish=pub.publish)
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from pathlib import Path
from typing import Any, Protocol

logger = logging.getLogger(__name__)

# Requests at policy version v > 0 name the adapter ADAPTER_PREFIX-v<v> (engines/vllm/lora.py).
ADAPTER_PREFIX = "policy"


def adapter_publish(cfg) -> bool:
    """Does this run (a launch RunConfig) publish LoRA adapters instead of weights? With ``learner.lora`` on a
    vLLM or SGLang fleet whose engines stay resident: disaggregated, or sharing the learner's GPUs asynchronously
    (``colocate.mode=async``, no sleep). Colocated sync engines sleep while the learner trains and take the
    merged weights at each wake, as before."""
    return cfg.learner.lora is not None and cfg.rollout.engine in ("vllm", "sglang") and not cfg.colocate.synchronous


class AdapterEndpoint(Protocol):
    engine_id: str

    async def load_adapter(self, path: str, version: int) -> dict[str, float]: ...

    async def close(self) -> None: ...


class AdapterPublishError(RuntimeError):
    def __init__(self, version: int, failed: dict[str, str]) -> None:
        super().__init__(f"LoRA adapter v{version} was not taken by {sorted(failed)}: {failed}")
        self.version, self.failed = version, failed


class AdapterPublisher:
    def __init__(
        self, endpoints: list[AdapterEndpoint], root: str | Path, *, keep: int = 3, timeout_s: float = 120.0, dtype=None
    ) -> None:
        """``dtype``: of the adapter tensors written (a torch dtype; None: as trained). bf16 halves the bytes and
        is what a bf16 engine computes with anyway."""
        if keep < 2:
            raise ValueError(
                f"keep must be >= 2 (the newest adapter and the one a lagging server may reload), got {keep}"
            )
        self.endpoints, self.root, self.keep, self.timeout_s = list(endpoints), Path(root), keep, timeout_s
        self.dtype = dtype
        self.last: dict[str, Any] = {}

    def folder(self, version: int) -> Path:
        return self.root / f"v{version:08d}"

    def publish(self, version: int, engine) -> None:
        """The learner loop's publish hook (every rank calls it; rank 0 talks to the engines)."""
        t0 = time.perf_counter()
        folder = self.folder(version)
        n_bytes = engine.export_adapter(folder, self.dtype)
        if engine.rank != 0:
            return
        written = time.perf_counter() - t0
        steps = asyncio.run(self._push(str(folder.resolve()), version))
        for old in sorted(p for p in self.root.glob("v*") if p.is_dir())[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)
        self.last = {
            "version": version,
            "bytes": n_bytes,
            "write_seconds": written,
            "seconds": time.perf_counter() - t0,
            "engines": steps,
        }
        logger.info(
            "LoRA adapter v%d published: %d bytes, %.3f s (write %.3f s)",
            version,
            n_bytes,
            self.last["seconds"],
            written,
        )

    async def _push(self, path: str, version: int) -> dict[str, dict[str, float]]:
        async def one(ep: AdapterEndpoint) -> dict[str, float]:
            try:
                return await asyncio.wait_for(ep.load_adapter(path, version), self.timeout_s)
            finally:
                await ep.close()  # its HTTP session is bound to this call's event loop

        results = await asyncio.gather(*(one(ep) for ep in self.endpoints), return_exceptions=True)
        failed = {
            ep.engine_id: (
                f"no answer within {self.timeout_s:.0f} s"
                if isinstance(r, TimeoutError)
                else f"{type(r).__name__}: {r}"
            )
            for ep, r in zip(self.endpoints, results, strict=True)
            if isinstance(r, BaseException)
        }
        if failed:
            raise AdapterPublishError(version, failed)
        return {
            ep.engine_id: r for ep, r in zip(self.endpoints, results, strict=True) if not isinstance(r, BaseException)
        }  # every one, after the check above
