"""The Megatron critic (learner/megatron/critic.py) against the FSDP critic's model, on CPU: for the same
checkpoint and the same head weights, its values and its value-loss gradients (every parameter) equal those
of transformers' ``AutoModelForTokenClassification`` (what learner/critic.py trains), run one sequence at a
time, so packing, the value head's placement and its fp32 cast are all checked against an independent model.
A tied (SmolLM2-like) and an untied tiny Qwen2 on one gloo rank, and the untied one with tensor parallelism 2
(2 gloo ranks, the gradients' shards joined as the weight export joins them) with and without sequence
parallelism; GAE from ``Critic.prepare``.

What CPU cannot carry: megatron-core's optimizer and its forward/backward schedule allocate on ``cuda``, so
the optimizer step and the checkpoint/resume of actor + critic run on the GPU machine
(tests/gpu/test_megatron_critic_gpu.py); here the micro-batches go through ``MegatronCritic.values`` and
``loss_of`` (what the schedule's forward step calls) with a plain backward, DDP's hooks filling main_grad.

megatron-core needs Python >= 3.12 by its metadata (pyproject's ``megatron`` extra); skipped where it is not
importable. It also runs on this repository's Python 3.11 with the 0.19.2 wheel and triton unpacked on
``PYTHONPATH`` (both import and run here; see docs/critic.md).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from learner_testkit import make_tiny_model, run_procs  # noqa: E402

pytestmark = pytest.mark.timeout(180)

pytest.importorskip("megatron.core", reason="needs megatron-core (pip install fleetrl[megatron], Python >= 3.12)")


def _rank(rank: int, world: int, port: int, kw: dict) -> None:
    from megatron_cpu import join_cpu_rank

    join_cpu_rank(rank, world, port)
    import torch
    import torch.distributed as dist
    from learner_testkit import make_batches

    from learner.batch import plan_step
    from learner.config import LearnerConfig
    from learner.critic import load_value_model
    from learner.gae import value_loss
    from learner.megatron import convert as cv
    from learner.megatron.critic import MegatronCritic
    from learner.megatron.engine import MegatronEngine

    res: dict = {}
    for name, model in kw["models"].items():
        cfg = LearnerConfig.model_validate(
            {
                "engine": "megatron",
                "loss": {"correction": "decoupled", "advantage": "gae", "gamma": 0.9, "lam": 0.95},
                "critic": {"cliprange_value": 0.05},
                "micro_batch_tokens": 64,
                "megatron": {"tensor_model_parallel_size": world, "sequence_parallel": kw["sp"]},
            }
        )
        engine = MegatronEngine(cfg, model, total_steps=1, seed=0)
        critic = MegatronCritic(cfg, model, total_steps=1, seed=0, engine=engine)
        ref = load_value_model(model, "eager")
        with torch.no_grad():  # the same fresh head in both
            ref.score.weight.copy_(critic.gpt.value_head.weight)
            ref.score.bias.copy_(critic.gpt.value_head.bias)
        plan = plan_step(
            make_batches(1, seed=3)[0],
            rank=engine.data_rank,
            world_size=engine.data_world_size,
            micro_batch_tokens=64,
            advantage="gae",
            drop_uniform=True,
            aggregation="token",
        )
        assert len(plan.micro_batches) > 1 and max(len(mb.seq_lens) for mb in plan.micro_batches) > 1

        def ref_values(mb, ref=ref):
            """Each packed sequence on its own through the HF critic; values at the micro-batch's targets."""
            pos = mb.position_ids[0]
            starts = (pos == 0).nonzero().flatten().tolist() + [pos.numel()]
            out = torch.empty(mb.target_index.numel())
            pieces = []
            for s, e in zip(starts[:-1], starts[1:], strict=True):
                v = ref(input_ids=mb.input_ids[:, s:e], use_cache=False).logits[0, :, 0]
                pieces.append((s, e, v))
            vals = []
            for t in mb.target_index.tolist():
                s, e, v = next(p for p in pieces if p[0] <= t < p[1])
                vals.append(v[t - s])
            return torch.stack(vals) if vals else out

        meg_v = [critic.values(mb).detach().clone() for mb in plan.micro_batches]
        # the model half of the critic's checkpoint (the optimizer half needs CUDA): every parameter, the value
        # head included, and no entry for the vocabulary head the critic dropped (GPTModel's own method
        # raised KeyError 'output_layer.weight' on the GPU machine before model_sharded_state_dict)
        sd = critic.model_sharded_state_dict()
        assert {n for n, _ in critic.gpt.named_parameters()} <= set(sd), sorted(sd)
        assert "value_head.weight" in sd and not any(k.startswith("output_layer") for k in sd), sorted(sd)
        with torch.no_grad():
            ref_v = [ref_values(mb) for mb in plan.micro_batches]
        prep = critic.prepare([plan], cfg.loss.gamma, cfg.loss.lam)
        # the values prepare() used are the critic's own
        assert all(torch.equal(mb.values, v) for mb, v in zip(plan.micro_batches, meg_v, strict=True))
        # one optimizer step's gradient: Megatron critic (main_grad) and the HF critic (.grad), same loss
        critic.model.train()
        critic.model.zero_grad_buffer()
        ref.train()
        ref.zero_grad()
        meg_loss = ref_loss = 0.0
        for mb in plan.micro_batches:
            loss, m = critic.loss_of(critic.values(mb, grad=True), mb, plan)
            loss.backward()
            meg_loss += float(loss.detach())
            rl, _ = value_loss(
                ref_values(mb), mb.values, mb.returns, critic._weights(mb, plan), cfg.critic.cliprange_value
            )
            rl.backward()
            ref_loss += float(rl.detach())
        if kw["sp"]:  # what the schedule's finalize_model_grads does: the norms' partial gradients summed over TP
            for p in critic.gpt.parameters():
                if getattr(p, "sequence_parallel", False):
                    dist.all_reduce(p.main_grad)
        # every rank's shards, joined over TP as the HF export joins weights (learner/megatron/convert.py)
        shards = {n: p.main_grad.view_as(p).detach().clone() for n, p in critic.gpt.named_parameters()}
        gathered = [None] * world
        dist.all_gather_object(gathered, shards)
        ref_grads = {n: p.grad for n, p in ref.named_parameters()}
        pairs = []
        for n in shards:
            parts = [g[n] for g in gathered]
            hf = (
                [(n.replace("value_head", "score"), parts[0])]
                if n.startswith("value_head")
                else cv.to_hf(n, parts, critic.shape)
            )
            pairs += [(h, t, ref_grads[h]) for h, t in hf]
        assert {h for h, _, _ in pairs} == set(ref_grads)  # every parameter of the HF critic compared
        res[name] = {
            "meg_v": torch.cat(meg_v),
            "ref_v": torch.cat(ref_v),
            "meg_loss": meg_loss,
            "ref_loss": ref_loss,
            "ev": prep.get("critic/vf_explained_var"),
            "grads": {h: (a.detach().clone(), b.detach().clone()) for h, a, b in pairs},
        }
        del critic, engine
    torch.save(res, kw["out"] + f".rank{rank}")
    dist.barrier()
    dist.destroy_process_group()
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()


@pytest.mark.parametrize("tp, sp", [(1, False), (2, False), (2, True)], ids=["tp1", "tp2", "tp2_sp"])
def test_megatron_critic_equals_the_hf_value_model(tmp_path, tp, sp):
    import torch

    models = {"untied": str(make_tiny_model(tmp_path / "untied", seed=1))}
    if tp == 1:
        models["tied"] = str(make_tiny_model(tmp_path / "tied", seed=2, tie=True))
    out = tmp_path / "res.pt"
    run_procs(_rank, tp, {"models": models, "out": str(out), "sp": sp}, 150, "spawn")
    ranks = [torch.load(f"{out}.rank{r}", weights_only=False) for r in range(tp)]
    for name in models:
        r = ranks[0][name]
        for other in ranks[1:]:  # the head is replicated: every TP rank computes the same values
            assert torch.equal(other[name]["meg_v"], r["meg_v"]), name
        verr = float((r["meg_v"] - r["ref_v"]).abs().max())
        gerr = {h: float((a - b).norm() / b.norm().clamp_min(1e-12)) for h, (a, b) in r["grads"].items()}
        print(
            f"{name}: {r['meg_v'].numel()} values, max |dv| {verr:.2e}, loss {r['meg_loss']:.6f} vs "
            f"{r['ref_loss']:.6f}, max grad rel err {max(gerr.values()):.2e}"
        )
        # fp32 on CPU in both, different attention kernels (Megatron's masked unfused attention over the packed
        # row, transformers' eager attention per sequence) and sum orders: ~1e-7 relative per op, a few 1e-6 after
        # two layers. 1e-5 absolute on values of order 0.1-1 (and 1e-4 relative on gradients) sits well above
        # that and far below a shifted position, a missing bias or a bf16 head (O(1e-2) or worse).
        assert verr < 1e-5, (name, verr)
        assert r["meg_loss"] == pytest.approx(r["ref_loss"], rel=1e-5), name
        for h, (_, b) in r["grads"].items():
            assert b.abs().sum() > 0 or h.endswith("bias"), (name, h)  # the gradient reaches every weight
            assert gerr[h] < 1e-4, (name, h, gerr[h])
