"""What ``learner/loop.py`` promises the loss, checked on one real FSDP rank (gloo, forked) and the tiny Qwen2.

* Every proximal log-prob of a step batch is computed once, for every mini-batch, before its first optimizer
  step, and never again in later epochs: the trust region's anchor is the policy before the step.
* The loop tells the batch planner the version the learner holds, so tokens sampled by that version are
  marked fresh and the start-up log-prob probe runs on them (a wrong version marks none and the probe would
  silently never run).
* With several optimizer steps, ``correction: none`` (verl's meaning) clips against that proximal pass.

Step 1's samples are tagged version 0 (learner_testkit.make_batches), the version the learner starts at.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from learner_testkit import join_gloo, make_batches, make_tiny_model, run_procs, write_batches

STEPS = 2
pytestmark = pytest.mark.timeout(240)


def _rank(rank: int, world_size: int, port: int, kw: dict) -> None:

    import pyarrow as pa

    from learner.config import LearnerConfig
    from learner.fsdp import FSDPEngine
    from learner.loop import Learner
    from learner.source import InProcessSource

    join_gloo(0, 1, port)
    # 3 trainable groups a step (make_batches' 4th is uniform), one per mini-batch, two epochs: 6 optimizer steps;
    # a tolerance of 50 nats passes whatever the synthetic behaviour log-probs are, so the probe only has to run
    cfg = LearnerConfig.model_validate(
        {
            "loss": {"correction": "none"},
            "micro_batch_tokens": 64,
            "ppo_mini_batch_size": 1,
            "ppo_epochs": 2,
            "checkpoint_every": 0,
            "logprob_probe_tolerance": 50.0,
            "optim": {"lr": 1e-3},
        }
    )
    engine = FSDPEngine(cfg, kw["model"], total_steps=STEPS, seed=0)
    events: list[list] = []
    prepare, train = engine.prepare_logprobs, engine.train_step

    def prepare_logprobs(plan):
        prepare(plan)
        events.append(["prepare", id(plan), all(mb.prox_logp is not None for mb in plan.micro_batches)])

    def train_step(plan, **kw_):
        m = train(plan, **kw_)
        events.append(["train", id(plan), m["clip_frac"]])
        return m

    engine.prepare_logprobs, engine.train_step = prepare_logprobs, train_step
    with pa.ipc.open_file(kw["data"]) as f:
        source = InProcessSource([f.get_batch(i) for i in range(f.num_record_batches)])
    records = {}
    learner = Learner(
        engine,
        cfg,
        source=source,
        max_steps=STEPS,
        on_metrics=lambda step, m: (events.append(["record", step]), records.__setitem__(step, m)),
    )
    learner.run()
    keep = (
        "learner/logprob_probe_tokens",
        "learner/optimizer_steps",
        "learner/clip_frac_last",
        "learner/batch_mini_batches",
    )
    Path(kw["out"], "events.json").write_text(
        json.dumps(
            {
                "events": events,
                "probed": learner.probed,
                "records": {s: {k: m[k] for k in keep if k in m} for s, m in records.items()},
            }
        )
    )
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("contract")
    model = make_tiny_model(d / "model")
    data = write_batches(d / "data.arrow", make_batches(STEPS))
    run_procs(_rank, 1, dict(model=str(model), data=str(data), out=str(d)), timeout=180, start_method="fork")
    return json.loads((d / "events.json").read_text())


def _steps(events: list[list]) -> list[list[list]]:
    out, cur = [], []
    for e in events:
        if e[0] == "record":
            out.append(cur)
            cur = []
        else:
            cur.append(e)
    return out


def test_the_proximal_pass_runs_once_per_mini_batch_before_the_first_optimizer_step(run):
    for step in _steps(run["events"]):
        kinds = [e[0] for e in step]
        n_prep = kinds.count("prepare")
        assert n_prep == 3, step  # one per mini-batch, not per epoch
        assert kinds == ["prepare"] * 3 + ["train"] * 6, step  # all before the first optimizer step
        assert all(e[2] for e in step if e[0] == "prepare"), (
            "correction none with several optimizer steps needs the proximal log-probs"
        )
        assert {e[1] for e in step if e[0] == "train"} == {e[1] for e in step if e[0] == "prepare"}


def test_the_first_optimizer_step_has_ratio_one_and_later_ones_move(run):
    for step in _steps(run["events"]):
        clip = [e[2] for e in step if e[0] == "train"]
        # the first optimizer step of a batch: pi == prox, so nothing can clip (ratio exactly 1 up to the
        # forward's determinism on CPU, far inside clip_low = 0.2)
        assert clip[0] == 0.0, clip
    assert all(r["learner/optimizer_steps"] == 6.0 for r in run["records"].values())


def test_the_learner_version_marks_fresh_tokens_and_the_probe_runs(run):
    assert run["probed"] is True
    # step 1 trains version-0 samples at version 0: every response token is fresh and probed
    assert run["records"]["1"]["learner/logprob_probe_tokens"] > 0
