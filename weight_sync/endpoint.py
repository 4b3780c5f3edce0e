"""An engine server as the publisher sees it: :class:`ServerHandle` (what every client of one server has) and
:class:`WeightEndpoint` (its weight-receiving side).

Both roles of an engine client derive from :class:`ServerHandle`: the generation clients
(``engines.base.EngineClient``, what the fleet uses) and the weight clients (:class:`WeightEndpoint`,
what the publisher uses: ``engines.vllm.weights``, ``engines.sglang.weights``, and the standalone
receiver's :class:`weight_sync.receiver_client.ReceiverClient`). It lives here, the lowest layer that needs
it, so the publisher (:mod:`weight_sync.publisher`) knows nothing else about an engine.

A publish of version ``v`` to one endpoint is ``init_weight_transfer`` (once per group epoch),
then ``update_weights(v)`` (or ``send_update``), or, staged, ``begin_update(v)`` ... broadcast ...
``commit_update(v)``. Every call is a coroutine bounded by a timeout; a failure raises
:class:`core.http_client.EngineError` naming the engine and the call.
"""

from __future__ import annotations

import abc
import concurrent.futures

from weight_sync.messages import GroupInfo, WeightPlan


class ServerHandle(abc.ABC):
    """A client of one engine server, in either role. ``engine_id`` is unique in the fleet."""

    engine_id: str

    @abc.abstractmethod
    async def health(self) -> bool:
        """True if the server answers (the fleet probes it; the publisher probes it to assign blame)."""

    @abc.abstractmethod
    async def load_weights_from_path(self, path: str, version: int) -> None:
        """Load a published HF safetensors export (a server that (re)joins late: its first load)."""

    @property
    @abc.abstractmethod
    def weight_version(self) -> int:
        """The policy version the server holds."""

    async def close(self) -> None:  # noqa: B027 (optional hook: most clients hold nothing)
        """Release client resources (HTTP sessions); does not stop the server."""


class WeightEndpoint(ServerHandle):
    """An engine's weight-receiving side."""

    group_ranks: int = 1  # ranks this engine takes in the weight-sync group (its TP x PP workers)

    @property
    def supports_staging(self) -> bool:
        """True if the engine takes a staged publish (``weight_sync.staging``): it receives into a standing
        copy while it keeps generating, and pauses only for the copy into the model."""
        return False

    #: True if the engine's receivers end each (unstaged) publish with the group's ack all-gather when the
    #: epoch's :attr:`GroupInfo.group_acks` says so (fleetrl's standalone receiver does).
    supports_group_acks: bool = False

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
