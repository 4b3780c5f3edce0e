"""verl's algorithm families through the real FSDP2 engine (gloo processes): a sequence-level policy loss with
an entropy bonus through the chunked head, and a sum aggregation with reinforce++, each giving the same step
on 1 and 2 ranks (the normalisation is global, whatever the split)."""

from __future__ import annotations

import math
import shutil

import pytest
import torch
from learner_testkit import make_batches, make_tiny_model, run_ranks, write_batches

CASES = {
    "geo_mean_rloo_entropy": dict(
        loss_extra={"policy_loss": "geo_mean", "advantage": "rloo", "entropy_coeff": 0.1},
        learner_extra={"logprobs": "chunked"},
    ),
    "dr_grpo_sum_rpp_entropy": dict(
        aggregation="seq_mean_token_sum_norm",
        loss_extra={"advantage": "reinforce_plus_plus", "loss_scale_factor": 16, "entropy_coeff": 0.01},
    ),
    # KL in the reward: zero at step 1 (the reference is the start), so step 2 is compared
    "kl_reward_reinforce_pp": dict(
        steps=3,
        loss_extra={"advantage": "reinforce_plus_plus"},
        learner_extra={"kl_reward": {"enable": True, "coef": 0.5, "type": "adaptive", "estimator": "k3"}},
    ),
    # verl's rollout_correction: sequence IS, batch-normalised, and a token k3 rejection; the weights'
    # normalisation and the kept-token count are collective, so 1 and 2 ranks must still agree
    "rollout_correction_seq_is_rs": dict(
        learner_extra={
            "rollout_correction": {
                "enable": True,
                "is_level": "sequence",
                "is_upper": 2.0,
                "is_batch_normalize": True,
                "rejection": [{"statistic": "k3", "level": "token", "upper": 0.05, "name": "token_k3"}],
            }
        }
    ),
    # verl's bypass (ratio against the sampler) with a sequence rejection rule measured in the loss
    "bypass_seq_rejection": dict(
        correction="bypass",
        learner_extra={
            "rollout_correction": {
                "enable": True,
                "rejection": [{"statistic": "k3", "level": "seq_max", "upper": 0.05, "name": "seq_max_k3"}],
            }
        },
    ),
}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", list(CASES))
def test_new_losses_match_across_ranks(tmp_path, case):
    torch.set_num_threads(1)
    model = make_tiny_model(tmp_path / "model")
    kw = dict(steps=1, correction="decoupled", micro_tokens=40) | CASES[case]
    data = write_batches(tmp_path / "data.arrow", make_batches(kw["steps"]))
    kw.update(model=str(model), data=str(data))
    ckpt = tmp_path / "ckpt"
    one = run_ranks(1, out=str(tmp_path / "one"), ckpt=str(ckpt), checkpoint_every=1, **kw)[0]["history"][-1]
    two = run_ranks(2, out=str(tmp_path / "two"), **kw)[0]["history"][-1]
    # fp32 throughout; 1 and 2 ranks differ only in the order of sums (see test_learner_fsdp.py's tolerance)
    for key in ("learner/loss_total", "learner/loss_policy", "learner/grad_norm", "learner/entropy"):
        assert math.isfinite(one[key]), key
        assert one[key] == pytest.approx(two[key], rel=1e-5, abs=1e-7), key
    assert one["learner/grad_norm"] > 0
    if case == "kl_reward_reinforce_pp":
        assert one["learner/batch_kl_reward_kl"] > 0
        assert one["learner/batch_kl_reward_kl"] == pytest.approx(two["learner/batch_kl_reward_kl"], rel=1e-5)
        # the adaptive coefficient moved (0.5 at step 1) and a resume from step 2 continues with its value:
        # bit-identical, as the rest of a resume (test_learner_fsdp.py)
        assert one["learner/batch_kl_reward_coef"] != 0.5
        shutil.rmtree(ckpt / "step_00000003")
        resumed = run_ranks(1, out=str(tmp_path / "resumed"), ckpt=str(ckpt), checkpoint_every=1, **kw)[0]
        assert resumed["resumed"]
        assert resumed["history"][-1]["learner/batch_kl_reward_coef"] == one["learner/batch_kl_reward_coef"]
    if case == "rollout_correction_seq_is_rs":
        for key in (
            "learner/batch_rollout_rs_masked_fraction",
            "learner/batch_rollout_is_batch_norm_factor",
            "learner/batch_rollout_is_mean",
        ):
            assert one[key] == pytest.approx(two[key], rel=1e-5), key
        # the rule rejects some tokens and keeps others (0.32 of 57 when written), so both paths run
        assert 0 < one["learner/batch_rollout_rs_masked_fraction"] < 1
        assert one["learner/batch_rollout_is_max"] <= 2.0
    if case == "bypass_seq_rejection":
        assert 0 < one["learner/rollout_rs_masked_fraction"] < 1
        assert one["learner/rollout_rs_masked_fraction"] == pytest.approx(two["learner/rollout_rs_masked_fraction"])
    if case == "geo_mean_rloo_entropy":
        # the bonus reaches the gradient through the chunked head: without it the step differs
        kw["loss_extra"] = {**kw["loss_extra"], "entropy_coeff": 0.0}
        plain = run_ranks(1, out=str(tmp_path / "plain"), **kw)[0]["history"][0]
        assert plain["learner/loss_policy"] == pytest.approx(one["learner/loss_policy"], rel=1e-6)
        assert abs(plain["learner/grad_norm"] - one["learner/grad_norm"]) > 1e-4 * one["learner/grad_norm"]
