"""Typed control messages of the standalone receiver's HTTP channel (msgspec JSON, no pickle)."""

from __future__ import annotations

import msgspec


class PlanMsg(msgspec.Struct, frozen=True):
    plan_id: str
    names: list[str]
    shapes: list[list[int]]
    dtypes: list[str]
    buckets: list[list[int]]


class GroupMsg(msgspec.Struct, frozen=True):
    master_addr: str
    master_port: int
    rank_offset: int
    world_size: int
    backend: str
    group_epoch: int
    group_acks: bool = False


class InitTransfer(msgspec.Struct, frozen=True):
    group: GroupMsg
    plan: PlanMsg
    timeout_s: float


class UpdateWeights(msgspec.Struct, frozen=True):
    version: int
    plan_id: str


class StageWeights(msgspec.Struct, frozen=True):
    """Post the receives of a staged publish and return at once (see WeightReceiver.stage)."""

    version: int
    plan_id: str


class CommitWeights(msgspec.Struct, frozen=True):
    """Load a staged publish once the broadcast is done; the reply carries the checksum."""

    version: int


class LoadFromPath(msgspec.Struct, frozen=True):
    path: str
    version: int


class DumpState(msgspec.Struct, frozen=True):
    """Write the held tensors to a safetensors file (tests compare them bit for bit)."""

    path: str


class Reply(msgspec.Struct, frozen=True):
    ok: bool
    error: str = ""
    checksum: str = ""
    version: int = -1
