"""The trajectory schema: round trip, and rejection of malformed batches with a clear message."""

import numpy as np
import pyarrow as pa
import pytest

from broker.schema import (
    TRAJECTORY_SCHEMA,
    SchemaError,
    Trajectory,
    from_record_batch,
    oldest_versions,
    to_record_batch,
    token_versions,
    validate_batch,
)
from tests.support.broker_groups import make_groups

pytestmark = pytest.mark.timeout(30)


def traj(i=0, **kw):
    base = dict(
        traj_id=f"g/{i}",
        group_id="g",
        sample_index=i,
        group_size=4,
        step=3,
        prompt_ids=[1, 2, 3],
        response_ids=[4, 5, 6, 7],
        behaviour_logprobs=[-0.1, -0.2, -0.3, -0.4],
        segment_starts=[0, 2],
        segment_versions=[1, 2],
        reward=1.0,
        finish_reason="stop",
        engine_id="vllm-0",
        data_source="addition",
        t_start=1.0,
        t_end=2.0,
    )
    base.update(kw)
    return Trajectory(**base)


def unchecked(trajs):
    """Build a batch bypassing validation, to feed validate_batch bad rows."""
    cols = {}
    for f in TRAJECTORY_SCHEMA:
        cols[f.name] = pa.array([getattr(t, f.name) for t in trajs], f.type)
    return pa.RecordBatch.from_pydict(cols, schema=TRAJECTORY_SCHEMA)


def test_round_trip_keeps_every_field():
    trajs = [traj(0), traj(1, response_ids=[], behaviour_logprobs=[], segment_starts=[0], segment_versions=[5])]
    back = from_record_batch(to_record_batch(trajs))
    for a, b in zip(trajs, back, strict=True):
        for f in TRAJECTORY_SCHEMA.names:
            x, y = getattr(a, f), getattr(b, f)
            if isinstance(y, np.ndarray):
                np.testing.assert_allclose(y, np.asarray(x, dtype=y.dtype))
            else:
                assert x == y, f
    ipc = pa.ipc.open_stream(_ipc(to_record_batch(trajs))).read_next_batch()
    assert ipc.equals(to_record_batch(trajs))


def _ipc(batch):
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as w:
        w.write_batch(batch)
    return sink.getvalue()


def test_oldest_and_token_versions():
    b = to_record_batch([traj(0), traj(1, segment_starts=[0], segment_versions=[7])])
    assert oldest_versions(b).tolist() == [1, 7]
    assert oldest_versions(b.slice(1)).tolist() == [7]
    assert token_versions(np.array([0, 2]), np.array([1, 2]), 4).tolist() == [1, 1, 2, 2]


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(behaviour_logprobs=[-0.1, float("nan"), -0.3, -0.4]), "NaN"),
        (dict(behaviour_logprobs=[-0.1, -0.2, -0.3]), "has 3 values but 'response_ids' has 4"),
        (dict(behaviour_logprobs=[-0.1, 0.5, -0.3, -0.4]), "positive"),
        (dict(segment_starts=[1], segment_versions=[1]), "begin at 0"),
        (dict(segment_starts=[0, 2, 2], segment_versions=[1, 2, 3]), "strictly increase"),
        (dict(segment_starts=[0, 2], segment_versions=[2, 1]), "must not decrease"),
        (dict(segment_starts=[0, 9], segment_versions=[1, 2]), "past the end"),
        (dict(segment_starts=[0, 2], segment_versions=[1]), "same, non-zero length"),
        (dict(segment_starts=[0], segment_versions=[-1]), ">= 0"),
        (dict(reward=float("inf")), "'reward'"),
        (dict(finish_reason="eos"), "'finish_reason' is 'eos'"),
        (dict(sample_index=4), "outside its group of 4"),
    ],
)
def test_bad_row_is_named(bad, message):
    with pytest.raises(SchemaError, match="row 1") as e:
        validate_batch(unchecked([traj(0), traj(1, **bad)]))
    assert message in str(e.value)
    with pytest.raises(SchemaError, match="row 1"):  # to_record_batch validates too
        to_record_batch([traj(0), traj(1, **bad)])


def test_row_numbers_refer_to_a_slice():
    b = unchecked([traj(0), traj(1), traj(2, behaviour_logprobs=[-0.1, float("nan"), -0.3, -0.4]), traj(3)])
    for offset in range(3):
        with pytest.raises(SchemaError, match=f"row {2 - offset}:"):
            validate_batch(b.slice(offset))
    validate_batch(b.slice(3))


def test_wrong_types_and_missing_fields():
    b = to_record_batch([traj(0)])
    cols = {f: b.column(f) for f in b.schema.names}
    cols["reward"] = pa.array([1.0], pa.float64())
    with pytest.raises(SchemaError, match=r"wrong types \['reward: double \(expected float\)'\]"):
        validate_batch(pa.RecordBatch.from_pydict(cols))
    cols = {f: b.column(f) for f in b.schema.names if f != "engine_id"}
    cols["engine"] = b.column("engine_id")
    with pytest.raises(SchemaError, match=r"missing \['engine_id'\], unexpected \['engine'\]"):
        validate_batch(pa.RecordBatch.from_pydict(cols))
    with pytest.raises(SchemaError, match="pyarrow.RecordBatch"):
        validate_batch({"traj_id": ["x"]})


def test_nulls_are_rejected_also_inside_lists():
    b = to_record_batch([traj(0), traj(1)])
    cols = {f: b.column(f) for f in b.schema.names}
    cols["response_ids"] = pa.array([[1, 2, 3, 4], [1, None, 3, 4]], pa.list_(pa.int32()))
    with pytest.raises(SchemaError, match="row 1: field 'response_ids' holds a null element"):
        validate_batch(pa.RecordBatch.from_pydict(cols, schema=TRAJECTORY_SCHEMA))
    cols = {f: b.column(f) for f in b.schema.names}
    cols["engine_id"] = pa.array(["a", None])
    with pytest.raises(SchemaError, match="row 1: field 'engine_id' is null"):
        validate_batch(pa.RecordBatch.from_pydict(cols))


def test_duplicate_traj_ids_and_ragged_offsets():
    with pytest.raises(SchemaError, match="'traj_id' 'g/0' appears twice"):
        validate_batch(unchecked([traj(0), traj(1, traj_id="g/0")]))
    b = make_groups(["a", "b"], step=1, version=0)
    # A hostile batch whose list offsets point past the values (patched IPC bytes): rejected
    # before anything reads through those offsets.
    b = make_groups(["a", "b"], step=1, version=0, group_size=2, resp_len=16)
    raw = bytearray(_ipc(b).to_pybytes())
    good = np.array([0, 16, 32, 48, 64], np.int32).tobytes()
    at = raw.find(good)
    assert at > 0
    raw[at + 16 : at + 20] = np.array([9999], np.int32).tobytes()
    hostile = pa.ipc.open_stream(pa.py_buffer(bytes(raw))).read_next_batch()
    with pytest.raises(SchemaError, match="not valid Arrow data"):
        validate_batch(hostile)


def test_empty_batch_and_realistic_batch_are_valid():
    validate_batch(to_record_batch([traj(0)]).slice(0, 0))
    validate_batch(make_groups([f"g{i}" for i in range(8)], step=1, version=0, group_size=4, resp_len=1000))
