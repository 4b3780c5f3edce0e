"""FSDP2 learner over gloo in real processes: 1 vs 2 ranks, exact resume, HF export.

One module fixture runs the two baseline trainings (1 rank and 2 ranks, 4 steps
each, same data and seed); the tests compare them and start further runs.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys

import pytest
import torch
import yaml
from learner_testkit import REPO, free_port, make_batches, make_tiny_model, run_ranks, write_batches
from safetensors.torch import load_file

STEPS = 4


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    torch.set_num_threads(1)
    d = tmp_path_factory.mktemp("learner")
    model = make_tiny_model(d / "model")
    data = write_batches(d / "data.arrow", make_batches(STEPS))
    common = dict(model=str(model), data=str(data), steps=STEPS, dump_at=(1, STEPS))
    one = run_ranks(
        1, out=str(d / "one"), export=str(d / "export1"), dump_path=str(d / "w1_v{version}.safetensors"), **common
    )
    two = run_ranks(
        2,
        out=str(d / "two"),
        export=str(d / "export2"),
        dump_path=str(d / "w2_v{version}.safetensors"),
        ckpt=str(d / "ckpt2"),
        checkpoint_every=2,
        **common,
    )
    return {"dir": d, "model": model, "data": data, "one": one, "two": two}


def losses(result) -> list[float]:
    return [h["learner/loss_total"] for h in result["history"]]


@pytest.mark.timeout(240)
def test_two_ranks_match_one_rank(runs):
    d = runs["dir"]
    one, two = runs["one"][0], runs["two"][0]
    # Every rank reports the same globally reduced metrics: one all-reduce hands every rank the same
    # bytes, so bit identity is the claim here.
    assert losses(runs["two"][1]) == losses(two)
    assert one["history"][0]["learner/batch_micro_batches"] > two["history"][0]["learner/batch_micro_batches"]
    # Tolerance: everything is fp32; 1 and 2 ranks differ only in the order of sums (per-token losses split
    # over other micro-batches, gloo's all-reduce of gradients and metrics, the grad-norm sum). Each fp32
    # addition rounds at ~6e-8 relative; a few hundred terms give ~1e-6 at worst, so 1e-5 relative is safe
    # while a normalisation bug (e.g. per-rank instead of global token count) would be off by ~10-50%.
    assert losses(one)[0] == pytest.approx(losses(two)[0], rel=1e-5, abs=1e-7)
    assert one["history"][0]["learner/grad_norm"] == pytest.approx(two["history"][0]["learner/grad_norm"], rel=1e-5)
    w1, w2 = load_file(str(d / "w1_v1.safetensors")), load_file(str(d / "w2_v1.safetensors"))
    assert w1.keys() == w2.keys()
    # After one AdamW step most weights moved by about lr = 1e-3 (the first Adam step is ~lr * g / (|g| + eps)).
    # A gradient's rounding noise |dg| is ~1e-7 (fp32) times its largest summands (<~1e-2 here), ~1e-9, even
    # when the sum itself cancels to ~0; it moves a weight by at most lr * |dg| / eps = 1e-3 * 1e-9 / 1e-5
    # = 1e-7 (eps = 1e-5 in these runs, see learner_testkit.worker). atol 1e-6: 10x that, 1000x below a step.
    moved = max((w1[k] - load_file(str(runs["model"] / "model.safetensors"))[k]).abs().max().item() for k in w1)
    assert moved > 5e-4, "the step did not change the weights"
    print("max |w1 - w2| after step 1:", max((w1[k] - w2[k]).abs().max().item() for k in w1))
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=0, atol=1e-6, msg=f"weights of {k} differ")
    # Later steps too (state of Adam, schedule) stay together.
    assert losses(one) == pytest.approx(losses(two), rel=1e-4, abs=1e-6)


@pytest.mark.timeout(240)
def test_resume_continues_loss_curve_exactly(runs):
    d = runs["dir"]
    straight = runs["two"][0]
    assert straight["published"] == [1, 2, 3, 4] and straight["reported"] == [1, 2, 3, 4] and straight["acked"] == 4
    # Keep only the step-2 checkpoint: a fresh pair of processes resumes from it.
    ckpt = d / "ckpt_resume"
    shutil.copytree(d / "ckpt2" / "step_00000002", ckpt / "step_00000002")
    assert (d / "ckpt2" / "step_00000004" / "meta.json").exists()
    resumed = run_ranks(
        2,
        model=str(runs["model"]),
        data=str(runs["data"]),
        out=str(d / "resumed"),
        steps=STEPS,
        ckpt=str(ckpt),
        checkpoint_every=2,
    )
    r0 = resumed[0]
    assert r0["resumed"] and r0["version"] == STEPS
    assert r0["published"] == [2, 3, 4]  # the resumed version is published first, then each new one
    assert r0["acked"] == 4 and r0["reported"] == [3, 4]
    # Same processes count, same data, restored optimizer/scheduler/RNG: bit-identical continuation.
    assert losses(r0) == losses(straight)[2:]
    assert [h["learner/lr"] for h in r0["history"]] == [h["learner/lr"] for h in straight["history"]][2:]
    assert [h["learner/grad_norm"] for h in r0["history"]] == [h["learner/grad_norm"] for h in straight["history"]][2:]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("which", ["1", "2"])
def test_hf_export_loads_and_matches(runs, which):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = runs["dir"]
    export = d / f"export{which}" / "latest"
    assert export.resolve().name == f"step_{STEPS:08d}"
    assert json.loads((export / "fleetrl_version.json").read_text()) == {"version": STEPS}
    final = load_file(str(d / f"w{which}_v{STEPS}.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    sd = model.state_dict()
    for k, v in final.items():
        assert torch.equal(sd[k], v), f"exported {k} differs from the trained weights"
    base = AutoModelForCausalLM.from_pretrained(runs["model"], dtype=torch.float32)
    ids = torch.tensor([[5, 9, 17, 33, 60, 2]])
    with torch.no_grad():
        assert not torch.allclose(model(ids).logits, base(ids).logits), "export equals the untrained model"
    tok = AutoTokenizer.from_pretrained(export)
    assert tok.convert_tokens_to_ids("t5") == 5


@pytest.mark.timeout(120)
def test_sequence_aggregation_tis_kl_match_across_ranks(runs):
    """Sequence-level normalisation and the KL term must also be global, not per rank.

    The 2-rank run also recomputes activations in backward (activation checkpointing), which must not
    change anything but memory.
    """
    d = runs["dir"]
    kw = dict(
        model=str(runs["model"]),
        data=str(runs["data"]),
        steps=1,
        correction="tis",
        aggregation="sequence",
        kl_coef=0.1,
        micro_tokens=40,
    )
    r1 = run_ranks(1, out=str(d / "seq1"), **kw)[0]
    r2 = run_ranks(2, out=str(d / "seq2"), activation_checkpointing=True, **kw)[0]
    one, two = r1["history"][0], r2["history"][0]
    # One MLP execution per micro-batch, two with checkpointing (the recompute in backward).
    assert r1["mlp_calls"] == one["learner/batch_micro_batches"]
    assert r2["mlp_calls"] == 2 * two["learner/batch_micro_batches"]
    for key in (
        "learner/loss_total",
        "learner/loss_policy",
        "learner/loss_kl",
        "learner/grad_norm",
        "learner/entropy",
        "learner/is_weight_mean",
        "learner/mismatch_kl_k3",
    ):
        assert one[key] == pytest.approx(two[key], rel=1e-5, abs=1e-7), key
    # The largest weight exp(logp - behaviour) comes from one token's fp32 log-prob, computed on a micro-batch
    # of another shape with 2 ranks (other packing, another kernel path and reduction order in the matmuls and
    # the log-softmax): ~1e-7 relative per op, a few e-7 after exp (seen: 4e-7 on one CPU). A different token
    # winning the max, or a weight not recomputed, differs by far more than 1e-5.
    assert one["learner/is_weight_max"] == pytest.approx(two["learner/is_weight_max"], rel=1e-5)
    # The reference is the initial model, so KL is zero at step 1. The reference's forward is another module
    # (not FSDP-wrapped) on the same weights: log-probs may differ by rounding (~1e-7), and k3 ~ d^2/2 turns
    # that into ~1e-14; a wrong reference or estimator gives >= 1e-4 on this random tiny model.
    assert one["learner/loss_kl"] == pytest.approx(0.0, abs=1e-9)
    assert math.isfinite(one["learner/loss_total"])


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_cli_entry_point_trains_and_exports(runs, tmp_path):
    """``python -m learner --config run.yaml --replay FILE`` as the launcher would start a rank."""
    run_dir = tmp_path / "run"
    cfg = {
        "model": {"path": str(runs["model"])},
        "data": {"train_files": ["unused.parquet"]},
        "learner": {
            "loss": {"correction": "decoupled"},
            "micro_batch_tokens": 256,
            "checkpoint_every": 1,
            "logprob_probe_tolerance": None,
        },  # replayed synthetic behaviour log-probs
        "run": {"seed": 0, "max_steps": 1, "run_dir": str(run_dir)},
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "RANK": "0",
        "WORLD_SIZE": "1",
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": str(REPO),
    }
    p = subprocess.run(
        [sys.executable, "-m", "learner", "--config", str(tmp_path / "run.yaml"), "--replay", str(runs["data"])],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert (run_dir / "checkpoints" / "step_00000001" / "meta.json").exists()
    assert (run_dir / "export" / "latest" / "model.safetensors").exists()
    assert "step 1: loss" in p.stderr
