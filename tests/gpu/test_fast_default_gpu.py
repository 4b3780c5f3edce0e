"""Issue 36 on one GPU: the FSDP engine as shipped takes every fast path without flags, sizes its micro-batches
at the first step, and its compiled (Triton) per-chunk head arithmetic equals the eager one.

Run on the GPU machine: ``pytest -m gpu tests/gpu/test_fast_default_gpu.py`` (about a minute, most of it compiles).
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))

pytestmark = pytest.mark.gpu


def _need_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")


@pytest.mark.timeout(180)
def test_fused_head_equals_eager_on_gpu():
    _need_cuda()
    from learner.logprobs import chunked_logprobs

    g = torch.Generator(device="cuda").manual_seed(0)
    n, h, v = 5000, 896, 32000  # chunks of 2048: two full ones and a tail (a dynamic-shape graph)
    hidden = (torch.randn(n, h, device="cuda", generator=g) * 0.5).to(torch.bfloat16).requires_grad_(True)
    weight = (torch.randn(v, h, device="cuda", generator=g) * 0.05).to(torch.bfloat16).requires_grad_(True)
    targets = torch.randint(0, v, (n,), device="cuda", generator=g)
    coef = torch.randn(n, device="cuda", generator=g)
    res = {}
    for fused in (False, True):
        hidden.grad = weight.grad = None
        lp, ent = chunked_logprobs(hidden, weight, targets, 0.7, 2048, torch.bfloat16, fused=fused)
        (lp * coef).sum().backward()
        res[fused] = (lp.detach(), ent.detach(), hidden.grad.float(), weight.grad.float())
    # Same fp32 logits (same matmul), reduced in another order by Triton: sums of 32,000 fp32 terms differ by
    # about sqrt(32000) x 2^-24 relative, 1e-5 of values ~10, so 1e-4; 5e-4 absolute with margin. Gradients are
    # rounded to bf16 after the logit gradient in both; a flipped rounding is 2^-8 relative of one entry, so
    # compare their norms to 1e-2 relative and entries to 2e-2 of the largest.
    for a, b in zip(res[True][:2], res[False][:2], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=5e-4)
    for a, b in zip(res[True][2:], res[False][2:], strict=True):
        assert abs(float(a.norm()) - float(b.norm())) <= 1e-2 * float(b.norm())
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2 * float(b.abs().max()))


@pytest.fixture(scope="module")
def one_rank_group():
    _need_cuda()
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
def test_engine_as_shipped_takes_the_fast_path(tmp_path, one_rank_group):
    from learner_testkit import make_batches, make_tiny_model

    from learner.batch import plan_step
    from learner.config import LearnerConfig
    from learner.fastpath import MAX_AUTO_TOKENS
    from learner.fsdp import FSDPEngine

    model = make_tiny_model(tmp_path / "model")
    eng = FSDPEngine(
        LearnerConfig.model_validate({"loss": {"correction": "tis"}, "optim": {"lr": 1e-3}}), str(model), total_steps=10
    )
    s = eng.settings
    assert (s.chunked_logprobs, s.varlen, s.fused_optimizer, s.meta_init, s.compile_blocks, s.fused_head) == (True,) * 6
    assert s.root_dtype == "bfloat16" and s.pending
    tokens = eng.micro_batch_tokens  # settles: a tiny model gets the cap
    assert tokens == MAX_AUTO_TOKENS and not eng.settings.pending and not eng.settings.activation_checkpointing
    assert "GiB free" in eng.settings.micro_batch_source
    plan = plan_step(
        make_batches(1)[0],
        rank=0,
        world_size=1,
        micro_batch_tokens=tokens,
        advantage="mean_std",
        drop_uniform=True,
        aggregation="token",
    )
    m = [eng.train_step(plan) for _ in range(2)]
    assert all(math.isfinite(x["loss_total"]) and math.isfinite(x["grad_norm"]) and x["grad_norm"] > 0 for x in m)
