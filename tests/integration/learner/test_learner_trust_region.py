"""Several optimizer steps per step batch make the trust region bind (real FSDP learner ranks over gloo).

With one optimizer step the proximal log-probs equal the policy where the gradient is taken (ratio 1), so
``decoupled`` and ``tis`` are the same update; with mini-batches and epochs the policy moves away from the
proximal computed once before the first optimizer step, the clip binds (``clip_frac > 0``) and
``decoupled`` (clip against prox) equals ``tis`` with the recomputed proximal, and ``tis`` without one (no
trust region at all) is refused.
"""

from __future__ import annotations

import pytest
import torch
from learner_testkit import make_batches, make_tiny_model, run_ranks, write_batches

STEPS = 2


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    torch.set_num_threads(1)
    d = tmp_path_factory.mktemp("trust")
    model = make_tiny_model(d / "model")
    data = write_batches(d / "data.arrow", make_batches(STEPS))
    # lr 1e-2: large enough that a dozen Adam steps move the tiny model's log-probs past the 0.8-1.28 clip.
    return dict(dir=d, kw=dict(model=str(model), data=str(data), steps=STEPS, lr=1e-2))


def hist(setup, name, **kw):
    return run_ranks(1, out=str(setup["dir"] / name), **setup["kw"], **kw)[0]["history"]


@pytest.mark.timeout(240)
def test_one_optimizer_step_decoupled_equals_tis(setup):
    dec, tis = hist(setup, "dec1", correction="decoupled"), hist(setup, "tis1", correction="tis")
    for a, b in zip(dec, tis, strict=True):
        assert a["learner/optimizer_steps"] == 1.0 and a["learner/clip_frac"] == 0.0
        # Same update: ratio exactly 1 in both and w = min(sg(pi) / mu, cap) either way; only the rounding of
        # a separately computed (identical) forward can differ.
        assert a["learner/loss_total"] == pytest.approx(b["learner/loss_total"], rel=1e-6, abs=1e-8)
        assert a["learner/grad_norm"] == pytest.approx(b["learner/grad_norm"], rel=1e-5)


@pytest.mark.timeout(240)
def test_mini_batches_make_the_clip_bind_and_tis_needs_the_proximal(setup):
    from learner.config import LearnerConfig

    many = dict(mini_batch=1, epochs=4)  # 3 trainable groups a step (one is uniform) -> 12 optimizer steps
    dec = hist(setup, "decN", correction="decoupled", **many)
    tis_prox = hist(setup, "tispN", correction="tis", recompute_proximal=True, **many)
    for h in dec:
        assert h["learner/optimizer_steps"] == 12.0 and h["learner/batch_mini_batches"] == 3.0
        assert h["learner/clip_frac"] > 0.0 and h["learner/clip_frac_last"] > 0.0
        assert h["learner/ratio_mean_last"] != pytest.approx(1.0, abs=1e-3)
    # tis without the proximal would have no trust region over 12 optimizer steps (ratio r(pi, sg(pi)) = 1):
    # refused before a rank starts
    with pytest.raises(ValueError, match="no trust region"):
        LearnerConfig.model_validate({"loss": {"correction": "tis"}, "ppo_mini_batch_size": 1, "ppo_epochs": 4})
    # tis with the recomputed proximal is decoupled's objective.
    for a, b in zip(dec, tis_prox, strict=True):
        assert a["learner/loss_total"] == pytest.approx(b["learner/loss_total"], rel=1e-5, abs=1e-7)
