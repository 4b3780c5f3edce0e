"""Weight-sync config: transport, bucketing and timeouts of a publish."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from core.configbase import ConfigModel

#: NCCL settings every process of an NCCL weight-sync group must share, set before its first NCCL call.
#: SGLang sets NCCL_CUMEM_ENABLE=0 in its own server and peers that disagree fail in the first
#: broadcast ("unhandled cuda error ... invalid argument"), so the learner and every server fleetrl starts
#: use 0 (unless the user set it).
NCCL_ENV = {"NCCL_CUMEM_ENABLE": "0"}


class WeightSyncConfig(ConfigModel):
    backend: Literal["auto", "nccl", "gloo"] = Field("auto", description="auto: nccl with CUDA, gloo otherwise")
    bucket_mb: float = Field(256.0, gt=0, description="bytes per broadcast bucket")
    tail_bucket_mb: float = Field(
        64.0,
        ge=0,
        description="cut the last bucket into pieces shrinking towards the end, the last one at most "
        "this size (see weight_sync.plan.build_plan), so that less of a receiver's work (load and checksum) "
        "follows the last byte; only where fleetrl's own receivers take the plan (gloo, or nccl_impl 'torch'). "
        "0 = off. Too small a piece costs the wire more than it saves; the ratio to raw broadcast each size gives "
        "is in bench/results/engines_gpu.md",
    )
    inflight_buckets: int = Field(
        2,
        ge=1,
        le=8,
        description="buckets on the wire at once (each costs bucket_mb on both sides); "
        "2 keeps the wire busy while the next bucket is packed or the last one loaded",
    )
    staging: bool = Field(
        False,
        description="receive into a standing copy of the weights while the engine keeps generating, "
        "and pause it only to copy that into the model (vLLM with fleetrl's backend, or SGLang with fleetrl's "
        "loader; costs the model's size "
        "in engine memory, so leave room under rollout.gpu_memory_utilization)",
    )
    acks: Literal["group", "rpc"] = Field(
        "group",
        description="how an unstaged publish is acknowledged: 'group' = every receiver all-gathers "
        "its checksum with the publisher's over the weight-sync group after its last load (no RPC round trip "
        "on the critical path; the RPC's answer is checked at the next publish), where every engine of the "
        "epoch supports it and the group is fleetrl's own (gloo, or nccl_impl 'torch'); 'rpc' = wait for each "
        "engine's answer",
    )
    timeout_s: float = Field(
        60.0, gt=0, description="limit of every step of a publish; a timeout aborts it and names the peer"
    )
    master_addr: str = Field(
        "127.0.0.1",
        description="host of the weight-sync group's store (learner rank 0 "
        "replaces it by its own node's address on a cluster)",
    )
    master_port: int = Field(0, ge=0, le=65535, description="TCP store port; 0 picks a free one")
    nccl_impl: Literal["auto", "vllm", "sglang", "torch"] = Field(
        "auto",
        description="with nccl, how the group is made and what the engines run: 'torch' = a ProcessGroupNCCL "
        "for fleetrl's own receivers (vLLM started with fleetrl's weight-transfer backend: checked loads, "
        "staging; SGLang through fleetrl's loader in its workers when staging); 'vllm' = vLLM's PyNccl group "
        "and its built-in nccl backend; 'sglang' = a ProcessGroupNCCL (gloo with backend 'gloo', colocated mode) "
        "under the store prefixes SGLang's own update uses. auto: 'sglang' for an SGLang fleet without staging, else 'torch'",
    )

    def tail_bytes(self, nccl: bool) -> int:
        """``build_plan``'s ``tail_bytes`` for this config (``nccl_impl`` resolved): 0 where vLLM's built-in backend
        (its packed format cuts buckets by its own rule) or SGLang's own update (one HTTP call per bucket) runs."""
        if (nccl and self.nccl_impl == "vllm") or self.nccl_impl == "sglang":  # SGLang's own update, NCCL or gloo
            return 0
        return int(self.tail_bucket_mb * (1 << 20))

    def resolved_nccl_impl(self, engine: str) -> str:
        """``nccl_impl`` with ``auto`` resolved for a fleet of ``engine`` (rollout.engine)."""
        if self.nccl_impl != "auto":
            return self.nccl_impl
        return "sglang" if engine == "sglang" and not self.staging else "torch"
