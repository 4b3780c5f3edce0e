"""The engine client interface every rollout engine implements.

An engine is a server process (vLLM, SGLang, fleetrl's local transformers server,
or the simulated engine) plus a client that speaks its HTTP API. Workers and the
fleet controller only see :class:`EngineClient`; weight sync reaches an engine's
receiving side through the same object (``init_weight_transfer`` /
``update_weights``), so switching engines is one config value.

All methods are coroutines and every one has a timeout: an engine that does not
answer raises :class:`EngineError` naming the engine, the call and the limit.
"""

from __future__ import annotations

import abc
import concurrent.futures
import math
from dataclasses import dataclass, field

import numpy as np


class EngineError(RuntimeError):
    """An engine call failed or timed out; the message names the engine and the call."""


@dataclass(kw_only=True, slots=True)
class SamplingParams:
    n: int
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)


@dataclass(kw_only=True, slots=True)
class Sample:
    """One generated sample: token ids and the sampler's log-prob of each.

    ``segment_starts``/``segment_versions`` say which policy version produced
    which tokens (one segment unless weights changed mid-sample).
    """

    token_ids: np.ndarray  # int32 [T]
    logprobs: np.ndarray  # float32 [T]
    finish_reason: str  # "stop" | "length" | "abort"
    segment_starts: list[int] = field(default_factory=lambda: [0])
    segment_versions: list[int] = field(default_factory=lambda: [0])


@dataclass(kw_only=True, slots=True)
class WeightPlan:
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
        sizes = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8, "int64": 8, "int32": 4, "uint8": 1, "int8": 1}
        return [sum(math.prod(self.shapes[i]) * sizes[self.dtypes[i]] for i in b) for b in self.buckets]


@dataclass(kw_only=True, slots=True)
class GroupInfo:
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


class EngineClient(abc.ABC):
    """Client of one engine server. ``engine_id`` is unique in the fleet."""

    engine_id: str
    simulated: bool = False
    group_ranks: int = 1  # ranks this engine takes in the weight-sync group (its TP x PP workers)

    @abc.abstractmethod
    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> list[Sample]:
        """``params.n`` samples for one prompt, with token ids and per-token log-probs."""

    @abc.abstractmethod
    async def health(self) -> bool:
        """True if the server answers and can generate."""

    @abc.abstractmethod
    async def pause(self, mode: str = "keep") -> None:
        """Stop admitting; ``abort`` running requests, ``wait`` for them, or ``keep`` them frozen."""

    @abc.abstractmethod
    async def resume(self) -> None: ...

    @abc.abstractmethod
    async def reset_prefix_cache(self) -> None: ...

    @abc.abstractmethod
    async def init_weight_transfer(self, group: GroupInfo, plan: WeightPlan) -> None:
        """Join the weight-sync group and learn the (fixed) plan; returns once joined."""

    @abc.abstractmethod
    async def update_weights(self, version: int, plan_id: str) -> str:
        """Receive one publish of ``version`` from the group and load it; return the checksum."""

    #: True if the engine takes a staged publish (``weight_sync.staging``): it receives into a standing
    #: copy while it keeps generating, and pauses only for the copy into the model.
    supports_staging: bool = False

    #: True if the engine's receivers end each (unstaged) publish with the group's ack all-gather when the
    #: epoch's :attr:`GroupInfo.group_acks` says so (fleetrl's standalone receiver does).
    supports_group_acks: bool = False

    def send_update(self, version: int, plan_id: str) -> concurrent.futures.Future | None:
        """Optional fast start of an (unstaged) update: write the request of :meth:`update_weights` from
        the calling thread now and return a future of its answer (the checksum), read on a thread of the
        client's own. A failure to send fails the future; it does not raise. ``None`` (the default): the
        client has no such path, and the publisher awaits :meth:`update_weights` on its RPC loop instead,
        which costs the hand-over to that loop's thread (0.1-0.3 ms on the 2x H200 host) before the
        engine even hears of the publish."""
        return None

    async def begin_update(self, version: int, plan_id: str) -> None:
        """Staged publish, phase 1: post the receives of ``version`` and return at once."""
        raise NotImplementedError(f"engine {self.engine_id} ({type(self).__name__}) takes no staged publish")

    async def commit_update(self, version: int) -> str:
        """Staged publish, phase 2 (after the broadcast): load what was received; return the checksum."""
        raise NotImplementedError(f"engine {self.engine_id} ({type(self).__name__}) takes no staged publish")

    @abc.abstractmethod
    async def load_weights_from_path(self, path: str, version: int) -> None:
        """Load a published HF safetensors export (a late joiner's first load)."""

    @property
    @abc.abstractmethod
    def weight_version(self) -> int:
        """The policy version the server holds."""

    async def close(self) -> None:  # noqa: B027 (optional hook: most clients hold nothing)
        """Release client resources (HTTP sessions); does not stop the server."""
