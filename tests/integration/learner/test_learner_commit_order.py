"""A step's record is written before its commit (checkpoint, export, ack), and a stop is taken after it.

One real FSDP rank (gloo, a forked process) on the tiny Qwen2, four steps, a checkpoint every two. The
hooks, the engine's checkpoint writer and the source's ack append to one event list. The order matters
for ``kill -9``: a learner killed between a checkpoint and the step's record left a step that the
re-run does not redo (it is in the checkpoint) and that no record shows (its metrics, and its groups in
the run's counts, were missing: CI on 2026-12-02). Written first, a record whose commit never happened
is replaced by the re-run's redo of that step.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from learner_testkit import join_gloo, make_batches, make_tiny_model, run_procs, write_batches

STEPS, EVERY = 4, 2
pytestmark = pytest.mark.timeout(240)


def _rank(rank: int, world_size: int, port: int, kw: dict) -> None:

    import pyarrow as pa

    from learner.config import LearnerConfig
    from learner.fsdp import FSDPEngine
    from learner.loop import Learner
    from learner.run import StopRun
    from learner.source import InProcessSource

    join_gloo(0, 1, port)
    cfg = LearnerConfig.model_validate(
        {
            "loss": {"correction": "decoupled"},
            "micro_batch_tokens": 64,
            "logprob_probe_tolerance": None,
            "checkpoint_every": EVERY,
            "optim": {"lr": 1e-3, "warmup_steps": 1},
        }
    )
    engine = FSDPEngine(cfg, kw["model"], total_steps=STEPS, seed=0)
    events: list[list] = []
    save = engine.save_checkpoint

    def save_checkpoint(path, extra):
        save(path, extra)
        events.append(["checkpoint", int(extra["version"])])

    engine.save_checkpoint = save_checkpoint

    class Recording(InProcessSource):
        def ack(self, lease_id):
            super().ack(lease_id)
            events.append(["ack", lease_id])

    with pa.ipc.open_file(kw["data"]) as f:
        source = Recording([f.get_batch(i) for i in range(f.num_record_batches)])

    def committed(step: int) -> None:
        events.append(["committed", step])
        if step == kw["stop_at"]:
            raise StopRun

    learner = Learner(
        engine,
        cfg,
        source=source,
        max_steps=STEPS,
        checkpoint_dir=Path(kw["out"]) / "ckpt",
        on_metrics=lambda step, m: events.append(["record", step, m["learner/checkpoint_seconds"]]),
        on_committed=committed,
    )
    stopped = False
    try:
        learner.run()
    except StopRun:
        stopped = True
    Path(kw["out"], "events.json").write_text(
        json.dumps({"events": events, "stopped": stopped, "version": learner.version})
    )
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("commit")
    return d, make_tiny_model(d / "model"), write_batches(d / "data.arrow", make_batches(STEPS))


def _run(files, name: str, stop_at: int) -> dict:
    d, model, data = files
    (d / name).mkdir()
    run_procs(
        _rank,
        1,
        dict(model=str(model), data=str(data), out=str(d / name), stop_at=stop_at),
        timeout=180,
        start_method="fork",
    )
    return json.loads((d / name / "events.json").read_text())


def _leases(source_events: list[list]) -> list[str]:
    return [e[1] for e in source_events if e[0] == "ack"]


def test_each_step_is_recorded_then_checkpointed_then_acked(files):
    out = _run(files, "all", stop_at=0)
    ev = out["events"]
    assert not out["stopped"] and out["version"] == STEPS
    kinds = [e[0] for e in ev]
    # steps 2 and 4 checkpoint; every step: record, [checkpoint], ack, committed
    assert kinds == ["record", "ack", "committed", "record", "checkpoint", "ack", "committed"] * 2, ev
    assert [e[1] for e in ev if e[0] == "record"] == [1, 2, 3, 4]
    assert [e[1] for e in ev if e[0] == "checkpoint"] == [2, 4]
    assert len(set(_leases(ev))) == STEPS  # one lease a step, each acked once
    # a record reports the checkpoint that committed the step before it: only step 3's follows one
    ckpt_s = [e[2] for e in ev if e[0] == "record"]
    assert ckpt_s[2] > 0.0 and ckpt_s[0] == 0.0, ckpt_s


def test_a_stop_is_taken_after_the_steps_ack(files):
    out = _run(files, "stop", stop_at=3)
    ev = out["events"]
    assert out["stopped"] and out["version"] == 3
    assert [e[0] for e in ev][-3:] == ["record", "ack", "committed"], ev  # step 3 acked, then the stop
    assert len(_leases(ev)) == 3
