"""Per-rank shards (broker.shards): a partition of whole groups, in batch order, balanced by tokens."""

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker.shards import row_tokens, shard_by_tokens
from tests.support.broker_groups import make_groups

pytestmark = pytest.mark.timeout(120)


def _batch(spec: list[tuple[int, int]]) -> pa.RecordBatch:
    """One group per (rows, response length), ids g0, g1, ..."""
    return pa.concat_batches(
        [
            make_groups([f"g{i}"], step=1, version=0, group_size=rows, resp_len=resp, prompt_len=3)
            for i, (rows, resp) in enumerate(spec)
        ]
    )


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    spec=st.lists(st.tuples(st.integers(1, 4), st.integers(1, 40)), min_size=1, max_size=12), ranks=st.integers(1, 6)
)
def test_shards_partition_whole_groups_in_order_with_balanced_tokens(spec, ranks):
    batch = _batch(spec)
    shards = shard_by_tokens(batch, ranks)
    assert len(shards) == ranks and all(s.schema.equals(batch.schema) for s in shards)
    ids = [s.column("traj_id").to_pylist() for s in shards]
    assert sorted(sum(ids, [])) == sorted(batch.column("traj_id").to_pylist())  # each row exactly once
    order = {t: i for i, t in enumerate(batch.column("traj_id").to_pylist())}
    for rows in ids:
        assert [order[t] for t in rows] == sorted(order[t] for t in rows)  # batch order kept
    owner = {}
    for r, s in enumerate(shards):
        for g in s.column("group_id").to_pylist():
            assert owner.setdefault(g, r) == r, "a group was split across ranks"
    group_tokens = [int(row_tokens(_batch([x])).sum()) for x in spec]
    loads = [int(row_tokens(s).sum()) for s in shards]
    assert sum(loads) == sum(group_tokens)
    assert max(loads) - min(loads) <= max(group_tokens)


def test_shards_of_a_concrete_batch():
    # tokens per group (3 prompt + resp per row): g0 2x(3+10)=26, g1 1x(3+30)=33, g2 3x(3+1)=12, g3 1x(3+5)=8
    batch = _batch([(2, 10), (1, 30), (3, 1), (1, 5)])
    a, b = shard_by_tokens(batch, 2)
    # LPT: g1 -> rank 0 (33), g0 -> rank 1 (26), g2 -> rank 1 (38), g3 -> rank 0 (41)
    assert a.column("group_id").unique().to_pylist() == ["g1", "g3"]
    assert b.column("group_id").unique().to_pylist() == ["g0", "g2"]
    assert (int(row_tokens(a).sum()), int(row_tokens(b).sum())) == (41, 38)
    empty = shard_by_tokens(_batch([(2, 4)]), 3)
    assert [s.num_rows for s in empty] == [2, 0, 0]
    assert shard_by_tokens(batch, 1)[0] is batch
    with pytest.raises(ValueError):
        shard_by_tokens(batch, 0)
    assert np.array_equal(row_tokens(batch), [13, 13, 33, 4, 4, 4, 8])
