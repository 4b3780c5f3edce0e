"""Megatron-core pipeline parallelism (PP=2 over 2 GPUs) and the KL reference model, on GPU (NCCL).

Run on the GPU machine (megatron-core installed)::

    NCCL_NVLS_ENABLE=0 NCCL_CUMEM_ENABLE=0 pytest -m gpu -s tests/gpu/test_megatron_pp_kl_gpu.py

The helpers (rank processes, the bf16 test models, the FSDP comparison and its tolerances, the
receiver-publish and round-trip checks) are those of tests/gpu/test_megatron_gpu.py.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(200)]

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("megatron.core", reason="needs megatron-core (pip install fleetrl[megatron])")
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("NCCL_CUMEM_ENABLE", "0")

import megatron_worker as mw  # noqa: E402
from test_megatron_gpu import (  # noqa: E402, F401, F811  (models: the module-scoped fixture, shared)
    _compare,
    _two_gpus,
    check_publish_into_receiver,
    check_round_trip,
    models,
    spawn,
)


def _merged(ranks: list[dict]) -> dict:
    """Each pipeline stage reports the gradients of its own layers: one dict for the whole model."""
    out = dict(ranks[0])
    out["grads"] = {k: v for r in ranks for k, v in r["grads"].items()}
    return out


def test_pp2_matches_fsdp_and_tp1_loss_and_gradients(models, tmp_path):
    """Megatron TP=1 PP=2 (layer 0 + embedding on GPU 0; layer 1, final norm, LM head on GPU 1) against FSDP2
    and Megatron TP=1 on the same bf16 weights and batch, with the tolerances of the TP test (its docstring).
    PP=2 pads every micro-batch to one length (p2p shapes), so its GEMMs differ from TP=1's by the padding
    rows only: the agreement with TP=1 should be at the bf16 noise level."""
    _two_gpus()
    model = str(models["untied"])
    ref = spawn(mw.fsdp_rank, 1, {"models": [model], "out": str(tmp_path / "fsdp")})[0]
    tp1 = spawn(mw.megatron_rank, 1, {"models": [model], "tp": 1, "grads": True, "out": str(tmp_path / "tp1")})[0]
    pp2_ranks = spawn(
        mw.megatron_rank, 2, {"models": [model], "tp": 1, "pp": 2, "grads": True, "out": str(tmp_path / "pp2")}
    )
    m0, m1 = ({k: v for k, v in r["metrics"].items() if not k.endswith("seconds")} for r in pp2_ranks)
    assert m0 == m1, f"the stages disagree on the step's metrics: {m0} vs {m1}"
    pp2 = _merged(pp2_ranks)
    assert sorted(pp2["grads"]) == sorted(ref["grads"]), sorted(set(pp2["grads"]) ^ set(ref["grads"]))
    for label, reference in (("megatron PP=2", ref), ("megatron PP=2 vs TP=1 (as reference)", tp1)):
        r = _compare(reference, pp2, label)
        assert r["loss"][1] == pytest.approx(r["loss"][0], abs=5e-3)
        assert r["entropy"][1] == pytest.approx(r["entropy"][0], rel=1e-2)
        assert r["grad_norm"][1] == pytest.approx(r["grad_norm"][0], rel=3e-2)
        assert r["grad_rel"] < 5e-2 and r["grad_cos"] > 0.998
        assert r["max_weight_diff_after_step"] < 3e-3 + 5e-4


def test_pp2_round_trip_and_publish_into_receiver(models, tmp_path):
    """PP=2: HF -> stage shards -> HF is bitwise for an untied and a tied model (the tied LM head lives on the
    last stage as a copy of the first stage's embedding), and a publish from PP=2 (later stages send their
    layers to rank 0 point to point) gives the receiver the HF tensors exactly."""
    check_round_trip(models, ["tiny", "tied"], tmp_path / "rt", "PP=2", tp=1, pp=2)
    check_publish_into_receiver(models["tiny"], tmp_path / "pub", "megatron PP=2", tp=1, pp=2)


@pytest.mark.parametrize(
    "layout",
    [
        pytest.param({"tp": 1, "pp": 2, "reference_offload": True}, id="pp2-offload"),
        pytest.param({"tp": 2, "pp": 1, "reference_offload": False}, id="tp2-on-gpu"),
    ],
)
def test_kl_reference(models, tmp_path, layout):
    """kl_coef > 0: the frozen reference's log-probs equal the policy's before the first step (KL = 0), the
    policy moves after one AdamW step (lr 1e-3: log-probs change by ~0.1 nats, KL > 0) while the reference
    does not. 'Moves' is measured on a second batch evaluated before and after the step.

    "Equal" within bf16 noise: reference and policy are separate tensors (the policy's are views into DDP's
    parameter buffer), so a kernel may round a logit differently, by one bf16 ulp (~0.03 at |logit| ~ 4;
    on CPU in fp32 we saw 0 and 5e-7). Hence per-token |ref - policy| < 0.05 and KL (k3 ~ d^2 / 2, a
    weighted mean) < 1e-4 at step 1, against ~1e-3 after the step (6e-4 to 1.3e-3 on CPU)."""
    _two_gpus()
    model = models["tied"] if layout["tp"] == 2 else models["untied"]
    ranks = spawn(
        mw.megatron_rank, 2, {"models": [str(model)], **layout, "kl": True, "kl_coef": 0.1, "out": str(tmp_path / "kl")}
    )
    last = [r["kl"] for r in ranks if r["kl"]["last_stage"]]
    assert last, "no rank reported the last pipeline stage"
    k = last[0]
    m1, m2 = k["m1"], k["m2"]
    print(
        f"KL {layout}: step 1 loss_kl {m1['loss_kl']:.3e} (ref vs policy max |diff| {k['ref_vs_policy_step1']}), "
        f"step 2 loss_kl {m2['loss_kl']:.3e}; on batch B the policy moved max {k['policy_moved']:.4f} mean "
        f"{k['policy_moved_mean']:.4f}, the reference max {k['ref_moved']} mean {k['ref_moved_mean']}; reference "
        f"kept on {k['ref_on']}; {k['n_logp']} tokens; peak GPU {k['gpu_mem_gib']:.2f} GiB"
    )
    assert k["n_logp"] > 0
    assert k["ref_vs_policy_step1"] < 5e-2 and abs(m1["loss_kl"]) < 1e-4, "policy == reference must give KL 0"
    assert k["policy_moved"] > 1e-2, "the optimizer step did not change the policy's log-probs"
    # a reference that trained with the policy would move as much; bf16 noise is a rare one-ulp flip
    assert k["ref_moved_mean"] < 0.1 * k["policy_moved_mean"], "the reference moved with the policy: not frozen"
    assert m2["loss_kl"] > 5 * max(abs(m1["loss_kl"]), 1e-5), (m1["loss_kl"], m2["loss_kl"])
    assert k["ref_on"].startswith("cpu" if layout["reference_offload"] else "cuda"), k["ref_on"]
    assert m1["step_skipped"] == 0.0 and m2["step_skipped"] == 0.0


def test_megatron_core_patches_apply():
    """learner/megatron/patches.py: each patch still finds its target in the installed megatron-core."""
    from learner.megatron import patches

    assert patches.check() == [], patches.check()
    assert patches.in_process_checkpoint_results_queue()
