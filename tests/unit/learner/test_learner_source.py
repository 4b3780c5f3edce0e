"""The in-process batch source's lease discipline, and checkpoint folder bookkeeping."""

from __future__ import annotations

import pytest

from broker.schema import Trajectory, to_record_batch
from learner import checkpoint as ckpt
from learner.source import BatchSource, InProcessSource


def one_batch(step: int):
    t = Trajectory(
        traj_id=f"s{step}/0",
        group_id=f"s{step}",
        sample_index=0,
        group_size=1,
        step=step,
        prompt_ids=[1],
        response_ids=[2],
        behaviour_logprobs=[-0.5],
    )
    return to_record_batch([t])


def test_in_process_source_leases_and_acks():
    src = InProcessSource([one_batch(1), one_batch(2)])
    assert isinstance(src, BatchSource)
    b = src.next_batch(1)
    assert b.step == 1 and b.batch.column("step")[0].as_py() == 1
    src.report_version(1)
    src.ack(b.lease_id)
    assert src.position() == {"acked_step": 1} and src.versions == [1]
    with pytest.raises(KeyError, match="unknown lease"):
        src.ack(b.lease_id)  # twice
    with pytest.raises(TimeoutError, match="step 3"):
        src.next_batch(3)
    with pytest.raises(ValueError, match="start at 1"):
        src.next_batch(0)
    src.restore({"acked_step": 2})
    assert src.acked_step == 2


def test_in_process_source_rejects_foreign_batches():
    import pyarrow as pa

    with pytest.raises(ValueError, match="TRAJECTORY_SCHEMA"):
        InProcessSource([pa.record_batch({"x": [1]})])


def test_latest_and_prune_skip_incomplete(tmp_path):
    for v in (1, 2, 3, 4, 5):
        d = ckpt.step_dir(tmp_path, v)
        d.mkdir()
        if v != 5:  # step 5 is still being written: no meta.json
            (d / ckpt.META).write_text("{}")
    assert ckpt.latest(tmp_path) == ckpt.step_dir(tmp_path, 4)
    removed = ckpt.prune(tmp_path, keep=2)
    assert sorted(p.name for p in removed) == ["step_00000001", "step_00000002"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000003", "step_00000004", "step_00000005"]
    assert ckpt.latest(tmp_path / "missing") is None
