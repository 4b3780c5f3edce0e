"""Losses against numbers worked out by hand (the arithmetic is in the comments)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from learner.engine import lr_lambda
from learner.losses import (
    LossSettings,
    aggregation_weights,
    combine_metrics,
    finalize_metrics,
    group_advantages,
    policy_loss,
)

# Three response tokens. logp - behaviour = [0.5, 0, -1].
LOGP = [-1.0, -0.5, -2.0]
BEHAV = [-1.5, -0.5, -1.0]
ADV = [1.0, -1.0, -2.0]
THIRD = [1 / 3] * 3


def t(x, grad=False):
    return torch.tensor(x, dtype=torch.float64, requires_grad=grad)


def run(correction, prox=None, ref=None, weights=THIRD, **kw):
    logp = t(LOGP, grad=True)
    s = LossSettings(correction=correction, clip_low=0.2, clip_high=0.28, **kw)
    loss, m = policy_loss(
        logp,
        t(BEHAV),
        t(ADV),
        t(weights),
        s,
        prox_logp=None if prox is None else t(prox),
        ref_logp=None if ref is None else t(ref),
        entropy=t([1.0, 2.0, 3.0]),
    )
    loss.backward()
    return loss.item(), {k: v.item() for k, v in m.items()}, logp.grad.tolist()


def test_group_advantages_mean_std_and_drop():
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 2.0, 2.0, 5.0])
    groups = torch.tensor([7, 7, 7, 7, 3, 3, 9])
    adv, keep = group_advantages(rewards, groups, "mean_std", drop_uniform=True)
    # group 7: mean 0.5, centred +-0.5, Bessel std sqrt(4 * 0.25 / 3) = 0.5773503; 0.5 / (0.5773503 + 1e-6) = 0.8660239
    # group 3: all equal -> 0 and dropped; group 9 (one sample): std 0 -> 0 and dropped (uniform)
    assert adv.tolist() == pytest.approx([0.8660239, -0.8660239, 0.8660239, -0.8660239, 0, 0, 0], abs=1e-6)
    assert keep.tolist() == [True, True, True, True, False, False, False]
    adv, keep = group_advantages(rewards, groups, "mean", drop_uniform=False)
    assert adv.tolist() == pytest.approx([0.5, -0.5, 0.5, -0.5, 0, 0, 0])
    assert keep.all()
    with pytest.raises(ValueError, match="mean_std"):
        group_advantages(rewards, groups, "median", drop_uniform=False)


def test_group_advantages_use_each_groups_own_std():
    # group a: [0, 1], mean 0.5, Bessel std sqrt(0.5) = 0.7071068 -> +-0.5 / 0.7071068 = +-0.7071058
    # group b: [0, 4, 2], mean 2, centred [-2, 2, 0], std sqrt(8 / 2) = 2 -> [-1, 1, 0] (to 1e-6)
    rewards = torch.tensor([0.0, 4.0, 1.0, 2.0, 0.0])
    groups = torch.tensor([1, 1, 0, 1, 0])
    adv, keep = group_advantages(rewards, groups, "mean_std", drop_uniform=True)
    assert adv.tolist() == pytest.approx([-1.0, 1.0, 0.7071058, 0.0, -0.7071058], abs=1e-5)
    assert keep.all()


def test_correction_none_is_verls_ratio_against_the_learner_not_the_sampler():
    # verl's meaning: the ratio's base is the learner's own pre-step log-probs, never the sampler's.
    # Without prox (one optimizer step) the base is sg(logp): ratio 1 everywhere, nothing clipped,
    # no behaviour weight, although logp - behaviour = [0.5, 0, -1] (a large engine-vs-learner gap).
    loss, m, grad = run("none")
    # per token -1 * A = [-1, 1, 2], mean over 3
    assert loss == pytest.approx((-1 + 1 + 2) / 3)
    assert m["clip_frac"] == 0.0 and m["clip_dual_frac"] == 0.0
    assert m["ratio_mean"] == pytest.approx(1.0)
    assert m["is_weight_mean"] == pytest.approx(1.0) and m["is_weight_max"] == 1.0
    # the mismatch is still measured: k3 = exp(d) - d - 1 for d = [0.5, 0, -1]: [0.1487213, 0, 0.3678794]
    assert m["mismatch_kl_k3"] == pytest.approx((0.1487213 + 0.3678794) / 3)
    assert m["mismatch_logp_diff"] == pytest.approx((-0.5 + 0 + 1) / 3)
    assert m["entropy"] == pytest.approx(2.0)
    # every token has the plain policy gradient -A / 3
    assert grad == pytest.approx([-1 / 3, 1 / 3, 2 / 3])


def test_correction_none_first_mini_batch_has_no_clip_when_the_sampler_is_off_by_0_3_nats():
    # The case: behaviour = learner + 0.3 nats on some tokens, first mini-batch (pi == prox).
    logp = t([-1.0, -0.5, -2.0, -0.7], grad=True)
    behaviour = logp.detach() + t([0.3, 0.0, 0.3, 0.0])
    s = LossSettings(correction="none", clip_low=0.2, clip_high=0.2)
    _, m = policy_loss(logp, behaviour, t([1.0, -1.0, -1.0, 1.0]), t([0.25] * 4), s, prox_logp=logp.detach())
    assert m["clip_frac"] == 0.0 and m["ratio_mean"] == pytest.approx(1.0)
    # the old meaning (ratio against the sampler: exp(-0.3) = 0.741 < 0.8) would clip the A = -1 token at 0.3
    assert m["is_weight_max"] == 1.0


def test_correction_none_clips_against_proximal_from_the_second_optimizer_step():
    prox = [-1.4, -0.5, -1.8]
    loss, m, grad = run("none", prox=prox)
    # ratio = exp(logp - prox) = exp([0.4, 0, -0.2]) = [1.4918247, 1, 0.8187308]; no weight
    # tok1 A=+1: clipped at 1.28 -> -1.28; tok2: +1; tok3 A=-2: inside -> 0.8187308 * 2 = 1.6374615
    assert loss == pytest.approx((-1.28 + 1 + 1.6374615) / 3, abs=1e-7)
    assert m["clip_frac"] == pytest.approx(1 / 3)
    assert m["is_weight_mean"] == pytest.approx(1.0)
    assert grad == pytest.approx([0.0, 1 / 3, 1.6374615 / 3])


def test_correction_tis_truncates_weight():
    loss, m, grad = run("tis", tis_cap=2.0)
    # no prox given: old = logp (ratio 1, never clipped); w = min(exp([0.5, 0, -1]), 2) = [1.6487213, 1, 0.3678794]
    # per token -w * A = [-1.6487213, 1, 0.7357589]
    assert loss == pytest.approx((-1.6487213 + 1 + 0.7357589) / 3, abs=1e-7)
    assert m["clip_frac"] == 0.0
    assert m["is_weight_mean"] == pytest.approx((1.6487213 + 1 + 0.3678794) / 3)
    assert m["is_weight_max"] == pytest.approx(1.6487213)
    assert grad == pytest.approx([-1.6487213 / 3, 1 / 3, 0.7357589 / 3])
    loss, m, _ = run("tis", tis_cap=1.5)
    # cap 1.5: w = [1.5, 1, 0.3678794] -> [-1.5, 1, 0.7357589]
    assert loss == pytest.approx((-1.5 + 1 + 0.7357589) / 3, abs=1e-7)
    assert m["is_weight_max"] == pytest.approx(1.5)


def test_correction_decoupled_clips_against_proximal():
    prox = [-1.4, -0.5, -1.8]
    loss, m, grad = run("decoupled", prox=prox, tis_cap=2.0)
    # ratio = exp(logp - prox) = exp([0.4, 0, -0.2]) = [1.4918247, 1, 0.8187308]
    # w = min(exp(prox - behav), 2) = exp([0.1, 0, -0.8]) = [1.1051709, 1, 0.4493290]
    # tok1 A=+1: clipped at 1.28 -> -1.1051709 * 1.28 = -1.4146188
    # tok2 A=-1: +1;  tok3 A=-2: ratio inside [0.8, 1.28] -> -0.4493290 * (0.8187308 * -2) = +0.7357589
    assert loss == pytest.approx((-1.4146188 + 1 + 0.7357589) / 3, abs=1e-7)
    assert m["clip_frac"] == pytest.approx(1 / 3)
    assert m["is_weight_mean"] == pytest.approx((1.1051709 + 1 + 0.4493290) / 3)
    assert m["ratio_mean"] == pytest.approx((1.4918247 + 1 + 0.8187308) / 3)
    # gradient: 0 on the clipped token; else -w * ratio * A / 3
    assert grad == pytest.approx([0.0, 1 / 3, 0.7357589 / 3])
    with pytest.raises(ValueError, match="prox_logp"):
        run("decoupled")


def test_kl_k2_k3_values_importance_weight_and_total():
    from learner.kl import kl_term

    ref = [-1.1, -0.7, -2.0]
    # d = logp - ref = [0.1, 0.2, 0]; k2 = d^2 / 2 = [0.005, 0.02, 0]; k3 = exp(-d) + d - 1 = [0.0048374, 0.0187308, 0]
    assert kl_term(t(LOGP), t(ref), "k2").tolist() == pytest.approx([0.005, 0.02, 0.0])
    assert kl_term(t(LOGP), t(ref), "mse").tolist() == pytest.approx([0.005, 0.02, 0.0])
    assert kl_term(t(LOGP), t(ref), "low_var_kl").tolist() == pytest.approx([0.0048374, 0.0187308, 0.0], abs=1e-7)
    # tis: the KL term is weighted by min(pi / mu, tis_cap) = min(exp([0.5, 0, -1]), 2) = [1.6487213, 1, 0.3678794];
    # the policy part with no prox: -w * A = [-1.6487213, 1, 0.7357589] / 3 = 0.0290459
    pol = (-1.6487213 + 1 + 0.7357589) / 3
    loss, m, _ = run("tis", ref=ref, kl_coef=0.5, kl_estimator="k2")
    assert m["loss_kl"] == pytest.approx(0.025 / 3) and m["loss_policy"] == pytest.approx(pol, abs=1e-7)
    assert loss == pytest.approx(pol + 0.5 * (1.6487213 * 0.005 + 0.02) / 3, abs=1e-7)
    loss, m, _ = run("tis", ref=ref, kl_coef=0.5, kl_estimator="k3")
    assert loss == pytest.approx(pol + 0.5 * (1.6487213 * 0.0048374 + 0.0187308) / 3, abs=1e-7)
    # none (verl's meaning): neither the policy term nor the KL term is weighted; policy -A / 3 summed = 2 / 3
    loss, m, _ = run("none", ref=ref, kl_coef=0.5, kl_estimator="k2")
    assert loss == pytest.approx(2 / 3 + 0.5 * 0.025 / 3)
    with pytest.raises(ValueError, match="ref_logp"):
        run("none", kl_coef=0.5)
    with pytest.raises(ValueError, match="zero expected gradient"):
        run("none", ref=ref, kl_coef=0.5, kl_estimator="k1")


def test_tis_uses_the_recomputed_proximal():
    """tis with prox is decoupled's objective: the ratio against prox (clipped) and w = min(prox / mu, cap)."""
    prox = [-1.4, -0.5, -1.8]
    loss, m, grad = run("tis", prox=prox, tis_cap=2.0)
    # same numbers as test_correction_decoupled_clips_against_proximal
    assert loss == pytest.approx((-1.4146188 + 1 + 0.7357589) / 3, abs=1e-7)
    assert m["clip_frac"] == pytest.approx(1 / 3)
    assert m["is_weight_mean"] == pytest.approx((1.1051709 + 1 + 0.4493290) / 3)
    assert grad == pytest.approx([0.0, 1 / 3, 0.7357589 / 3])


def test_dual_clip_bounds_negative_advantage_tokens():
    """The issue's case: log-ratio 7.9 and A = -1 gave loss and gradient 2,697 without dual-clip."""

    def one(logp, behav, adv, c=3.0):
        lp = t([logp], grad=True)
        s = LossSettings(correction="none", clip_ratio_c=c)
        # the ratio's base is the proximal policy (here the old weights, 'behav'), as from a second optimizer step
        loss, m = policy_loss(lp, t([behav]), t([adv]), t([1.0]), s, prox_logp=t([behav]))
        loss.backward()
        return loss.item(), lp.grad.item(), m

    loss, grad, m = one(-0.1, -8.0, -1.0)
    # ratio e^7.9 = 2697.28; -min(-2697.28, -1.28) = 2697.28 > 3 * 1: capped at 3, no gradient
    assert loss == pytest.approx(3.0) and grad == 0.0 and m["clip_dual_frac"].item() == 1.0
    loss, grad, m = one(-0.1, -8.0, -1.0, c=1e9)  # effectively no dual-clip: today's unbounded loss
    assert loss == pytest.approx(2697.28, rel=1e-4) and grad == pytest.approx(2697.28, rel=1e-4)
    # ratio 2 (< c) and A = -1: not capped; loss 2, gradient d(ratio * 1)/dlogp = 2
    loss, grad, m = one(-1.0 + np.log(2.0), -1.0, -1.0)
    assert loss == pytest.approx(2.0) and grad == pytest.approx(2.0) and m["clip_dual_frac"].item() == 0.0
    # positive advantages are never dual-clipped: ratio 2 > 1.28 clips to 1.28 * A as before
    loss, grad, _ = one(-1.0 + np.log(2.0), -1.0, 1.0)
    assert loss == pytest.approx(-1.28) and grad == 0.0
    with pytest.raises(ValueError, match="clip_ratio_c"):
        LossSettings(correction="none", clip_ratio_c=1.0)


def test_log_ratio_is_clamped_before_exp():
    # fp32: exp(100) = inf and inf * 0 = nan; clamped at 20 the zero-advantage token contributes exactly 0.
    lp = torch.tensor([0.0, -1.0], requires_grad=True)
    loss, m = policy_loss(
        lp,
        torch.tensor([-100.0, -1.0]),
        torch.tensor([0.0, 1.0]),
        torch.tensor([0.5, 0.5]),
        LossSettings(correction="none"),
        prox_logp=torch.tensor([-100.0, -1.0]),
    )
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(lp.grad).all()
    assert loss.item() == pytest.approx(-0.5)  # token 2: ratio 1, A = 1, weight 0.5


def test_mismatch_on_fresh_tokens_is_separate_from_drift():
    prox = [-1.4, -0.5, -1.8]
    logp = t(LOGP, grad=True)
    _, m = policy_loss(
        logp,
        t(BEHAV),
        t(ADV),
        t(THIRD),
        LossSettings(correction="decoupled"),
        prox_logp=t(prox),
        fresh=torch.tensor([True, True, False]),
    )
    f = finalize_metrics({k: v.item() for k, v in m.items()})
    # pre-step (prox) - behaviour = [0.1, 0, -0.8]; k3 = exp(d) - d - 1 = [0.0051709, 0, 0.2493290]
    assert f["fresh_token_frac"] == pytest.approx(2 / 3)
    assert f["mismatch_kl_k3_fresh"] == pytest.approx(0.0051709 / 2, abs=1e-7)  # mean over the 2 fresh tokens
    assert f["drift_kl_k3"] == pytest.approx(0.2493290, abs=1e-7)  # the one stale token


def test_aggregation_weights_token_and_sequence():
    lens = torch.tensor([2, 1])
    # token: 1 / total tokens of the whole step (here 6, the rest lives in other micro-batches)
    assert aggregation_weights(lens, "token", total_tokens=6, total_seqs=4).tolist() == pytest.approx([1 / 6] * 3)
    # sequence: 1 / (len * total sequences): [1/(2*2), 1/(2*2), 1/(1*2)]
    w = aggregation_weights(lens, "sequence", total_tokens=3, total_seqs=2)
    assert w.tolist() == pytest.approx([0.25, 0.25, 0.5])
    # against the proximal BEHAV (ratio exp([0.5, 0, -1]): per-token losses [-1.28, 1, 1.6], see the dual-clip test)
    loss, _, _ = run("none", prox=BEHAV, weights=w.tolist())
    assert loss == pytest.approx(0.25 * -1.28 + 0.25 * 1 + 0.5 * 1.6)  # 0.73
    with pytest.raises(ValueError, match="aggregation"):
        aggregation_weights(lens, "batch", 3, 2)


def test_split_micro_batches_sum_to_the_whole():
    # The loss of a batch split into micro-batches sums to the loss of the whole batch.
    whole, mw, _ = run("none", prox=BEHAV)
    s = LossSettings(correction="none")
    parts = []
    for idx in ([0, 1], [2]):
        _, m = policy_loss(t(LOGP)[idx], t(BEHAV)[idx], t(ADV)[idx], t(THIRD)[idx], s, prox_logp=t(BEHAV)[idx])
        parts.append(m)
    c = combine_metrics(parts)
    assert c["loss_total"].item() == pytest.approx(whole)
    assert c["clip_frac"].item() == pytest.approx(2 / 3)
    assert c["is_weight_max"].item() == 1.0


def test_settings_require_a_known_correction():
    with pytest.raises(ValueError, match="correction"):
        LossSettings(correction="ppo")


def test_lr_schedule_by_hand():
    cos = lr_lambda("cosine", warmup_steps=2, total_steps=6)
    # warm-up: (s + 1) / 2; then cosine over 4 steps: 0.5 * (1 + cos(pi * (s - 2) / 4))
    assert [cos(s) for s in range(7)] == pytest.approx([0.5, 1.0, 1.0, 0.8535534, 0.5, 0.1464466, 0.0])
    lin = lr_lambda("linear", warmup_steps=0, total_steps=4, min_lr_ratio=0.2)
    assert [lin(s) for s in range(5)] == pytest.approx([1.0, 0.8, 0.6, 0.4, 0.2])
    assert lr_lambda("constant", 0, 10)(7) == 1.0
