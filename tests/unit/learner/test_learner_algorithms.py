"""verl's algorithm families in the learner: advantage estimators, loss aggregation modes, policy losses
(gspo, geo_mean) and the entropy bonus, each against numbers worked out by hand in the comments."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from broker.schema import Trajectory, to_record_batch
from learner.advantages import sequence_advantages
from learner.batch import plan_step
from learner.config import LossConfig
from learner.logprobs import chunked_logprobs
from learner.losses import LossSettings, aggregation_scale, aggregation_weights, policy_loss

# Hand-computed values are rounded to 6 decimals in the comments; float32 arithmetic on numbers of order 1
# agrees with them to ~1e-6, so 1e-5 tolerates both without letting a wrong formula through.
TOL = 1e-5


def adv(rewards, groups, mode, drop_uniform=False, lengths=None):
    a, keep = sequence_advantages(
        torch.tensor(rewards, dtype=torch.float32),
        torch.tensor(groups),
        mode,
        drop_uniform,
        lengths=None if lengths is None else torch.tensor(lengths),
    )
    return a.tolist(), keep.tolist()


# ---- advantage estimators ----------------------------------------------------------------------------------


def test_rloo_is_reward_minus_the_others_mean():
    # group 0 = [1, 0, 0]: leave-one-out baselines 0, 0.5, 0.5 -> A = 1, -0.5, -0.5
    # group 1 = [2, 0]: baselines 0, 2 -> A = 2, -2; group 2 = [1, 1] uniform -> 0, dropped
    a, keep = adv([1, 0, 0, 2, 0, 1, 1], [0, 0, 0, 1, 1, 2, 2], "rloo", drop_uniform=True)
    assert a == pytest.approx([1.0, -0.5, -0.5, 2.0, -2.0, 0.0, 0.0], abs=TOL)
    assert keep == [True] * 5 + [False] * 2


def test_gpg_scales_by_rows_over_nonzero_rewards():
    # 7 rows, 4 non-zero rewards: alpha = 7/4. group 0 mean 1/3: A = 7/4 * (2/3, -1/3, -1/3) = 7/6, -7/12, -7/12
    # group 1 mean 1: A = 7/4 * (1, -1); group 2 uniform: 0
    a, _ = adv([1, 0, 0, 2, 0, 1, 1], [0, 0, 0, 1, 1, 2, 2], "gpg")
    assert a == pytest.approx([7 / 6, -7 / 12, -7 / 12, 7 / 4, -7 / 4, 0.0, 0.0], abs=TOL)


def test_reinforce_plus_plus_whitens_over_tokens_and_keeps_uniform_groups():
    # rewards [1, 0] with 3 and 1 trained tokens: token values [1, 1, 1, 0], mean 0.75,
    # unbiased variance (3 * 0.0625 + 0.5625) / 3 = 0.25, std 0.5 -> A = 0.25 / 0.5 = 0.5 and -0.75 / 0.5 = -1.5.
    # The uniform group [1, 1] (2 tokens each) is part of it too: no baseline, so it is never dropped.
    a, keep = adv([1, 0], [0, 0], "reinforce_plus_plus", drop_uniform=True, lengths=[3, 1])
    assert a == pytest.approx([0.5, -1.5], abs=TOL)
    assert keep == [True, True]
    a, keep = adv([1, 0, 1, 1], [0, 0, 1, 1], "reinforce_plus_plus", drop_uniform=True, lengths=[3, 1, 2, 2])
    # tokens: seven 1s and one 0: mean 7/8, var = (7 * (1/8)^2 + (7/8)^2) / 7 = (7/64 + 49/64) / 7 = 1/8
    s = math.sqrt(1 / 8)
    assert a == pytest.approx([(1 / 8) / s, (-7 / 8) / s, (1 / 8) / s, (1 / 8) / s], abs=TOL)
    assert all(keep)
    with pytest.raises(ValueError, match="lengths"):
        adv([1, 0], [0, 0], "reinforce_plus_plus")


def test_reinforce_plus_plus_baseline_centres_per_group_then_whitens():
    # group 0 = [1, 0] (3 and 1 tokens): centred 0.5, -0.5; group 1 = [1, 1] (2 and 2 tokens): centred 0, 0.
    # Dropping the uniform group: whiten over group 0's tokens [.5, .5, .5, -.5]: mean 0.25, var 0.25, std 0.5
    # -> A = 0.5, -1.5.
    a, keep = adv([1, 0, 1, 1], [0, 0, 1, 1], "reinforce_plus_plus_baseline", drop_uniform=True, lengths=[3, 1, 2, 2])
    assert a[:2] == pytest.approx([0.5, -1.5], abs=TOL)
    assert keep == [True, True, False, False]
    # Keeping it (verl without a filter): tokens [.5 x3, -.5, 0 x4]: mean 1/8; squared deviations
    # 3 * 0.140625 + 0.390625 + 4 * 0.015625 = 0.875, var 0.875 / 7 = 0.125, std 0.353553
    # -> A = 0.375 / 0.353553 = 1.060660, -0.625 / 0.353553 = -1.767767, -0.125 / 0.353553 = -0.353553
    a, keep = adv([1, 0, 1, 1], [0, 0, 1, 1], "reinforce_plus_plus_baseline", drop_uniform=False, lengths=[3, 1, 2, 2])
    assert a == pytest.approx([1.060660, -1.767767, -0.353553, -0.353553], abs=TOL)
    assert all(keep)


def test_grpo_modes_unchanged_and_unknown_mode_named():
    # group [1, 0, 0]: mean 1/3, Bessel std sqrt(1/3) = 0.577350 -> (2/3) / 0.577350 = 1.154701
    a, _ = adv([1, 0, 0], [0, 0, 0], "mean_std")
    assert a == pytest.approx([1.154700, -0.577350, -0.577350], abs=TOL)
    a, _ = adv([1, 0, 0], [0, 0, 0], "mean")
    assert a == pytest.approx([2 / 3, -1 / 3, -1 / 3], abs=TOL)
    with pytest.raises(ValueError, match="rloo"):
        adv([1, 0], [0, 0], "vtrace")


def test_config_refuses_gae_naming_the_critic_and_needs_a_norm_length():
    from learner.config import LearnerConfig

    with pytest.raises(ValueError, match="critic"):
        LearnerConfig.model_validate({"loss": {"correction": "none", "advantage": "gae"}})
    # KL in the reward with GAE is legal: the penalty enters the token rewards (tests/unit/learner/test_learner_gae.py)
    assert LearnerConfig.model_validate(
        {"loss": {"correction": "none", "advantage": "gae"}, "critic": {}, "kl_reward": {"enable": True}}
    ).kl_reward.enable
    with pytest.raises(ValueError, match="loss_scale_factor"):
        LossConfig(correction="none", aggregation="seq_mean_token_sum_norm")
    cfg = LossConfig(correction="none", aggregation="token_sum", policy_loss="gspo")
    assert cfg.effective_aggregation == "sequence"  # gspo is a sequence-level objective, as in verl


def test_run_config_fills_the_norm_length_from_max_tokens():
    from launch.config import RunConfig

    base = {
        "model": {"path": "models/tiny-adder"},
        "data": {"train_files": ["x.parquet"]},
        "run": {"eval_samples": 0},
        "rollout": {"engine": "simulated", "sampling": {"max_tokens": 48}},
    }
    cfg = RunConfig.model_validate(
        {
            **base,
            "learner": {"loss": {"correction": "none", "aggregation": "seq_mean_token_sum_norm"}},
            "broker": {"max_staleness": 0},
        }
    )
    assert cfg.learner.loss.loss_scale_factor == 48
    with pytest.raises(ValueError, match="entropy_coeff"):
        RunConfig.model_validate(
            {
                **base,
                "broker": {"max_staleness": 0},
                "learner": {"engine": "megatron", "loss": {"correction": "none", "entropy_coeff": 0.01}},
            }
        )


# ---- aggregation ---------------------------------------------------------------------------------------------


def _agg(losses, lens, mode, factor=None, split=None):
    """sum over micro-batches of loss_scale * sum(weights * token losses); ``split``: sequences per micro-batch."""
    split = split or [len(lens)]
    total_t, total_s = sum(lens), len(lens)
    scale = aggregation_scale(mode, total_t, total_s, factor)
    out, i = 0.0, 0
    for k in split:
        part = lens[i : i + k]
        tok = torch.tensor([x for seq in losses[i : i + k] for x in seq])
        w = aggregation_weights(torch.tensor(part), mode, total_t, total_s)
        out += scale * float((w * tok).sum())
        i += k
    return out


@pytest.mark.parametrize("split", [None, [2, 1], [1, 1, 1]])
def test_aggregation_modes_by_hand_whatever_the_split(split):
    # sequences a = [1, 3], b = [2], c = [4, 4, 4]: T = 6 tokens, S = 3 sequences, token sum 18
    losses, lens = [[1, 3], [2], [4, 4, 4]], [2, 1, 3]
    assert _agg(losses, lens, "token", split=split) == pytest.approx(18 / 6)  # token-mean 3
    assert _agg(losses, lens, "sequence", split=split) == pytest.approx((2 + 2 + 4) / 3)  # mean of means 8/3
    assert _agg(losses, lens, "token_sum", split=split) == pytest.approx(18)
    assert _agg(losses, lens, "seq_mean_token_sum", split=split) == pytest.approx((4 + 2 + 12) / 3)  # 6
    assert _agg(losses, lens, "seq_mean_token_sum_norm", 4, split=split) == pytest.approx(6 / 4)  # Dr. GRPO, L = 4
    with pytest.raises(ValueError, match="loss_scale_factor"):
        aggregation_scale("seq_mean_token_sum_norm", 6, 3, None)


def _verl_style(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str, factor: int | None) -> float:
    """verl's agg_loss semantics on the whole (padded) optimizer step, written from its definitions."""
    tok_sum = (loss_mat * mask).sum()
    seq_sum = (loss_mat * mask).sum(-1)
    n_seq = (mask.sum(-1) > 0).sum()
    if mode == "token":
        return float(tok_sum / mask.sum())
    if mode == "token_sum":
        return float(tok_sum)
    if mode == "sequence":
        return float((seq_sum / mask.sum(-1).clamp(min=1)).sum() / n_seq)
    if mode == "seq_mean_token_sum":
        return float(seq_sum.sum() / n_seq)
    return float(seq_sum.sum() / n_seq / (factor or mask.shape[-1]))


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    trajs = []
    for g in range(4):
        for i in range(3):
            n = int(rng.integers(1, 9))
            trajs.append(
                Trajectory(
                    traj_id=f"g{g}/{i}",
                    group_id=f"g{g}",
                    sample_index=i,
                    group_size=3,
                    step=1,
                    prompt_ids=[5, 6, 7][: 1 + g % 3],
                    response_ids=rng.integers(3, 50, size=n).tolist(),
                    behaviour_logprobs=[-1.0] * n,
                    reward=float(i == g % 3),
                )
            )
    return to_record_batch(trajs)


@pytest.mark.parametrize("mode", ["token", "sequence", "token_sum", "seq_mean_token_sum", "seq_mean_token_sum_norm"])
def test_micro_batches_and_ranks_sum_to_verls_aggregate(mode):
    b = _batch()
    r_len = [len(x) for x in b.column("response_ids").to_pylist()]
    L = max(r_len)
    # a per-token loss that differs across rows and positions: 0.1 * (row + 1) + 0.01 * position
    loss_mat = torch.tensor([[0.1 * (i + 1) + 0.01 * t for t in range(L)] for i in range(b.num_rows)])
    mask = torch.tensor([[1.0 if t < r_len[i] else 0.0 for t in range(L)] for i in range(b.num_rows)])
    total = 0.0
    for rank in range(2):  # two ranks, micro-batches of at most 16 tokens: many parts
        plan = plan_step(
            b,
            rank=rank,
            world_size=2,
            micro_batch_tokens=16,
            advantage="mean",
            drop_uniform=False,
            aggregation=mode,
            loss_scale_factor=10,
        )
        for mb in plan.micro_batches:
            tok = (
                torch.cat([loss_mat[row, :n] for row, n in zip(mb.rows, mb.seq_lens.tolist(), strict=True)])
                if mb.rows
                else torch.zeros(1)
            )
            total += mb.loss_scale * float((mb.weights * tok).sum())
    assert total == pytest.approx(_verl_style(loss_mat, mask, mode, 10), rel=1e-5)


# ---- policy losses -----------------------------------------------------------------------------------------


def _loss(mode, logp_vals, prox_vals, adv_vals, seq_lens, weights, **kw):
    logp = torch.tensor(logp_vals, requires_grad=True)
    prox = torch.tensor(prox_vals)
    s = LossSettings(correction="decoupled", clip_low=0.2, clip_high=0.28, policy_loss=mode, **kw)
    loss, m = policy_loss(
        logp,
        prox.clone(),
        torch.tensor(adv_vals),
        torch.tensor(weights),
        s,
        prox_logp=prox,
        seq_lens=torch.tensor(seq_lens),
    )
    loss.backward()
    return float(loss.detach()), logp.grad.tolist(), m


def test_gspo_uses_the_sequence_ratio_at_every_token():
    # seq 0: log-ratios [0.2, 0.0] (mean 0.1), A = +1; seq 1: log-ratio [-0.4], A = -1. Sequence weights [1/4, 1/4, 1/2].
    # s0 = e^0.1 = 1.105171 inside [0.8, 1.28]: loss -1.105171 on both tokens.
    # s1 = e^-0.4 = 0.670320 < 0.8 with A < 0: max(0.670320, 0.8) = 0.8, clipped (no gradient).
    # loss = 0.5 * -1.105171 + 0.5 * 0.8 = -0.152585
    # gradient at seq 0's tokens: weight * -A * s0 = 0.25 * -1.105171 = -0.276293 for BOTH (token ratios
    # e^0.2 and e^0 would give different ones: the vanilla loss)
    loss, grad, m = _loss("gspo", [-1.0, -2.0, -1.4], [-1.2, -2.0, -1.0], [1.0, 1.0, -1.0], [2, 1], [0.25, 0.25, 0.5])
    assert loss == pytest.approx(-0.152585, abs=TOL)
    assert grad == pytest.approx([-0.276293, -0.276293, 0.0], abs=TOL)
    assert float(m["clip_frac"]) == pytest.approx(0.5)  # the weight of seq 1's token
    _, grad_v, _ = _loss("vanilla", [-1.0, -2.0, -1.4], [-1.2, -2.0, -1.0], [1.0, 1.0, -1.0], [2, 1], [0.25, 0.25, 0.5])
    # vanilla: -0.25 * e^0.2 = -0.305351 and -0.25 * e^0 = -0.25
    assert grad_v[:2] == pytest.approx([-0.305351, -0.25], abs=TOL)


def test_geo_mean_clips_token_log_ratios_by_the_sign_of_the_advantage():
    # seq 0, A = +1: log-ratios [0.5, 0.0]; clamp to [-0.2, 0.28] -> [0.28, 0]; A > 0 keeps the min: [0.28, 0.0]
    #   ratio = exp(0.14) = 1.150274, pg0 = -1.150274; token 0 clipped (no gradient), token 1 gradient
    #   -A * ratio / len = -0.575137
    # seq 1, A = -1: log-ratio [-0.4] -> clamp -0.2; A < 0 keeps the max: -0.2; ratio = e^-0.2 = 0.818731,
    #   pg1 = +0.818731, clipped (no gradient)
    # sequence weights [1/4, 1/4, 1/2] put pg_i on each token: loss = (pg0 + pg1) / 2 = -0.165772
    # gradient at token 1 = 2 tokens * 1/4 * -0.575137 = -0.287568
    loss, grad, m = _loss(
        "geo_mean", [-0.5, -2.0, -1.4], [-1.0, -2.0, -1.0], [1.0, 1.0, -1.0], [2, 1], [0.25, 0.25, 0.5]
    )
    assert loss == pytest.approx(-0.165772, abs=TOL)
    assert grad == pytest.approx([0.0, -0.287568, 0.0], abs=TOL)
    assert float(m["clip_frac"]) == pytest.approx(0.75)  # tokens 0 and 2 are clipped


def test_sequence_losses_need_seq_lens():
    s = LossSettings(correction="tis", policy_loss="gspo")
    x = torch.zeros(3)
    with pytest.raises(ValueError, match="seq_lens"):
        policy_loss(x, x, x, x, s)


# ---- entropy bonus -----------------------------------------------------------------------------------------


def test_entropy_bonus_value_and_gradient_through_the_chunked_head():
    torch.manual_seed(0)
    n, h, v, temp = 7, 5, 11, 0.7
    hidden = torch.randn(n, h, requires_grad=True)
    weight = torch.randn(v, h, requires_grad=True)
    targets = torch.randint(0, v, (n,))
    coef = torch.randn(n)
    # reference: full logits and autograd through log_softmax
    lp_all = torch.log_softmax(hidden @ weight.t() / temp, -1)
    ref_ent = -(lp_all.exp() * lp_all).sum(-1)
    ref = (lp_all.gather(-1, targets.view(-1, 1)).squeeze(-1) * coef).sum() - 0.3 * ref_ent.sum()
    gh_ref, gw_ref = torch.autograd.grad(ref, (hidden, weight))
    logp, ent = chunked_logprobs(hidden, weight, targets, temp, chunk=3, entropy_grad=True)
    assert ent.requires_grad
    gh, gw = torch.autograd.grad((logp * coef).sum() - 0.3 * ent.sum(), (hidden, weight))
    # fp32 on both paths; only the order of the sums differs
    torch.testing.assert_close(gh, gh_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(gw, gw_ref, rtol=1e-4, atol=1e-5)
    # without the flag the entropy stays a metric
    _, ent_metric = chunked_logprobs(hidden, weight, targets, temp, chunk=3)
    assert not ent_metric.requires_grad


def test_policy_loss_subtracts_the_entropy_bonus():
    # zero advantages: the loss is -coef * sum(w * H) = -0.1 * (0.5 * 2.0 + 0.5 * 1.0) = -0.15
    logp = torch.zeros(2, requires_grad=True)
    ent = torch.tensor([2.0, 1.0], requires_grad=True)
    s = LossSettings(correction="decoupled", entropy_coeff=0.1)
    loss, _ = policy_loss(
        logp, torch.zeros(2), torch.zeros(2), torch.tensor([0.5, 0.5]), s, prox_logp=torch.zeros(2), entropy=ent
    )
    assert float(loss) == pytest.approx(-0.15)
    loss.backward()
    assert ent.grad.tolist() == pytest.approx([-0.05, -0.05])
    with pytest.raises(ValueError, match="entropy"):
        policy_loss(
            logp,
            torch.zeros(2),
            torch.zeros(2),
            torch.tensor([0.5, 0.5]),
            s,
            prox_logp=torch.zeros(2),
            entropy=ent.detach(),
        )


# ---- KL in the reward --------------------------------------------------------------------------------------


def _kl_plan(advantage):
    trajs = [
        Trajectory(
            traj_id=f"g/{i}",
            group_id="g",
            sample_index=i,
            group_size=2,
            step=1,
            prompt_ids=[5],
            response_ids=[7] * n,
            behaviour_logprobs=[-1.0] * n,
            reward=r,
        )
        for i, (n, r) in enumerate([(2, 1.0), (1, 0.0)])
    ]
    b = to_record_batch(trajs)
    plan = plan_step(
        b, rank=0, world_size=1, micro_batch_tokens=64, advantage=advantage, drop_uniform=True, aggregation="token"
    )
    (mb,) = plan.micro_batches
    assert mb.rows == [0, 1]
    # old - ref per token: sample 0 [0.1, 0.3], sample 1 [0.2]
    mb.prox_logp = torch.tensor([-1.0, -1.0, -1.0])
    mb.ref_logp = torch.tensor([-1.1, -1.3, -1.2])
    return b, plan, mb


def test_kl_in_the_reward_for_an_outcome_estimator():
    from learner import kl_reward

    b, plan, mb = _kl_plan("mean")
    ctl = kl_reward.KLController("adaptive", 0.5, target_kl=0.1, horizon=100)
    m = kl_reward.apply(b, [plan], advantage="mean", drop_uniform=True, estimator="k1", controller=ctl)
    # k1 sums: 0.4 and 0.2; beta 0.5: r' = 1 - 0.2 = 0.8 and 0 - 0.1 = -0.1; group mean 0.35 -> A = +-0.45
    assert mb.advantages.tolist() == pytest.approx([0.45, 0.45, -0.45], abs=TOL)
    # current KL: mean of per-sample token means (0.4 / 2, 0.2 / 1) = 0.2; error clip(0.2 / 0.1 - 1) = 0.2;
    # beta *= 1 + 0.2 * 2 samples / 100 = 1.004
    assert m["kl_reward_kl"] == pytest.approx(0.2) and m["kl_reward_coef"] == pytest.approx(0.5)
    assert ctl.value == pytest.approx(0.5 * 1.004)


def test_kl_in_the_reward_gives_reinforce_plus_plus_token_returns():
    from learner import kl_reward

    b, plan, mb = _kl_plan("reinforce_plus_plus")
    kl_reward.apply(
        b,
        [plan],
        advantage="reinforce_plus_plus",
        drop_uniform=True,
        estimator="k1",
        controller=kl_reward.KLController("fixed", 0.5),
    )
    # returns (gamma 1): sample 0: 1 - 0.5 * (0.1 + 0.3) = 0.8, 1 - 0.5 * 0.3 = 0.85; sample 1: 0 - 0.5 * 0.2 = -0.1
    # whitened over the 3 tokens: mean 0.516667, unbiased var 0.285833, std 0.534634
    assert mb.advantages.tolist() == pytest.approx([0.529958, 0.623480, -1.153437], abs=TOL)


def test_kl_penalty_estimators():
    from learner.kl_reward import kl_penalty

    old, ref = torch.tensor([-1.0]), torch.tensor([-1.5])  # d = old - ref = 0.5
    assert float(kl_penalty(old, ref, "k1")) == pytest.approx(0.5)
    assert float(kl_penalty(old, ref, "k2")) == pytest.approx(0.125)
    assert float(kl_penalty(old, ref, "k3")) == pytest.approx(math.exp(-0.5) + 0.5 - 1)  # 0.106531
    assert float(kl_penalty(ref, old, "abs")) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="estimator"):
        kl_penalty(old, ref, "kl")
