"""The weight-sync contracts and the typed control messages of the standalone receiver's HTTP channel.

:class:`WeightPlan` and :class:`GroupInfo` are what a publisher tells every receiver (vLLM's
plugin, SGLang's loader, fleetrl's standalone receiver); they are msgspec Structs used as they
are on every wire (msgspec JSON, no pickle): one declaration, one encoding
(``msgspec.to_builtins`` / ``msgspec.convert``, see :func:`weight_sync.plan.plan_from_dict`).
"""

from __future__ import annotations

import math

import msgspec

_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8, "int64": 8, "int32": 4, "uint8": 1, "int8": 1}


class WeightPlan(msgspec.Struct, kw_only=True, frozen=True):
    """What one publish carries: tensor names, shapes and dtypes in broadcast order, split in buckets.

    The plan is fixed for a run (same model, same order), so it is announced once
    when a receiver joins and then referred to by ``plan_id``.
    """

    plan_id: str
    names: list[str]
    shapes: list[list[int]]
    dtypes: list[str]  # torch dtype names without the "torch." prefix, e.g. "bfloat16"
    buckets: list[list[int]]  # indices into names, in broadcast order

    def bucket_bytes(self) -> list[int]:
        return [sum(math.prod(self.shapes[i]) * _ITEMSIZE[self.dtypes[i]] for i in b) for b in self.buckets]


class GroupInfo(msgspec.Struct, kw_only=True, frozen=True):
    """Where a receiver joins the weight-sync process group."""

    master_addr: str
    master_port: int
    rank_offset: int  # this engine's first rank in the group (the publisher is rank 0)
    world_size: int
    backend: str  # "nccl" | "gloo"
    group_epoch: int  # bumps on every rebuild
    # Acks through the group (weight_sync.acks = "group"): after its last load each receiver all-gathers its
    # fingerprints with the publisher's, which takes that as the ack; the RPC's answer is checked later.
    group_acks: bool = False


class InitTransfer(msgspec.Struct, frozen=True):
    group: GroupInfo
    plan: WeightPlan
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
    code: str = ""  # a core.http_client.EngineErrorCode when ok is False and the receiver knows why
    checksum: str = ""
    version: int = -1
