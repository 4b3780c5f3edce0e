"""Groups: the broker's unit of admission, lease and ack, and how a pushed batch is cut into them.

A group is every row of one GRPO group (``group_size`` rows, sample indices ``0..group_size-1``,
one ticket step). :func:`split_groups` cuts a validated batch into whole groups, zero-copy where the
rows sit together, and refuses a partial one; :mod:`broker.state` keeps them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from broker.protocol import BrokerError, ErrorCode
from broker.schema import BatchView, batch_view


@dataclass(slots=True)
class Group:
    group_id: str
    label: int  # the step of the ticket that started it (the rows' ``step``)
    seq: int  # arrival order; ties between labels break on it
    batch: pa.RecordBatch
    nbytes: int
    versions: np.ndarray  # oldest policy version of each row
    vmin: int = 0  # min and max of versions, read once (a lease checks them as plain ints)
    vmax: int = 0
    lease_id: str | None = None
    payload: object = None  # the pushed IPC frame when it held exactly this group: re-sent as is


def split_groups(batch: pa.RecordBatch, payload_bytes: int | None = None, view: BatchView | None = None) -> list[Group]:
    """Cut a validated batch into whole groups; raise BrokerError if any group is partial.

    Rows of one group that sit together become a zero-copy slice; scattered rows are
    gathered with ``take`` (one copy). ``seq`` and ``lease_id`` are filled in by the caller.
    ``view``: the batch's :class:`broker.schema.BatchView` if the caller has it already
    (with ``view.whole`` set the batch is known to be one whole group and is not re-checked).
    """
    n = batch.num_rows
    if n == 0:
        return []
    view = view if view is not None else batch_view(batch)
    si, gs, step, ver = view.sample_index, view.group_size, view.step, view.oldest_version
    total = payload_bytes if payload_bytes is not None else batch.nbytes
    if (
        view.whole and view.single_group is not None
    ):  # checked already, for all the pushes of a message at once (inspect_batches)
        # a copy: ``ver`` is a view of that joint check's concatenation, which would live on with it
        return [Group(view.single_group, view.label, 0, batch, max(1, total), ver.copy(), view.vmin, view.vmax)]
    if view.single_group is not None and n == int(gs[0]) and (gs == n).all() and (step == step[0]).all():
        # One whole group per push (the usual case): the same checks as below, without the
        # per-group index arrays. Validated rows have 0 <= sample_index < group_size, so
        # the indices are all of 0..n-1 exactly when the count of each is one.
        if (np.bincount(si, minlength=n) == 1).all():
            # a copy: ``ver`` may be a view of a joint validation's concatenation of several
            # pushes (broker.schema.inspect_batches), which would otherwise live on with it
            return [
                Group(
                    view.single_group, int(step[0]), 0, batch, max(1, total), ver.copy(), int(ver.min()), int(ver.max())
                )
            ]
    gids = view.group_ids if view.group_ids is not None else batch.column("group_id").to_pylist()
    rows_of: dict[str, list[int]] = {}
    for i, g in enumerate(gids):
        rows_of.setdefault(g, []).append(i)
    out = []
    for gid, rows in rows_of.items():
        idx = np.asarray(rows)
        size = int(gs[idx[0]])
        if (gs[idx] != size).any() or (step[idx] != step[idx[0]]).any():
            raise BrokerError(ErrorCode.INCOMPLETE_GROUP, f"group {gid!r}: rows disagree on group_size or step")
        if len(idx) != size or len(np.unique(si[idx])) != size:
            raise BrokerError(
                ErrorCode.INCOMPLETE_GROUP,
                f"group {gid!r} has {len(idx)} rows with sample indices {sorted(si[idx].tolist())[:8]}, "
                f"expected all of 0..{size - 1}; push whole groups only",
            )
        contiguous = idx[-1] - idx[0] + 1 == len(idx)
        rows_batch = batch.slice(int(idx[0]), len(idx)) if contiguous else batch.take(pa.array(idx))
        v = ver[idx]
        out.append(
            Group(gid, int(step[idx[0]]), 0, rows_batch, max(1, total * len(idx) // n), v, int(v.min()), int(v.max()))
        )
    return out
