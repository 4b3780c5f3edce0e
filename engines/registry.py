"""Which weight client the learner's publisher uses for one engine server: :func:`weight_client`.

The learner imports this directly (``learner/rank.py``); the choice follows ``rollout.engine``, the group's
backend and ``weight_sync.nccl_impl``::

    rollout.engine   backend / nccl_impl                     client
    vllm             ipc (colocated on one GPU)              engines.vllm.ipc.VLLMIpcClient
    vllm             nccl, nccl_impl 'vllm'                  engines.vllm.nccl.VLLMNcclClient (vLLM's own backend)
    vllm             gloo, nccl (fleetrl's backend)          engines.vllm.weights.VLLMWeightClient
    sglang           nccl, gloo (colocated)                  engines.sglang.weights.SGLangPublishClient

The fleet's generation clients come from each engine's factory (``engines/vllm/factory.py``,
``engines/sglang/factory.py``, :class:`engines.simulated.SimulatedFactory`).
"""

from __future__ import annotations

from typing import Any

from engines.base import adapter_versions
from engines.sglang.weights import SGLangPublishClient
from engines.vllm.ipc import VLLMIpcClient
from engines.vllm.nccl import VLLMNcclClient
from engines.vllm.weights import VLLMWeightClient
from weight_sync.adapter_publisher import ADAPTER_PREFIX, adapter_publish
from weight_sync.endpoint import WeightEndpoint


def weight_client(cfg: Any, backend: str, eid: str, url: str) -> WeightEndpoint:
    """The publisher's client of server ``eid`` at ``url``; ``cfg`` is the run config (``launch.config.RunConfig``).

    vllm: fleetrl's weight-transfer backend (gloo on CPU, NCCL on GPU; backend 'ipc': CUDA IPC from the
    colocated learner's GPU), or with nccl_impl 'vllm' vLLM's built-in NCCL backend (the packed settings where
    the installed vLLM wants them); sglang: SGLang's distributed update (NCCL), or with weight_sync.staging
    fleetrl's loader in SGLang's workers (engines/sglang/loader.py).
    """
    engine, ws = cfg.rollout.engine, cfg.weight_sync
    if engine == "sglang":
        return SGLangPublishClient(
            eid,
            url,
            timeout_s=ws.timeout_s,
            staging=ws.staging,
            # LoRA: the publisher loads adapters through this client (learner/rank.py)
            adapter_prefix=ADAPTER_PREFIX if adapter_publish(cfg) else None,
            adapter_versions=adapter_versions(cfg.broker.max_staleness),
        )
    if engine != "vllm":
        raise ValueError(f"the learner publishes to rollout.engine 'vllm' or 'sglang', not {engine!r}")
    kw = dict(
        model=cfg.model.path,
        timeout_s=ws.timeout_s,
        update_pause_mode="wait" if cfg.rollout.weight_update == "pause" else "keep",
    )
    if backend == "ipc":  # colocated on one GPU: the learner's CUDA IPC slots (weight_sync/ipc_publisher.py)
        return VLLMIpcClient(eid, url, **kw)
    if backend == "nccl" and ws.resolved_nccl_impl(engine) == "vllm":
        return VLLMNcclClient(eid, url, **kw)
    if adapter_publish(cfg):  # LoRA: the publisher loads adapters through this client (learner/rank.py)
        kw["adapter_prefix"] = ADAPTER_PREFIX
        kw["adapter_versions"] = adapter_versions(cfg.broker.max_staleness)
    return VLLMWeightClient(eid, url, weight_backend="fleetrl", **kw)
