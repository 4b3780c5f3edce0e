"""PPO with a learned value baseline: GAE, whitening, the clipped value loss, explained variance.

Pure functions on flat token tensors, laid out as the learner's packed micro-batches
(learner/batch.py): the trained response tokens of several sequences concatenated,
``seq_lens`` giving each sequence's count. Tokens the loss mask leaves out (tool
observations) are not in the layout, so GAE runs over the trained tokens only; that is
verl's masked GAE (``compute_gae_advantage_return``: an observation token neither
contributes a TD error nor breaks the recursion, and the next value is the next
*trained* token's).

Per sequence, with ``V_t`` the critic's value at the state before trained token ``t``
and the outcome reward ``R`` placed on the last trained token (``r_t = 0`` elsewhere; with
KL in the reward every token's ``r_t`` also carries ``-beta * kl_t``, learner/kl_reward.py)::

    delta_t = r_t + gamma * V_{t+1} - V_t          (V_{T} = 0 after the last token)
    A_t     = delta_t + gamma * lam * A_{t+1}
    G_t     = A_t + V_t                            (the value target: "returns")

The advantages are then whitened over every trained token of the step batch (all
micro-batches, all ranks): ``(A - mean) / sqrt(var + 1e-8)`` with the unbiased
variance, as verl's ``masked_whiten``. Across ranks the whitening needs only three
numbers (count, sum, sum of squares), combined with one all-reduce
(:func:`global_moments`), so N ranks whiten exactly as one rank would, up to the
order of float64 sums.

Value loss (verl ``compute_value_loss``), per token, with ``v`` the prediction being
trained, ``V`` the values the advantages were computed with (no grad) and ``c`` =
``cliprange_value``::

    v_clip = clamp(v, V - c, V + c)
    l_t    = 0.5 * max((v - G)^2, (v_clip - G)^2)

aggregated with the learner's aggregation weights (sum to one over the optimizer step).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# verl's masked_whiten: rsqrt(var + 1e-8); explained variance: var(returns) + 1e-5 in the denominator.
WHITEN_EPS = 1e-8
EV_EPS = 1e-5


def _check_layout(values: torch.Tensor, seq_lens: torch.Tensor) -> None:
    if values.dim() != 1 or seq_lens.dim() != 1:
        raise ValueError(f"values {tuple(values.shape)} and seq_lens {tuple(seq_lens.shape)} must be 1-D")
    if bool((seq_lens < 1).any()):
        raise ValueError(f"every sequence needs at least one trained token, got seq_lens {seq_lens.tolist()}")
    if int(seq_lens.sum()) != values.shape[0]:
        raise ValueError(f"seq_lens sum to {int(seq_lens.sum())} but there are {values.shape[0]} values")


def token_rewards(
    seq_rewards: torch.Tensor, seq_lens: torch.Tensor, penalty: torch.Tensor | None = None
) -> torch.Tensor:
    """[n] float64 rewards with each sequence's scalar reward on its last trained token, zero elsewhere, minus
    ``penalty`` ([n], per token) when given: KL in the reward, ``beta * kl_t`` (verl's apply_kl_penalty)."""
    if seq_rewards.shape != seq_lens.shape:
        raise ValueError(f"seq_rewards {tuple(seq_rewards.shape)} and seq_lens {tuple(seq_lens.shape)} differ")
    out = torch.zeros(int(seq_lens.sum()), dtype=torch.float64)
    out[torch.cumsum(seq_lens, 0) - 1] = seq_rewards.double()
    if penalty is not None:
        if penalty.shape != out.shape:
            raise ValueError(f"token penalty {tuple(penalty.shape)} does not match the {out.shape[0]} trained tokens")
        out = out - penalty.detach().double().cpu()
    return out


def gae(
    rewards: torch.Tensor, values: torch.Tensor, seq_lens: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and returns ([n] float32 each) of the packed sequences ``seq_lens``.

    ``rewards``: [n] per-token rewards (:func:`token_rewards` for an outcome reward);
    ``values``: [n] the critic's values at the same tokens. Computed in float64, all sequences at
    once (no Python loop over tokens: a long response costs a few vector passes).
    """
    _check_layout(values, seq_lens)
    if rewards.shape != values.shape:
        raise ValueError(f"rewards {tuple(rewards.shape)} and values {tuple(values.shape)} differ")
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
        raise ValueError(f"gamma and lam must lie in [0, 1], got gamma={gamma}, lam={lam}")
    n, c = values.shape[0], gamma * lam
    v = values.detach().double()
    seq = torch.repeat_interleave(torch.arange(seq_lens.shape[0]), seq_lens)
    same = seq[1:] == seq[:-1]  # token t + 1 belongs to t's sequence
    next_v = torch.zeros(n, dtype=torch.float64)
    next_v[:-1] = torch.where(same, v[1:], 0.0)
    a = rewards.double() + gamma * next_v - v  # the TD errors
    # A_t = sum_k (gamma lam)^k delta_{t+k} inside the sequence, as a log-depth suffix scan: after the pass with
    # offset d, a_t sums the 2d terms from t on (fewer at the sequence's end), so ceil(log2(longest)) passes.
    d, coef = 1, c
    while d < int(seq_lens.max()):
        shifted = torch.zeros(n, dtype=torch.float64)
        shifted[:-d] = torch.where(seq[d:] == seq[:-d], a[d:], 0.0)
        a = a + coef * shifted
        d, coef = 2 * d, coef * coef
    return a.float(), (a + v).float()


def moments(x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """float64 [count, sum, sum of squares] of ``x`` where ``mask`` (all of it when None)."""
    x = x.detach().double()
    m = torch.ones_like(x) if mask is None else mask.to(torch.float64)
    return torch.stack([m.sum(), (m * x).sum(), (m * x * x).sum()])


def global_moments(parts: list[torch.Tensor], device: torch.device | None = None, group=None) -> torch.Tensor:
    """Sum per-micro-batch :func:`moments` and all-reduce them over ``group`` (None: the default process group,
    if any): one collective per call, whatever the number of statistics stacked in ``parts`` ([..., 3] each).
    ``group`` must hold each token once: the data-parallel group where tensor-parallel ranks repeat the data."""
    total = torch.stack(parts).sum(0) if parts else torch.zeros(3, dtype=torch.float64)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        t = total.to(device) if device is not None else total
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
        total = t.cpu()
    return total


def mean_var(mom: torch.Tensor) -> tuple[float, float]:
    """Mean and unbiased variance from [count, sum, sumsq]; needs count >= 2 (as verl's masked_var)."""
    n, s, ss = (float(x) for x in mom)
    if n < 2:
        raise ValueError(f"whitening needs at least 2 tokens over the step batch, got {n:g}")
    mean = s / n
    # sum of squares about the mean; clamped at 0 against cancellation when all values are equal
    var = max(ss - n * mean * mean, 0.0) / (n - 1)
    return mean, var


def whiten(x: torch.Tensor, mom: torch.Tensor, eps: float = WHITEN_EPS) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps)`` with mean and unbiased variance from ``mom`` (the whole step's)."""
    mean, var = mean_var(mom)
    return ((x.double() - mean) / (var + eps) ** 0.5).to(x.dtype)


def explained_variance(ret_mom: torch.Tensor, resid_mom: torch.Tensor) -> float:
    """``1 - var(G - V) / (var(G) + 1e-5)`` (verl's ``critic/vf_explained_var``) from the moments of the
    returns and of the residuals; 1: the values predict the returns, 0: no better than their mean."""
    _, var_r = mean_var(ret_mom)
    _, var_d = mean_var(resid_mom)
    return 1.0 - var_d / (var_r + EV_EPS)


def value_loss(
    vpreds: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, weights: torch.Tensor, cliprange_value: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The weighted clipped value loss of one micro-batch and its weighted-sum metrics ([n] tensors).

    Metrics (summed over micro-batches and ranks they are means over the step): ``vf_loss``,
    ``vf_clipfrac`` (tokens where the clipped term was the larger one: their gradient is zero),
    ``vpred_mean``.
    """
    n = vpreds.shape[0]
    for name, t in (("old_values", old_values), ("returns", returns), ("weights", weights)):
        if t.shape != (n,):
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected ({n},) like vpreds")
    if not cliprange_value > 0:
        raise ValueError(f"cliprange_value must be > 0, got {cliprange_value}")
    v = vpreds.float()
    old = old_values.detach().float()
    ret = returns.detach().float()
    v_clip = torch.maximum(torch.minimum(v, old + cliprange_value), old - cliprange_value)
    l1 = (v - ret) ** 2
    l2 = (v_clip - ret) ** 2
    per_token = 0.5 * torch.maximum(l1, l2)
    w = weights.float()
    loss = (w * per_token).sum()
    with torch.no_grad():
        metrics = {
            "vf_loss": loss.detach(),
            "vf_clipfrac": (w * (l2 > l1).float()).sum(),
            "vpred_mean": (w * v.detach()).sum(),
        }
    return loss, metrics
