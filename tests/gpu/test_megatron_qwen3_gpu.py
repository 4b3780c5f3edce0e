"""Qwen3 (QK-norm) through the Megatron learner on one GPU, and the fp32 output layer.

A random 2-layer Qwen3 (per-head RMSNorm on queries and keys before RoPE) in bf16:
- HF -> Megatron TP=1 -> HF through ``full_tensors`` and ``export_hf`` is bit-identical (the converter's
  ``q_norm``/``k_norm`` <-> ``q_layernorm``/``k_layernorm`` mapping, learner/megatron/convert.py);
- Megatron TP=1 and FSDP2 agree on the loss, entropy, behaviour/learner log-prob gap and the whole gradient (a QK-norm that
  Megatron applied after RoPE, to the wrong axis, or not at all gives O(1) log-prob differences);
- the output layer's logits come out fp32 on both (learner/megatron/engine.py ``fp32_output_layer``; FSDP's
  fp32 root).

Run on the GPU machine: ``pytest -m gpu tests/gpu/test_megatron_qwen3_gpu.py`` (megatron-core needed).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "support"))
import megatron_worker as mw  # noqa: E402
from learner_testkit import VOCAB, make_tiny_model, run_procs  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("megatron.core", reason="needs megatron-core (pip install fleetrl[megatron])")
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("NCCL_CUMEM_ENABLE", "0")


def make_tiny_qwen3(out: Path, seed: int = 5) -> Path:
    """A random 2-layer Qwen3 (head_dim 16, QK-norm weights perturbed away from 1 so that a dropped norm
    shows) with the word-level tokenizer of learner_testkit's tiny Qwen2."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    tok_src = make_tiny_model(out.parent / f"{out.name}_tok", seed=seed)
    torch.manual_seed(seed)
    cfg = Qwen3Config(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_hidden_layers=2,
        intermediate_size=128,
        vocab_size=VOCAB,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.copy_(1.0 + 0.5 * torch.randn_like(p))
    model.save_pretrained(out)
    for f in tok_src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy2(f, out / f.name)
    return out


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("qwen3")
    return str(mw.bf16_model(make_tiny_qwen3(d / "src"), d / "bf16"))


def _spawn(target, kw: dict) -> dict:
    run_procs(target, 1, kw, 200, "spawn")
    return torch.load(kw["out"] + ".rank0.pt", weights_only=False)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def test_qwen3_round_trip_tp1_bit_identical(qwen3, tmp_path):
    res = _spawn(mw.megatron_rank, {"models": [qwen3], "tp": 1, "roundtrip": True, "out": str(tmp_path / "rt")})
    hf, full, export = res["hf_0"], res["full_0"], res["export_0"]
    assert any(k.endswith("q_norm.weight") for k in full), sorted(full)
    assert sorted(full) == sorted(hf), sorted(set(full) ^ set(hf))
    bad = [k for k in hf if full[k].dtype != hf[k].dtype or not torch.equal(_bits(full[k]), _bits(hf[k]))]
    bad_export = [k for k in hf if not torch.equal(_bits(export[k]), _bits(hf[k]))]
    print(f"Qwen3 TP=1 round trip: {len(full)} tensors, mismatched {bad}, export mismatched {bad_export}")
    assert not bad and not bad_export


def test_qwen3_megatron_matches_fsdp_with_fp32_heads(qwen3, tmp_path):
    """Tolerances as tests/gpu/test_megatron_gpu.py's FSDP parity (bf16 bodies through different attention
    kernels: ~1e-2 nats per token through two layers; both heads fp32, so the head adds nothing)."""
    ref = _spawn(mw.fsdp_rank, {"models": [qwen3], "out": str(tmp_path / "fsdp")})
    # logprobs=full: the output layer itself runs, so its output dtype can be checked (auto would be chunked)
    got = _spawn(
        mw.megatron_rank, {"models": [qwen3], "tp": 1, "grads": True, "logprobs": "full", "out": str(tmp_path / "meg")}
    )
    assert got["head_dtype"] == "torch.float32"
    g_ref = torch.cat([ref["grads"][k].flatten() for k in sorted(ref["grads"])])
    g_got = torch.cat([got["grads"][k].flatten() for k in sorted(ref["grads"])])
    rel = float((g_got - g_ref).norm() / g_ref.norm())
    m0, m1 = ref["metrics"], got["metrics"]
    print(
        f"Qwen3 Megatron TP=1 vs FSDP: grad rel {rel:.2e}; loss {m0['loss_total']:.6f} {m1['loss_total']:.6f}; "
        f"entropy {m0['entropy']:.5f} {m1['entropy']:.5f}"
    )
    assert m1["grad_norm"] == pytest.approx(m0["grad_norm"], rel=3e-2)
    assert m1["mismatch_logp_diff"] == pytest.approx(m0["mismatch_logp_diff"], abs=5e-3)
    assert rel < 5e-2
    assert m1["loss_total"] == pytest.approx(m0["loss_total"], abs=5e-3)
    assert m1["entropy"] == pytest.approx(m0["entropy"], rel=1e-2)
