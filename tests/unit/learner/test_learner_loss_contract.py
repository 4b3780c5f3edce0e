"""The loss details that a plausible edit could silently break, each with a case that tells the right rule
from the wrong one (every test here was seen failing on the broken variant it names).

Numbers are worked out in the comments; float64 where the arithmetic is checked to rounding.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from learner.batch import plan_step
from learner.losses import LossSettings, group_advantages, policy_loss
from learner.minibatch import plan_mini_batches
from tests.support.broker_groups import make_groups


def t(x, grad=False):
    return torch.tensor(x, dtype=torch.float64, requires_grad=grad)


def _batch(rewards: list[float], finish: list[str], group_size: int = 4, resp_len: int = 6) -> pa.RecordBatch:
    n_groups = len(rewards) // group_size
    b = make_groups([f"g{i}" for i in range(n_groups)], step=1, version=0, group_size=group_size, resp_len=resp_len)
    cols = {name: b.column(name) for name in b.schema.names}
    cols["reward"] = pa.array(np.asarray(rewards, np.float32))
    cols["finish_reason"] = pa.array(finish)
    return pa.RecordBatch.from_pydict(cols, schema=b.schema)


def _plan(batch, **kw):
    args = dict(
        rank=0,
        world_size=1,
        micro_batch_tokens=4096,
        advantage="mean",
        drop_uniform=True,
        aggregation="token",
        learner_version=0,
    )
    args.update(kw)
    return plan_step(batch, **args)


# -- mask_truncated -----------------------------------------------------------------------------------------
def test_truncated_rows_stay_in_their_groups_baseline():
    # one group, rewards [1, 0, 0, 0], row 0 cut at the length limit. Its reward still counts in the mean
    # (0.25): the others' advantage is -0.25, not 0 (a baseline without row 0 would make the group uniform)
    batch = _batch([1.0, 0.0, 0.0, 0.0], ["length", "stop", "stop", "stop"])
    plan = _plan(batch, mask_truncated=True)
    (mb,) = plan.micro_batches
    assert mb.rows == [1, 2, 3]
    assert mb.advantages.unique().tolist() == pytest.approx([-0.25])
    assert plan.stats["samples_trained"] == 3.0 and plan.stats["samples_truncated"] == 1.0


def test_a_mini_batch_split_never_makes_an_empty_optimizer_step_of_truncated_groups():
    # group 0: every response cut (nothing to train under mask_truncated); group 1: trainable
    batch = _batch([1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0], ["length"] * 4 + ["stop"] * 4)
    plans, stats = plan_mini_batches(
        batch,
        groups_per_mini=1,
        rank=0,
        world_size=1,
        micro_batch_tokens=4096,
        advantage="mean",
        drop_uniform=True,
        aggregation="token",
        learner_version=0,
        mask_truncated=True,
    )
    assert len(plans) == 1 and stats["mini_batches"] == 1.0
    assert [p.stats["samples_trained"] for p in plans] == [4.0]


# -- aggregation ------------------------------------------------------------------------------------------
def test_sequence_weights_are_normalised_over_the_whole_step_not_each_micro_batch():
    # 2 groups x 4 rows of 6 tokens; a 20-token budget packs one sequence (prompt 8 + 5 inputs = 13) per
    # micro-batch. 'sequence': each of the 8 trained sequences weighs 1/8 in total, whatever micro-batch
    # it lands in, and the weights of the whole step sum to 1 (a per-micro-batch normaliser gives 1 per
    # micro-batch: 8 in all).
    batch = _batch([1.0, 0.0, 1.0, 0.0, 2.0, 0.0, 0.0, 1.0], ["stop"] * 8)
    plan = _plan(batch, micro_batch_tokens=20, aggregation="sequence")
    assert len(plan.micro_batches) == 8
    total = sum(float(mb.weights.double().sum()) for mb in plan.micro_batches)
    assert total == pytest.approx(1.0, abs=1e-6)  # float32 weights: 8 * 6 terms of 1/48
    for mb in plan.micro_batches:
        assert float(mb.weights.double().sum()) == pytest.approx(1 / 8, abs=1e-7)


# -- the KL term's importance weight -------------------------------------------------------------------------
def _kl_loss(logp, behaviour, prox, ref, cap=2.0):
    s = LossSettings(correction="decoupled", kl_coef=1.0, kl_estimator="k2", tis_cap=cap)
    lp = t(logp, grad=True)
    loss, m = policy_loss(
        lp, t(behaviour), t([0.0] * len(logp)), t([1.0 / len(logp)] * len(logp)), s, prox_logp=t(prox), ref_logp=t(ref)
    )
    return loss.item(), m


def test_the_kl_weight_is_capped():
    # zero advantages: only the KL term. d = logp - ref = 0.5: k2 = 0.125. pi / mu = e^2 = 7.39 > cap 2
    loss, m = _kl_loss([-1.0], [-3.0], [-1.0], [-1.5])
    assert m["loss_kl"].item() == pytest.approx(0.125)
    assert loss == pytest.approx(2.0 * 0.125)  # uncapped: 7.39 * 0.125 = 0.92


def test_the_kl_weight_is_the_current_policys_not_the_proximals():
    # pi / mu = exp(-1.0 - -1.5) = e^0.5 = 1.6487213; prox / mu = exp(-1.4 - -1.5) = e^0.1 (the wrong one)
    loss, _ = _kl_loss([-1.0], [-1.5], [-1.4], [-1.5])
    assert loss == pytest.approx(1.6487213 * 0.125, rel=1e-7)


# -- dual-clip -----------------------------------------------------------------------------------------
def test_dual_clip_bounds_the_surrogate_before_the_behaviour_weight():
    # decoupled, A = -1: ratio = exp(logp - prox) = e^5 = 148.4; w = prox / mu = e^-0.693 = 0.5.
    # Right: pg = w * min(148.4, c = 3) = 0.5 * 3 = 1.5. Wrong (bound on the weighted surrogate):
    # min(0.5 * 148.4, 3) = 3.
    prox, mu = -6.0, -6.0 + np.log(2.0)
    s = LossSettings(correction="decoupled", clip_ratio_c=3.0, tis_cap=2.0)
    loss, m = policy_loss(t([-1.0], grad=True), t([mu]), t([-1.0]), t([1.0]), s, prox_logp=t([prox]))
    assert m["is_weight_mean"].item() == pytest.approx(0.5)
    assert loss.item() == pytest.approx(1.5)
    assert m["clip_dual_frac"].item() == 1.0


def test_group_baseline_counts_every_row_of_the_group():
    # the plain function the planner calls: the same [1, 0, 0, 0] group, mean 0.25
    adv, keep = group_advantages(
        torch.tensor([1.0, 0.0, 0.0, 0.0]), torch.zeros(4, dtype=torch.int64), "mean", drop_uniform=True
    )
    assert adv.tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25]) and keep.all()


def test_tis_without_the_proximal_is_refused_with_several_optimizer_steps():
    from learner.config import LearnerConfig

    with pytest.raises(ValueError, match="no trust region"):
        LearnerConfig.model_validate({"loss": {"correction": "tis"}, "ppo_mini_batch_size": 4})
    with pytest.raises(ValueError, match="no trust region"):
        LearnerConfig.model_validate({"loss": {"correction": "tis"}, "ppo_epochs": 2})
    LearnerConfig.model_validate({"loss": {"correction": "tis"}, "ppo_epochs": 2, "recompute_proximal": True})
    LearnerConfig.model_validate({"loss": {"correction": "tis"}})  # one optimizer step: the IS gradient


def test_which_corrections_need_the_proximal_pass():
    from learner.losses import needs_proximal

    assert needs_proximal("decoupled", False, False)
    assert needs_proximal("tis", True, False) and not needs_proximal("tis", False, False)
    # none: sg(pi) is the pre-step policy only at the first optimizer step
    assert needs_proximal("none", False, True) and not needs_proximal("none", False, False)
