"""FSDP2's root in bf16 with the chunked head (the GPU default, learner/fastpath.py) scores the same
log-probs as the fp32 root it replaces, within a bound derived from bf16 rounding, through a real gloo rank on
CPU (FSDP2's bf16 policy runs there as on GPU; the head's bf16 operands give fp32 logits on both devices)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from learner_testkit import make_batches, make_tiny_model, run_procs


def _rank(rank, world_size, port, kw):
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from learner.batch import plan_step
    from learner.fsdp import _load_model, _shard
    from learner.logprobs import head_logprobs

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.manual_seed(0)
    (mb,) = plan_step(
        make_batches(1)[0],
        rank=0,
        world_size=1,
        micro_batch_tokens=10_000,
        advantage="mean",
        drop_uniform=False,
        aggregation="token",
    ).micro_batches
    out = {}
    norm_w = None
    for name, root in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        model = _load_model(kw["model"], "sdpa")
        with torch.no_grad():  # a final norm whose weights are not 1.0 (rounding to bf16 must change them)
            if norm_w is None:
                norm_w = 1 + 0.3 * torch.randn(
                    model.model.norm.weight.shape, generator=torch.Generator().manual_seed(3)
                )
            model.model.norm.weight.copy_(norm_w)
        head_w = model.get_output_embeddings().weight.detach().to(torch.bfloat16).float()
        _shard(
            model,
            init_device_mesh("cpu", (1,)),
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
            offload=False,
            root_dtype=root,
        )
        seen = {}
        model.model.norm.register_forward_hook(lambda m, a, o, seen=seen: seen.update(h=o.detach()))
        logp, _ = head_logprobs(model, mb, 1.0, chunk=7, compute_dtype=torch.bfloat16)
        out[name] = {
            "logp": logp.detach().tolist(),
            "h_dtype": str(seen["h"].dtype),
            "h": seen["h"][0, mb.target_index].float().tolist(),
            "w": head_w.tolist(),
        }
    Path(kw["out"]).write_text(json.dumps(out))
    dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_bf16_root_log_probs_match_fp32_root(tmp_path):
    torch.set_num_threads(1)
    model = make_tiny_model(tmp_path / "model")
    out = tmp_path / "out.json"
    run_procs(_rank, 1, {"model": str(model), "out": str(out)}, timeout=90, start_method="fork")
    r = json.loads(out.read_text())
    a, b = r["fp32"], r["bf16"]
    assert (a["h_dtype"], b["h_dtype"]) == ("torch.float32", "torch.bfloat16")  # the roots really differ
    la, lb = torch.tensor(a["logp"]), torch.tensor(b["logp"])
    h, w = torch.tensor(a["h"]), torch.tensor(w_ := a["w"])
    assert w_ == b["w"]
    # The decoder layers are the same bf16 computation in both; only the final norm's output differs: the fp32
    # root multiplies the bf16-rounded normalised row by the fp32 weight g and the head casts the product to bf16,
    # the bf16 root multiplies by bf16(g) and rounds. With u = 2^-8 (bf16 unit roundoff) each head input differs
    # by at most ~3u |h_i| (g's rounding, two final roundings). A logit z_v = sum_i W_vi h_i (exact bf16 products,
    # fp32 sums) then moves by at most 3u sum_i |W_vi||h_i| plus the two fp32 sums' error (2 n 2^-24 of the same
    # sum, n = hidden size); log p = z_target - logsumexp(z) by at most twice the largest logit change.
    u = 2.0**-8
    mag = (h.abs() @ w.abs().t()).max(-1).values  # per token: max over the vocabulary of sum_i |W_vi||h_i|
    bound = 2 * (3 * u + 2 * h.shape[1] * 2.0**-24) * mag
    diff = (la - lb).abs()
    assert bool((diff <= bound).all()), (diff - bound).max()
    assert diff.max() > 0  # the two roots did compute different hidden states (the bound was exercised)
    assert diff.mean() < 0.01  # and the mean stays far below the engine-vs-learner probe tolerance
