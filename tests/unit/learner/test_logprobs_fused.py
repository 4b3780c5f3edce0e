"""The compiled per-chunk arithmetic of the chunked head (learner/logprobs.py, ``fused=True``: what the GPU
runs by default with compiled blocks) computes what the eager chunk loop computes: log-probs, entropies and
the gradients of hidden states and head weight. Compiled here with inductor's CPU backend, the same graphs
inductor lowers to Triton on a GPU."""

from __future__ import annotations

import pytest
import torch

from learner.logprobs import chunked_logprobs


def _run(fused: bool, hidden, weight, targets, coef, temperature, chunk, cd):
    hidden.grad = weight.grad = None
    lp, ent = chunked_logprobs(hidden, weight, targets, temperature, chunk, cd, fused=fused)
    (lp * coef).sum().backward()
    return lp.detach(), ent.detach(), hidden.grad.float().clone(), weight.grad.float().clone()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("cd", [None, torch.bfloat16], ids=["fp32", "bf16-operands"])
def test_fused_chunk_math_equals_eager(cd):
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(5)
    n, h, v = 50, 24, 301  # 50 rows in chunks of 16: a 2-row tail (a second, dynamic-shape graph)
    hidden = torch.randn(n, h, generator=g).requires_grad_(True)
    weight = (torch.randn(v, h, generator=g) * 0.3).requires_grad_(True)
    targets = torch.randint(0, v, (n,), generator=g)
    coef = torch.randn(n, generator=g)
    ref = _run(False, hidden, weight, targets, coef, 0.6, 16, cd)
    got = _run(True, hidden, weight, targets, coef, 0.6, 16, cd)
    # Same formulas on the same fp32 logits, reduced in another order (and the softmax recomputed as
    # exp(z - logsumexp) rather than torch.softmax): a few fp32 ulps of values ~10, hence 2e-5 absolute;
    # gradients sum n such terms: 2e-5 relative. With bf16 operands the logit gradient is rounded to bf16
    # before the head's backward matmuls in both paths, so one ulp of disagreement before rounding can flip
    # a bf16 rounding: 2^-8 relative of a gradient entry, summed over rows: 1e-2 relative, 1e-3 absolute.
    tol = dict(rtol=2e-5, atol=2e-5) if cd is None else dict(rtol=1e-2, atol=1e-3)
    for name, a, b in zip(("logp", "entropy", "grad_hidden", "grad_weight"), got, ref, strict=True):
        torch.testing.assert_close(a, b, **(tol if name.startswith("grad") else dict(rtol=2e-5, atol=2e-5)), msg=name)
    assert not torch.equal(got[2], torch.zeros_like(got[2]))  # a real gradient flowed


@pytest.mark.timeout(180)
def test_fused_chunks_compile_once_for_every_row_count():
    """A micro-batch's last chunk has rows of its own count: after the first micro-batch, none recompiles (the
    default compile is static at first and recompiled a later step's new count inside a measured step)."""
    import learner.logprobs as lp_mod
    from learner.busy import StepTimer

    torch.set_num_threads(1)
    torch._dynamo.reset()
    lp_mod._compiled.clear()
    g = torch.Generator().manual_seed(3)
    weight = (torch.randn(97, 16, generator=g) * 0.3).requires_grad_(True)

    def step(*rows: int) -> float:
        timer = StepTimer()
        for n in rows:  # chunks of 32: full ones, and a tail of n % 32
            hidden = torch.randn(n, 16, generator=g).requires_grad_(True)
            targets = torch.randint(0, 97, (n,), generator=g)
            lp, _ = chunked_logprobs(hidden, weight, targets, 1.0, 32, None, fused=True)
            lp.sum().backward()
        return timer.stop()["learner/compiled_graphs"]

    assert step(64) >= 1  # whole chunks only
    assert step(45, 71) == 0  # tails of 13 and 7 rows
    assert step(100, 3) == 0
