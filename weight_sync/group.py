"""The dedicated weight-sync process group: made from a TCP store, never the default group.

FSDP owns the learner's default group and every engine owns its own, so the
weight group is a bare ``ProcessGroupGloo``/``ProcessGroupNCCL`` built from a
``TCPStore`` (the publisher hosts it) under a per-epoch prefix. Nothing here
calls ``init_process_group`` or touches ``torch.distributed``'s global state.

Ranks: the publisher is rank 0; an engine with ``k`` workers holds ranks
``rank_offset .. rank_offset + k - 1``. A rebuild bumps the epoch, so a stale
peer from an old epoch can never meet the new one under the same keys.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from core.network import is_loopback, route_ip
from weight_sync.messages import GroupInfo

log = logging.getLogger(__name__)
_Backend = torch._C._distributed_c10d.Backend


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def host_store(addr: str, port: int, timeout_s: float) -> dist.TCPStore:
    """The store server, in the publisher. ``port=0`` picks a free port (read ``.port``)."""
    return dist.TCPStore(addr, port, is_master=True, timeout=_td(timeout_s), wait_for_workers=False)


def connect_store(addr: str, port: int, timeout_s: float) -> dist.TCPStore:
    try:
        return dist.TCPStore(addr, port, is_master=False, timeout=_td(timeout_s), wait_for_workers=False)
    except Exception as e:  # torch raises DistStoreError/RuntimeError with a terse text
        raise TimeoutError(f"weight-sync store {addr}:{port} unreachable within {timeout_s:.0f}s: {e}") from e


def _gloo_device(master_addr: str):
    """gloo's interface: the default (the hostname's address) on one host; across hosts the local address
    that routes to the store's host, which the hostname need not resolve to (containers, namespaces)."""
    if is_loopback(master_addr):
        return dist.ProcessGroupGloo.create_default_device()
    return dist.ProcessGroupGloo.create_device(hostname=route_ip(master_addr))


def make_group(store: dist.Store, group: GroupInfo, rank: int, timeout_s: float) -> Any:
    """Join the group of ``group.group_epoch`` as ``rank``; returns when every rank has joined.

    The group is a c10d backend object (``ProcessGroupGloo`` or ``ProcessGroupNCCL``), used only through
    this module's collectives; torch's type stubs describe neither fully, hence ``Any``.

    gloo connects the full mesh in its constructor, so this is the join
    barrier; it raises after ``timeout_s`` if a rank never comes.
    """
    if not 0 <= rank < group.world_size:
        raise ValueError(f"rank {rank} outside weight-sync group of size {group.world_size}")
    prefixed = dist.PrefixStore(f"fleetrl/weight_sync/epoch{group.group_epoch}", store)
    if group.backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = _td(timeout_s)
        opts._devices = [_gloo_device(group.master_addr)]
        return dist.ProcessGroupGloo(prefixed, rank, group.world_size, opts)
    if group.backend == "nccl":
        if not torch.cuda.is_available():
            raise RuntimeError("weight-sync backend 'nccl' needs CUDA; use 'gloo' on CPU")
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = _td(timeout_s)
        pg: Any = dist.ProcessGroupNCCL(prefixed, rank, group.world_size, opts)  # (stubs lack its collectives)
        # NCCL connects lazily; a one-element all-reduce makes this the join barrier like gloo's.
        t = torch.zeros(1, device="cuda")
        pg.allreduce([t]).wait(_td(timeout_s))
        return pg
    raise ValueError(f"unknown weight-sync backend {group.backend!r}; expected 'gloo' or 'nccl'")


class TorchGroup:
    """A torch ProcessGroup (gloo or NCCL) behind the two calls a publish needs."""

    def __init__(self, pg) -> None:
        self.pg = pg

    def broadcast_async(self, buf: torch.Tensor):
        """Start broadcasting ``buf`` from rank 0; the returned work has ``wait(timedelta)``."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        return self.pg.broadcast([buf], opts)

    def all_gather_async(self, out: torch.Tensor, inp: torch.Tensor):
        """Start gathering every rank's ``inp`` into ``out[rank]``; the returned work has ``wait(timedelta)``."""
        # into one tensor: no per-rank output list, so NCCL copies nothing out of a staging buffer
        return self.pg._allgather_base(out.view(-1, *inp.shape[1:]), inp)

    def close(self) -> None:
        close_group(self.pg)


def broadcast_async(pg, buf: torch.Tensor):
    """Start broadcasting ``buf`` from rank 0 over a ProcessGroup or a group adapter; returns a ``wait(timedelta)`` handle."""
    if hasattr(pg, "broadcast_async"):  # TorchGroup, weight_sync.vllm_nccl.VllmNcclGroup
        return pg.broadcast_async(buf)
    if isinstance(pg, (dist.ProcessGroup, _Backend)):  # ProcessGroupGloo/NCCL are Backends, not ProcessGroups
        return TorchGroup(pg).broadcast_async(buf)
    return pg.broadcast([buf], None)  # any other object shaped like a torch ProcessGroup (none of fleetrl's own)


def all_gather_async(pg, out: torch.Tensor, inp: torch.Tensor):
    """Start an all-gather of ``inp`` (one shape on every rank) into ``out`` (``[world, *inp.shape]``) over a
    ProcessGroup or a group adapter that has ``all_gather_async``; returns a ``wait(timedelta)`` handle."""
    if hasattr(pg, "all_gather_async"):
        return pg.all_gather_async(out, inp)
    if isinstance(pg, (dist.ProcessGroup, _Backend)):
        return TorchGroup(pg).all_gather_async(out, inp)
    raise TypeError(f"weight-sync group {type(pg).__name__} has no all-gather; use acks='rpc' with it")


def wait_work(
    work,
    deadline: float,
    what: str,
    max_sleep_s: float = 2e-4,
    check: Callable[[], None] | None = None,
    spin_s: float = 0.0,
) -> None:
    """Wait for an asynchronous collective until ``deadline`` (a ``time.monotonic()`` value).

    Why not ``work.wait(timeout)``: on NCCL a wait with a timeout blocks the thread
    in 1 ms sleeps, so waiting bucket by bucket costs up to a millisecond per bucket.
    Polling ``is_completed()`` with a back-off from 10 us reacts within microseconds. Once complete, ``wait()`` without
    a timeout re-raises the collective's error, if any, and on CUDA orders the
    current stream after it (no host wait). ``max_sleep_s`` caps the back-off: lower where the
    host has nothing else to do and a late reaction is on the critical path. ``check()``, called
    between polls, may raise to end the wait early (e.g. a peer's RPC has already failed).
    ``spin_s``: poll without sleeping for that long first, for a wait that is short and on the
    critical path (a short sleep takes several times longer with Linux's default timer slack).
    """
    if spin_s > 0:
        until = time.monotonic() + spin_s
        while not work.is_completed() and time.monotonic() < until:
            if check is not None:
                check()
    delay = 1e-5
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not done within the weight-sync timeout (a peer is gone or stuck)")
        if check is not None:
            check()
        time.sleep(delay)
        delay = min(delay * 2, max_sleep_s)
    work.wait()


def close_group(pg) -> None:
    """Tear a group down so peers blocked in it fail at once instead of waiting for their timeout."""
    if pg is None:
        return
    for how in ("close", "abort", "shutdown"):
        if not hasattr(pg, how):
            continue
        try:
            getattr(pg, how)()
            return
        except Exception as e:  # noqa: BLE001 - best effort; the group is being discarded
            log.debug("weight-sync group %s failed: %s", how, e)
