"""``learner.loss.uniform_groups_in_mean`` through the config, the loop and a real FSDP rank (gloo, forked, the
tiny Qwen2): skipping the uniform group yet counting it in the mean gives the gradient norm of training it, and
plain dropping does not. Each step batch of learner_testkit.make_batches has one uniform group of four.

The three runs start from the same weights and see the same first batch, so their first steps' gradients are
comparable: train and skip compute the same sum in another order (float32 on CPU: 1e-5 relative is loose for
a few hundred tokens); drop divides by fewer tokens, so its norm is larger by all tokens / trained tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from learner_testkit import join_gloo, make_batches, make_tiny_model, run_procs, write_batches

pytestmark = pytest.mark.timeout(300)
VARIANTS = {
    "train": {"drop_uniform_groups": False},
    "skip": {"drop_uniform_groups": True, "uniform_groups_in_mean": True},
    "drop": {"drop_uniform_groups": True},
}


def _rank(rank: int, world_size: int, port: int, kw: dict) -> None:
    import pyarrow as pa

    from learner.config import LearnerConfig
    from learner.fsdp import FSDPEngine
    from learner.loop import Learner
    from learner.source import InProcessSource

    join_gloo(0, 1, port)
    cfg = LearnerConfig.model_validate(
        {
            "loss": {"correction": "none", **VARIANTS[kw["variant"]]},
            "micro_batch_tokens": 64,
            "checkpoint_every": 0,
            "logprob_probe_tolerance": 50.0,  # the synthetic behaviour log-probs are not the model's
            "optim": {"lr": 1e-3},
        }
    )
    engine = FSDPEngine(cfg, kw["model"], total_steps=1, seed=0)
    with pa.ipc.open_file(kw["data"]) as f:
        source = InProcessSource([f.get_batch(0)])
    records = {}
    Learner(engine, cfg, source=source, max_steps=1, on_metrics=lambda step, m: records.__setitem__(step, m)).run()
    m = records[1]
    keep = ("learner/grad_norm", "learner/batch_samples_trained", "learner/batch_response_tokens", "learner/loss_total")
    Path(kw["out"], f"{kw['variant']}.json").write_text(json.dumps({k: m[k] for k in keep}))
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("uniform")
    model = make_tiny_model(d / "model")
    batches = make_batches(1)
    data = write_batches(d / "data.arrow", batches)
    for variant in VARIANTS:
        kw = dict(model=str(model), data=str(data), out=str(d), variant=variant)
        run_procs(_rank, 1, kw, timeout=180, start_method="fork")
    out = {v: json.loads((d / f"{v}.json").read_text()) for v in VARIANTS}
    b = batches[0]
    lengths = [len(x) for x in b.column("response_ids").to_pylist()]
    uniform = [g.endswith("g3") for g in b.column("group_id").to_pylist()]  # make_batches' last group of 4
    out["tokens"] = {"all": sum(lengths), "kept": sum(n for n, u in zip(lengths, uniform, strict=True) if not u)}
    return out


def test_skipping_uniform_groups_in_the_mean_keeps_the_gradient_of_training_them(runs):
    train, skip = runs["train"], runs["skip"]
    assert skip["learner/batch_samples_trained"] == 12.0 and train["learner/batch_samples_trained"] == 16.0
    assert train["learner/grad_norm"] > 0
    assert skip["learner/grad_norm"] == pytest.approx(train["learner/grad_norm"], rel=1e-5)


def test_plain_dropping_scales_the_gradient_by_the_tokens_left_out(runs):
    t = runs["tokens"]
    ratio = runs["drop"]["learner/grad_norm"] / runs["train"]["learner/grad_norm"]
    assert ratio == pytest.approx(t["all"] / t["kept"], rel=1e-4), (ratio, t)
