"""The publisher's side of a weight-sync group whose receivers are SGLang's own workers.

SGLang's ``/init_weights_update_group`` makes each worker join a process group over our TCP
store under key prefixes of its own (see :func:`sglang_store_prefixes`); rank 0 (the learner's
publisher) must build its side under the same prefixes. Used with ``weight_sync.nccl_impl =
"sglang"``; the client that drives the servers is ``engines.sglang.weights.SGLangWeightClient``.
"""

from __future__ import annotations

from weight_sync.config import NCCL_ENV
from weight_sync.messages import GroupInfo


def publisher_nccl_env() -> dict[str, str]:
    """The NCCL settings the publishing process must share with SGLang (see module docstring)."""
    return dict(NCCL_ENV)


def sglang_group_name(group_epoch: int) -> str:
    """SGLang names its update group; one name per weight-sync epoch keeps epochs apart in the store."""
    return f"fleetrl_ws_epoch{group_epoch}"


def sglang_store_prefixes(group_epoch: int, device_type: str = "cuda") -> list[str]:
    """The key prefixes SGLang's side of the group uses, outermost first.

    SGLang's ``init_custom_process_group`` wraps the TCP store in ``PrefixStore(G)``,
    torch's ``_new_process_group_helper`` adds ``PrefixStore(G + "/")`` and, per device
    type, ``PrefixStore("cuda/")``. The publisher's rank 0 must see the same keys.
    """
    g = sglang_group_name(group_epoch)
    return [g, g + "/", device_type + "/"]


def publisher_group(store, group: GroupInfo, timeout_s: float):
    """Rank 0's ``ProcessGroupNCCL`` of a group whose other ranks are SGLang workers.

    No barrier here: SGLang runs no collective when it joins; the first broadcast of
    the first publish creates the communicator on both sides (the slow one, ~0.5 s).
    """
    import datetime

    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    if group.backend == "gloo":  # colocated mode (learner and server on one GPU), and the CPU tests' key layout
        s = store
        for p in sglang_store_prefixes(group.group_epoch, "cpu"):
            s = dist.PrefixStore(p, s)
        return dist.ProcessGroupGloo(s, 0, group.world_size, timeout)
    if group.backend != "nccl":
        raise ValueError(f"SGLang receives weights over NCCL or gloo, not {group.backend!r}")
    s = store
    for p in sglang_store_prefixes(group.group_epoch):
        s = dist.PrefixStore(p, s)
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return dist.ProcessGroupNCCL(s, 0, group.world_size, opts)
