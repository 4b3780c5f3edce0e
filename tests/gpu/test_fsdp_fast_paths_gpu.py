"""The FSDP engine's GPU fast paths compute what the plain paths compute (issue 21), on one GPU.

- chunked log-probs/entropy from the hidden state (learner/logprobs.py) vs full fp32 logits of the bf16 operands;
- varlen flash attention over a packed row (learner/attention.py) vs sdpa with transformers' packed mask;
- a whole FSDP train step with every fast path (meta-device init, chunked, varlen, fused AdamW) vs the
  plain engine: the same initial shards bit for bit, the same loss and gradient norm within bf16 tolerance.

Run on the GPU machine: ``pytest -m gpu tests/gpu/test_fsdp_fast_paths_gpu.py``.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "learner"))

pytestmark = pytest.mark.gpu


def _need_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")


@pytest.mark.timeout(120)
def test_chunked_logprobs_match_full_logits_bf16():
    _need_cuda()
    from learner.engine import logprobs_from_selected
    from learner.logprobs import chunked_logprobs

    g = torch.Generator(device="cuda").manual_seed(0)
    n, h, v = 3000, 896, 32000
    hidden = (torch.randn(n, h, device="cuda", generator=g) * 0.5).to(torch.bfloat16).requires_grad_(True)
    weight = (torch.randn(v, h, device="cuda", generator=g) * 0.05).to(torch.bfloat16).requires_grad_(True)
    targets = torch.randint(0, v, (n,), device="cuda", generator=g)
    coef = torch.randn(n, device="cuda", generator=g)
    for temperature in (1.0, 0.7):
        ref_lp, ref_ent = logprobs_from_selected(hidden.float() @ weight.float().t(), targets, temperature)
        (ref_lp * coef).sum().backward()
        ref_gh, ref_gw = hidden.grad.clone(), weight.grad.clone()
        hidden.grad = weight.grad = None
        lp, ent = chunked_logprobs(hidden, weight, targets, temperature, chunk=1024)  # 1024 does not divide 3000
        (lp * coef).sum().backward()
        # The same fp32 logits of the bf16 operands (the chunked head multiplies them on tensor cores with an
        # fp32 result, the reference upcasts them), both reduced in fp32: they differ only in the order of
        # fp32 sums (~1e-6 relative on values of ~10): 1e-4 absolute.
        torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-4)
        torch.testing.assert_close(ent, ref_ent, rtol=0, atol=1e-4)
        # Gradients pass through a bf16 matmul in both (8 significant bits): 2e-2 relative to each tensor's
        # scale, measured as the norm of the difference over the norm of the reference.
        for a, b in ((hidden.grad, ref_gh), (weight.grad, ref_gw)):
            rel = float((a.float() - b.float()).norm() / b.float().norm())
            assert rel < 2e-2, rel
        hidden.grad = weight.grad = None


def _tiny_bf16_model(attn: str):
    from transformers import AutoModelForCausalLM, Qwen2Config

    from learner import attention

    if attn == "varlen":
        attn = attention.register()
    torch.manual_seed(0)
    cfg = Qwen2Config(
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=4,
        intermediate_size=512,
        vocab_size=96,
        max_position_embeddings=512,
    )
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=torch.bfloat16).cuda().eval()


@pytest.mark.timeout(120)
def test_varlen_attention_matches_sdpa_packed_mask():
    _need_cuda()
    from test_learner_packing import batch

    from learner.attention import varlen_kwargs
    from learner.batch import plan_step
    from learner.engine import packed_forward

    plan = plan_step(
        batch(n_groups=6, group_size=4),
        rank=0,
        world_size=1,
        micro_batch_tokens=10_000,
        advantage="mean",
        drop_uniform=False,
        aggregation="token",
    )
    (mb,) = plan.micro_batches
    assert len(mb.seq_lens) > 10  # many sequences in one row: the masking is really exercised
    mb.to(torch.device("cuda"))
    with torch.no_grad():
        ref, ref_ent = packed_forward(_tiny_bf16_model("sdpa"), mb)
        out, ent = packed_forward(_tiny_bf16_model("varlen"), mb, **varlen_kwargs(mb.cu_seqlens, mb.max_seqlen))
    diff = (out - ref).abs()
    print(f"varlen vs sdpa: max |d logp| {float(diff.max()):.2e}, mean {float(diff.mean()):.2e}")
    # Same bf16 weights, two attention kernels (different summation order, bf16 outputs of 8 significant bits
    # per layer, 4 layers): log-probs of ~-4.6 agree to a few bf16 ulps; a leak across sequences would move
    # them by O(0.1-1).
    assert float(diff.max()) < 5e-2 and float(diff.mean()) < 5e-3
    assert float((ent - ref_ent).abs().max()) < 5e-2


@pytest.fixture(scope="module")
def one_rank_group():
    _need_cuda()
    import os

    import torch.distributed as dist

    from core.http_client import free_port

    if not dist.is_initialized():
        os.environ.update(
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"
        )
        torch.cuda.set_device(0)
        dist.init_process_group("nccl")
    yield
    dist.destroy_process_group()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tie", [False, True])
def test_fast_engine_step_matches_plain(tmp_path, one_rank_group, tie):
    from learner_testkit import make_batches, make_tiny_model
    from torch.distributed.tensor import DTensor

    from learner.batch import plan_step
    from learner.config import LearnerConfig
    from learner.fsdp import FSDPEngine

    model = make_tiny_model(tmp_path / "model", tie=tie)
    batch = make_batches(1)[0]
    out = {}
    for name, over in {
        "plain": {"logprobs": "full", "attn_implementation": "sdpa", "fused_optimizer": "off", "meta_init": "off"},
        "fast": {
            "logprobs": "chunked",
            "attn_implementation": "varlen",
            "fused_optimizer": "on",
            "meta_init": "on",
            "logprob_chunk": 7,
        },
    }.items():
        cfg = LearnerConfig.model_validate(
            {"loss": {"correction": "tis"}, "optim": {"lr": 1e-3}, "micro_batch_tokens": 64, **over}
        )
        eng = FSDPEngine(cfg, str(model), total_steps=10)
        init = {
            k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in eng.model.state_dict().items()
        }
        plan = plan_step(
            batch,
            rank=0,
            world_size=1,
            micro_batch_tokens=64,
            advantage="mean_std",
            drop_uniform=True,
            aggregation="token",
        )
        out[name] = (init, [eng.train_step(plan) for _ in range(2)])
        del eng
    (i0, m0), (i1, m1) = out["plain"], out["fast"]
    assert sorted(i0) == sorted(i1)
    for k in i0:  # meta-device init + shard load writes exactly what from_pretrained loads (fp32 file)
        assert torch.equal(i0[k], i1[k]), k
    for a, b in zip(m0, m1, strict=True):
        for key in ("loss_total", "grad_norm", "entropy"):
            assert math.isfinite(a[key]) and math.isfinite(b[key]), key
        # bf16 compute in both; the fast step differs in the attention kernel and the order of the
        # log-softmax sums: 2% of the gradient norm, 0.01 nats of entropy, and 2% of the loss scale (the
        # loss is a small difference of clipped ratios, so its own size is no scale: |loss| + 1e-2).
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 2e-2 * a["grad_norm"], (a["grad_norm"], b["grad_norm"])
        assert abs(a["entropy"] - b["entropy"]) <= 1e-2, (a["entropy"], b["entropy"])
        assert abs(a["loss_total"] - b["loss_total"]) <= 2e-2 * (abs(a["loss_total"]) + 1e-2)


@pytest.mark.timeout(60)
def test_the_head_matmul_of_half_operands_is_their_exact_fp32_product():
    """learner.logprobs.mm_fp32: bf16/fp16 operands on tensor cores with an fp32 result equal the fp32 matmul of
    the upcast operands to the order of fp32 sums (products of half values are exact in fp32), where a plain
    bf16 matmul rounds every logit to 8 significant bits."""
    _need_cuda()
    from learner import logprobs

    g = torch.Generator(device="cuda").manual_seed(1)
    for dtype in (torch.bfloat16, torch.float16):
        a = torch.randn(512, 896, device="cuda", generator=g).to(dtype)
        b = torch.randn(896, 4096, device="cuda", generator=g).to(dtype)
        ref = a.double() @ b.double()
        out = logprobs.mm_fp32(a, b)
        assert out.dtype == torch.float32
        err = float((out.double() - ref).abs().max() / ref.abs().max())
        rounded = float(((a @ b).double() - ref).abs().max() / ref.abs().max())
        assert err < 1e-5 and rounded > 1e-4, (dtype, err, rounded, logprobs._out_dtype_mm)
        print(
            f"mm_fp32 {dtype}: max rel err {err:.2e} (a half-precision result: {rounded:.2e}); "
            f"torch.mm out_dtype used: {logprobs._out_dtype_mm}"
        )
