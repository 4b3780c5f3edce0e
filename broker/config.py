"""Broker config: the staleness bound, delivery, durability and memory limits."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from core.configbase import ConfigModel


class BrokerConfig(ConfigModel):
    max_staleness: int = Field(
        2, ge=0, le=1024, description="k: learner step s may start while s <= v + k + 1; 0 is on-policy"
    )
    groups_per_step: int = Field(8, ge=1, description="prompt groups one optimizer step consumes")
    address: str = Field("tcp://127.0.0.1:0", description="ZMQ bind address; port 0 picks a free port")
    lease_timeout_s: float = Field(120.0, gt=0, description="an unacked batch is handed out again after this")
    ticket_timeout_s: float = Field(
        600.0, gt=0, description="an unfulfilled ticket expires after this and is granted again"
    )
    request_timeout_s: float = Field(30.0, gt=0, description="client-side timeout of every request")
    byte_budget_mb: float = Field(1024.0, gt=0, description="bytes the broker holds before producers are slowed")
    spool_dir: str | None = Field(
        None, description="directory for the durable spool; None keeps trajectories in memory only"
    )
    fsync: Literal["never", "batch", "always"] = Field(
        "batch", description="spool durability: fsync never, once per batch of writes, or after every write"
    )
    curve_keys_dir: str | None = Field(None, description="CurveZMQ key directory for traffic across hosts")
    max_message_mb: float = Field(
        512.0, gt=0, description="largest ZMQ message accepted; a larger one drops its connection"
    )
    socket_hwm: int = Field(
        1000, ge=1, description="ZMQ high-water mark (messages) of the broker socket, each direction"
    )
    metrics_port: int | None = Field(None, ge=0, le=65535, description="Prometheus port; None disables the endpoint")
