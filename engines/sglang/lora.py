"""LoRA policy updates on an SGLang server (written from SGLang's source; NOT run here: SGLang has no CPU build).

The same scheme as engines/vllm/lora.py: the server serves the base with LoRA enabled
(:func:`sglang_lora_server_args`), each policy version is an adapter under its own name::

    POST /load_lora_adapter {lora_name: "<prefix>-v<v>", lora_path: <peft folder>}
    POST /update_weight_version {new_version: v, abort_all_requests: false}
    POST /unload_lora_adapter {lora_name: "<prefix>-v<v-2>"}

and ``/generate`` names the adapter with its ``lora_path`` field (SGLang takes an adapter name there). Requests
running keep their adapter; SGLang's radix cache is keyed by adapter, so no KV of another version is reused.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from core.http_client import EngineError
from engines.base import lora_name

if TYPE_CHECKING:
    from engines.sglang.handle import SGLangHandle


def sglang_lora_server_args(rank: int) -> list[str]:
    """Server arguments for adapters of ``rank`` loaded at runtime: with no ``--lora-paths`` at start SGLang must
    be told the largest rank and the target modules up front; two adapters per batch (old and new version)."""
    if rank < 1:
        raise ValueError(f"LoRA rank must be >= 1, got {rank}")
    return [
        "--enable-lora",
        "--max-lora-rank",
        str(rank),
        "--lora-target-modules",
        "all",
        "--max-loras-per-batch",
        "2",
        "--max-loaded-loras",
        "3",
    ]


async def load_adapter(client: SGLangHandle, path: str, version: int) -> dict[str, float]:
    """Serve the adapter folder ``path`` as ``version``; returns seconds per call."""
    if not client.adapter_prefix:
        raise ValueError(f"engine {client.engine_id}: load_adapter needs the client's adapter_prefix (learner.lora)")
    steps: dict[str, float] = {}
    t = time.perf_counter()
    await client._control(
        "/load_lora_adapter",
        {"lora_name": lora_name(client.adapter_prefix, version), "lora_path": str(path)},
        client.timeout_s,
    )
    steps["load_adapter"], t = time.perf_counter() - t, time.perf_counter()
    await client._control("/update_weight_version", {"new_version": str(version), "abort_all_requests": False})
    steps["label_version"], t = time.perf_counter() - t, time.perf_counter()
    client._version = version
    if version > 2:  # version 0 is the base model; the previous version stays for lagging workers
        old = lora_name(client.adapter_prefix, version - 2)
        r = await client._request("POST", "/unload_lora_adapter", json={"lora_name": old}, check_status=False)
        if r.status_code not in (200, 400, 404):  # 400/404: not loaded here (a server that joined late)
            raise EngineError(f"engine {client.engine_id}: unloading LoRA adapter {old!r} -> HTTP {r.status_code}")
    steps["unload_old"] = time.perf_counter() - t
    client.last_update_steps = steps
    return steps
