"""Megatron with varlen flash core attention (learner/megatron/varlen.py) equals its masked attention.

One GPU, the same bf16 weights and packed batch, Megatron TP=1 twice: ``attn_implementation=auto`` (the
local spec's DotProductAttention with the packed [T, T] mask) and ``varlen``. Compared: loss, entropy,
gradient norm and the whole reduced gradient.

Run on the GPU machine: ``pytest -m gpu tests/gpu/test_megatron_varlen_gpu.py`` (megatron-core needed).
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

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(200)]

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("megatron.core", reason="needs megatron-core (pip install fleetrl[megatron])")
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("NCCL_CUMEM_ENABLE", "0")


def _run(model: str, out: Path, attn: str) -> dict:
    kw = {"models": [model], "tp": 1, "grads": True, "out": str(out), "attn": attn}
    run_procs(mw.megatron_rank, 1, kw, 150, "spawn")
    return torch.load(str(out) + ".rank0.pt", weights_only=False)


def test_megatron_varlen_matches_masked_attention(tmp_path):
    model = str(mw.bf16_model(make_tiny_model(tmp_path / "src", seed=3), tmp_path / "bf16"))
    ref = _run(model, tmp_path / "masked", "auto")
    got = _run(model, tmp_path / "varlen", "varlen")
    diff = sum(float((got["grads"][n] - ref["grads"][n]).pow(2).sum()) for n in ref["grads"]) ** 0.5
    norm = sum(float(g.pow(2).sum()) for g in ref["grads"].values()) ** 0.5
    m0, m1 = ref["metrics"], got["metrics"]
    print(
        f"varlen vs masked: grad rel {diff / norm:.2e}; loss {m0['loss_total']:.6f} {m1['loss_total']:.6f}; "
        f"grad_norm {m0['grad_norm']:.5f} {m1['grad_norm']:.5f}; entropy {m0['entropy']:.5f} {m1['entropy']:.5f}"
    )
    # bf16 compute in both, two attention kernels (flash vs unfused softmax over the masked square): the same
    # tolerances as tests/gpu/test_megatron_gpu.py's FSDP-vs-Megatron comparison, whose reasoning applies
    # unchanged (a leak across packed sequences or a wrong head grouping gives O(1) relative gradient error).
    assert diff / norm < 5e-2
    assert m1["loss_total"] == pytest.approx(m0["loss_total"], abs=5e-3)
    assert m1["entropy"] == pytest.approx(m0["entropy"], rel=1e-2)
    assert m1["grad_norm"] == pytest.approx(m0["grad_norm"], rel=3e-2)
