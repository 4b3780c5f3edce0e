"""LoRA policy updates on a vLLM server: a new adapter per policy version, loaded at runtime.

The server serves the frozen base model with LoRA enabled (:func:`lora_server_settings`). Publishing version
``v`` is::

    POST /v1/load_lora_adapter {lora_name: "<prefix>-v<v>", lora_path: <peft folder the learner wrote>}
    POST /update_weight_version {new_version: v}        (the label the fleet reads: /weight_info)
    POST /v1/unload_lora_adapter for versions older than v - 1

No pause: requests already running keep the adapter they named, so every token of a sample comes from its
start version (the segments stay one version long) and staleness accounting is unchanged; requests made after
the label name the new adapter. The previous version stays registered so a worker that has not yet read the
new label is still served. A version's adapter is a new name and path, so prefix-cache blocks of an older
adapter are never reused for it (vLLM keys its prefix cache by adapter).

Adapter folders travel by path: the learner and the servers must share the folder (one host, or a shared
filesystem), as prime-rl's LoRA sync does.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from core.http_client import EngineError
from engines.base import lora_name

if TYPE_CHECKING:
    from engines.vllm.handle import VLLMHandle

log = logging.getLogger(__name__)

# vLLM's --max-lora-rank accepts only these (vllm/config/lora.py MaxLoRARanks, 0.32).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def lora_server_settings(rank: int) -> tuple[list[str], dict[str, str]]:
    """(extra server arguments, environment) for a vLLM server that takes adapters of ``rank`` at runtime.

    Two adapters at once (``--max-loras 2``): requests of the previous version may still run beside the new
    one's; without the slot vLLM would hold the new requests back until the old ones finish."""
    fit = next((r for r in VLLM_LORA_RANKS if rank <= r), None)
    if fit is None:
        raise ValueError(f"LoRA rank {rank} exceeds vLLM's largest --max-lora-rank {VLLM_LORA_RANKS[-1]}")
    return (
        ["--enable-lora", "--max-lora-rank", str(fit), "--max-loras", "2", "--max-cpu-loras", "3"],
        {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"},
    )


async def load_adapter(client: VLLMHandle, path: str, version: int) -> dict[str, float]:
    """Serve the adapter folder ``path`` as ``version`` on ``client``'s server; returns seconds per call."""
    if not client.adapter_prefix:
        raise ValueError(f"engine {client.engine_id}: load_adapter needs the client's adapter_prefix (learner.lora)")
    steps: dict[str, float] = {}
    t = time.perf_counter()
    name = lora_name(client.adapter_prefix, version)
    await client._request(
        "POST",
        "/v1/load_lora_adapter",
        json={"lora_name": name, "lora_path": str(path)},
        timeout_s=client.request_timeout_s,
    )
    steps["load_adapter"], t = time.perf_counter() - t, time.perf_counter()
    await client.label_version(version)
    steps["label_version"], t = time.perf_counter() - t, time.perf_counter()
    previous = client.weight_version
    client._version = version
    if previous > 0 and previous < version - 1:
        await _unload(client, lora_name(client.adapter_prefix, previous))
    if version > 2:  # version 0 is the base model, not an adapter
        await _unload(client, lora_name(client.adapter_prefix, version - 2))
    steps["unload_old"] = time.perf_counter() - t
    client.last_update_steps = steps
    return steps


async def _unload(client: VLLMHandle, name: str) -> None:
    r = await client._request("POST", "/v1/unload_lora_adapter", json={"lora_name": name}, check_status=False)
    if r.status_code == 404:  # never loaded here (a server that joined late, or already gone)
        return
    if r.status_code != 200:
        raise EngineError(
            f"engine {client.engine_id}: unloading LoRA adapter {name!r} -> HTTP {r.status_code}: {r.text[:200]}"
        )
