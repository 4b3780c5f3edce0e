"""Synthetic trajectory batches for the broker tests and bench (realistic shapes, numpy-built), and an in-memory
producer for the rollout workers' tests."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from broker.schema import TRAJECTORY_SCHEMA, SchemaError, _find_error, validate_batch


def make_groups(
    group_ids: list[str],
    *,
    step: int,
    version: int,
    group_size: int = 2,
    resp_len: int = 16,
    prompt_len: int = 8,
    engine_id: str = "sim-0",
    rng: np.random.Generator | None = None,
) -> pa.RecordBatch:
    """Rows of whole groups, built from numpy buffers (no per-token Python work)."""
    rng = rng or np.random.default_rng(0)
    n = len(group_ids) * group_size

    def lists(length: int, values: np.ndarray) -> pa.ListArray:
        offsets = np.arange(0, (n + 1) * length, length, dtype=np.int32)
        return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))

    cols = {
        "traj_id": pa.array([f"{g}/{i}" for g in group_ids for i in range(group_size)]),
        "group_id": pa.array([g for g in group_ids for _ in range(group_size)]),
        "sample_index": pa.array(np.tile(np.arange(group_size, dtype=np.int32), len(group_ids))),
        "group_size": pa.array(np.full(n, group_size, np.int32)),
        "step": pa.array(np.full(n, step, np.int64)),
        "prompt_ids": lists(prompt_len, rng.integers(0, 1000, n * prompt_len, dtype=np.int32)),
        "response_ids": lists(resp_len, rng.integers(0, 1000, n * resp_len, dtype=np.int32)),
        "behaviour_logprobs": lists(resp_len, -rng.random(n * resp_len, dtype=np.float32)),
        "segment_starts": lists(1, np.zeros(n, np.int32)),
        "segment_versions": lists(1, np.full(n, version, np.int64)),
        "reward": pa.array(rng.random(n, dtype=np.float32)),
        "finish_reason": pa.array(["stop"] * n),
        "engine_id": pa.array([engine_id] * n),
        "data_source": pa.array(["addition"] * n),
        "t_start": pa.array(np.zeros(n)),
        "t_end": pa.array(np.ones(n)),
        "loss_mask": pa.ListArray.from_arrays(pa.array(np.zeros(n + 1, np.int32)), pa.array(np.zeros(0, np.int8))),
    }
    return pa.RecordBatch.from_pydict(cols, schema=TRAJECTORY_SCHEMA)


def batch_from_rows(rows: list[dict]) -> pa.RecordBatch:
    """A batch in the trajectory schema from row dicts, not validated (tests build bad rows with it)."""
    # rows written before the loss mask existed (schema v1) train every token: an empty mask
    return pa.RecordBatch.from_pydict(
        {
            f.name: pa.array([r.get(f.name, []) if f.name == "loss_mask" else r[f.name] for r in rows], f.type)
            for f in TRAJECTORY_SCHEMA
        },
        schema=TRAJECTORY_SCHEMA,
    )


def passes_row_checks(batch: pa.RecordBatch) -> bool:
    """Whether the schema's row-by-row checks (the reference the fast paths are held to) accept ``batch``."""
    try:
        _find_error(batch)
        return True
    except SchemaError:
        return False


class MemoryProducer:
    """The broker side of a rollout worker's test: keeps each pushed batch after the broker's own checks
    (``validate_batch``: schema, whole groups, finite log-probs), so a bad push fails the test as it would the run."""

    def __init__(self) -> None:
        self.batches: list[pa.RecordBatch] = []

    def push(self, batch):
        self.batches.append(validate_batch(batch))
