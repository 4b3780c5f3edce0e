"""The receiving side of weight sync as the publisher sees it: one :class:`WeightEndpoint` per engine.

The vLLM and SGLang clients (``rollout_fleet.engines``) and the standalone receiver's client
(:class:`weight_sync.receiver_client.ReceiverClient`) implement it; the publisher
(:mod:`weight_sync.publisher`) knows nothing else about an engine. Generation is not part of it:
that is ``rollout_fleet.engines.base.EngineClient``.

A publish of version ``v`` to one endpoint is ``init_weight_transfer`` (once per group epoch),
then ``update_weights(v)`` (or ``send_update``), or, staged, ``begin_update(v)`` ... broadcast ...
``commit_update(v)``. Every call is a coroutine bounded by a timeout; a failure raises
:class:`core.net.EngineError` naming the engine and the call.
"""

from __future__ import annotations

import abc
import concurrent.futures

from weight_sync.messages import GroupInfo, WeightPlan


class WeightEndpoint(abc.ABC):
    """An engine's weight-receiving side. ``engine_id`` is unique in the fleet."""

    engine_id: str
    group_ranks: int = 1  # ranks this engine takes in the weight-sync group (its TP x PP workers)

    #: True if the engine takes a staged publish (``weight_sync.staging``): it receives into a standing
    #: copy while it keeps generating, and pauses only for the copy into the model.
    supports_staging: bool = False

    #: True if the engine's receivers end each (unstaged) publish with the group's ack all-gather when the
    #: epoch's :attr:`GroupInfo.group_acks` says so (fleetrl's standalone receiver does).
    supports_group_acks: bool = False

    @abc.abstractmethod
    async def health(self) -> bool:
        """True if the server answers (the publisher probes it to assign blame)."""

    @abc.abstractmethod
    async def init_weight_transfer(self, group: GroupInfo, plan: WeightPlan) -> None:
        """Join the weight-sync group and learn the (fixed) plan; returns once joined."""

    @abc.abstractmethod
    async def update_weights(self, version: int, plan_id: str) -> str:
        """Receive one publish of ``version`` from the group and load it; return the checksum."""

    def send_update(self, version: int, plan_id: str) -> concurrent.futures.Future | None:
        """Optional fast start of an (unstaged) update: write the request of :meth:`update_weights` from
        the calling thread now and return a future of its answer (the checksum), read on a thread of the
        client's own. A failure to send fails the future; it does not raise. ``None`` (the default): the
        client has no such path, and the publisher awaits :meth:`update_weights` on its RPC loop instead,
        which costs the hand-over to that loop's thread before the engine even hears of the publish."""
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
