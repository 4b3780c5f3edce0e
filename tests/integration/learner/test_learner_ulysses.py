"""Ulysses sequence parallelism (learner/ulysses.py) over gloo in real processes: SP=2 on 2 ranks and SP=2 x
DP=2 on 4 ranks give the loss, the metrics and the gradients of SP=1 on one rank, for one step batch whose
packed rows are cut unevenly by the slice boundary and hold a one-token sequence (shorter than the SP degree),
with a KL reference model that differs from the policy (its log-probs are computed under SP too) and the
decoupled correction's proximal pass (also under SP); SP=2 x DP=2 with activation checkpointing; and SP=4 on 4 ranks, where the tiny model's 2 key/value
heads are repeated before the exchange.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from learner_testkit import make_tiny_model, run_procs

# fp32 on CPU. SP changes only the order of float sums, never the function: the all-to-alls move values
# without arithmetic; attention runs per head on the same [T, T] block-causal mask (one call over
# heads/sp heads instead of all heads, the row padded by at most sp - 1 masked-off tokens); every other op
# is position-wise; the per-rank gradients are summed by FSDP's reduce-scatter in another order. Each
# reordered sum of K fp32 terms moves a result by at most ~K * 2^-24 of the summed magnitudes; with K at
# most a few hundred here (hidden 64, rows < 64 tokens, 4 ranks) that is ~1e-5 relative, so 1e-4 of a
# tensor's largest entry bounds the gradient difference with margin, while a wrong scaling (a factor 2),
# a token counted twice or lost, or heads/positions exchanged in the wrong order move it by O(1).
GRAD_RTOL = 1e-4
LOSS_RTOL = 1e-5
KEYS = ("loss_total", "loss_policy", "loss_kl", "entropy", "ratio_mean", "clip_frac", "mismatch_kl_k3")


def _step_batch():
    """3 groups of 2: input lengths (prompt + response - 1) 8, 10, 1, 8, 6, 12 tokens."""
    from broker.schema import Trajectory, to_record_batch

    shape = [
        ((5, 6, 7), (4, 9, 3, 8, 5, 6)),
        ((5, 6, 7), (9, 9, 4, 3, 7, 5, 8, 6)),
        ((11,), (12,)),
        ((13, 14, 15, 16), (20, 21, 22, 23, 24)),
        ((30, 31), (32, 33, 34, 35, 36)),
        ((30, 31), (40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50)),
    ]
    trajs = []
    for i, (prompt, resp) in enumerate(shape):
        g = i // 2
        trajs.append(
            Trajectory(
                traj_id=f"g{g}/{i % 2}",
                group_id=f"g{g}",
                sample_index=i % 2,
                group_size=2,
                step=1,
                prompt_ids=list(prompt),
                response_ids=list(resp),
                behaviour_logprobs=[-4.5 + 0.05 * ((7 * i + j) % 5) for j in range(len(resp))],
                segment_starts=[0],
                segment_versions=[0],
                reward=float(i % 2) + 0.1 * g,
                finish_reason="stop",
                engine_id="test",
                data_source="synthetic",
            )
        )
    return to_record_batch(trajs)


def _rank(rank: int, world_size: int, port: int, kw: dict) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        OMP_NUM_THREADS="1",
    )
    from learner.batch import plan_step
    from learner.config import LearnerConfig
    from learner.fsdp import FSDPEngine
    from learner.run import init_distributed

    init_distributed("gloo", timeout_s=120)
    cfg = LearnerConfig.model_validate(
        {
            "loss": {"correction": "decoupled", "kl_coef": 0.5, "kl_estimator": "k2"},
            # no clipping (the gradient is compared as computed), one micro-batch budget that packs a replica's
            # sequences into two rows
            "optim": {"lr": 1e-3, "grad_clip": 1e6},
            "micro_batch_tokens": 24,
            "sequence_parallel_size": kw["sp"],
            "logprob_probe_tolerance": None,
            # recomputing a layer in backward repeats its two exchanges on every rank alike
            "activation_checkpointing": kw["ac"],
        }
    )
    engine = FSDPEngine(cfg, kw["model"], total_steps=1, seed=0)
    with torch.no_grad():  # elementwise, so the same on every sharding: a sharper reference head, KL well above 0
        for name, p in engine.ref_model.named_parameters():
            p.to_local().mul_(4.0 if name.startswith("lm_head") else 0.9)
    grads: dict[str, torch.Tensor] = {}

    def keep_grads(opt, args, kwargs):  # collective (full_tensor) on every rank, before the update
        for name, p in engine.model.named_parameters():
            grads[name] = p.grad.full_tensor().clone()

    engine.optimizer.register_step_pre_hook(keep_grads)
    plan = plan_step(
        _step_batch(),
        rank=engine.data_rank,
        world_size=engine.data_world_size,
        micro_batch_tokens=cfg.micro_batch_tokens,
        advantage="mean",
        drop_uniform=True,
        aggregation="token",
    )
    lens = [mb.n_tokens for mb in plan.micro_batches]
    engine.prepare_logprobs(plan)
    metrics = engine.train_step(plan)
    if rank == 0:
        torch.save(grads, f"{kw['out']}.grads")
    Path(f"{kw['out']}.rank{rank}").write_text(
        json.dumps({"metrics": metrics, "row_tokens": lens, "local_tokens": [mb.n_tokens for mb in plan.micro_batches]})
    )
    torch.distributed.destroy_process_group()


def _run(world: int, sp: int, d: Path, name: str, model: Path, ac: bool = False) -> dict:
    out = str(d / name)
    run_procs(_rank, world, {"sp": sp, "model": str(model), "out": out, "ac": ac}, 180.0, "fork")
    ranks = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(world)]
    return {"ranks": ranks, "grads": torch.load(f"{out}.grads")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    torch.set_num_threads(1)
    d = tmp_path_factory.mktemp("ulysses")
    model = make_tiny_model(d / "model")  # 4 attention heads, 2 key/value heads
    return {
        "model": model,
        "sp1": _run(1, 1, d, "sp1", model),
        "sp2": _run(2, 2, d, "sp2", model),
        "sp2dp2": _run(4, 2, d, "sp2dp2", model, ac=True),
    }


def _compare(ref: dict, got: dict) -> None:
    m_ref, m_got = ref["ranks"][0]["metrics"], got["ranks"][0]["metrics"]
    assert m_ref["loss_kl"] > 1e-3, "the reference model must differ from the policy for the KL check to mean much"
    for k in KEYS:
        assert m_got[k] == pytest.approx(m_ref[k], rel=LOSS_RTOL, abs=1e-7), k
    assert m_got["grad_norm"] == pytest.approx(m_ref["grad_norm"], rel=GRAD_RTOL)
    assert ref["grads"].keys() == got["grads"].keys()
    for name, g in ref["grads"].items():
        diff = float((got["grads"][name] - g).abs().max())
        assert diff <= GRAD_RTOL * float(g.abs().max()) + 1e-9, (name, diff, float(g.abs().max()))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sp2_matches_sp1(runs):
    sp2 = runs["sp2"]
    # both SP ranks ran the same rows (one replica), each on half of the padded row
    rows = sp2["ranks"][0]["row_tokens"]
    assert rows == runs["sp1"]["ranks"][0]["row_tokens"]
    assert any(n % 2 for n in rows), "a row of odd length exercises the padding"
    for r in sp2["ranks"]:
        assert r["local_tokens"] == [(n + 1) // 2 for n in rows]
    _compare(runs["sp1"], sp2)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sp2_dp2_matches_sp1(runs):
    ranks = runs["sp2dp2"]["ranks"]
    assert ranks[0]["row_tokens"] == ranks[1]["row_tokens"] and ranks[2]["row_tokens"] == ranks[3]["row_tokens"]
    assert ranks[0]["row_tokens"] != ranks[2]["row_tokens"], "the two replicas train different sequences"
    _compare(runs["sp1"], runs["sp2dp2"])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sp4_with_repeated_kv_heads_matches_sp1(runs, tmp_path):
    """SP=4 over the tiny model's 2 key/value heads: each is repeated twice before the exchange."""
    sp4 = _run(4, 4, tmp_path, "sp4", runs["model"])
    rows = runs["sp1"]["ranks"][0]["row_tokens"]
    for r in sp4["ranks"]:
        assert r["local_tokens"] == [(n + 3) // 4 for n in rows]
    _compare(runs["sp1"], sp4)
