"""KL in the reward with GAE (verl's use_kl_in_reward with adv_estimator=gae) on 2 real FSDP CPU ranks:
the token rewards the critic's GAE reads are ``score * [t last] - beta * kl_t`` with ``kl_t`` from the
actor's pre-step log-probs and the frozen reference's.

The learner runs as shipped (learner/loop.py) for 3 steps; ``Critic.prepare`` is wrapped only to keep the
step's micro-batches, and after each step every micro-batch's returns are checked against a plain
token-by-token GAE recursion on those rewards, written here independently of learner/gae.py. Step 1's
policy equals the reference (KL 0); the later steps have moved the actor, so the penalty is non-zero.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from learner_testkit import join_gloo, make_batches, make_tiny_model, run_procs, write_batches

STEPS = 3
BETA = 0.5
GAMMA, LAM = 0.95, 0.9
pytestmark = pytest.mark.timeout(240)


def _reference_returns(mb, beta: float) -> list[float]:
    """GAE returns of one micro-batch, token by token in float64, from its rewards, log-probs and values."""
    kl = (mb.prox_logp.double() - mb.ref_logp.double()).tolist()  # k1
    values = mb.values.double().tolist()
    out, start = [], 0
    for n, score in zip(mb.seq_lens.tolist(), mb.rewards.double().tolist(), strict=True):
        adv, ret = 0.0, [0.0] * n
        for t in reversed(range(n)):
            r = -beta * kl[start + t] + (score if t == n - 1 else 0.0)
            next_v = values[start + t + 1] if t + 1 < n else 0.0
            adv = r + GAMMA * next_v - values[start + t] + GAMMA * LAM * adv
            ret[t] = adv + values[start + t]
        out += ret
        start += n
    return out


def _rank(rank: int, world_size: int, port: int, kw: dict) -> None:
    import pyarrow as pa

    from learner.config import LearnerConfig
    from learner.critic import Critic
    from learner.fsdp import FSDPEngine
    from learner.loop import Learner
    from learner.source import InProcessSource

    join_gloo(rank, world_size, port)
    cfg = LearnerConfig.model_validate(
        {
            "loss": {"correction": "decoupled", "advantage": "gae", "gamma": GAMMA, "lam": LAM},
            "critic": {"optim": {"lr": 1e-3}},
            "kl_reward": {"enable": True, "coef": BETA, "estimator": "k1", "type": "fixed"},
            "micro_batch_tokens": 48,
            "optim": {"lr": 1e-2, "warmup_steps": 0},
            "logprob_probe_tolerance": None,
        }
    )
    engine = FSDPEngine(cfg, kw["model"], total_steps=STEPS, seed=0)
    critic = Critic(cfg, kw["model"], total_steps=STEPS, seed=0, engine=engine)
    kept: list = []
    prepare = critic.prepare

    def keep(plans, gamma, lam, penalties=None):
        kept[:] = [(mb, penalties is not None) for p in plans for mb in p.micro_batches if mb.rows]
        return prepare(plans, gamma, lam, penalties)

    critic.prepare = keep
    source = None
    if rank == 0:
        with pa.ipc.open_file(kw["data"]) as f:
            source = InProcessSource([f.get_batch(i) for i in range(f.num_record_batches)])
    learner = Learner(engine, cfg, source=source, max_steps=STEPS, publish=lambda v, e: None, critic=critic)
    steps = []
    for _ in range(STEPS):
        m = learner.step()
        worst, kl_max, n_tok = 0.0, 0.0, 0
        for mb, had_penalties in kept:
            assert had_penalties
            want = torch.tensor(_reference_returns(mb, BETA))
            worst = max(worst, float((mb.returns.double().cpu() - want).abs().max()))
            kl_max = max(kl_max, float((mb.prox_logp - mb.ref_logp).abs().max()))
            n_tok += mb.returns.shape[0]
        steps.append(
            {
                "worst": worst,
                "kl_max": kl_max,
                "tokens": n_tok,
                "kl": m["learner/batch_kl_reward_kl"],
                "coef": m["learner/batch_kl_reward_coef"],
                "ev": m["critic/vf_explained_var"],
            }
        )
    Path(kw["out"], f"rank{rank}.json").write_text(json.dumps(steps))
    torch.distributed.destroy_process_group()


def test_kl_penalty_enters_the_critics_gae(tmp_path):
    model = make_tiny_model(tmp_path / "model")
    data = write_batches(tmp_path / "data.arrow", make_batches(STEPS, groups=4, group_size=2))
    run_procs(_rank, 2, dict(model=str(model), data=str(data), out=str(tmp_path)), timeout=200, start_method="fork")
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for steps in ranks:
        assert all(s["tokens"] > 0 for s in steps)
        # the learner's returns (float64 GAE rounded to float32) against float64 here: |G| < ~10 on this data,
        # so float32 rounding is below 1e-6; a missing penalty would be off by beta * kl (the check below)
        assert all(s["worst"] < 1e-5 for s in steps), steps
        assert steps[0]["kl"] == 0.0 and steps[0]["kl_max"] == 0.0  # the policy still is the reference
        assert all(s["kl"] != 0.0 and BETA * s["kl_max"] > 1e-3 for s in steps[1:]), steps
        assert all(s["coef"] == BETA for s in steps)
    # the batch KL is all-reduced: every rank reports the same
    assert [s["kl"] for s in ranks[0]] == [s["kl"] for s in ranks[1]]
