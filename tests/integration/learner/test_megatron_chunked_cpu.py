"""The Megatron engine's chunked log-prob head (learner/megatron/engine.py, ``learner.logprobs=chunked``)
equals its full-logits head: per-token log-probs and entropies, the loss and every parameter's gradient.

One gloo rank on CPU (fp32 everywhere), one engine, the same weights and packed batch: the head is switched
between the two paths on the built engine (``engine.chunked``), so nothing else differs. A tied and an
untied tiny Qwen2 (tied: the weight is the embedding's, handed in by GPTModel as ``output_weight``),
temperature 0.7 (so a missing or doubled temperature shows) and a chunk smaller than the response rows
of a micro-batch (so several chunks and the last, partial one are exercised).

megatron-core needs Python >= 3.12 (pyproject's ``megatron`` extra): skipped where it is not importable.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from learner_testkit import make_tiny_model, run_procs  # noqa: E402

pytestmark = pytest.mark.timeout(120)

pytest.importorskip("megatron.core", reason="needs megatron-core (pip install fleetrl[megatron], Python >= 3.12)")

TEMPERATURE = 0.7


def _rank(rank: int, world: int, port: int, kw: dict) -> None:
    from megatron_cpu import join_cpu_rank

    join_cpu_rank(rank, world, port)
    import torch
    import torch.distributed as dist
    from learner_testkit import make_batches

    from learner.batch import plan_step
    from learner.config import LearnerConfig
    from learner.losses import policy_loss
    from learner.megatron.engine import MegatronEngine

    res: dict = {}
    for name, model in kw["models"].items():
        cfg = LearnerConfig.model_validate(
            {
                "engine": "megatron",
                "loss": {"correction": "tis"},
                "micro_batch_tokens": 64,
                "temperature": TEMPERATURE,
                "logprobs": "chunked",
                "logprob_chunk": 5,
                "optim": {"lr": 1e-3},
            }
        )
        engine = MegatronEngine(cfg, model, total_steps=1, seed=0)
        assert engine.chunked  # chosen by learner.logprobs
        plan = plan_step(
            make_batches(1, seed=2)[0],
            rank=0,
            world_size=1,
            micro_batch_tokens=64,
            advantage="mean_std",
            drop_uniform=True,
            aggregation="token",
        )
        assert max(mb.targets.numel() for mb in plan.micro_batches) > cfg.logprob_chunk
        params = dict(engine.gpt.named_parameters())
        for chunked in (False, True):
            engine.chunked = chunked
            engine.model.train()
            engine.model.zero_grad_buffer()
            logp, ent, losses = [], [], []
            # Megatron's forward/backward schedule allocates on "cuda" (not runnable here): the micro-batches go
            # through engine.forward_logprobs (the same head hook and _logprobs as the schedule's forward_step;
            # that path is run on the GPU by tests/gpu/test_megatron_chunked_gpu.py) and a plain backward, DDP's
            # hooks accumulating the gradient into main_grad.
            for mb in plan.micro_batches:
                lp, en = engine.forward_logprobs(mb, grad=True)
                loss, _ = policy_loss(
                    lp, mb.behaviour_logp, mb.advantages, mb.weights, engine.loss, entropy=en, fresh=mb.fresh
                )
                loss.backward()
                logp.append(lp.detach().clone())
                ent.append(en.detach().clone())
                losses.append(loss.detach().clone())
            res[f"{name}.{chunked}"] = {
                "logp": torch.cat(logp),
                "ent": torch.cat(ent),
                "loss": torch.stack(losses).sum(),
                "grads": {n: p.main_grad.detach().clone() for n, p in params.items()},
            }
        del engine
    torch.save(res, kw["out"])
    dist.barrier()
    dist.destroy_process_group()
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()


def test_megatron_chunked_head_equals_full_logits(tmp_path):
    import torch

    models = {
        "untied": str(make_tiny_model(tmp_path / "untied", seed=1)),
        "tied": str(make_tiny_model(tmp_path / "tied", seed=2, tie=True)),
    }
    out = tmp_path / "res.pt"
    run_procs(_rank, 1, {"models": models, "out": str(out)}, 100, "spawn")
    res = torch.load(out, weights_only=False)
    for name in models:
        full, chunk = res[f"{name}.False"], res[f"{name}.True"]
        gerr = max(float((chunk["grads"][n] - g).norm() / g.norm().clamp_min(1e-12)) for n, g in full["grads"].items())
        print(
            f"{name}: {full['logp'].numel()} tokens; max |dlogp| {float((chunk['logp'] - full['logp']).abs().max()):.2e}"
            f", max |dent| {float((chunk['ent'] - full['ent']).abs().max()):.2e}, loss {float(full['loss']):.6f} vs "
            f"{float(chunk['loss']):.6f}, max grad rel err {gerr:.2e}"
        )
        # fp32 on CPU in both paths, the same fp32 head matmul: they differ only by the order of fp32 sums
        # (the chunk's logsumexp vs log_softmax over the same row; the weight gradient accumulated per chunk),
        # ~1e-7 relative. 1e-5 is far above that and far below what a wrong temperature (0.7 vs 1: log-probs
        # off by O(0.1) nats), a wrong target row or a missed padding row (O(1) relative gradient) gives.
        assert torch.allclose(chunk["logp"], full["logp"], rtol=0, atol=1e-5), name
        assert torch.allclose(chunk["ent"], full["ent"], rtol=0, atol=1e-5), name
        assert float(chunk["loss"]) == pytest.approx(float(full["loss"]), rel=1e-5, abs=1e-7), name
        for n, g in full["grads"].items():
            assert g.abs().sum() > 0 or "bias" in n, (name, n)  # the gradient reaches every weight
            err = float((chunk["grads"][n] - g).norm() / g.norm().clamp_min(1e-12))
            assert err < 1e-5, (name, n, err)
