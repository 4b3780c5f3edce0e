"""Weight-sync config: transport, bucketing and timeouts of a publish."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from launch.configbase import ConfigModel


class WeightSyncConfig(ConfigModel):
    backend: Literal["auto", "nccl", "gloo"] = Field("auto", description="auto: nccl with CUDA, gloo otherwise")
    bucket_mb: float = Field(256.0, gt=0, description="bytes per broadcast bucket")
    timeout_s: float = Field(60.0, gt=0, description="limit of every step of a publish; a timeout aborts it and names the peer")
    master_addr: str = "127.0.0.1"
    master_port: int = Field(0, ge=0, le=65535, description="TCP store port; 0 picks a free one")
    nccl_impl: Literal["vllm", "torch"] = Field(
        "vllm",
        description="with nccl: 'vllm' = vLLM's PyNccl group, what vLLM's built-in nccl backend joins; "
        "'torch' = a ProcessGroupNCCL for fleetrl's own receivers",
    )
