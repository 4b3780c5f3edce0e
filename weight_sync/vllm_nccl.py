"""The publisher's side of vLLM's built-in ``nccl`` weight-transfer backend (GPU).

vLLM's NCCL workers join through ``StatelessProcessGroup.create(host, port,
rank, world)`` (rank 0 hosts that store) and a ``PyNcclCommunicator``, not a
torch ProcessGroup; so to feed them the publisher opens the same kind of group
as rank 0. With ``packed=True`` and ``packed_buffer_size_bytes`` from
:func:`weight_sync.plan.packed_buffer_bytes`, each of our buckets is one of
vLLM's packed chunks (``packed_nccl_broadcast_consumer``), byte for byte.

NCCL calls are asynchronous on a CUDA stream and have no timeout of their own,
so :class:`_EventWork` exposes a CUDA event that the publisher polls against a
deadline (:func:`weight_sync.group.wait_work`): a dead peer turns into a
``TimeoutError`` naming the step instead of a silent hang.

Not exercised on CPU; the GPU test (tests/gpu) runs it against vLLM 0.26.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)


class _EventWork:
    """The ``is_completed``/``wait`` pair of a torch ``Work`` for a broadcast on our own stream."""

    def __init__(self, event: "torch.cuda.Event", buf: torch.Tensor) -> None:
        self.event, self.buf = event, buf  # keep the buffer alive until the broadcast has run

    def is_completed(self) -> bool:
        return bool(self.event.query())

    def wait(self) -> bool:
        """Order the current stream after the broadcast (the host waits in ``wait_work``, bounded)."""
        torch.cuda.current_stream(self.buf.device).wait_event(self.event)
        return True


class VllmNcclGroup:
    """Rank 0 of a vLLM-style NCCL group (StatelessProcessGroup + PyNcclCommunicator)."""

    def __init__(self, comm, stream: "torch.cuda.Stream") -> None:
        self.comm, self.stream = comm, stream

    @classmethod
    def open(cls, host: str, port: int, world_size: int, timeout_s: float, device: torch.device) -> "VllmNcclGroup":
        try:
            from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
            from vllm.distributed.utils import StatelessProcessGroup
        except ImportError as e:
            raise RuntimeError(f"weight sync to vLLM's nccl backend needs vLLM importable in the learner: {e}") from e
        pg = StatelessProcessGroup.create(
            host=host, port=port, rank=0, world_size=world_size, store_timeout=int(timeout_s)
        )
        comm = PyNcclCommunicator(pg, device=device)
        return cls(comm, torch.cuda.Stream(device=device))

    def broadcast_async(self, buf: torch.Tensor) -> _EventWork:
        # Order after whatever produced buf (the gather) on the current stream, then send on ours.
        self.stream.wait_stream(torch.cuda.current_stream(buf.device))
        self.comm.broadcast(buf, src=0, stream=self.stream)
        ev = torch.cuda.Event()
        ev.record(self.stream)
        return _EventWork(ev, buf)

    def close(self) -> None:
        try:
            self.comm.destroy()
        except Exception as e:  # noqa: BLE001 - the group is being discarded
            log.warning("closing the vLLM NCCL weight group failed: %s", e)
