"""Per-step metrics of multi-turn batches (learner/metrics_sink.batch_metrics): turns per episode and the
fraction of episodes that got an observation (a tool response), from the loss masks."""

from __future__ import annotations

import pyarrow as pa

from learner.metrics_sink import batch_metrics


def _batch(masks):
    n = len(masks)
    return pa.RecordBatch.from_pydict(
        {
            "response_ids": [[1] * max(1, len(m)) for m in masks],
            "finish_reason": ["stop"] * n,
            "reward": [1.0] * n,
            "data_source": ["s"] * n,
            "segment_versions": [[0]] * n,
            "group_id": ["g"] * n,
            "loss_mask": pa.array(masks, type=pa.list_(pa.int8())),
        }
    )


def test_turns_and_observation_fraction_come_from_the_loss_masks():
    # 1 turn; 2 turns around a tool response; 3 turns, 2 responses; a turn cut after its response
    out, _, _ = batch_metrics(_batch([[1, 1, 1], [1, 1, 0, 0, 1], [1, 0, 1, 0, 0, 1, 1], [1, 1, 0]]), step=1)
    assert out["rollout/turns_mean"] == (1 + 2 + 3 + 1) / 4
    assert out["rollout/observation_fraction"] == 3 / 4


def test_single_turn_batches_have_no_turn_metrics():
    out, _, _ = batch_metrics(_batch([[], []]), step=1)  # empty masks: every token trained on (single turn)
    assert "rollout/turns_mean" not in out and "rollout/observation_fraction" not in out
