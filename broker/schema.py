"""The trajectory schema: the contract between the rollout fleet and the learner.

One Arrow row per sample. Batches of rows travel fleet -> broker -> learner as
Arrow IPC record batches and are spooled and exported in the same schema.

Fields (types are Arrow types):

==================== ===================== ===============================================
field                type                  meaning
==================== ===================== ===============================================
traj_id              string                unique id of the sample (``<group_id>/<index>``)
group_id             string                id of its prompt group (GRPO normalises per group)
sample_index         int32                 index of the sample in its group, ``0..group_size-1``
group_size           int32                 samples in the group (``rollout.sampling.n``)
step                 int64                 learner step whose admission ticket started the group
prompt_ids           list<int32>           prompt token ids
response_ids         list<int32>           generated token ids (may be empty)
behaviour_logprobs   list<float32>         sampler log-prob of each response token; same length
segment_starts       list<int32>           offsets into the response where a policy version starts;
                                           first is 0, strictly increasing
segment_versions     list<int64>           the policy version of each segment, non-decreasing
reward               float32               scalar reward of the sample (finite)
finish_reason        string                ``stop``, ``length`` or ``abort``
engine_id            string                server that produced it (``sim-`` prefix: simulated)
data_source          string                dataset name (verl's ``data_source``)
t_start              float64               unix seconds when generation started
t_end                float64               unix seconds when the reward was scored
==================== ===================== ===============================================

The oldest version of a sample is ``segment_versions[0]``; its staleness when the
learner is at version ``v`` is ``v - segment_versions[0]``.

Example::

    t = Trajectory(traj_id="g1/0", group_id="g1", sample_index=0, group_size=2, step=1,
                   prompt_ids=[1, 2], response_ids=[3, 4], behaviour_logprobs=[-0.1, -0.2],
                   segment_starts=[0], segment_versions=[0], reward=1.0, finish_reason="stop",
                   engine_id="vllm-0", data_source="addition", t_start=0.0, t_end=1.0)
    batch = to_record_batch([t])
    validate_batch(batch)     # raises SchemaError naming the row and field if malformed
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

SCHEMA_VERSION = 1

TRAJECTORY_SCHEMA = pa.schema(
    [
        pa.field("traj_id", pa.string(), nullable=False),
        pa.field("group_id", pa.string(), nullable=False),
        pa.field("sample_index", pa.int32(), nullable=False),
        pa.field("group_size", pa.int32(), nullable=False),
        pa.field("step", pa.int64(), nullable=False),
        pa.field("prompt_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("response_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("behaviour_logprobs", pa.list_(pa.float32()), nullable=False),
        pa.field("segment_starts", pa.list_(pa.int32()), nullable=False),
        pa.field("segment_versions", pa.list_(pa.int64()), nullable=False),
        pa.field("reward", pa.float32(), nullable=False),
        pa.field("finish_reason", pa.string(), nullable=False),
        pa.field("engine_id", pa.string(), nullable=False),
        pa.field("data_source", pa.string(), nullable=False),
        pa.field("t_start", pa.float64(), nullable=False),
        pa.field("t_end", pa.float64(), nullable=False),
    ],
    metadata={b"fleetrl.schema_version": str(SCHEMA_VERSION).encode()},
)

FINISH_REASONS = ("stop", "length", "abort")


class SchemaError(ValueError):
    """A trajectory batch that breaks the schema; the message names the row and field."""


@dataclass(kw_only=True, slots=True)
class Trajectory:
    """One sample, as the fleet builds it. Sequences may be lists or numpy arrays."""

    traj_id: str
    group_id: str
    sample_index: int
    group_size: int
    step: int
    prompt_ids: list[int] | np.ndarray
    response_ids: list[int] | np.ndarray
    behaviour_logprobs: list[float] | np.ndarray
    segment_starts: list[int] | np.ndarray = field(default_factory=lambda: [0])
    segment_versions: list[int] | np.ndarray = field(default_factory=lambda: [0])
    reward: float = 0.0
    finish_reason: str = "stop"
    engine_id: str = ""
    data_source: str = ""
    t_start: float = 0.0
    t_end: float = 0.0


def _list_array(seqs: list, value_type: pa.DataType) -> pa.ListArray:
    """A list array built from numpy buffers (no per-element Python work)."""
    np_type = value_type.to_pandas_dtype()
    lengths = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
    offsets = np.zeros(len(seqs) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    values = np.concatenate([np.asarray(s, dtype=np_type) for s in seqs]) if seqs else np.zeros(0, np_type)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values.astype(np_type, copy=False), value_type))


def to_record_batch(trajs: list[Trajectory]) -> pa.RecordBatch:
    """Build a validated record batch from trajectories."""
    cols = {}
    for f in TRAJECTORY_SCHEMA:
        values = [getattr(t, f.name) for t in trajs]
        if pa.types.is_list(f.type):
            cols[f.name] = _list_array(values, f.type.value_type)
        else:
            cols[f.name] = pa.array(values, f.type)
    batch = pa.RecordBatch.from_pydict(cols, schema=TRAJECTORY_SCHEMA)
    validate_batch(batch)
    return batch


def from_record_batch(batch: pa.RecordBatch) -> list[Trajectory]:
    """The inverse of :func:`to_record_batch` (numpy arrays for sequences)."""
    out = []
    cols = {f.name: batch.column(f.name) for f in TRAJECTORY_SCHEMA}
    for i in range(batch.num_rows):
        kw = {}
        for name, col in cols.items():
            if pa.types.is_list(col.type):
                kw[name] = col[i].values.to_numpy(zero_copy_only=False)
            else:
                kw[name] = col[i].as_py()
        out.append(Trajectory(**kw))
    return out


def _row_of_first(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


def validate_batch(batch: pa.RecordBatch) -> pa.RecordBatch:
    """Check a batch against the schema and its invariants; return it or raise SchemaError.

    Checks: exact field names and types; no nulls; ``behaviour_logprobs`` as long
    as ``response_ids``, finite and <= 0; segments start at 0, increase, and lie
    inside the response; versions non-decreasing and >= 0; reward finite; known
    finish reasons; ``0 <= sample_index < group_size``.
    """
    if not isinstance(batch, pa.RecordBatch):
        raise SchemaError(f"expected a pyarrow.RecordBatch, got {type(batch).__name__}")
    got = [(f.name, f.type) for f in batch.schema]
    want = [(f.name, f.type) for f in TRAJECTORY_SCHEMA]
    if got != want:
        missing = sorted({n for n, _ in want} - {n for n, _ in got})
        extra = sorted({n for n, _ in got} - {n for n, _ in want})
        wrong = [f"{n}: {t} (expected {dict(want)[n]})" for n, t in got if n in dict(want) and dict(want)[n] != t]
        raise SchemaError(
            f"trajectory batch has the wrong schema: missing {missing or 'none'}, "
            f"unexpected {extra or 'none'}, wrong types {wrong or 'none'}"
        )
    n = batch.num_rows
    for f in TRAJECTORY_SCHEMA:
        col = batch.column(f.name)
        if col.null_count:
            raise SchemaError(f"row {_row_of_first(col.is_null().to_numpy(zero_copy_only=False))}: field '{f.name}' is null")
    if n == 0:
        return batch

    resp_len = pc.list_value_length(batch.column("response_ids")).to_numpy()
    lp_len = pc.list_value_length(batch.column("behaviour_logprobs")).to_numpy()
    if (bad := resp_len != lp_len).any():
        r = _row_of_first(bad)
        raise SchemaError(
            f"row {r}: 'behaviour_logprobs' has {lp_len[r]} values but 'response_ids' has {resp_len[r]} tokens"
        )
    lp = batch.column("behaviour_logprobs").flatten().to_numpy(zero_copy_only=False)
    if (bad_v := ~np.isfinite(lp) | (lp > 1e-4)).any():
        offsets = batch.column("behaviour_logprobs").offsets.to_numpy()
        r = int(np.searchsorted(offsets, _row_of_first(bad_v), side="right") - 1)
        raise SchemaError(f"row {r}: 'behaviour_logprobs' holds a NaN, infinite or positive value")

    seg_len = pc.list_value_length(batch.column("segment_starts")).to_numpy()
    ver_len = pc.list_value_length(batch.column("segment_versions")).to_numpy()
    if (bad := (seg_len != ver_len) | (seg_len == 0)).any():
        r = _row_of_first(bad)
        raise SchemaError(
            f"row {r}: 'segment_starts' ({seg_len[r]}) and 'segment_versions' ({ver_len[r]}) "
            "must have the same, non-zero length"
        )
    starts = batch.column("segment_starts")
    versions = batch.column("segment_versions")
    first_start = pc.list_element(starts, 0).to_numpy()
    if (bad := first_start != 0).any():
        raise SchemaError(f"row {_row_of_first(bad)}: 'segment_starts' must begin at 0")
    if (seg_len > 1).any():
        s_off = starts.offsets.to_numpy()
        s_val = starts.flatten().to_numpy()
        v_val = versions.flatten().to_numpy()
        same_row = np.repeat(np.arange(n), seg_len)
        inner = same_row[1:] == same_row[:-1]
        if (bad := inner & (np.diff(s_val) <= 0)).any():
            raise SchemaError(f"row {same_row[1:][bad][0]}: 'segment_starts' must strictly increase")
        if (bad := inner & (np.diff(v_val) < 0)).any():
            raise SchemaError(f"row {same_row[1:][bad][0]}: 'segment_versions' must not decrease")
        last = s_val[s_off[1:] - 1]
        if (bad := (seg_len > 1) & (last >= resp_len)).any():
            raise SchemaError(f"row {_row_of_first(bad)}: a segment starts past the end of the response")
    if (bad := pc.list_element(versions, 0).to_numpy() < 0).any():
        raise SchemaError(f"row {_row_of_first(bad)}: 'segment_versions' must be >= 0")

    reward = batch.column("reward").to_numpy(zero_copy_only=False)
    if (bad := ~np.isfinite(reward)).any():
        raise SchemaError(f"row {_row_of_first(bad)}: 'reward' is {reward[_row_of_first(bad)]}, expected a finite number")
    fr = batch.column("finish_reason")
    if (bad := ~pc.is_in(fr, pa.array(FINISH_REASONS)).to_numpy(zero_copy_only=False)).any():
        r = _row_of_first(bad)
        raise SchemaError(f"row {r}: 'finish_reason' is {fr[r].as_py()!r}, expected one of {FINISH_REASONS}")
    si = batch.column("sample_index").to_numpy()
    gs = batch.column("group_size").to_numpy()
    if (bad := (si < 0) | (si >= gs) | (gs < 1)).any():
        r = _row_of_first(bad)
        raise SchemaError(f"row {r}: 'sample_index' {si[r]} is outside its group of {gs[r]}")
    return batch


def oldest_versions(batch: pa.RecordBatch) -> np.ndarray:
    """The oldest policy version of each row (its first segment's version)."""
    return pc.list_element(batch.column("segment_versions"), 0).to_numpy()


def token_versions(segment_starts: np.ndarray, segment_versions: np.ndarray, n_tokens: int) -> np.ndarray:
    """Expand run-length segments into one version per response token."""
    lengths = np.diff(np.append(np.asarray(segment_starts), n_tokens))
    return np.repeat(np.asarray(segment_versions, dtype=np.int64), lengths)
