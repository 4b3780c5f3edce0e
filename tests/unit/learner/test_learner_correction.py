"""learner/correction.py (verl's rollout_correction IS levels, rejection sampling, veto) and the bypass
correction of learner/losses.py, against numbers worked out by hand.

The running example: two packed sequences of 2 and 1 trained tokens whose log-ratios d = prox - behaviour
are [ln 2, ln 0.5, ln 4], i.e. token ratios [2, 0.5, 4]; the first sequence's ratio product is 1, the
second's 4. The pure functions work in float64 and are compared with a 1e-9 tolerance (exp/log of these values
is exact to ~1e-16). ``apply`` reads float32 log-probs and stores float32 weights (as the engines hold them):
those are compared with 1e-6, a few float32 ulps (~2.4e-7 at 4) of values at most 4.
"""

from __future__ import annotations

import math

import pytest
import torch

from learner.batch import MicroBatch, StepPlan
from learner.config import LearnerConfig, RejectionRule, RolloutCorrectionConfig
from learner.correction import apply, is_weights, keep_mask, verl_rule_bounds
from learner.losses import LossSettings, needs_proximal, policy_loss

D = torch.tensor([math.log(2.0), math.log(0.5), math.log(4.0)], dtype=torch.float64)
LENS = torch.tensor([2, 1])
TOL = 1e-9


F32_TOL = 1e-6


def close(a: torch.Tensor, b: list[float], tol: float = TOL) -> bool:
    return torch.allclose(a.double(), torch.tensor(b, dtype=torch.float64), atol=tol, rtol=0)


def rule(mode: str, lower: float | None = None, upper: float | None = None) -> RejectionRule:
    st, level, lo, up = verl_rule_bounds(mode, lower, upper)
    return RejectionRule(statistic=st, level=level, lower=lo, upper=up, name=mode)


def test_token_is_truncated_and_icepop():
    assert close(is_weights(D, LENS, "token", 3.0), [2.0, 0.5, 3.0])  # TIS: min(r, 3)
    assert close(is_weights(D, LENS, "token", 3.0, lower=0.6), [2.0, 0.0, 0.0])  # IcePop: 0.5 < 0.6, 4 > 3


def test_sequence_is_is_the_product_of_the_sequence_ratios():
    # sequence 1: 2 * 0.5 = 1 on both tokens; sequence 2: 4, truncated at 2
    assert close(is_weights(D, LENS, "sequence", 2.0), [1.0, 1.0, 2.0])
    assert close(is_weights(D, LENS, "sequence", 5.0, lower=2.0), [0.0, 0.0, 4.0])


def test_verl_k1_rules_compare_minus_log_ratio_with_the_log_bounds():
    # verl keeps log(lower) <= -d <= log(upper): "0.2_1.0" keeps ratios in [1, 5], not [0.2, 1]
    keep, _ = keep_mask(D, LENS, [rule("token_k1", 0.2, 1.0)])
    assert keep.tolist() == [True, False, True]
    # sequence mean of -d: sequence 1 has 0 (kept in [log .999, log 1.001]), sequence 2 has -ln 4
    keep, _ = keep_mask(D, LENS, [rule("seq_mean_k1", 0.999, 1.001)])
    assert keep.tolist() == [True, True, False]
    # a single float is the upper ratio bound, the lower its reciprocal
    assert verl_rule_bounds("seq_sum_k1", None, 2.0)[2:] == pytest.approx((math.log(0.5), math.log(2.0)))


def test_divergence_rules_k2_k3_token_sum_max():
    # k3 = r - 1 - d: [1 - ln 2 = 0.307, ln 2 - 0.5 = 0.193, 3 - ln 4 = 1.614]
    assert keep_mask(D, LENS, [rule("token_k3", upper=0.5)])[0].tolist() == [True, True, False]
    # sequence 1 sums k3 to 0.5 (kept under 0.6); sequence 2 has 1.614
    assert keep_mask(D, LENS, [rule("seq_sum_k3", upper=0.6)])[0].tolist() == [True, True, False]
    assert keep_mask(D, LENS, [rule("seq_sum_k3", upper=0.4)])[0].tolist() == [False, False, False]
    # k2 = d^2 / 2: [0.240, 0.240, 0.961]; sequence max
    assert keep_mask(D, LENS, [rule("seq_max_k2", upper=0.3)])[0].tolist() == [True, True, False]
    with pytest.raises(ValueError, match="seq_max_k1"):
        verl_rule_bounds("seq_max_k1", 0.5, 2.0)
    with pytest.raises(ValueError, match="one upper"):
        verl_rule_bounds("token_k2", 0.5, 2.0)


def test_legacy_geometric_rule_and_the_veto():
    # verl's older geometric mode: exp(mean d) in [0.99, 1.01]: sequence 1 (1.0) kept, sequence 2 (4.0) not
    assert keep_mask(D, LENS, [rule("geometric", 0.99, 1.01)])[0].tolist() == [True, True, False]
    # the veto: a sequence with any token ratio below 0.6 is rejected whole (sequence 1 has 0.5)
    veto = RejectionRule(statistic="log_ratio", level="seq_min", lower=math.log(0.6))
    keep, each = keep_mask(D, LENS, [veto, rule("token_k3", upper=0.5)])
    assert keep.tolist() == [False, False, False]  # every rule must keep a token
    assert [k.tolist() for k in each] == [[False, False, True], [True, True, False]]


def _plan(stats_seqs: int = 2) -> tuple[StepPlan, MicroBatch]:
    n = 3
    mb = MicroBatch(
        input_ids=torch.zeros(1, 6, dtype=torch.int64),
        position_ids=torch.zeros(1, 6, dtype=torch.int64),
        target_index=torch.arange(n),
        targets=torch.zeros(n, dtype=torch.int64),
        behaviour_logp=torch.zeros(n),
        advantages=torch.ones(n),
        weights=torch.full((n,), 1 / 3),
        seq_lens=LENS.clone(),
        prox_logp=D.float(),
    )
    return StepPlan(micro_batches=[mb], stats={"samples_trained": float(stats_seqs)}), mb


def test_apply_rebuilds_the_aggregation_over_kept_tokens_and_reports_verls_metrics():
    plan, mb = _plan()
    rc = RolloutCorrectionConfig(
        enable=True, is_level="token", is_upper=3.0, rejection=[rule("seq_mean_k1", 0.999, 1.001)]
    )
    m = apply([plan], rc, aggregation="token")
    assert close(mb.weights, [0.5, 0.5, 0.0], F32_TOL)  # token mean over the 2 kept tokens
    assert close(mb.is_weights, [2.0, 0.5, 3.0], F32_TOL)
    assert mb.loss_scale == 1.0
    assert m["rollout_rs_masked_fraction"] == pytest.approx(1 / 3)
    assert m["rollout_rs_seq_masked_fraction"] == pytest.approx(1 / 2)
    assert m["rollout_rs_seq_mean_k1_masked_fraction"] == pytest.approx(1 / 3)
    assert m["rollout_is_mean"] == pytest.approx(5.5 / 3)
    assert (m["rollout_is_max"], m["rollout_is_min"]) == pytest.approx((3.0, 0.5))
    assert m["rollout_is_ratio_fraction_high"] == pytest.approx(1 / 3)  # the raw 4 > 3
    assert m["rollout_is_ratio_fraction_low"] == 0.0  # nothing below 1/3


def test_apply_sequence_mean_and_sum_modes_count_the_rejected_sequence():
    plan, mb = _plan()
    rc = RolloutCorrectionConfig(enable=True, rejection=[rule("seq_mean_k1", 0.999, 1.001)])
    apply([plan], rc, aggregation="sequence")
    # verl divides by the mini-batch's sequences (2), the rejected one included: 1 / (2 tokens * 2 sequences)
    assert close(mb.weights, [0.25, 0.25, 0.0], F32_TOL)
    assert close(mb.is_weights, [1.0, 1.0, 1.0], F32_TOL)  # is_level none: weight 1, not decoupled's tis_cap weight
    plan, mb = _plan()
    apply([plan], rc, aggregation="token_sum")
    assert close(mb.weights, [0.5, 0.5, 0.0], F32_TOL) and mb.loss_scale == 2.0  # the sum over the 2 kept tokens


def test_apply_batch_normalizes_token_and_sequence_weights():
    plan, mb = _plan()
    m = apply(
        [plan],
        RolloutCorrectionConfig(enable=True, is_level="token", is_upper=3.0, is_batch_normalize=True),
        aggregation="token",
    )
    assert close(mb.is_weights, [12 / 11, 3 / 11, 18 / 11], F32_TOL)  # [2, 0.5, 3] / (5.5 / 3)
    assert m["rollout_is_batch_norm_factor"] == pytest.approx(5.5 / 3)
    plan, mb = _plan()
    apply(
        [plan],
        RolloutCorrectionConfig(enable=True, is_level="sequence", is_upper=2.0, is_batch_normalize=True),
        aggregation="token",
    )
    assert close(mb.is_weights, [2 / 3, 2 / 3, 4 / 3], F32_TOL)  # sequence weights [1, 2], mean 1.5 over sequences


def test_policy_loss_takes_the_precomputed_weights():
    plan, mb = _plan()
    apply([plan], RolloutCorrectionConfig(enable=True, is_level="token", is_upper=3.0), aggregation="token")
    s = LossSettings(correction="decoupled")
    logp = mb.prox_logp.clone().requires_grad_(True)
    # at pi = prox the ratio is 1, so each token's loss is -w * A = -w: (1/3) * -(2 + 0.5 + 3)
    loss, met = policy_loss(
        logp, mb.behaviour_logp, mb.advantages, mb.weights, s, prox_logp=mb.prox_logp, is_weights=mb.is_weights
    )
    assert float(loss.detach()) == pytest.approx(-5.5 / 3, abs=1e-6)
    # without them decoupled truncates at tis_cap 2: -(2 + 0.5 + 2) / 3
    loss2, _ = policy_loss(logp, mb.behaviour_logp, mb.advantages, mb.weights, s, prox_logp=mb.prox_logp)
    assert float(loss2.detach()) == pytest.approx(-4.5 / 3, abs=1e-6)
    with pytest.raises(ValueError, match="is_weights"):
        policy_loss(
            logp, mb.behaviour_logp, mb.advantages, mb.weights, LossSettings(correction="tis"), is_weights=mb.is_weights
        )


def test_bypass_takes_the_ratio_against_the_sampler_with_no_weight():
    s = LossSettings(correction="bypass", clip_low=0.2, clip_high=0.28)
    logp = torch.zeros(2, requires_grad=True)  # pi = 1 on both tokens
    behaviour = torch.log(torch.tensor([0.5, 1.0]))  # ratios pi / mu = [2, 1]
    adv, w = torch.ones(2), torch.full((2,), 0.5)
    loss, met = policy_loss(logp, behaviour, adv, w, s)
    # token 1: ratio 2 clipped at 1.28 (A > 0), token 2: ratio 1: 0.5 * -(1.28 + 1)
    assert float(loss.detach()) == pytest.approx(-0.5 * 2.28, abs=1e-6)
    assert float(met["clip_frac"]) == pytest.approx(0.5)
    loss.backward()
    assert logp.grad.tolist() == pytest.approx([0.0, -0.5])  # the clipped token gives no gradient
    assert not needs_proximal("bypass", recompute_proximal=True, several_optimizer_steps=True)


def test_bypass_rejection_is_measured_per_micro_batch_and_keeps_the_denominator():
    # pi = 1, mu = 1/[2, 0.5, 4]: d = [ln 2, ln 0.5, ln 4], the running example; seq_mean_k1 rejects sequence 2
    rc = RolloutCorrectionConfig(enable=True, rejection=[rule("seq_mean_k1", 0.999, 1.001)])
    s = LossSettings(correction="bypass", rejection=tuple(rc.rejection))
    logp = torch.zeros(3, requires_grad=True)
    behaviour = -D.float()
    w = torch.full((3,), 1 / 3)
    loss, met = policy_loss(logp, behaviour, torch.ones(3), w, s, seq_lens=LENS)
    # ratios [2, 0.5, 4] clipped to [1.28, 0.5, 1.28] (A = 1); the rejected token is 0 and still weighs 1/3
    assert float(loss.detach()) == pytest.approx(-(1.28 + 0.5) / 3, abs=1e-6)
    assert float(met["rollout_rs_masked_fraction"]) == pytest.approx(1 / 3)
    assert float(met["rollout_rs_seq_mean_k1_masked_fraction"]) == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="bypass mode"):
        LossSettings(correction="decoupled", rejection=tuple(rc.rejection))
    lc = LearnerConfig.model_validate(
        {
            "loss": {"correction": "bypass"},
            "engine": "megatron",
            "rollout_correction": {"enable": True, "rejection": [rc.rejection[0].model_dump()]},
        }
    )
    assert LossSettings.from_config(lc.loss, lc.rollout_correction).rejection == tuple(rc.rejection)
    with pytest.raises(ValueError, match="is_level=none"):
        LearnerConfig.model_validate(
            {"loss": {"correction": "bypass"}, "rollout_correction": {"enable": True, "is_level": "token"}}
        )


def test_config_refuses_rollout_correction_without_decoupled_or_on_megatron():
    base = {"loss": {"correction": "decoupled"}, "rollout_correction": {"enable": True}}
    LearnerConfig.model_validate(base)
    with pytest.raises(ValueError, match="correction=decoupled"):
        LearnerConfig.model_validate({**base, "loss": {"correction": "tis"}})
    with pytest.raises(ValueError, match="engine=fsdp"):
        LearnerConfig.model_validate({**base, "engine": "megatron"})
    with pytest.raises(ValueError, match="lower, upper or both"):
        RejectionRule(statistic="k1", level="token")
