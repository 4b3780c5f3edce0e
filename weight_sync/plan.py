"""The bucket plan of a publish, bucket packing, and the checksum both sides compute.

A plan is fixed for a run: the same tensors in the same order every publish, so
it is announced once per group epoch and then referred to by ``plan_id``.

Buckets are cut with vLLM's packed-broadcast rule (append tensors until the
running size *exceeds* the bucket size, then cut after that tensor), so a bucket
of ours is byte for byte one chunk of vLLM's ``packed_nccl_broadcast_consumer``
given ``packed_buffer_size_bytes = bucket_bytes``: the same publisher feeds
vLLM's built-in NCCL backend and fleetrl's own receivers.

Example::

    plan = build_plan([(n, list(t.shape), t.dtype) for n, t in model.state_dict().items()], 256 << 20)
    buf = pack_bucket([state[n] for n in bucket_names(plan, 0)])
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Sequence

import msgspec
import torch

from weight_sync.messages import WeightPlan

_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
    "int8": torch.int8,
}


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise TypeError(f"weight sync cannot carry dtype {dtype}; supported: {sorted(_DTYPES)}")
    return name


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise TypeError(f"unknown dtype name {name!r} in weight plan; supported: {sorted(_DTYPES)}") from None


def nbytes(shape: Sequence[int], dtype: str) -> int:
    return math.prod(shape) * _DTYPES[dtype].itemsize


TAIL_FACTOR = (
    4  # an estimate (not measured alone) of how much faster a receiver loads and checksums than the wire brings
)


def build_plan(
    params: Sequence[tuple[str, Sequence[int], torch.dtype | str]],
    bucket_bytes: int,
    tail_bytes: int = 0,
    tail_factor: int = 0,
) -> WeightPlan:
    """Plan for ``params`` = [(name, full shape, dtype)] in broadcast order.

    ``tail_bytes > 0`` cuts the last bucket into pieces that shrink towards the end:
    its trailing tensors up to ``tail_bytes`` become the last bucket, those before them
    up to ``tail_factor`` (default :data:`TAIL_FACTOR`) times that the one before, and so
    on. If a receiver loads and checksums a bucket that many times faster than the wire
    brings it, each piece's work is done while the next, smaller one arrives, and what
    is left after the last byte is the work on a few MB rather than on a full bucket
    (what that gains against an uncut plan: bench/results/engines_gpu.md). The plan then no longer
    follows vLLM's packed rule, so only fleetrl's own receivers take it (see
    :meth:`weight_sync.config.WeightSyncConfig.tail_bytes`).

    ``plan_id`` is a digest of names, shapes, dtypes and buckets, so two sides that
    agree on the id agree on the byte layout.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    if not params:
        raise ValueError("a weight plan needs at least one tensor")
    names, shapes, dtypes = [], [], []
    for name, shape, dtype in params:
        names.append(name)
        shapes.append([int(s) for s in shape])
        dtypes.append(dtype if isinstance(dtype, str) else dtype_name(dtype))
        torch_dtype(dtypes[-1])
    if len(set(names)) != len(names):
        raise ValueError("weight plan has duplicate tensor names")
    sizes = [nbytes(s, d) for s, d in zip(shapes, dtypes, strict=True)]
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i in range(len(names)):
        current.append(i)
        size += sizes[i]
        if size > bucket_bytes:  # vLLM's rule: cut after the tensor that crosses the limit
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    if tail_bytes > 0 and sum(sizes[i] for i in buckets[-1]) > tail_bytes:  # (a last bucket that small stays whole)
        last, limit = buckets.pop(), tail_bytes
        pieces: list[list[int]] = []
        while len(last) > 1:
            piece: list[int] = []
            size = 0
            while len(last) > 1 and size + sizes[last[-1]] <= limit:
                size += sizes[last[-1]]
                piece.insert(0, last.pop())
            if not piece:
                break
            pieces.insert(0, piece)
            limit *= tail_factor or TAIL_FACTOR
            if sum(sizes[i] for i in last) <= limit:  # what is left is small enough to be the next piece
                break
        buckets += [last, *pieces]
    digest = hashlib.sha256(repr((names, shapes, dtypes, buckets)).encode()).hexdigest()[:16]
    return WeightPlan(plan_id=digest, names=names, shapes=shapes, dtypes=dtypes, buckets=buckets)


def packed_buffer_bytes(plan: WeightPlan) -> int:
    """The ``packed_buffer_size_bytes`` under which vLLM's packed NCCL format cuts exactly ``plan.buckets``."""
    sizes = [[nbytes(plan.shapes[i], plan.dtypes[i]) for i in b] for b in plan.buckets]
    lo = max(sum(b[:-1]) for b in sizes)  # no bucket may cross the limit before its last tensor
    hi = min(sum(b) for b in sizes[:-1]) - 1 if len(sizes) > 1 else max(lo, sum(sizes[0]))  # every cut must cross it
    if hi < lo:
        raise ValueError(
            f"plan {plan.plan_id}: buckets were not cut by the packed rule; vLLM's NCCL backend cannot follow them"
        )
    return max(hi, 1)  # the largest consistent limit: closest to the bucket size the plan was built with


def validate_plan(plan: WeightPlan) -> None:
    """Reject a malformed plan received over the wire, naming the problem."""
    n = len(plan.names)
    if len(plan.shapes) != n or len(plan.dtypes) != n:
        raise ValueError(
            f"weight plan {plan.plan_id}: {n} names but {len(plan.shapes)} shapes, {len(plan.dtypes)} dtypes"
        )
    for d in plan.dtypes:
        torch_dtype(d)
    flat = [i for b in plan.buckets for i in b]
    if sorted(flat) != list(range(n)):
        raise ValueError(f"weight plan {plan.plan_id}: buckets do not cover each of the {n} tensors exactly once")


def bucket_layout(plan: WeightPlan, b: int) -> tuple[list[str], list[list[int]], list[torch.dtype], list[int]]:
    """Names, shapes, dtypes and byte sizes of bucket ``b``, in packing order."""
    idx = plan.buckets[b]
    return (
        [plan.names[i] for i in idx],
        [plan.shapes[i] for i in idx],
        [torch_dtype(plan.dtypes[i]) for i in idx],
        [nbytes(plan.shapes[i], plan.dtypes[i]) for i in idx],
    )


def pack_bucket(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Concatenate tensors' raw bytes into one contiguous uint8 buffer (vLLM's packed layout).

    A bucket of one contiguous tensor (an embedding, an LM head) is sent from that tensor's own
    memory, without a copy: it must then stay unchanged until its broadcast is done.
    """
    flat = [t.detach().contiguous().view(-1).view(torch.uint8) for t in tensors]
    return flat[0] if len(flat) == 1 else torch.cat(flat)


def unpack_bucket(buf: torch.Tensor, plan: WeightPlan, b: int) -> list[tuple[str, torch.Tensor]]:
    """Views of ``buf`` as the named tensors of bucket ``b``."""
    names, shapes, dtypes, sizes = bucket_layout(plan, b)
    if buf.numel() != sum(sizes):
        raise ValueError(f"bucket {b} of plan {plan.plan_id}: got {buf.numel()} bytes, expected {sum(sizes)}")
    parts = buf.split(sizes)
    return [(n, p.view(d).view(s)) for n, s, d, p in zip(names, shapes, dtypes, parts, strict=True)]


class SendRing:
    """Where rank 0 packs buckets: ``slots`` standing buffers of the largest group's size, used in turn.

    Consecutive buckets of at most ``group_bytes`` together (the configured bucket size) form a *group*:
    in a plan cut by the packed rule every bucket is larger than that and goes alone, and the small
    pieces a tail cut leaves at the end share one group. A group is packed with one ``_foreach_copy_``
    into its slot, through typed views built once, and its buckets go on the wire back to back, so a
    small piece never waits on the host for a slot (a view chain and a cat per tensor can cost more host
    time per bucket than a full bucket spends on the wire). A group of one contiguous tensor is sent
    from that tensor itself. With ``slots = inflight + 1`` the slot a group is packed into was last used
    by a group whose broadcasts have completed. (Groups of several full-size buckets were tried and sent
    slower than one at a time: bench/results/engines_gpu.md.)"""

    def __init__(self, plan: WeightPlan, slots: int, device: torch.device, group_bytes: int) -> None:
        self.plan, self.sizes = plan, plan.bucket_bytes()
        self.expect = [
            (n, torch.Size(s), torch_dtype(d)) for n, s, d in zip(plan.names, plan.shapes, plan.dtypes, strict=True)
        ]
        self.groups: list[list[int]] = []
        used = group_bytes
        for b, n in enumerate(self.sizes):
            if used + n > group_bytes:
                self.groups.append([])
                used = 0
            self.groups[-1].append(b)
            used += n
        slot_bytes = max(sum(self.sizes[b] for b in group) for group in self.groups)
        self.bufs = [
            torch.empty(slot_bytes, dtype=torch.uint8, device=device) for _ in range(min(slots, len(self.groups)))
        ]
        self.views: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}

    @torch.no_grad()
    def pack(self, g: int, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        """Pack group ``g`` (``parts``: its tensors in plan order); returns one byte buffer per bucket."""
        if len(parts) == 1 and parts[0].is_contiguous():
            return [pack_bucket(parts)]  # no copy
        entry = self.views.get(g)
        if entry is None:
            slot, at, bufs, views = self.bufs[g % len(self.bufs)], 0, [], []
            for b in self.groups[g]:
                bufs.append(slot[at : at + self.sizes[b]])
                views += [v for _, v in unpack_bucket(bufs[-1], self.plan, b)]
                at += self.sizes[b]
            entry = self.views[g] = (bufs, views)
        torch._foreach_copy_(entry[1], parts)
        return entry[0]


_FOLD = 512  # int64 words (4 KiB) per row of the fingerprint


def bucket_fingerprint(buf: torch.Tensor) -> torch.Tensor:
    """Fingerprint of a bucket's bytes, computed where the bytes are (no copy to the host).

    The bytes are read once as rows of 4 KiB of int64 words; each row's wrapping
    sum is kept, and the fingerprint is the plain and the row-index-weighted sum of
    those. Integer addition modulo 2**64 is associative, so CPU and GPU and any
    reduction order give the same value. Any flipped bit changes it; so does a row
    sent to the wrong place (a reordering inside one 4 KiB row does not). A CRC on
    the host costs a device-to-host copy and a core's time per bucket (far longer than
    the broadcast itself on GPU); this is one pass over device memory.
    Returns a 2-element int64 tensor on ``buf``'s device; stays asynchronous until
    :func:`combine_fingerprints`.
    """
    flat = buf.detach().reshape(-1).view(torch.uint8)
    row_bytes = 8 * _FOLD
    whole = flat.numel() - flat.numel() % row_bytes
    sums = [flat[:whole].view(torch.int64).view(-1, _FOLD).sum(dim=1)] if whole else []
    if whole < flat.numel():  # the ragged tail, zero-padded to one row
        tail = torch.zeros(row_bytes, dtype=torch.uint8, device=flat.device)
        tail[: flat.numel() - whole] = flat[whole:]
        sums.append(tail.view(torch.int64).sum().reshape(1))
    per_row = torch.cat(sums) if len(sums) > 1 else sums[0]
    return (per_row * _row_weights(per_row.numel(), flat.device)).sum(dim=1)  # [plain sum, weighted sum]


@functools.lru_cache(maxsize=64)
def _row_weights(rows: int, device: torch.device) -> torch.Tensor:
    """``[[1, 1, ...], [1, 2, ..., rows]]`` (int64): both sums of a fingerprint in one multiply and one
    reduction, from weights made once per bucket size (a plan has few), not per publish."""
    return torch.stack(
        [
            torch.ones(rows, dtype=torch.int64, device=device),
            torch.arange(1, rows + 1, dtype=torch.int64, device=device),
        ]
    )


def combine_fingerprints(prints: Sequence[torch.Tensor]) -> str:
    """One checksum for a publish from the per-bucket fingerprints (one host sync, at the end)."""
    if not prints:
        return "0-0"
    return fingerprints_checksum(torch.stack(list(prints)))


def fingerprints_checksum(values) -> str:
    """The checksum of a publish from its per-bucket fingerprints as one int64 tensor (``[buckets, 2]``, or
    flat, on any device) or numpy array: what :func:`combine_fingerprints` returns for the same fingerprints.
    Group acks gather the fingerprints themselves, and each side turns them into this string."""
    if isinstance(values, torch.Tensor):
        values = values.cpu().numpy()  # one device-to-host copy, one sync
    flat = values.reshape(-1, 2).astype("<i8", copy=False)
    return f"{hashlib.blake2b(flat.tobytes(), digest_size=8).hexdigest()}-{flat.shape[0]}"


def plan_to_dict(plan: WeightPlan) -> dict:
    """The plan as JSON-ready data inside a larger body (vLLM's ``init_info``, SGLang's loader command)."""
    return msgspec.to_builtins(plan)


def plan_from_dict(d: dict) -> WeightPlan:
    """The plan in such a body, type-checked by its Struct and then by :func:`validate_plan`."""
    try:
        plan = msgspec.convert(d, WeightPlan)
    except msgspec.ValidationError as e:
        raise ValueError(f"bad weight plan message: {e}; keys given: {sorted(d)}") from None
    validate_plan(plan)
    return plan
