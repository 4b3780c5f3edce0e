"""The per-step response-length figures of learner/metrics_sink.py (a long-tail run reads min, median, p90
and max of every step's responses from RUN_DIR/metrics/learner.jsonl)."""

from __future__ import annotations

import pyarrow as pa
import pytest

from learner.metrics_sink import EVERY_STEP, batch_metrics
from tests.support.broker_groups import make_groups


def test_response_length_quantiles_of_one_step():
    # ten one-sample groups of 1..10 tokens
    batches = [make_groups([f"g{n}"], step=1, version=0, group_size=1, resp_len=n) for n in range(1, 11)]
    batch = pa.Table.from_batches(batches).combine_chunks().to_batches()[0]
    out, _, _ = batch_metrics(batch, step=1)
    got = {k: out[f"rollout/response_length_{k}_tokens"] for k in ("min", "p50", "p90", "max", "mean")}
    # numpy's linear percentile over 1..10: p50 between the 5th and 6th, p90 at 1 + 0.9 * 9 = 9.1
    assert got == pytest.approx({"min": 1.0, "p50": 5.5, "p90": 9.1, "max": 10.0, "mean": 5.5}, abs=1e-12)
    assert {f"rollout/response_length_{k}_tokens" for k in ("min", "p50", "p90")} <= set(EVERY_STEP)
