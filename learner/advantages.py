"""Outcome advantage estimators: one scalar reward per sample in, one advantage per sample out.

``learner.loss.advantage`` picks one (verl's ``algorithm.adv_estimator`` names in brackets):

* ``mean_std`` (grpo): ``A = (r - mean_g) / (std_g + eps)``, std with Bessel's correction.
* ``mean`` (grpo with ``norm_adv_by_std_in_grpo=False``, Dr. GRPO): ``A = r - mean_g``.
* ``rloo``: the leave-one-out baseline, ``A = r - mean of the group's other rewards
  = n / (n - 1) * (r - mean_g)``.
* ``gpg``: ``A = alpha * (r - mean_g)`` with ``alpha = rows / nonzero rewards`` over the step
  batch (GPG's correction for the share of samples that carry a signal; verl's ``f_norm`` is 1).
* ``reinforce_plus_plus``: no group baseline; the discounted return of every token (gamma 1
  with an outcome reward: the sample's reward on each of its tokens) whitened over all trained
  tokens of the batch: ``A = (r - mu_tok) / sqrt(var_tok + 1e-8)``, mean and (unbiased)
  variance weighted by each sample's trained-token count, as verl's ``masked_whiten``.
* ``reinforce_plus_plus_baseline``: ``r - mean_g`` first, then the same token-weighted whitening.

Where fleetrl differs from verl on purpose:

* A group of one sample has advantage 0 and counts as uniform (verl: its raw reward for
  grpo/rloo, as if the baseline were 0). A lone sample has no group to compare against; the
  launcher refuses ``rollout.sampling.n < 2`` anyway.
* ``drop_uniform`` (``learner.loss.drop_uniform_groups``) leaves groups whose rewards are all
  equal out of the step. For the group-baseline estimators their advantage is exactly zero, and
  for ``reinforce_plus_plus_baseline`` the whitening then runs over the kept samples only (what
  verl computes after DAPO's filter removed those groups). ``reinforce_plus_plus`` has no group
  baseline, so a uniform group still carries a signal: it is never dropped.

Every estimator is a pure function of the step batch, so all learner ranks compute the same values.
"""

from __future__ import annotations

import torch

ESTIMATORS = ("mean", "mean_std", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gpg")
# verl's masked_whiten adds this to the variance before the inverse square root.
WHITEN_EPS = 1e-8


def _groups(rewards: torch.Tensor, group_index: torch.Tensor):
    """(inverse index, count, mean, std (Bessel), uniform) per sample's group, float64."""
    _, inv = torch.unique(group_index, return_inverse=True)
    n_groups = int(inv.max()) + 1 if inv.numel() else 0

    def gsum(x: torch.Tensor) -> torch.Tensor:
        return torch.zeros(n_groups, dtype=torch.float64).index_add_(0, inv, x)

    count = gsum(torch.ones_like(rewards))
    mean = gsum(rewards) / count
    centred = rewards - mean[inv]
    std = torch.sqrt(gsum(centred**2) / (count - 1).clamp(min=1))
    # Exact comparison: a group is uniform only if every reward equals the others.
    gmax = torch.zeros(n_groups, dtype=torch.float64).scatter_reduce_(0, inv, rewards, "amax", include_self=False)
    gmin = torch.zeros(n_groups, dtype=torch.float64).scatter_reduce_(0, inv, rewards, "amin", include_self=False)
    return inv, count[inv], centred, std[inv], (gmax == gmin)[inv]


def whiten(values: torch.Tensor, lengths: torch.Tensor, include: torch.Tensor) -> torch.Tensor:
    """Per-sample values whitened over the tokens of the ``include``d samples (each counts ``lengths`` times).

    Mean and unbiased variance over tokens, as verl's masked_whiten over a response mask in which a
    sample's value fills all of its tokens. Samples outside ``include`` are shifted and scaled alike.
    """
    w = lengths.double() * include.double()
    n_tok = float(w.sum())
    if n_tok < 2:
        # One token or none: no variance to estimate; verl would divide by zero here.
        return values - (float((w * values).sum()) / n_tok if n_tok > 0 else 0.0)
    mu = (w * values).sum() / n_tok
    var = (w * (values - mu) ** 2).sum() / (n_tok - 1)
    return (values - mu) * torch.rsqrt(var + WHITEN_EPS)


def sequence_advantages(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    mode: str,
    drop_uniform: bool,
    lengths: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample advantages ([n] float32) and the mask of samples to keep ([n] bool).

    ``rewards``: [n] float; ``group_index``: [n] int64 (any labels, equal = same group);
    ``lengths``: [n] trained response tokens per sample, the weights of the reinforce++
    whitening (required for those two estimators, ignored by the others).
    """
    if mode not in ESTIMATORS:
        raise ValueError(f"advantage mode must be one of {list(ESTIMATORS)}, got {mode!r}")
    if rewards.shape != group_index.shape or rewards.dim() != 1:
        raise ValueError(
            f"rewards {tuple(rewards.shape)} and group_index {tuple(group_index.shape)} must be equal 1-D shapes"
        )
    if mode.startswith("reinforce_plus_plus") and (lengths is None or lengths.shape != rewards.shape):
        raise ValueError(f"advantage {mode!r} whitens over tokens and needs lengths [n] (trained tokens per sample)")
    r = rewards.double()
    _, count, centred, std, uniform = _groups(r, group_index)
    if mode == "reinforce_plus_plus":
        keep = torch.ones_like(uniform)
        adv = whiten(r, lengths, keep)
        return adv.float(), keep
    keep = ~uniform if drop_uniform else torch.ones_like(uniform)
    if mode == "mean":
        adv = centred
    elif mode == "mean_std":
        adv = centred / (std + eps)
    elif mode == "rloo":
        adv = centred * count / (count - 1).clamp(min=1)
    elif mode == "gpg":
        alpha = r.numel() / max(int(torch.count_nonzero(r)), 1)
        adv = alpha * centred
    else:  # reinforce_plus_plus_baseline
        adv = whiten(centred, lengths, keep)
    return adv.float(), keep
