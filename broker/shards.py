"""Per-rank shards of a step's batch, balanced by token count.

A learner with ``R`` data-parallel ranks trains one step's batch as ``R`` shards; the
slowest rank sets the step time, and a rank's work grows with its tokens, not its
rows. GRPO normalises advantages within a prompt group, so a group is never split:
groups go, largest first, to the rank with the fewest tokens so far (the LPT rule),
ties to the lowest rank, so the split is deterministic. Guarantees:

* every row is in exactly one shard, and the rows of a group are in one shard, in
  their batch order; a shard keeps the batch's group order (oldest first);
* the token counts of any two shards differ by at most the largest group's tokens;
* with fewer groups than ranks some shards are empty (zero rows, same schema).

A row's tokens are its prompt plus its response tokens. Example::

    lease = await consumer.next_batch(step, wait_s=60)
    mine = lease.shards(world_size)[rank]      # or shard_by_tokens(lease.batch, world_size)
"""

from __future__ import annotations

import heapq

import numpy as np
import pyarrow as pa


def row_tokens(batch: pa.RecordBatch) -> np.ndarray:
    """Prompt plus response tokens of each row (int64)."""
    out = np.zeros(batch.num_rows, np.int64)
    for name in ("prompt_ids", "response_ids"):
        off = batch.column(name).offsets.to_numpy()
        out += np.diff(off)
    return out


def shard_by_tokens(batch: pa.RecordBatch, ranks: int) -> list[pa.RecordBatch]:
    """``ranks`` record batches of whole groups with balanced token counts (see module doc)."""
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    if ranks == 1:
        return [batch]
    rows_of: dict[str, list[int]] = {}
    for i, gid in enumerate(batch.column("group_id").to_pylist()):
        rows_of.setdefault(gid, []).append(i)
    groups = list(rows_of.values())  # in order of first appearance
    tokens = row_tokens(batch)
    size = [int(tokens[rows].sum()) for rows in groups]
    # largest group first; among equal sizes the earlier group first (deterministic)
    order = sorted(range(len(groups)), key=lambda g: (-size[g], g))
    load = [(0, r) for r in range(ranks)]  # (tokens so far, rank): the least loaded, lowest rank first
    owned: list[list[int]] = [[] for _ in range(ranks)]
    for g in order:
        total, r = heapq.heappop(load)
        owned[r].append(g)
        heapq.heappush(load, (total + size[g], r))
    out = []
    for gs in owned:
        idx = [i for g in sorted(gs) for i in groups[g]]
        out.append(batch.take(pa.array(idx, pa.int64())) if idx else batch.slice(0, 0))
    return out
