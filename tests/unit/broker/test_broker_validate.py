"""The broker's fast batch validation agrees with the row-by-row checks, and IPC framing round-trips.

``broker.schema.inspect_batch`` accepts a batch on whole-batch reductions and only looks
row by row when one fails. The property here: whenever the fast path accepts, the
row-wise checks (which name the bad row) accept too, and the view it returns is the
same as the one read column by column; for the usual single-segment rows it does accept.
Batches are built unchecked, from random rows with random defects, and also sliced
(a non-zero array offset is where buffer arithmetic goes wrong).
"""

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker import protocol as P
from broker.schema import (
    JOINT_MAX_BYTES,
    TRAJECTORY_SCHEMA,
    SchemaError,
    _fast_view,
    batch_view,
    inspect_batch,
    inspect_batches,
    validate_batch,
)
from tests.support.broker_groups import batch_from_rows, make_groups, passes_row_checks

pytestmark = pytest.mark.timeout(120)

DEFECTS = [
    "none",
    "none",
    "none",
    "lp_nan",
    "lp_inf",
    "lp_neg_inf",
    "lp_positive",
    "lp_tiny_positive",
    "lp_short",
    "dup_traj",
    "seg_two_ok",
    "seg_two_unordered",
    "seg_two_past_end",
    "seg_versions_down",
    "seg_not_zero",
    "seg_empty",
    "version_negative",
    "reward_nan",
    "reward_inf",
    "finish_unknown",
    "sample_index_high",
    "sample_index_negative",
    "group_size_zero",
    "empty_response",
    "null_reward",
    "null_logprob",
]


def _rows(n, defects, resp_len, draw_int):
    rows = []
    for i in range(n):
        d = defects[i]
        r = resp_len if d != "empty_response" else 0
        lp = [-0.5] * r
        starts, vers = [0], [3]
        if d == "lp_nan" and r:
            lp[draw_int(r)] = float("nan")
        elif d == "lp_inf" and r:
            lp[draw_int(r)] = float("inf")
        elif d == "lp_neg_inf" and r:
            lp[draw_int(r)] = float("-inf")
        elif d == "lp_positive" and r:
            lp[draw_int(r)] = 0.5
        elif d == "lp_tiny_positive" and r:
            lp[draw_int(r)] = 5e-5  # rounding noise of a sampler: allowed
        elif d == "lp_short" and r:
            lp = lp[:-1]
        elif d == "null_logprob" and r:
            lp[draw_int(r)] = None
        elif d == "seg_two_ok" and r > 1:
            starts, vers = [0, r - 1], [3, 4]
        elif d == "seg_two_unordered" and r > 1:
            starts, vers = [0, 0], [3, 4]
        elif d == "seg_two_past_end":
            starts, vers = [0, r + 1], [3, 4]
        elif d == "seg_versions_down" and r > 1:
            starts, vers = [0, 1], [3, 2]
        elif d == "seg_not_zero":
            starts = [1]
        elif d == "seg_empty":
            starts, vers = [], []
        elif d == "version_negative":
            vers = [-1]
        rows.append(
            dict(
                traj_id=f"g/{i}" if d != "dup_traj" else "g/0",
                group_id="g" if i % 3 else "h",
                sample_index={"sample_index_high": 9, "sample_index_negative": -1}.get(d, i % 4),
                group_size=0 if d == "group_size_zero" else 4,
                step=2,
                prompt_ids=[1, 2],
                response_ids=list(range(r)),
                behaviour_logprobs=lp,
                segment_starts=starts,
                segment_versions=vers,
                reward={"reward_nan": float("nan"), "reward_inf": float("inf"), "null_reward": None}.get(d, 0.5),
                finish_reason="exploded" if d == "finish_unknown" else ["stop", "length", "abort"][i % 3],
                engine_id="e",
                data_source="d",
                t_start=0.0,
                t_end=1.0,
            )
        )
    return rows


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data(), n=st.integers(1, 12), resp_len=st.integers(0, 6))
def test_fast_path_accepts_only_what_the_row_wise_checks_accept(data, n, resp_len):
    defects = data.draw(st.lists(st.sampled_from(DEFECTS), min_size=n, max_size=n))
    batch = batch_from_rows(_rows(n, defects, resp_len, lambda k: data.draw(st.integers(0, k - 1))))
    start = data.draw(st.integers(0, n - 1))
    for b in (batch, batch.slice(start, data.draw(st.integers(1, n - start)))):
        b.validate(full=True)
        view = _fast_view(b)
        if view is not None:
            assert passes_row_checks(b), defects
            ref = batch_view(b)
            assert view.single_group == ref.single_group
            assert view.group_ids in (None, ref.group_ids)
            for name in ("sample_index", "group_size", "step", "oldest_version"):
                assert np.array_equal(getattr(view, name), getattr(ref, name)), name
        clean = all(d in ("none", "lp_tiny_positive", "empty_response") for d in defects)
        if clean and b is batch:
            assert view is not None, "a clean single-segment batch left the fast path"
        # the public entry point raises exactly when the row-wise checks do
        try:
            inspect_batch(b)
            accepted = True
        except SchemaError:
            accepted = False
        assert accepted == passes_row_checks(b)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    data=st.data(), k=st.integers(2, 4), resp_len=st.integers(0, 4), whole_copy=st.booleans(), shared_traj=st.booleans()
)
def test_batches_checked_together_pass_only_if_each_passes_alone(data, k, resp_len, whole_copy, shared_traj):
    """inspect_batches (the pushes of one message, checked at once, by either of its two
    paths) accepts only when inspect_batch accepts every batch, and then gives each the
    same view; clean batches are accepted."""
    batches = []
    for j in range(k):
        n = data.draw(st.integers(1, 6))
        defects = data.draw(st.lists(st.sampled_from(DEFECTS[:3] * 6 + DEFECTS), min_size=n, max_size=n))
        rows = _rows(n, defects, resp_len, lambda m: data.draw(st.integers(0, m - 1)))
        for r in rows:  # distinct across batches, unless the draw shares them
            r["traj_id"] = r["traj_id"] if shared_traj else f"b{j}/{r['traj_id']}"
        b = batch_from_rows(rows)
        batches.append(b.slice(1) if n > 1 and data.draw(st.booleans()) else b)
    nbytes = 1 if whole_copy else JOINT_MAX_BYTES  # which path: copy all, or the per-row columns only
    views = inspect_batches(batches, nbytes)
    alone = []
    for b in batches:
        try:
            alone.append(inspect_batch(b))
        except SchemaError:
            alone.append(None)
    if views is not None:
        assert all(v is not None for v in alone)
        for b, v in zip(batches, views, strict=True):
            ref = batch_view(b)
            assert v.single_group == ref.single_group and v.group_ids in (None, ref.group_ids)
            for name in ("sample_index", "group_size", "step", "oldest_version"):
                assert np.array_equal(getattr(v, name), getattr(ref, name)), name
    clean = [make_groups([f"c{j}"], step=1, version=0, group_size=3, resp_len=5) for j in range(k)]
    assert inspect_batches(clean, nbytes) is not None


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data(), k=st.integers(2, 4), whole_copy=st.booleans())
def test_batches_checked_together_know_which_are_one_whole_group(data, k, whole_copy):
    """inspect_batches marks a batch ``whole`` (the broker then skips split_groups' own
    checks) exactly when its rows are one complete group, with that group's step and the
    min and max of its rows' oldest versions; valid batches only, some of them near misses."""
    batches, expect = [], []
    for j in range(k):
        n = data.draw(st.integers(1, 4))
        kind = data.draw(st.sampled_from(["whole", "whole", "dup_index", "size_off", "two_steps", "two_groups"]))
        if n == 1 and kind in ("dup_index", "two_steps", "two_groups"):
            kind = "whole"
        si = data.draw(st.permutations(range(n)))
        if kind == "dup_index":
            si = [0] + list(si[1:]) if si[0] != 0 else [1] + list(si[1:])  # one index twice, one missing
        size = n + 1 if kind == "size_off" else n
        steps = [3] * n if kind != "two_steps" else [3] * (n - 1) + [4]
        gids = [f"g{j}"] * n if kind != "two_groups" else [f"g{j}"] * (n - 1) + [f"x{j}"]
        vers = data.draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
        rows = _rows(n, ["none"] * n, 2, lambda m: 0)
        for row, (r, i, st_, g, v) in enumerate(zip(rows, si, steps, gids, vers, strict=True)):
            r.update(traj_id=f"{j}/{row}", group_id=g, sample_index=i, group_size=size, step=st_, segment_versions=[v])
        batches.append(batch_from_rows(rows))
        expect.append((True, 3, min(vers), max(vers)) if kind == "whole" else (False,))
    views = inspect_batches(batches, 1 if whole_copy else JOINT_MAX_BYTES)
    assert views is not None
    assert [(v.whole, v.label, v.vmin, v.vmax) if v.whole else (False,) for v in views] == expect


def test_ipc_round_trip_of_one_and_several_batches_is_byte_identical_to_a_stream_writer():
    for rows in (1, 8, 300):  # 300 rows of 1,000 tokens: over the small-batch threshold
        b = make_groups(["g"], step=1, version=0, group_size=rows, resp_len=1000)
        for batches in ([b], [b, b.slice(1)]):
            sink = pa.BufferOutputStream()
            with pa.ipc.new_stream(sink, b.schema) as w:
                for x in batches:
                    w.write_batch(x)
            wire = P.batch_to_ipc(batches)
            assert wire.to_pybytes() == sink.getvalue().to_pybytes()
            back = P.ipc_to_batches(wire)
            assert [x.num_rows for x in back] == [x.num_rows for x in batches]
            assert all(x.equals(y) for x, y in zip(back, batches, strict=True))
            validate_batch(back[0])


def test_producer_serialiser_writes_the_same_bytes_as_batch_to_ipc():
    """trajectory_to_ipc (the producer client's) is batch_to_ipc of one batch, byte for byte:
    small and large batches, slices, and batches in other schemas (which it hands over)."""
    nullable = pa.schema([f.with_nullable(True) for f in TRAJECTORY_SCHEMA], metadata=TRAJECTORY_SCHEMA.metadata)
    for rows in (1, 8, 300):
        b = make_groups(["g"], step=1, version=0, group_size=rows, resp_len=1000)
        other = pa.RecordBatch.from_arrays(b.columns, schema=nullable)
        for x in (b, b.slice(1), other, b.replace_schema_metadata(None), pa.RecordBatch.from_pydict({"y": [1, 2]})):
            assert P.trajectory_to_ipc(x).to_pybytes() == P.batch_to_ipc(x).to_pybytes()
        assert P.ipc_to_batches(P.trajectory_to_ipc(b))[0].equals(b)


def test_ipc_reader_refuses_streams_that_are_not_record_batches():
    good = P.batch_to_ipc(make_groups(["g"], step=1, version=0)).to_pybytes()
    dictionary = P.batch_to_ipc(pa.RecordBatch.from_pydict({"x": pa.array(["a", "b"]).dictionary_encode()}))
    for bad in (b"", good[:40], good[: len(good) - 30], b"\x00" * 64, dictionary.to_pybytes()):
        with pytest.raises(P.ProtocolError) as e:
            P.ipc_to_batches(bad)
        assert e.value.code == P.ErrorCode.BAD_FRAME
