"""The KL-to-reference term of the loss, with the direction its gradient really has.

Tokens ``y`` are sampled by the behaviour policy ``mu`` (the fleet); ``pi`` is the
policy being trained, ``ref`` the frozen reference; all three are per-token
log-probs of the sampled token. A term ``f(log pi(y), log ref(y))`` added to the
loss has the expected gradient ``E_y~pi[grad f + f grad log pi]`` only if the
score-function part is added; the loss here adds ``f`` alone, so what matters is
``E_pi[grad f]``:

* ``k1`` (``log pi - log ref``): ``grad f = grad log pi``, whose expectation under
  ``pi`` is zero. In the loss it does nothing on average, so it is refused (a k1
  penalty belongs in the reward, as in the original RLHF recipe; fleetrl does not
  implement that path).
* ``k2`` (verl's ``mse``): ``f = 1/2 (log pi - log ref)^2``; ``E_pi[grad f] =
  E_pi[(log pi - log ref) grad log pi] = grad KL(pi || ref)``: the gradient of the
  reverse ("mode-seeking") KL that RLHF means by "KL to the reference".
* ``k3`` (verl's ``low_var_kl``): ``f = r - log r - 1`` with ``r = ref / pi``; its
  value is an unbiased, non-negative estimate of ``KL(pi || ref)``, but
  ``E_pi[grad f] = E_pi[(1 - ref/pi) grad log pi] = -E_ref[grad log pi] =
  grad KL(ref || pi)``: the gradient of the *forward* KL. verl's ``low_var_kl`` has
  the same property (it also clamps the value to [-10, 10]; we do not).

Both are checked against the exact gradients on a small vocabulary in
tests/unit/learner/test_learner_kl.py.

Under staleness the tokens come from ``mu``, not ``pi``: the term is weighted by
the detached importance ratio ``min(pi / mu, tis_cap)``, which makes the
expectations above hold (exactly while the cap does not bind).
"""

from __future__ import annotations

import torch

from learner.config import resolve_kl_estimator as resolve

__all__ = ["kl_term", "resolve"]


def kl_term(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL term for the loss (differentiable in ``logp``); see the module docstring for directions."""
    est = resolve(estimator)
    d = logp - ref_logp
    if est == "k2":
        return 0.5 * d * d
    return torch.exp(-d) + d - 1  # k3 with r = ref / pi = exp(-d)
