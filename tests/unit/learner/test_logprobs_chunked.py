"""The chunked log-prob/entropy path (learner/logprobs.py) computes what the full-logits path computes.

Compared on CPU in fp32 and fp64 against ``learner.engine.logprobs_from_selected`` (the path every engine
used before): values, entropies and the gradients of hidden states and head weight, for chunk sizes that
do and do not divide the rows, with and without a sampling temperature; then through a tiny Qwen2 (tied
and untied head) against ``packed_forward``, including every parameter's gradient.
"""

from __future__ import annotations

import pytest
import torch
from test_learner_packing import batch  # same folder (pytest rootdir-relative import)

from learner.batch import plan_step
from learner.engine import logprobs_from_selected, packed_forward
from learner.logprobs import chunked_logprobs, head_logprobs


def _grads(fn, hidden, weight, coef):
    hidden.grad = weight.grad = None
    lp, ent = fn()
    (lp * coef).sum().backward()
    return lp.detach(), ent.detach(), hidden.grad.clone(), weight.grad.clone()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_chunked_equals_full_logits(dtype, chunk, temperature):
    g = torch.Generator().manual_seed(chunk)
    n, h, v = 50, 24, 301
    hidden = torch.randn(n, h, generator=g, dtype=dtype).requires_grad_(True)
    weight = (torch.randn(v, h, generator=g, dtype=dtype) * 0.3).requires_grad_(True)
    targets = torch.randint(0, v, (n,), generator=g)
    coef = torch.randn(n, generator=g, dtype=dtype)
    ref = _grads(lambda: logprobs_from_selected(hidden @ weight.t(), targets, temperature), hidden, weight, coef)
    got = _grads(lambda: chunked_logprobs(hidden, weight, targets, temperature, chunk), hidden, weight, coef)
    # Both upcast the logits to fp32 and reduce there (the fp64 case too: the plain path's .float() and ours
    # round identically); they differ only in the order of fp32 sums over 301 terms of size ~5: a few fp32
    # ulps of values ~10, so 2e-5 absolute; gradients are sums of n such terms: 2e-5 relative + 2e-5 absolute.
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-5)
    assert not got[1].requires_grad  # entropy is a metric here, as in the plain path


def test_chunked_rejects_bad_shapes_and_handles_empty():
    w = torch.randn(10, 4)
    with pytest.raises(ValueError, match="hidden"):
        chunked_logprobs(torch.randn(3, 5), w, torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="targets"):
        chunked_logprobs(torch.randn(3, 4), w, torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="chunk"):
        chunked_logprobs(torch.randn(3, 4), w, torch.zeros(3, dtype=torch.long), chunk=0)
    h = torch.randn(0, 4, requires_grad=True)
    lp, ent = chunked_logprobs(h, w, torch.zeros(0, dtype=torch.long))
    assert lp.shape == ent.shape == (0,)
    lp.sum().backward()  # an empty micro-batch still has a (zero) gradient path
    assert h.grad is not None


def _tiny(tie: bool):
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    cfg = Qwen2Config(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        intermediate_size=128,
        vocab_size=96,
        max_position_embeddings=256,
        tie_word_embeddings=tie,
    )
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("tie", [False, True])
def test_head_logprobs_equal_packed_forward_with_gradients(tie):
    torch.set_num_threads(1)
    model = _tiny(tie)
    plan = plan_step(
        batch(),
        rank=0,
        world_size=1,
        micro_batch_tokens=10_000,
        advantage="mean",
        drop_uniform=False,
        aggregation="token",
    )
    (mb,) = plan.micro_batches
    coef = torch.randn(mb.targets.shape[0], generator=torch.Generator().manual_seed(1))
    res = {}
    for name, fn in {
        "full": lambda: packed_forward(model, mb, 0.8),
        "chunked": lambda: head_logprobs(model, mb, 0.8, chunk=5),
    }.items():
        model.zero_grad(set_to_none=True)
        lp, ent = fn()
        (lp * coef).sum().backward()
        res[name] = (lp.detach(), ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    (lp0, e0, g0), (lp1, e1, g1) = res["full"], res["chunked"]
    # fp32 end to end; same kernels up to the head, then the same reduction in another order (see above).
    torch.testing.assert_close(lp1, lp0, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(e1, e0, rtol=2e-5, atol=2e-5)
    assert g0.keys() == g1.keys()
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-4, atol=1e-5, msg=n)
    # The head's forward is restored afterwards: a plain call gives logits again.
    assert model(input_ids=mb.input_ids).logits.shape[-1] == 96
