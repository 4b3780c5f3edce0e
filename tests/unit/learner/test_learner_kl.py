"""The KL term's expected gradient against the exact gradient of each KL direction on a small vocabulary.

One position, a 6-token vocabulary, policy logits ``theta`` (the parameters) and fixed reference logits.
The expected gradient of the loss term when tokens are sampled is computed exactly by summing over the
vocabulary with the sampling probabilities as aggregation weights (no Monte Carlo), through
``policy_loss`` itself with zero advantages (only the KL term has a gradient).
"""

from __future__ import annotations

import pytest
import torch

from learner.losses import LossSettings, policy_loss

V = 6


def setup(seed=0):
    g = torch.Generator().manual_seed(seed)
    # scale 1: every |log pi - log ref| stays well under the k3 clamp (learner.losses.KL_CLAMP), so the
    # expectation below is of the unclamped estimator
    theta = (torch.randn(V, generator=g, dtype=torch.float64) * 1.0).requires_grad_(True)
    ref_logits = torch.randn(V, generator=g, dtype=torch.float64) * 1.0
    mu_logits = torch.randn(V, generator=g, dtype=torch.float64) * 1.5
    return theta, ref_logits, mu_logits


def expected_kl_grad(estimator: str, sampler: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """E_{y ~ sampler}[grad of the per-token loss] (exact), and the exact gradients of both KL directions."""
    theta, ref_logits, mu_logits = setup()
    logp = torch.log_softmax(theta, -1)
    ref = torch.log_softmax(ref_logits, -1)
    mu = torch.log_softmax(mu_logits, -1) if sampler == "mu" else logp.detach()
    # every vocabulary entry is one "token", weighted by its sampling probability: the exact expectation
    s = LossSettings(correction="tis", kl_coef=1.0, kl_estimator=estimator, tis_cap=1e9)
    loss, _ = policy_loss(logp, mu, torch.zeros(V, dtype=torch.float64), mu.exp(), s, ref_logp=ref)
    (g_loss,) = torch.autograd.grad(loss, theta)

    theta2 = theta.detach().clone().requires_grad_(True)
    lp2 = torch.log_softmax(theta2, -1)
    kl_pi_ref = (lp2.exp() * (lp2 - ref)).sum()
    (g_rev,) = torch.autograd.grad(kl_pi_ref, theta2)
    theta3 = theta.detach().clone().requires_grad_(True)
    lp3 = torch.log_softmax(theta3, -1)
    kl_ref_pi = (ref.exp() * (ref - lp3)).sum()
    (g_fwd,) = torch.autograd.grad(kl_ref_pi, theta3)
    return g_loss, g_rev, g_fwd


@pytest.mark.parametrize("estimator", ["k2", "mse"])
@pytest.mark.parametrize("sampler", ["pi", "mu"])
def test_k2_has_the_gradient_of_kl_pi_ref(estimator, sampler):
    g, g_rev, g_fwd = expected_kl_grad(estimator, sampler)
    # float64 sums of 6 terms: agreement to rounding (1e-12); the other direction differs by O(0.1).
    torch.testing.assert_close(g, g_rev, rtol=1e-9, atol=1e-12)
    assert (g - g_fwd).abs().max() > 1e-2


@pytest.mark.parametrize("estimator", ["k3", "low_var_kl"])
@pytest.mark.parametrize("sampler", ["pi", "mu"])
def test_k3_in_the_loss_has_the_gradient_of_kl_ref_pi(estimator, sampler):
    g, g_rev, g_fwd = expected_kl_grad(estimator, sampler)
    torch.testing.assert_close(g, g_fwd, rtol=1e-9, atol=1e-12)
    assert (g - g_rev).abs().max() > 1e-2


def test_without_the_importance_weight_stale_samples_give_the_wrong_gradient():
    """Tokens from mu but no pi/mu weight (what an unweighted KL term does under staleness): not pi's gradient."""
    theta, ref_logits, mu_logits = setup()
    logp = torch.log_softmax(theta, -1)
    ref, mu = torch.log_softmax(ref_logits, -1), torch.log_softmax(mu_logits, -1)
    unweighted = (mu.exp() * 0.5 * (logp - ref) ** 2).sum()
    (g,) = torch.autograd.grad(unweighted, theta)
    _, g_rev, _ = expected_kl_grad("k2", "mu")
    assert (g - g_rev).abs().max() > 1e-2


def test_k1_in_the_loss_would_have_zero_expected_gradient():
    """Why k1 is refused: E_pi[grad (log pi - log ref)] = E_pi[grad log pi] = 0."""
    theta, ref_logits, _ = setup()
    logp = torch.log_softmax(theta, -1)
    k1 = (logp.exp().detach() * (logp - torch.log_softmax(ref_logits, -1))).sum()
    (g,) = torch.autograd.grad(k1, theta)
    assert g.abs().max() < 1e-12
    with pytest.raises(ValueError, match="zero expected gradient"):
        LossSettings(correction="tis", kl_coef=1.0, kl_estimator="k1")


def test_k3_is_clamped_like_verls_low_var_kl():
    """A token whose log-ratio to the reference exploded gives k3 = e^|d|: clamped to KL_CLAMP, no gradient,
    so one token cannot overflow fp32 and skip the optimizer step."""
    from learner.losses import KL_CLAMP

    logp = torch.tensor([-0.5, -30.0], dtype=torch.float32, requires_grad=True)
    ref = torch.tensor([-0.6, -0.1], dtype=torch.float32)
    s = LossSettings(correction="tis", kl_coef=1.0, kl_estimator="k3", tis_cap=1e9)
    loss, m = policy_loss(logp, logp.detach(), torch.zeros(2), torch.tensor([0.5, 0.5]), s, ref_logp=ref)
    (g,) = torch.autograd.grad(loss, logp)
    assert torch.isfinite(loss)
    d = ref[0] - logp[0].detach()  # k3 of token 0: e^d - d - 1, far below the clamp
    assert m["loss_kl"].item() == pytest.approx(0.5 * (torch.exp(d) - d - 1).item() + 0.5 * KL_CLAMP, rel=1e-5)
    assert g[1] == 0 and g[0] != 0
