"""Validation of a push that is one whole group, read straight from its Arrow buffers.

Rollout workers push one prompt group at a time, so the broker validates pushes one by
one far more often than in a batch. Checking a few rows costs per call, not per byte:
the general checks make about forty numpy and Arrow calls, and ``RecordBatch.columns``
alone wraps sixteen arrays. :func:`whole_group` gets every buffer of the batch with two calls
(``to_struct_array().buffers()``) and answers most checks by comparing buffers with
constant bytes (offsets ``0..n``, all zeros, ``n`` repeated), which Arrow does in C, and
the few numeric ones with one numpy reduction each.

It accepts only a batch that passes every check of :func:`broker.schema.validate_batch`
and is exactly one whole group (one ``group_id``, ``group_size`` equal to the row count,
one ``step``, sample indices ``0..n-1`` each once, one policy segment per row); for
anything else it answers None and the caller takes the general path, which finds and
names any error. So it can only be slower than needed, never more lenient.

Array offsets: the buffers hold no offsets, so each buffer read here must be exactly as
large as its rows need. Full validation guarantees ``size >= (offset + length) * width``,
so an exact size proves the offset is 0 (the IPC reader makes such arrays; slices of
in-process arrays take the general path).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from functools import lru_cache
from operator import is_not, itemgetter
from typing import NamedTuple

import numpy as np
import pyarrow as pa

_I32, _I64 = struct.Struct("=i"), struct.Struct("=q")  # native, as numpy and Arrow read buffers


@dataclass(frozen=True, slots=True)
class Layout:
    """Where each column's buffers sit in ``batch.to_struct_array().buffers()`` (depth
    first: the struct's validity, then each column's buffers and its children's)."""

    validity: itemgetter  # all validity bitmaps (None: no nulls)
    nones: tuple[None, ...]  # as many as there are validity bitmaps
    n_buffers: int
    pos: dict[str, tuple[int, ...]]  # column -> positions of its non-validity buffers
    col: dict[str, int]  # column -> index in the schema
    finish_reasons: frozenset[str]


def layout(schema: pa.Schema, finish_reasons) -> Layout:
    validity, pos = [0], {}  # the struct's own validity first
    i = 1

    def walk(t: pa.DataType) -> list[int]:
        nonlocal i
        mine = list(range(i + 1, i + t.num_buffers))  # buffer 0 is the validity bitmap
        validity.append(i)
        i += t.num_buffers
        for k in range(t.num_fields):
            mine += walk(t.field(k).type)
        return mine

    for f in schema:
        pos[f.name] = tuple(walk(f.type))
    return Layout(
        itemgetter(*validity),
        (None,) * len(validity),
        i,
        pos,
        {f.name: k for k, f in enumerate(schema)},
        frozenset(finish_reasons),
    )


class _Consts(NamedTuple):
    upto: pa.Buffer  # int32 0..n: the offsets of lists of one element each
    below: pa.Buffer  # int32 0..n-1: sample indices in order
    full_n: pa.Buffer  # int32 n, n times: group sizes
    zeros: pa.Buffer  # n int32 zeros: segment starts
    rng: list[int]  # 0..n-1
    below_np: np.ndarray  # read-only numpy arrays of ``below`` and ``full_n``
    full_n_np: np.ndarray


@lru_cache(maxsize=256)
def _zero_offsets(n: int) -> pa.Buffer:
    return pa.py_buffer(bytes(4 * (n + 1)))


@lru_cache(maxsize=256)
def _consts(n: int) -> _Consts:
    upto = np.arange(n + 1, dtype=np.int32)
    full = np.full(n, n, np.int32)
    below_np, full_np = upto[:n].copy(), full.copy()
    below_np.flags.writeable = full_np.flags.writeable = False
    return _Consts(
        pa.py_buffer(upto.tobytes()),
        pa.py_buffer(upto[:n].tobytes()),
        pa.py_buffer(full.tobytes()),
        pa.py_buffer(bytes(4 * n)),
        list(range(n)),
        below_np,
        full_np,
    )


def whole_group(batch: pa.RecordBatch, lay: Layout):
    """(group_ids, group_id, sample_index, group_size, step, oldest_version, step, vmin, vmax)
    of a valid batch of one whole group, the arrays read-only numpy arrays (views of its
    buffers, or shared constants); None: not known to be both (the general path decides).
    ``batch`` must have the trajectory schema's fields and have passed
    ``batch.validate(full=True)``."""
    n = batch.num_rows
    if n < 1:
        return None
    s = batch.to_struct_array()
    b = s.buffers()
    if len(b) != lay.n_buffers or any(map(is_not, lay.validity(b), lay.nones)):
        return None  # a validity bitmap: nulls, maybe (the general path counts them)
    p = lay.pos
    c = _consts(n)
    # One whole group: all group_size == n, one step, sample indices a permutation of 0..n-1
    # (then 0 <= sample_index < group_size >= 1 holds too).
    si_b, gs_b, step_b = b[p["sample_index"][0]], b[p["group_size"][0]], b[p["step"][0]]
    if not gs_b.equals(c.full_n) or step_b.size != 8 * n:
        return None
    steps = step_b.to_pybytes()
    if steps != steps[:8] * n:
        return None
    if si_b.equals(c.below):
        si = c.below_np
    elif si_b.size == 4 * n and sorted(memoryview(si_b).cast("i")) == c.rng:
        si = np.frombuffer(si_b, np.int32)
    else:
        return None
    # One policy segment per row, starting at 0 (offsets exactly 0..n, starts all zero).
    s_off, s_val = (b[k] for k in p["segment_starts"])
    v_off, v_val = (b[k] for k in p["segment_versions"])
    if not (s_off.equals(c.upto) and v_off.equals(c.upto) and s_val.equals(c.zeros)) or v_val.size != 8 * n:
        return None
    ver = np.frombuffer(v_val, np.int64)
    vs = ver.tolist()
    vmin = min(vs)
    if vmin < 0:
        return None
    # As many log-probs as response tokens in each row; each finite and <= 0 (1e-4: rounding).
    r_off, _ = (b[k] for k in p["response_ids"])
    l_off, l_val = (b[k] for k in p["behaviour_logprobs"])
    if not (r_off.size == 4 * (n + 1) and r_off.equals(l_off)):
        return None
    first, last = _I32.unpack_from(l_off, 0)[0], _I32.unpack_from(l_off, 4 * n)[0]
    if l_val.size != 4 * last:  # the child's offset is then 0 (see the module docstring)
        return None
    if last > first:
        lp = np.frombuffer(l_val, np.float32, last - first, 4 * first)
        if not (lp.max() <= 1e-4 and lp.min() > -np.inf):  # a NaN fails the first
            return None
    # Loss masks: all empty (every token trained), or one 0/1 per response token in each row.
    m_off, m_val = (b[k] for k in p["loss_mask"])
    if m_off.size != 4 * (n + 1):
        return None
    if not m_off.equals(_zero_offsets(n)):
        if not m_off.equals(r_off) or m_val.size != last:
            return None
        if last > first:
            m = np.frombuffer(m_val, np.int8, last - first, first)
            if m.min() < 0 or m.max() > 1:
                return None
    # Finite rewards: a float64 sum of float32 values cannot overflow, so it is finite
    # exactly when each value is (inf - inf is a NaN).
    rew_b = b[p["reward"][0]]
    if rew_b.size != 4 * n or not math.isfinite(sum(memoryview(rew_b).cast("f"))):
        return None
    col = lay.col
    fr = s.field(col["finish_reason"]).to_pylist()
    if not set(fr) <= lay.finish_reasons:
        return None
    gids = s.field(col["group_id"]).to_pylist()
    if gids.count(gids[0]) != n:
        return None
    tids = s.field(col["traj_id"]).to_pylist()
    if len(set(tids)) != n:
        return None
    return (
        gids,
        gids[0],
        si,
        c.full_n_np,
        np.frombuffer(step_b, np.int64),
        ver,
        _I64.unpack_from(steps)[0],
        vmin,
        max(vs),
    )
