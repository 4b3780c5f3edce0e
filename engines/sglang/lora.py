"""LoRA policy updates on an SGLang server (checked against SGLang 0.5.16's source; NOT run yet: no CPU build).

The same scheme as engines/vllm/lora.py: the server serves the base with LoRA enabled
(:func:`sglang_lora_server_args`), each policy version is an adapter under its own name::

    POST /load_lora_adapter {lora_name: "<prefix>-v<v>", lora_path: <peft folder>}
    POST /update_weight_version {new_version: "<v>", abort_all_requests: false}
    POST /unload_lora_adapter {lora_name: "<prefix>-v<v-K>"}   (K versions kept, engines/vllm/lora.py adapter_versions)

and ``/generate`` names the adapter in its ``lora_path`` field (SGLang takes an adapter *name* there).

What was read in sglang 0.5.16 (the wheel's ``sglang/srt``; 2026-12-06):

* ``entrypoints/http_server.py``: the three routes above exist (POST); load and unload answer
  ``LoRAUpdateOutput`` ``{success, error_message, loaded_adapters}`` with HTTP 200, or 400 on failure (so a
  failure raises in :meth:`~core.http_client.HttpClient._request` with SGLang's message). ``/update_weight_version``
  takes ``new_version: str`` and ``abort_all_requests`` (default **true**: we pass false) and only relabels.
  ``/update_weights_from_disk`` takes ``model_path``, ``weight_version``, ``flush_cache`` and reloads every weight
  through the default loader, also with LoRA enabled (the LoRA wrappers keep the base ``weight`` parameter).
* ``managers/tokenizer_control_mixin.py``: a load refuses a name that is loaded; ``--max-loaded-loras`` evicts the
  least recently used adapter once more are registered. An unload first stops new requests for the name, then
  **waits until every running request of that adapter has finished**, under the lock later loads take: with long
  responses of version v-2 still running, the unload (and the next load) waits for them. An unknown name is a 400.
* ``managers/tokenizer_manager.py``: a request naming an adapter that was unloaded (a lagging worker asking for
  v-2) reloads it from the path it was first loaded from, if that folder still exists (AdapterPublisher keeps 3).
* ``server_args.py`` (``check_lora_server_args``): ``--enable-lora`` is a plain switch; ``--max-lora-rank`` any int;
  ``--lora-target-modules`` takes module names or ``all``; without ``--lora-paths`` both ``--max-lora-rank`` and
  ``--lora-target-modules`` are required; ``--max-loaded-loras`` must be >= ``--max-loras-per-batch`` (and <= twice
  it with ``--enable-lora-overlap-loading``, off by default). Loading at runtime needs ``--dp-size 1`` (asserted in
  the tokenizer manager; fleetrl's servers are TP only).
  ``--lora-backend`` defaults to ``csgmv`` (triton, csgmv, ascend, torch_native). Nothing else is asked for:
  server_args turns piecewise CUDA graphs off by itself with LoRA, and fleetrl's 0.5.16 compat flags
  (``engines/sglang/server.py``) run without CUDA graphs anyway.
* ``lora/lora_manager.py``: ``--max-loras-per-batch`` counts base-model requests as one adapter (``None`` takes a
  slot); a batch that would need more waits. ``all`` targets also ``embed_tokens`` and ``lm_head``
  (``EMBEDDING_NAMES``), which the learner never adapts, so the server is told the linear modules instead.
* ``lora/lora_config.py``, ``lora/lora.py``: the peft folder fleetrl writes (``learner/lora.py``: adapter_config.json
  with ``r``, ``lora_alpha``, ``target_modules`` as a list, ``use_dora`` false; ``adapter_model.safetensors`` with
  ``base_model.model.model.layers.<i>.<...>.lora_A.weight``) is read as is; the scale is ``lora_alpha / r`` as in
  the learner; q/k/v and gate/up are stacked by SGLang. An adapter of a larger rank or other modules than the
  server was started with is refused at load (HTTP 400 naming ``--max-lora-rank`` / ``--lora-target-modules``).
* ``managers/schedule_batch.py``: the radix-cache key of a request includes its adapter id, so KV of another
  version is never reused.

Also run on CPU against the 0.5.16 wheel's own modules (its GPU-only imports stubbed; no server, no kernels):
SGLang's argparse and ``check_lora_server_args`` accept the full command :class:`~engines.sglang.server.SGLangServer`
builds with these arguments (and refuse ``--max-loaded-loras`` below ``--max-loras-per-batch``, a missing rank or
module list, an unknown module); its ``LoRAConfig`` / ``LoRAAdapter.initialize_weights`` read a folder written by
``learner.lora.save_adapter`` (scale alpha / r, q/k/v and gate/up stacked equal to the learner's tensors
concatenated, its modules within the server's); and every request body fleetrl sends validates as SGLang's
request type (``LoadLoRAAdapterReqInput``, ``UnloadLoRAAdapterReqInput``, ``UpdateWeightVersionReqInput``,
``UpdateWeightFromDiskReqInput``, ``GenerateReqInput`` with ``lora_path``; n > 1 copies the adapter to each sample).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from core.http_client import EngineError
from engines.base import adapters_out_of_window, check_adapter_versions, lora_name

if TYPE_CHECKING:
    from engines.sglang.handle import SGLangHandle

# The linear layers ``learner.lora``'s ``all-linear`` adapts in a Llama/Qwen-style decoder block (every nn.Linear
# but the output layer): what the server is told to make room for by default.
DECODER_LINEAR_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def sglang_lora_slots(versions: int = 2) -> tuple[int, int]:
    """(``--max-loras-per-batch``, ``--max-loaded-loras``) for a server that keeps ``versions`` adapter versions
    (:func:`engines.base.adapter_versions`). A batch may mix every kept version and the base, which SGLang
    counts as one adapter (unlike vLLM's ``--max-loras``); requests of one more would wait for a batch of their
    own. Registered at once: the kept versions and the one being loaded, until the oldest is unloaded."""
    check_adapter_versions(versions)
    return versions + 1, versions + 1


def sglang_lora_server_args(
    rank: int, target_modules: list[str] | tuple[str, ...] | None = None, versions: int = 2
) -> list[str]:
    """Server arguments for adapters of ``rank`` loaded at runtime, ``versions`` of them kept
    (:func:`sglang_lora_slots`). Without ``--lora-paths`` at start SGLang must be told the largest rank and the
    target modules up front (``target_modules``: default :data:`DECODER_LINEAR_MODULES`; ``["all"]`` also
    targets the embeddings and the output layer)."""
    if rank < 1:
        raise ValueError(f"LoRA rank must be >= 1, got {rank}")
    per_batch, loaded = sglang_lora_slots(versions)
    modules = list(target_modules if target_modules is not None else DECODER_LINEAR_MODULES)
    if not modules or any(not isinstance(m, str) or not m or m.startswith("-") for m in modules):
        raise ValueError(f"LoRA target modules must be a non-empty list of module names, got {target_modules!r}")
    if "all" in modules and len(modules) > 1:
        raise ValueError(f"SGLang takes 'all' as the only LoRA target module, got {modules}")
    return [
        "--enable-lora",
        "--max-lora-rank",
        str(rank),
        "--lora-target-modules",
        *modules,
        "--max-loras-per-batch",
        str(per_batch),
        "--max-loaded-loras",
        str(loaded),
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
    previous, client._version = client.weight_version, version
    for old in adapters_out_of_window(previous, version, client.adapter_versions):
        await _unload(client, lora_name(client.adapter_prefix, old))
    steps["unload_old"] = time.perf_counter() - t
    client.last_update_steps = steps
    return steps


async def _unload(client: SGLangHandle, name: str) -> None:
    # waits for the adapter's running requests (see above): the generation timeout, not the control one
    r = await client._request(
        "POST", "/unload_lora_adapter", json={"lora_name": name}, timeout_s=client.timeout_s, check_status=False
    )
    if r.status_code not in (200, 400, 404):  # 400: not loaded here (a server that joined late, or evicted)
        raise EngineError(
            f"engine {client.engine_id}: unloading LoRA adapter {name!r} -> HTTP {r.status_code}: {r.text[:300]}"
        )
