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
loss_mask            list<int8>            empty: every response token is trained on (single turn);
                                           else one 0/1 per response token, 0 for tokens the policy
                                           did not sample (observations, tool results: multi-turn)
==================== ===================== ===============================================

Schema versions: 2 added ``loss_mask`` (multi-turn episodes keep the environment's tokens in
the response, masked out of the loss). A batch of another version fails :func:`validate_batch`
with an error naming both versions.

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

from broker import group_check

SCHEMA_VERSION = 2

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
        pa.field("loss_mask", pa.list_(pa.int8()), nullable=False),  # last: earlier columns keep their buffers
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
    loss_mask: list[int] | np.ndarray = field(default_factory=list)


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


def _list_parts(col: pa.ListArray) -> tuple[np.ndarray, np.ndarray, pa.Array]:
    """(offsets relative to the first row, lengths, child values of exactly these rows).

    Works on sliced arrays: a slice keeps the parent's offsets and child, so both are
    re-based here (row numbers in errors then refer to the slice, as the caller sees it).
    """
    off = col.offsets.to_numpy()
    values = col.values
    first, last = int(off[0]), int(off[-1])
    if first != 0 or last != len(values):
        values = values.slice(first, last - first)
        off = off - first
    return off, off[1:] - off[:-1], values


def _first_elements(off: np.ndarray, lengths: np.ndarray, values: np.ndarray) -> np.ndarray:
    """The first element of each non-empty list (callers ensure none is empty)."""
    return values[off[:-1]] if len(values) else np.zeros(len(lengths), values.dtype)


_LIST_FIELDS = tuple(f.name for f in TRAJECTORY_SCHEMA if pa.types.is_list(f.type))
_LIST_IDX = tuple(i for i, f in enumerate(TRAJECTORY_SCHEMA) if pa.types.is_list(f.type))
_SCALAR_FIELDS = tuple(f.name for f in TRAJECTORY_SCHEMA if not pa.types.is_list(f.type))


_SCHEMAS_SEEN_OK: set[pa.Schema] = set()  # producers send one schema again and again


class ArrowDataError(SchemaError):
    """The batch's Arrow data is structurally invalid: offsets, lengths, null counts or
    UTF-8 that a full validation refuses. Reading such a batch can run out of bounds, so
    it is refused (``bad_arrow``) before any check reads its values."""


def check_structure(batch: pa.RecordBatch) -> None:
    """Arrow's full structural validation of ``batch`` (``RecordBatch.validate(full=True)``:
    every offset inside its buffer and monotonic, lengths and null counts consistent, strings
    UTF-8); raises :class:`ArrowDataError`. Every pushed batch passes here before anything
    reads its buffers; bench/broker.py measures its cost per megabyte."""
    try:
        batch.validate(full=True)
    except (pa.ArrowException, ValueError) as e:
        raise ArrowDataError(f"trajectory batch is not valid Arrow data: {e}") from None


def _check_schema(batch: pa.RecordBatch) -> None:
    if batch.schema.equals(TRAJECTORY_SCHEMA) or batch.schema in _SCHEMAS_SEEN_OK:
        return
    got = [(f.name, f.type) for f in batch.schema]
    want = [(f.name, f.type) for f in TRAJECTORY_SCHEMA]
    if got != want:
        want_d = dict(want)
        missing = sorted(set(want_d) - {n for n, _ in got})
        extra = sorted({n for n, _ in got} - set(want_d))
        wrong = [f"{n}: {t} (expected {want_d[n]})" for n, t in got if n in want_d and want_d[n] != t]
        order = "" if missing or extra or wrong else " (fields out of order)"
        meta = batch.schema.metadata or {}
        theirs = meta.get(b"fleetrl.schema_version", b"?").decode(errors="replace")
        versions = f" (batch is trajectory schema v{theirs}, this reader expects v{SCHEMA_VERSION})"
        raise SchemaError(
            f"trajectory batch has the wrong schema{order}{versions if theirs != str(SCHEMA_VERSION) else ''}: "
            f"missing {missing or 'none'}, unexpected {extra or 'none'}, wrong types {wrong or 'none'}"
        )
    if len(_SCHEMAS_SEEN_OK) < 64:
        _SCHEMAS_SEEN_OK.add(batch.schema)


def validate_batch(batch: pa.RecordBatch) -> pa.RecordBatch:
    """Check a batch against the schema and its invariants; return it or raise SchemaError.

    Checks: Arrow-level consistency (offsets inside their buffers: a hostile batch cannot
    make later reads run out of bounds); exact field names and types; no nulls, also
    inside lists; unique ``traj_id``; ``behaviour_logprobs`` as long as ``response_ids``,
    finite and <= 0; segments start at 0, increase, and lie inside the response; versions
    non-decreasing and >= 0; reward finite; known finish reasons;
    ``0 <= sample_index < group_size``.
    """
    inspect_batch(batch)
    return batch


@dataclass(slots=True)
class BatchView:
    """What the broker needs of a validated batch, read once (numpy views of its buffers)."""

    group_ids: list[str] | None  # per row; None for a big batch of one group (not read then)
    single_group: str | None  # the group id when every row has the same one
    sample_index: np.ndarray
    group_size: np.ndarray
    step: np.ndarray
    oldest_version: np.ndarray  # segment_versions[0] of each row
    # Set by inspect_batches, for all its batches at once: the batch is exactly one whole
    # group (one id, group_size == rows, one step, sample indices 0..n-1 each once), whose
    # step and oldest versions' min and max are these. False: not known, look at the rows.
    whole: bool = False
    label: int = 0
    vmin: int = 0
    vmax: int = 0


def inspect_batch(batch: pa.RecordBatch) -> BatchView:
    """:func:`validate_batch`, returning the columns the broker reads afterwards.

    The broker calls this on every push, so a valid batch takes a fast path of
    whole-batch reductions straight over the Arrow buffers (tens of microseconds for a
    few rows; per-call overhead, not data, dominates small batches). A push of one whole
    group, the usual one, is checked by :mod:`broker.group_check` in about half the calls
    (and marked ``whole``); any other batch by :func:`_fast_view`. A batch that fails
    either goes through the row-by-row checks, which name the first bad row and field.
    """
    if not isinstance(batch, pa.RecordBatch):
        raise SchemaError(f"expected a pyarrow.RecordBatch, got {type(batch).__name__}")
    try:
        return _inspect(batch)
    except SchemaError:
        raise
    except (ValueError, TypeError, IndexError, OverflowError, pa.ArrowException) as e:
        # a batch the checks cannot even read (e.g. field names that are not UTF-8) is invalid
        raise SchemaError(f"trajectory batch cannot be checked: {type(e).__name__}: {str(e)[:200]}") from None


def _inspect(batch: pa.RecordBatch) -> BatchView:
    _check_schema(batch)
    check_structure(batch)
    if (view := _whole_view(batch)) is not None:  # one push of one group: the usual case
        return view
    view = _fast_view(batch)
    if view is None:
        _find_error(batch)  # raises, unless the batch only left the fast path (e.g. multi-segment rows)
        view = batch_view(batch)
    return view


def _whole_view(batch: pa.RecordBatch) -> BatchView | None:
    """The view of a valid batch of exactly one whole group, checked over its buffers
    (:mod:`broker.group_check`, a few dozen microseconds); None: not known to be both."""
    g = group_check.whole_group(batch, _LAYOUT)
    if g is None:
        return None
    group_ids, single_group, sample_index, group_size, step, oldest_version, label, vmin, vmax = g
    return BatchView(
        group_ids,
        single_group,
        sample_index,
        group_size,
        step,
        oldest_version,
        whole=True,
        label=label,
        vmin=vmin,
        vmax=vmax,
    )


JOINT_MAX_BYTES = 64 << 20  # batches checked together at most (bytes)
# Up to this size (bytes per batch, on average) a copy of the whole batches costs less than
# the per-batch calls it saves; above it the copy costs more (bench/broker.py shows both).
_JOINT_COPY_MAX = 128 << 10


def inspect_batches(batches: list[pa.RecordBatch], nbytes: int | None = None) -> list[BatchView] | None:
    """The views of several batches that each pass :func:`validate_batch`, checked together.

    Validation costs mostly per call (a few dozen numpy and Arrow calls per batch, whatever
    its size), so the broker checks the pushes of one message at once: each batch gets
    Arrow's full structural validation on its own (so no hostile offsets reach the copy),
    then their concatenation goes through the whole-batch checks once. Batches larger than
    ``_JOINT_COPY_MAX`` are not copied whole: each gets the checks of its token lists
    (prompt, response, log-probs: nearly all its bytes) on its own, and only their other,
    per-row columns are concatenated for the remaining checks (unless each is one whole
    group: then each alone, see :func:`inspect_batch`, costs less). Every check is per
    row or implied by its counterpart over the union (unique ``traj_id`` over all of them
    implies it within each), so passing together implies passing alone. None: one of them
    failed (or the checks do not apply); call :func:`inspect_batch` on each for the precise
    error. The views refer to each batch's own rows. ``nbytes``: their size if the caller
    knows it (e.g. the frames' lengths; ``RecordBatch.nbytes`` walks every buffer).
    """
    if len(batches) < 2:
        return None
    nbytes = nbytes if nbytes is not None else sum(b.nbytes for b in batches)
    if nbytes > JOINT_MAX_BYTES:
        return None
    schema = batches[0].schema
    if not schema.equals(TRAJECTORY_SCHEMA):
        return None
    for b in batches:
        if not b.schema.equals(schema, check_metadata=True):
            return None
        try:
            check_structure(b)
        except ArrowDataError:
            return None
    if nbytes <= _JOINT_COPY_MAX * len(batches):
        view = _fast_view(pa.concat_batches(batches))
    else:
        # Big batches that are each one whole group (the usual pushes) cost less checked one
        # by one over their buffers than through the joint checks; other batches go on below.
        views = []
        for b in batches:
            if (v := _whole_view(b)) is None:
                break
            views.append(v)
        else:
            return views
        for b in batches:
            if not _tokens_ok(b.column, b.num_rows):  # b.columns would wrap all 16
                return None
        small = pa.concat_batches([b.select(_ROW_IDX) for b in batches])
        cols: list = [None] * len(TRAJECTORY_SCHEMA)
        for i, c in zip(_ROW_IDX, small.columns, strict=True):
            cols[i] = c
        view = _fast_view_cols(cols, small.num_rows, tokens_checked=True)
    if view is None:
        return None
    counts = np.fromiter((b.num_rows for b in batches), np.int64, len(batches))
    whole = _whole_groups(view, counts)
    out, a = [], 0
    for j, b in enumerate(batches):
        z = a + b.num_rows
        if view.group_ids is None:  # one group id in all of them
            gids, single = None, view.single_group
        else:
            gids = view.group_ids[a:z]
            single = gids[0] if gids and gids.count(gids[0]) == len(gids) else None
        v = BatchView(
            gids, single, view.sample_index[a:z], view.group_size[a:z], view.step[a:z], view.oldest_version[a:z]
        )
        if whole is not None and single is not None and whole[0][j]:
            v.whole, v.label, v.vmin, v.vmax = True, whole[1][j], whole[2][j], whole[3][j]
        out.append(v)
        a = z
    return out


def _whole_groups(view: BatchView, counts: np.ndarray) -> tuple[list, list, list, list] | None:
    """For batches of ``counts`` rows each, concatenated in ``view`` (rows valid): whether
    each one's rows are one whole group apart from its ids (group_size equal to its row
    count, one step, sample indices 0..n-1 each once), and its step, min and max oldest
    version. One numpy pass over all of them instead of a dozen calls per batch; None if
    a batch is empty. A batch whose rows claim a larger group may spill into the next
    batch's sample-index range below, which can only fail that one, never pass it."""
    if not len(counts) or counts.min() < 1:
        return None
    starts = np.zeros(len(counts), np.int64)
    np.cumsum(counts[:-1], out=starts[1:])
    si, gs, step, ver = view.sample_index, view.group_size, view.step, view.oldest_version
    own = np.repeat(counts, counts)
    ok = (gs == own) & (step == np.repeat(step[starts], counts))
    ok &= np.bincount(si + np.repeat(starts, counts), minlength=len(si))[: len(si)] == 1
    return (
        np.logical_and.reduceat(ok, starts).tolist(),
        step[starts].tolist(),
        np.minimum.reduceat(ver, starts).tolist(),
        np.maximum.reduceat(ver, starts).tolist(),
    )


_COL = {f.name: i for i, f in enumerate(TRAJECTORY_SCHEMA)}
_TOKEN_IDX = (_COL["prompt_ids"], _COL["response_ids"], _COL["behaviour_logprobs"], _COL["loss_mask"])
_ROW_IDX = [i for i in range(len(TRAJECTORY_SCHEMA)) if i not in _TOKEN_IDX]
_FINISH_SET = frozenset(FINISH_REASONS)
_LAYOUT = group_check.layout(TRAJECTORY_SCHEMA, FINISH_REASONS)
_SMALL = 128  # rows up to which Python sets beat Arrow hash kernels (per-call cost dominates)


def _buf(arr: pa.Array, i: int, dtype, count: int, extra: int = 0) -> np.ndarray:
    """``count`` values of buffer ``i`` of ``arr`` as numpy (no copy), honouring its offset."""
    return np.frombuffer(
        arr.buffers()[i], dtype=dtype, count=count, offset=np.dtype(dtype).itemsize * (arr.offset + extra)
    )


def _list_np(col: pa.ListArray, n: int, dtype) -> tuple[np.ndarray, np.ndarray]:
    """(offsets rebased to 0, the child values of exactly these rows) of a list column."""
    off = _buf(col, 1, np.int32, n + 1)
    values = col.values
    first, last = int(off[0]), int(off[-1])
    vals = _buf(values, 1, dtype, last - first, first) if last > first else np.zeros(0, dtype)
    return (off - first if first else off), vals


def _distinct(col: pa.Array, n: int) -> int:
    return len(set(col.to_pylist())) if n <= _SMALL else pc.count_distinct(col).as_py()


def _fast_view(batch: pa.RecordBatch) -> BatchView | None:
    """The view of a batch that passes every check of :func:`validate_batch`; None: look closer.

    Each test implies the row-wise one it stands for (``max <= 1e-4`` is false for a NaN,
    ``min > -inf`` excludes -inf, a float64 sum of float32 values is finite only if each is).
    Rows with more than one policy segment take the row-wise path. Needs
    ``batch.validate(full=True)`` first: offsets monotonic and inside their buffers.
    """
    return _fast_view_cols(batch.columns, batch.num_rows)


def _tokens_ok(column, n: int) -> bool:
    """The checks of the token list columns (``column(i)``: the i-th column): no nulls, as
    many log-probs as response tokens in each row, log-probs finite and <= 0."""
    prompt, resp, lps = (column(i) for i in _TOKEN_IDX[:3])
    for c in (prompt, resp, lps):
        if c.null_count or c.values.null_count:
            return False
    if n == 0:
        return True
    resp_off, _ = _list_np(resp, n, np.int32)
    lp_off, lp = _list_np(lps, n, np.float32)
    if not (np.array_equal(resp_off, lp_off) and (not len(lp) or (lp.max() <= 1e-4 and lp.min() > -np.inf))):
        return False
    return _mask_ok(column(_COL["loss_mask"]), n, resp_off)


def _mask_ok(mask: pa.ListArray, n: int, resp_off: np.ndarray) -> bool:
    """Each row's loss mask empty or one 0/1 per response token, no nulls."""
    if mask.null_count or mask.values.null_count:
        return False
    m_off, m = _list_np(mask, n, np.int8)
    if not len(m):
        return True
    lens, r_lens = np.diff(m_off), np.diff(resp_off)
    return bool(((lens == 0) | (lens == r_lens)).all() and m.min() >= 0 and m.max() <= 1)


def _fast_view_cols(cols: list, n: int, tokens_checked: bool = False) -> BatchView | None:
    """_fast_view over columns in schema order; with ``tokens_checked`` the token list
    columns (None then) passed :func:`_tokens_ok` already."""
    if not tokens_checked and not _tokens_ok(cols.__getitem__, n):
        return None
    for i, c in enumerate(cols):
        if c is not None and (c.null_count or (i in _LIST_IDX and c.values.null_count)):
            return None
    if n == 0:
        return BatchView(
            [], None, np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0, np.int64), np.zeros(0, np.int64)
        )
    if _distinct(cols[_COL["traj_id"]], n) != n:
        return None
    s_off, starts = _list_np(cols[_COL["segment_starts"]], n, np.int32)
    v_off, versions = _list_np(cols[_COL["segment_versions"]], n, np.int64)
    if len(starts) != n or not np.array_equal(s_off, v_off) or (s_off[1:] == s_off[:-1]).any():
        return None  # not exactly one segment per row
    if starts.any() or versions.min() < 0:
        return None
    if not np.isfinite(_buf(cols[_COL["reward"]], 1, np.float32, n).sum(dtype=np.float64)):
        return None
    fr = cols[_COL["finish_reason"]]
    if not set(fr.to_pylist() if n <= _SMALL else fr.unique().to_pylist()) <= _FINISH_SET:
        return None
    si = _buf(cols[_COL["sample_index"]], 1, np.int32, n)
    gs = _buf(cols[_COL["group_size"]], 1, np.int32, n)
    if not (si.min() >= 0 and gs.min() >= 1 and (si < gs).all()):
        return None
    gcol = cols[_COL["group_id"]]
    gids = gcol.to_pylist() if n <= _SMALL else None
    if gids is not None:
        single = gids[0] if gids.count(gids[0]) == n else None
    else:
        uniq = gcol.unique()
        single = uniq[0].as_py() if len(uniq) == 1 else None
        gids = None if single is not None else gcol.to_pylist()
    return BatchView(gids, single, si, gs, _buf(cols[_COL["step"]], 1, np.int64, n), versions)


def batch_view(batch: pa.RecordBatch) -> BatchView:
    """The view of a batch validated before (e.g. read back from the broker's spool)."""
    gids = batch.column("group_id").to_pylist()
    single = gids[0] if gids and gids.count(gids[0]) == len(gids) else None
    return BatchView(
        gids,
        single,
        batch.column("sample_index").to_numpy(),
        batch.column("group_size").to_numpy(),
        batch.column("step").to_numpy(),
        oldest_versions(batch),
    )


def _find_error(batch: pa.RecordBatch) -> None:
    """The row-wise checks: raise SchemaError naming the first bad row and field."""
    n = batch.num_rows
    lists = {}
    for name in _SCALAR_FIELDS:
        col = batch.column(name)
        if col.null_count:
            raise SchemaError(
                f"row {_row_of_first(col.is_null().to_numpy(zero_copy_only=False))}: field '{name}' is null"
            )
    for name in _LIST_FIELDS:
        col = batch.column(name)
        if col.null_count:
            raise SchemaError(
                f"row {_row_of_first(col.is_null().to_numpy(zero_copy_only=False))}: field '{name}' is null"
            )
        if name == "prompt_ids" and not col.values.null_count:
            continue  # nothing else to check
        off, lengths, values = _list_parts(col)
        if values.null_count:
            bad = np.flatnonzero(values.is_null().to_numpy(zero_copy_only=False))[0]
            r = int(np.searchsorted(off, bad, side="right") - 1)
            raise SchemaError(f"row {r}: field '{name}' holds a null element")
        lists[name] = (off, lengths, values.to_numpy())
    if n == 0:
        return

    tids = batch.column("traj_id").to_pylist()
    if len(set(tids)) != n:
        seen: set[str] = set()
        for row, t in enumerate(tids):
            if t in seen:
                raise SchemaError(f"row {row}: 'traj_id' {t!r} appears twice in the batch")
            seen.add(t)

    _, resp_len, _ = lists["response_ids"]
    lp_off, lp_len, lp = lists["behaviour_logprobs"]
    if (bad := resp_len != lp_len).any():
        r = _row_of_first(bad)
        raise SchemaError(
            f"row {r}: 'behaviour_logprobs' has {lp_len[r]} values but 'response_ids' has {resp_len[r]} tokens"
        )
    if (bad_v := ~np.isfinite(lp) | (lp > 1e-4)).any():
        r = int(np.searchsorted(lp_off, _row_of_first(bad_v), side="right") - 1)
        raise SchemaError(f"row {r}: 'behaviour_logprobs' holds a NaN, infinite or positive value")

    s_off, seg_len, s_val = lists["segment_starts"]
    _, ver_len, v_val = lists["segment_versions"]
    if (bad := (seg_len != ver_len) | (seg_len == 0)).any():
        r = _row_of_first(bad)
        raise SchemaError(
            f"row {r}: 'segment_starts' ({seg_len[r]}) and 'segment_versions' ({ver_len[r]}) "
            "must have the same, non-zero length"
        )
    if (bad := _first_elements(s_off, seg_len, s_val) != 0).any():
        raise SchemaError(f"row {_row_of_first(bad)}: 'segment_starts' must begin at 0")
    if (seg_len > 1).any():
        same_row = np.repeat(np.arange(n), seg_len)
        inner = same_row[1:] == same_row[:-1]
        if (bad := inner & (np.diff(s_val) <= 0)).any():
            raise SchemaError(f"row {same_row[1:][bad][0]}: 'segment_starts' must strictly increase")
        if (bad := inner & (np.diff(v_val) < 0)).any():
            raise SchemaError(f"row {same_row[1:][bad][0]}: 'segment_versions' must not decrease")
        last = s_val[s_off[1:] - 1]
        if (bad := (seg_len > 1) & (last >= resp_len)).any():
            raise SchemaError(f"row {_row_of_first(bad)}: a segment starts past the end of the response")
    if (bad := _first_elements(s_off, seg_len, v_val) < 0).any():
        raise SchemaError(f"row {_row_of_first(bad)}: 'segment_versions' must be >= 0")

    m_off, m_len, m_val = lists["loss_mask"]
    if (bad := (m_len != 0) & (m_len != resp_len)).any():
        r = _row_of_first(bad)
        raise SchemaError(
            f"row {r}: 'loss_mask' has {m_len[r]} values but 'response_ids' has {resp_len[r]} tokens "
            "(expected that many, or none: every token trained)"
        )
    if (bad := (m_val != 0) & (m_val != 1)).any():
        r = int(np.searchsorted(m_off, _row_of_first(bad), side="right") - 1)
        raise SchemaError(f"row {r}: 'loss_mask' holds a value other than 0 or 1")

    reward = batch.column("reward").to_numpy()
    if (bad := ~np.isfinite(reward)).any():
        raise SchemaError(
            f"row {_row_of_first(bad)}: 'reward' is {reward[_row_of_first(bad)]}, expected a finite number"
        )
    fr = batch.column("finish_reason").to_pylist()
    for r, reason in enumerate(fr):
        if reason not in FINISH_REASONS:
            raise SchemaError(f"row {r}: 'finish_reason' is {reason!r}, expected one of {FINISH_REASONS}")
    si = batch.column("sample_index").to_numpy()
    gs = batch.column("group_size").to_numpy()
    if (bad := (si < 0) | (si >= gs) | (gs < 1)).any():
        r = _row_of_first(bad)
        raise SchemaError(f"row {r}: 'sample_index' {si[r]} is outside its group of {gs[r]}")


def oldest_versions(batch: pa.RecordBatch) -> np.ndarray:
    """The oldest policy version of each row (its first segment's version; rows must be valid)."""
    off, lengths, values = _list_parts(batch.column("segment_versions"))
    return _first_elements(off, lengths, values.to_numpy())


def loss_mask_of(mask: np.ndarray, n_tokens: int) -> np.ndarray:
    """One bool per response token: trained on (an empty stored mask means every token)."""
    return np.ones(n_tokens, bool) if len(mask) == 0 else np.asarray(mask) != 0


def token_versions(segment_starts: np.ndarray, segment_versions: np.ndarray, n_tokens: int) -> np.ndarray:
    """Expand run-length segments into one version per response token."""
    lengths = np.diff(np.append(np.asarray(segment_starts), n_tokens))
    return np.repeat(np.asarray(segment_versions, dtype=np.int64), lengths)
