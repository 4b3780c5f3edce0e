"""GAE, whitening, the clipped value loss and explained variance (learner/gae.py) against hand-computed numbers."""

from __future__ import annotations

import math
import multiprocessing as mp
import os

import pytest
import torch

from learner.gae import (
    explained_variance,
    gae,
    global_moments,
    moments,
    token_rewards,
    value_loss,
    whiten,
)

# The hand-computed numbers below have at most 5 significant decimals and gae() runs in float64 then
# returns float32: 1e-6 covers the float32 rounding (|x| < 2, one ulp ~ 2.4e-7) with room.
TOL = 1e-6


def test_gae_hand_computed_gamma_lam_below_one():
    # two sequences packed: 3 trained tokens (reward 1.0), 2 trained tokens (reward -0.5)
    seq_lens = torch.tensor([3, 2])
    values = torch.tensor([0.2, 0.4, 0.6, 0.1, -0.3])
    r = token_rewards(torch.tensor([1.0, -0.5]), seq_lens)
    assert r.tolist() == [0.0, 0.0, 1.0, 0.0, -0.5]
    adv, ret = gae(r, values, seq_lens, gamma=0.9, lam=0.8)
    # seq 1, backwards: d2 = 1 - .6 = .4; d1 = .9*.6 - .4 = .14, A1 = .14 + .72*.4 = .428;
    #                   d0 = .9*.4 - .2 = .16, A0 = .16 + .72*.428 = .46816
    # seq 2: d1 = -.5 + .3 = -.2; d0 = .9*(-.3) - .1 = -.37, A0 = -.37 + .72*(-.2) = -.514
    expect_adv = [0.46816, 0.428, 0.4, -0.514, -0.2]
    torch.testing.assert_close(adv, torch.tensor(expect_adv), atol=TOL, rtol=0)
    torch.testing.assert_close(ret, torch.tensor(expect_adv) + values, atol=TOL, rtol=0)


def test_kl_in_the_reward_enters_gae_per_token():
    """verl's use_kl_in_reward with adv_estimator=gae: r_t = score * [t last] - beta * kl_t, then GAE."""
    from broker.schema import Trajectory, to_record_batch
    from learner import kl_reward
    from learner.batch import plan_step

    trajs = [
        Trajectory(
            traj_id=f"p{i}/0",
            group_id=f"p{i}",
            sample_index=0,
            group_size=1,
            step=1,
            prompt_ids=[5],
            response_ids=[7] * n,
            behaviour_logprobs=[-1.0] * n,
            reward=r,
        )
        for i, (n, r) in enumerate([(3, 1.0), (2, 0.0)])
    ]
    b = to_record_batch(trajs)
    plan = plan_step(
        b, rank=0, world_size=1, micro_batch_tokens=64, advantage="gae", drop_uniform=True, aggregation="token"
    )
    (mb,) = plan.micro_batches
    assert mb.rows == [0, 1] and mb.seq_lens.tolist() == [3, 2]
    # k1 = old - ref per token: sample 0 [0.2, -0.1, 0.4], sample 1 [0.3, 0.5]
    mb.prox_logp = torch.tensor([-1.0, -1.0, -1.0, -1.0, -1.0])
    mb.ref_logp = torch.tensor([-1.2, -0.9, -1.4, -1.3, -1.5])
    ctl = kl_reward.KLController("fixed", 0.1)
    pen, m = kl_reward.gae_penalties(b, [plan], estimator="k1", controller=ctl)
    # current KL: mean of the samples' token means (0.5 / 3, 0.8 / 2) = (0.166667 + 0.4) / 2 = 0.283333
    assert m["kl_reward_kl"] == pytest.approx(0.283333, abs=1e-6) and m["kl_reward_coef"] == 0.1
    r = token_rewards(mb.rewards, mb.seq_lens, pen[id(mb)])
    # beta 0.1: sample 0 [-0.02, +0.01, 1 - 0.04]; sample 1 [-0.03, -0.05]. The log-probs are float32 (as the
    # engine's): each difference is off by at most an ulp of 1.5 (2.4e-7), times beta 0.1: 5e-8 covers it.
    assert r.tolist() == pytest.approx([-0.02, 0.01, 0.96, -0.03, -0.05], abs=5e-8)
    values = torch.tensor([0.5, 0.6, 0.7, 0.2, -0.1])
    adv, ret = gae(r, values, mb.seq_lens, gamma=0.9, lam=0.8)
    # sample 0, backwards: d2 = .96 - .7 = .26; d1 = .01 + .9*.7 - .6 = .04, A1 = .04 + .72*.26 = .2272;
    #                      d0 = -.02 + .9*.6 - .5 = .02, A0 = .02 + .72*.2272 = .183584
    # sample 1: d1 = -.05 + .1 = .05; d0 = -.03 + .9*(-.1) - .2 = -.32, A0 = -.32 + .72*.05 = -.284
    expect_adv = torch.tensor([0.183584, 0.2272, 0.26, -0.284, 0.05])
    torch.testing.assert_close(adv, expect_adv, atol=TOL, rtol=0)
    torch.testing.assert_close(ret, expect_adv + values, atol=TOL, rtol=0)
    with pytest.raises(ValueError, match="does not match the 5 trained tokens"):
        token_rewards(mb.rewards, mb.seq_lens, torch.zeros(4))
    with pytest.raises(ValueError, match="gae_penalties"):
        kl_reward.apply(b, [plan], advantage="gae", drop_uniform=True, estimator="k1", controller=ctl)


def test_gae_gamma_lam_one_gives_reward_minus_value():
    # verl's defaults: every token's return is the outcome reward, the advantage R - V_t
    seq_lens = torch.tensor([4])
    values = torch.tensor([0.1, -0.2, 0.3, 0.5])
    adv, ret = gae(token_rewards(torch.tensor([1.0]), seq_lens), values, seq_lens, 1.0, 1.0)
    torch.testing.assert_close(ret, torch.ones(4), atol=TOL, rtol=0)
    torch.testing.assert_close(adv, 1.0 - values, atol=TOL, rtol=0)


def _verl_masked_gae(rewards, values, mask, gamma, lam):
    """verl's recursion on the full response (observation tokens included, mask 0), one sequence."""
    next_v, last, out = 0.0, 0.0, []
    for t in reversed(range(len(rewards))):
        delta = rewards[t] + gamma * next_v - values[t]
        new = delta + gamma * lam * last
        next_v = values[t] * mask[t] + (1 - mask[t]) * next_v
        last = new * mask[t] + (1 - mask[t]) * last
        out.append(last)
    return out[::-1]


def test_gae_over_trained_tokens_equals_verl_masked_gae():
    # a response [a, obs, obs, b, c] whose observation tokens the loss mask drops; reward on c (the last)
    full_v = [0.2, 9.0, -7.0, 0.6, 0.5]
    mask = [1, 0, 0, 1, 1]
    full_r = [0.0, 0.0, 0.0, 0.0, 1.0]
    ref = _verl_masked_gae(full_r, full_v, mask, 0.9, 0.8)
    kept = [i for i, m in enumerate(mask) if m]
    seq_lens = torch.tensor([len(kept)])
    adv, _ = gae(
        token_rewards(torch.tensor([1.0]), seq_lens), torch.tensor([full_v[i] for i in kept]), seq_lens, 0.9, 0.8
    )
    torch.testing.assert_close(adv, torch.tensor([ref[i] for i in kept], dtype=torch.float32), atol=TOL, rtol=0)
    # by hand: d(c) = 1 - .5 = .5; d(b) = .9*.5 - .6 = -.15, A(b) = -.15 + .72*.5 = .21;
    #          d(a) = .9*.6 - .2 = .34 (the next trained token's value), A(a) = .34 + .72*.21 = .4912
    torch.testing.assert_close(adv, torch.tensor([0.4912, 0.21, 0.5]), atol=TOL, rtol=0)


def test_gae_scan_equals_the_token_by_token_recursion():
    # many packed sequences of lengths 1..300 (several scan passes), per-token rewards anywhere
    g = torch.Generator().manual_seed(1)
    seq_lens = torch.randint(1, 300, (40,), generator=g)
    seq_lens[:3] = torch.tensor([1, 2, 1])
    n = int(seq_lens.sum())
    values, rewards = torch.randn(n, generator=g), torch.randn(n, generator=g).double()
    adv, ret = gae(rewards, values, seq_lens, gamma=0.99, lam=0.95)
    ref, start = [], 0
    for L in seq_lens.tolist():
        ref += _verl_masked_gae(
            rewards[start : start + L].tolist(), values[start : start + L].double().tolist(), [1] * L, 0.99, 0.95
        )
        start += L
    ref = torch.tensor(ref, dtype=torch.float64)
    # both float64 until the final cast: the results differ by float32 rounding, 2^-24 relative (|A| < 30 here)
    torch.testing.assert_close(adv.double(), ref, rtol=2e-7, atol=1e-6)
    torch.testing.assert_close(ret.double(), ref + values.double(), rtol=2e-7, atol=1e-6)


def test_gae_rejects_bad_layout():
    with pytest.raises(ValueError, match="seq_lens sum to 3"):
        gae(torch.zeros(4), torch.zeros(4), torch.tensor([1, 2]), 1.0, 1.0)
    with pytest.raises(ValueError, match="gamma and lam"):
        gae(torch.zeros(2), torch.zeros(2), torch.tensor([2]), 1.5, 1.0)


def test_whiten_unbiased_like_verl():
    x = torch.tensor([1.0, 2.0, 3.0, 4.0])
    w = whiten(x, moments(x))
    # mean 2.5, unbiased variance 5/3
    expect = (x.double() - 2.5) / math.sqrt(5 / 3 + 1e-8)
    torch.testing.assert_close(w, expect.float(), atol=TOL, rtol=0)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        whiten(x[:1], moments(x[:1]))


def test_value_loss_clipping_by_hand():
    # old values 0, cliprange 0.5, returns 2
    old = torch.zeros(3)
    ret = torch.full((3,), 2.0)
    v = torch.tensor([1.0, -1.0, 0.3], requires_grad=True)
    w = torch.full((3,), 1 / 3)
    loss, m = value_loss(v, old, ret, w, cliprange_value=0.5)
    # token 0: (1-2)^2 = 1 vs clipped (0.5-2)^2 = 2.25 -> 0.5*2.25 = 1.125, clipped term wins (zero gradient)
    # token 1: (-1-2)^2 = 9 vs (-0.5-2)^2 = 6.25 -> 4.5, unclipped wins, gradient 0.5*2*(-1-2)/3 = -1
    # token 2: inside the range, both terms 2.89 -> 1.445, not counted as clipped
    assert float(loss.detach()) == pytest.approx((1.125 + 4.5 + 1.445) / 3, abs=TOL)
    assert float(m["vf_clipfrac"]) == pytest.approx(1 / 3, abs=TOL)
    assert float(m["vpred_mean"]) == pytest.approx(0.1, abs=TOL)
    loss.backward()
    torch.testing.assert_close(v.grad, torch.tensor([0.0, -1.0, (0.3 - 2.0) / 3]), atol=TOL, rtol=0)


def test_explained_variance_by_hand():
    ret = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert explained_variance(moments(ret), moments(ret - ret)) == pytest.approx(1.0, abs=1e-12)
    v = torch.tensor([1.0, 2.0, 3.0, 3.0])
    # residuals [0, 0, 0, 1]: unbiased variance 0.25; returns' 5/3
    assert explained_variance(moments(ret), moments(ret - v)) == pytest.approx(1 - 0.25 / (5 / 3 + 1e-5), abs=1e-12)
    # values that ignore the state (all 0): the residual is the return, nothing explained
    assert explained_variance(moments(ret), moments(ret)) == pytest.approx(0.0, abs=1e-5)


def _rank(rank: int, port: int, x: torch.Tensor, q) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    mine = x[:5] if rank == 0 else x[5:]
    # two micro-batches on rank 0, one on rank 1: the parts are summed before the one all-reduce
    parts = [moments(mine[:2]), moments(mine[2:])] if rank == 0 else [moments(mine)]
    q.put((rank, whiten(mine, global_moments(parts)).tolist()))
    dist.destroy_process_group()


def test_whitening_across_two_gloo_ranks_equals_one_rank():
    from core.http_client import free_port

    x = torch.randn(13, generator=torch.Generator().manual_seed(0)) * 3 + 1
    one = whiten(x, moments(x))
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, x, q), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(30)
    two = torch.tensor(got[0] + got[1])
    # The moments are float64 sums in a different order (per rank, then across): they differ by a few
    # float64 ulps (relative ~1e-15 for 13 terms). Whitening then rounds to float32, so the two results
    # can differ by at most one float32 ulp of |w| (< 2^-23 * 4 ~ 5e-7 for |w| < 4): atol 1e-6.
    torch.testing.assert_close(two, one, atol=1e-6, rtol=0)


# ---- config: advantage=gae, learner.critic, n=1 ----------------------------------------------------------


def test_ppo_recipe_allows_one_sample_per_prompt_grpo_does_not():
    from core.configbase import ConfigError
    from launch.config import load_run_config

    cfg = load_run_config("ppo", ["rollout.sampling.n=1", "broker.groups_per_step=128"])
    # the ranks read the config back from the launcher's full dump
    assert type(cfg).model_validate(cfg.model_dump(mode="json")) == cfg
    assert cfg.learner.loss.advantage == "gae" and cfg.learner.critic is not None and cfg.rollout.sampling.n == 1
    assert load_run_config("ppo", []).rollout.sampling.n == 4
    with pytest.raises(ConfigError, match="rollout.sampling.n=1: GRPO scores each sample"):
        load_run_config("tiny", ["rollout.sampling.n=1"])


def test_critic_defaults_are_verls():
    from learner.config import LearnerConfig

    c = LearnerConfig.model_validate(
        {"loss": {"correction": "decoupled", "advantage": "gae"}, "critic": {"optim": {"lr": 2e-5}}}
    ).critic
    assert (c.optim.lr, c.optim.weight_decay, c.cliprange_value, c.grad_clip) == (2e-5, 0.01, 0.5, 1.0)


@pytest.mark.parametrize(
    "learner, match",
    [
        ({"loss": {"correction": "decoupled", "advantage": "gae"}}, "advantage=gae needs a value model"),
        ({"loss": {"correction": "decoupled"}, "critic": {}}, "never uses its values"),
        (
            {
                "engine": "megatron",
                "loss": {"correction": "decoupled", "advantage": "gae"},
                "critic": {},
                "megatron": {"pipeline_model_parallel_size": 2},
            },
            "Megatron critic .* has no pipeline stages",
        ),
        (
            {
                "engine": "megatron",
                "loss": {"correction": "decoupled", "advantage": "gae"},
                "critic": {"param_offload": True},
            },
            "critic.param_offload / optimizer_offload are FSDP's",
        ),
        (
            {"loss": {"correction": "decoupled", "advantage": "gae"}, "critic": {"micro_batch_tokens": 512}},
            "critic.micro_batch_tokens=512 differs",
        ),
        (
            {"loss": {"correction": "decoupled", "advantage": "gae"}, "critic": {"optim": {"grad_clip": 2.0}}},
            "learner.critic.grad_clip",
        ),
        ({"loss": {"correction": "decoupled", "advantage": "gae", "lam": 1.5}, "critic": {}}, "lam"),
        (
            {"loss": {"correction": "decoupled", "advantage": "gae"}, "critic": {}, "sequence_parallel_size": 2},
            "sequence_parallel_size=1 for PPO",
        ),
    ],
)
def test_critic_config_refusals_name_the_problem(learner, match):
    from pydantic import ValidationError

    from learner.config import LearnerConfig

    with pytest.raises(ValidationError, match=match):
        LearnerConfig.model_validate(learner)


def test_live_view_shows_the_critic():
    import json as _json

    from rich.console import Console

    from launch.monitor import Monitor
    from launch.snapshot import FleetStatus, JobSnapshot
    from learner.status import LearnerStatus

    def view(learner: LearnerStatus) -> str:
        snap = JobSnapshot(
            fleet=FleetStatus(), learner=learner, max_steps=3, max_staleness=2, simulated=False, wall_s=1.0
        )
        snap = JobSnapshot.from_wire(_json.loads(_json.dumps(snap.to_wire())))  # as it crosses from the rank
        console = Console(record=True, width=200)
        console.print(Monitor.render(type("M", (), {"simulated": False})(), snap))
        return console.export_text()

    text = view(LearnerStatus(critic_vf_loss=0.0123, critic_explained_var=0.456))
    assert "vf_loss 0.0123, explained variance 0.456" in text
    assert "critic" not in view(LearnerStatus())  # GRPO runs: no critic row
