"""The single-push fast path (broker.group_check.whole_group) agrees with the general checks.

A push that is one whole group is validated over its raw Arrow buffers. The property: it
accepts only batches that the row-wise checks accept and that the general path then cuts
into exactly that one whole group (same id, step, versions); clean groups do take it; and
``inspect_batch`` raises exactly when the row-wise checks do. Batches are built with random
defects aimed at each check, and in layouts where reading buffers without their offsets
would go wrong: slices with bad rows around them, list children with an offset, list
offsets that do not start at 0, and as read back from Arrow IPC (the broker's case).
"""

import itertools

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker import group_check
from broker import protocol as P
from broker.groups import split_groups
from broker.protocol import BrokerError
from broker.schema import _LAYOUT, TRAJECTORY_SCHEMA, SchemaError, batch_view, inspect_batch
from tests.support.broker_groups import batch_from_rows, make_groups, passes_row_checks

pytestmark = pytest.mark.timeout(120)

BENIGN = ["none", "si_permuted", "lp_tiny_positive", "empty_response", "versions_mixed"]
DEFECTS = BENIGN + [
    "si_dup",
    "si_high",
    "si_negative",
    "gs_all_off",
    "gs_one_off",
    "step_one_off",
    "gid_one_off",
    "two_segments",
    "seg_not_zero",
    "seg_empty",
    "version_negative",
    "lp_nan",
    "lp_inf",
    "lp_neg_inf",
    "lp_positive",
    "lp_len_moved",
    "lp_short",
    "versions_len_moved",
    "reward_nan",
    "reward_inf",
    "reward_inf_minus_inf",
    "finish_unknown",
    "dup_traj",
    "null_reward",
    "null_logprob",
    "null_traj",
    "null_prompt_token",
]
LAYOUTS = [
    "plain",
    "ipc",
    "slice",
    "child_offset",
    "child_offset_lp",
    "child_offset_versions",
    "shifted_offsets",
    "shifted_ipc",
]
JUNK_LP = -0.5  # what rows around a slice or before shifted offsets hold: valid, so a misread passes


def _rows(n, defects, lens, ints, perm):
    """Rows of one whole group with ``defects``; ``ints(lo, hi)`` and ``perm(n)`` choose where."""
    rows = []
    for i in range(n):
        r = lens[i]
        rows.append(
            dict(
                traj_id=f"g/{i}",
                group_id="g",
                sample_index=i,
                group_size=n,
                step=5,
                prompt_ids=[1, 2],
                response_ids=list(range(r)),
                behaviour_logprobs=[-0.25] * r,
                segment_starts=[0],
                segment_versions=[3],
                reward=0.5,
                finish_reason=["stop", "length", "abort"][i % 3],
                engine_id="e",
                data_source="d",
                t_start=0.0,
                t_end=1.0,
            )
        )
    row, other = rows[ints(0, n - 1)], rows[ints(0, n - 1)]
    for d in defects:
        r = len(row["response_ids"])
        if d == "si_permuted":
            for x, i in zip(rows, perm(n), strict=True):
                x["sample_index"] = i
        elif d == "empty_response":
            row.update(response_ids=[], behaviour_logprobs=[])
        elif d == "versions_mixed":
            for x in rows:
                x["segment_versions"] = [ints(0, 4)]
        elif d == "si_dup" and n > 1:
            rows[0]["sample_index"] = rows[1]["sample_index"]
        elif d == "si_high":
            row["sample_index"] = n
        elif d == "si_negative":
            row["sample_index"] = -1
        elif d == "gs_all_off":
            for x in rows:
                x["group_size"] = n + 1
        elif d == "gs_one_off":
            row["group_size"] = n + 1
        elif d == "step_one_off":
            row["step"] = 6
        elif d == "gid_one_off":
            row["group_id"] = "h"
        elif d == "two_segments" and r > 1:
            row.update(segment_starts=[0, 1], segment_versions=[3, 4])
        elif d == "seg_not_zero":
            row["segment_starts"] = [1]
        elif d == "seg_empty":
            row.update(segment_starts=[], segment_versions=[])
        elif d == "version_negative":
            row["segment_versions"] = [-1]
        elif (
            d in ("lp_nan", "lp_inf", "lp_neg_inf", "lp_positive", "lp_tiny_positive", "null_logprob")
            and row["behaviour_logprobs"]
        ):  # its current length: an earlier defect may have moved one
            value = {
                "lp_nan": float("nan"),
                "lp_inf": float("inf"),
                "lp_neg_inf": float("-inf"),
                "lp_positive": 0.5,
                "lp_tiny_positive": 5e-5,
                "null_logprob": None,
            }[d]
            row["behaviour_logprobs"][ints(0, len(row["behaviour_logprobs"]) - 1)] = value
        elif d == "lp_len_moved" and r and row is not other:  # same total, wrong rows
            row["behaviour_logprobs"] = row["behaviour_logprobs"][:-1]
            other["behaviour_logprobs"] = other["behaviour_logprobs"] + [-0.1]
        elif d == "versions_len_moved" and row is not other:  # same total, wrong rows
            row["segment_versions"], other["segment_versions"] = [3, 3], []
        elif d == "lp_short" and r:
            row["behaviour_logprobs"] = row["behaviour_logprobs"][:-1]
        elif d == "reward_nan":
            row["reward"] = float("nan")
        elif d == "reward_inf":
            row["reward"] = float("inf")
        elif d == "reward_inf_minus_inf" and row is not other:
            row["reward"], other["reward"] = float("inf"), float("-inf")
        elif d == "finish_unknown":
            row["finish_reason"] = "exploded"
        elif d == "dup_traj" and n > 1:
            rows[1]["traj_id"] = rows[0]["traj_id"]
        elif d in ("null_reward", "null_traj"):
            row[{"null_reward": "reward", "null_traj": "traj_id"}[d]] = None
        elif d == "null_prompt_token":
            row["prompt_ids"] = [1, None]
    return rows


def _junk_row(i):
    return dict(
        traj_id=f"junk/{i}",
        group_id="g",
        sample_index=0,
        group_size=1,
        step=5,
        prompt_ids=[1],
        response_ids=[7, 7],
        behaviour_logprobs=[JUNK_LP] * 2,
        segment_starts=[0],
        segment_versions=[3],
        reward=0.0,
        finish_reason="stop",
        engine_id="e",
        data_source="d",
        t_start=0.0,
        t_end=1.0,
    )


def _shift_lists(batch, names, pad):
    """The same rows, with each named list column's offsets starting at ``pad`` (a child
    that holds ``pad`` valid-looking values first)."""
    cols = batch.columns
    for name in names:
        i = TRAJECTORY_SCHEMA.get_field_index(name)
        c = cols[i]
        t = c.type.value_type
        junk = pa.array([JUNK_LP if pa.types.is_floating(t) else 0] * pad, t)
        off = np.asarray(c.offsets) - c.offsets[0].as_py() + pad
        values = pa.concat_arrays([junk, c.values.slice(c.offsets[0].as_py())])
        cols[i] = pa.ListArray.from_arrays(pa.array(off.astype(np.int32)), values)
    return pa.RecordBatch.from_arrays(cols, schema=TRAJECTORY_SCHEMA)


def _layout(rows, layout, pad):
    if layout == "slice":
        return batch_from_rows([_junk_row(0)] + rows + [_junk_row(1)]).slice(1, len(rows))
    b = batch_from_rows(rows)
    if layout.startswith("child_offset"):  # children sliced: their buffers begin before their values
        cols = b.columns
        names = {"child_offset_lp": ["behaviour_logprobs"], "child_offset_versions": ["segment_versions"]}.get(
            layout, ["response_ids", "behaviour_logprobs", "segment_starts", "segment_versions"]
        )
        for name in names:
            i = TRAJECTORY_SCHEMA.get_field_index(name)
            c = cols[i]
            t = c.type.value_type
            junk = pa.array([JUNK_LP if pa.types.is_floating(t) else 0] * pad, t)
            child = pa.concat_arrays([junk, c.values]).slice(pad)
            cols[i] = pa.ListArray.from_arrays(c.offsets, child)
        return pa.RecordBatch.from_arrays(cols, schema=TRAJECTORY_SCHEMA)
    if layout in ("shifted_offsets", "shifted_ipc"):
        b = _shift_lists(b, ("response_ids", "behaviour_logprobs"), pad)
    if layout in ("ipc", "shifted_ipc"):
        return P.ipc_to_batches(P.batch_to_ipc(b))[0]
    return b


def _general_groups(batch):
    """The general path's groups of a valid batch: (id, step, min, max version, rows) or the refusal."""
    try:
        groups = split_groups(batch, None, batch_view(batch))
        return [(g.group_id, g.label, g.vmin, g.vmax, g.batch.num_rows) for g in groups]
    except BrokerError as e:
        return e.code


def _check(rows, layout, pad, defects):
    b = _layout(rows, layout, pad)
    b.validate(full=True)
    got = group_check.whole_group(b, _LAYOUT)
    ok = passes_row_checks(b)
    if got is not None:
        assert ok, defects
        gids, single, si, gs, step, ver, label, vmin, vmax = got
        assert _general_groups(b) == [(single, label, vmin, vmax, len(rows))], defects
        ref = batch_view(b)
        assert gids == ref.group_ids and single == ref.single_group
        for mine, theirs in ((si, ref.sample_index), (gs, ref.group_size), (step, ref.step), (ver, ref.oldest_version)):
            assert np.array_equal(mine, theirs)
    elif all(d in BENIGN for d in defects) and layout in ("plain", "ipc", "shifted_offsets", "shifted_ipc"):
        pytest.fail(f"a clean whole group ({layout}, {defects}) left the fast path")
    try:  # the public entry point: raises exactly when the row-wise checks do
        view = inspect_batch(b)
    except SchemaError:
        assert not ok, defects
    else:
        assert ok, defects
        assert view.whole == (got is not None)


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data(), n=st.integers(1, 9), layout=st.sampled_from(LAYOUTS), pad=st.integers(1, 5))
def test_whole_group_path_accepts_only_valid_whole_groups(data, n, layout, pad):
    defects = data.draw(st.lists(st.sampled_from(DEFECTS), min_size=0, max_size=2))
    lens = data.draw(st.lists(st.integers(0, 5), min_size=n, max_size=n))
    rows = _rows(
        n, defects, lens, lambda lo, hi: data.draw(st.integers(lo, hi)), lambda k: data.draw(st.permutations(range(k)))
    )
    _check(rows, layout, pad, defects)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("defect", DEFECTS)
def test_each_defect_alone_in_each_layout(defect, layout):
    """Every defect on its own, deterministically (the property test above draws them at random)."""
    alternate = itertools.cycle((True, False))
    rows = _rows(4, [defect], [3, 2, 3, 1], lambda lo, hi: hi if next(alternate) else lo, lambda k: range(k)[::-1])
    _check(rows, layout, 2, [defect])


def test_whole_group_path_takes_the_pushes_the_broker_sees():
    """Groups as the bench and the fleet push them, read back from IPC, take the fast path
    and get the same view as the joint path gives them."""
    for size, resp in ((1, 1), (8, 1000), (16, 3000), (123, 1000)):
        b = P.ipc_to_batches(
            P.trajectory_to_ipc(make_groups(["g7"], step=4, version=2, group_size=size, resp_len=resp))
        )[0]
        view = inspect_batch(b)
        assert view.whole and (view.single_group, view.label, view.vmin, view.vmax) == ("g7", 4, 2, 2)
        assert _general_groups(b) == [("g7", 4, 2, 2, size)]


def test_layout_matches_arrow_buffer_order():
    """The buffer positions derived from the schema are the ones Arrow returns."""
    b = make_groups(["g"], step=1, version=0, group_size=3, resp_len=4)
    bufs = b.to_struct_array().buffers()
    assert len(bufs) == _LAYOUT.n_buffers
    for name, pos in _LAYOUT.pos.items():
        col = b.column(name)
        mine = [bufs[k] for k in pos]
        theirs = [x for x in col.buffers() if x is not None]
        assert len(mine) == len(theirs) and all(x.address == y.address for x, y in zip(mine, theirs, strict=True)), name
