"""Megatron's chunked log-prob head (``learner.logprobs=chunked``, learner/megatron/engine.py) equals its
full-logits head on the GPU.

One GPU, the same bf16 weights and packed batch, Megatron TP=1 with varlen attention twice:
``logprobs=full`` (the fp32 output layer's [T, V] logits) and ``chunked`` (the final hidden state through
learner/logprobs.py in chunks of 7 rows, so several per micro-batch and a partial last one), at temperature 0.7. Compared: per-token
log-probs (forward_logprobs), the reduced gradient of every weight (Megatron's schedule, DDP), loss,
entropy and gradient norm of a train_step. An untied and a tied model (the tied head's weight is the
embedding's). tests/integration/learner/test_megatron_chunked_cpu.py checks the same on CPU in fp32, and
that a wrong temperature or an undropped vocab padding row fails it.

Run on the GPU machine: ``pytest -m gpu tests/gpu/test_megatron_chunked_gpu.py`` (megatron-core needed).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "support"))
import megatron_worker as mw  # noqa: E402
from learner_testkit import make_tiny_model, run_procs  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("megatron.core", reason="needs megatron-core (pip install fleetrl[megatron])")
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("NCCL_CUMEM_ENABLE", "0")


def _run(model: str, out: Path, logprobs: str) -> dict:
    kw = {
        "models": [model],
        "tp": 1,
        "grads": True,
        "logp": True,
        "out": str(out),
        "attn": "varlen",
        "logprobs": logprobs,
        "temperature": 0.7,
        "logprob_chunk": 7,
    }  # several chunks per micro-batch
    run_procs(mw.megatron_rank, 1, kw, 150, "spawn")
    return torch.load(str(out) + ".rank0.pt", weights_only=False)


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_megatron_chunked_logprobs_match_full_logits(tmp_path, tie):
    model = str(mw.bf16_model(make_tiny_model(tmp_path / "src", seed=3, tie=tie), tmp_path / "bf16"))
    ref = _run(model, tmp_path / "full", "full")
    got = _run(model, tmp_path / "chunked", "chunked")
    assert not ref["chunked"] and got["chunked"]
    dlogp = float((got["logp"] - ref["logp"]).abs().max())
    diff = sum(float((got["grads"][n] - ref["grads"][n]).pow(2).sum()) for n in ref["grads"]) ** 0.5
    norm = sum(float(g.pow(2).sum()) for g in ref["grads"].values()) ** 0.5
    m0, m1 = ref["metrics"], got["metrics"]
    print(
        f"chunked vs full ({'tied' if tie else 'untied'}): {ref['logp'].numel()} tokens, max |dlogp| {dlogp:.2e}; "
        f"grad rel {diff / norm:.2e}; loss {m0['loss_total']:.6f} {m1['loss_total']:.6f}; grad_norm "
        f"{m0['grad_norm']:.5f} {m1['grad_norm']:.5f}; entropy {m0['entropy']:.5f} {m1['entropy']:.5f}"
    )
    # The same bf16 body and the same fp32 logits (the full head upcasts both operands, the chunked one multiplies
    # the bf16 operands with an fp32 result: the same products): the log-probs differ only by the order of fp32
    # sums (~1e-6). The chunked head's backward takes the logits' gradient in bf16 into its two matmuls (as every
    # other matmul of the bf16 backward does; the full head's autograd keeps it fp32): 8 significant bits,
    # 2^-8 = 3.9e-3 relative per element, plus the flash-attention backward's non-deterministic accumulation.
    # Measured on an H200: 5.4e-3 (tied) and 5.5e-3 (untied), hence 1e-2. A head without the temperature is off
    # by ~0.1 nats and ~0.3 relative in the gradient, a softmax over the vocab padding rows by ~1e-2 nats (the
    # log-prob bound catches it) and ~1.5e-2 (measured on the CPU test's model).
    assert dlogp < 2e-3
    assert diff / norm < 1e-2
    assert m1["loss_total"] == pytest.approx(m0["loss_total"], abs=1e-4)
    assert m1["entropy"] == pytest.approx(m0["entropy"], rel=1e-3)
    assert m1["grad_norm"] == pytest.approx(m0["grad_norm"], rel=5e-3)
