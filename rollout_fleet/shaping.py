"""DAPO's reward-side pieces, applied by the rollout worker after a group is scored.

* Overlong shaping (``reward.overlong_buffer``): with ``L = rollout.sampling.max_tokens`` and buffer
  ``b``, a response of ``n`` tokens gets ``min(0, -(n - (L - b)) / b * penalty_factor)`` added to its
  reward: nothing up to ``L - b`` tokens, then linearly down to ``-penalty_factor`` at ``L`` (verl's
  DAPO reward manager). It is added whatever the finish reason, as verl does.
* Dynamic sampling (``rollout.filter_groups``): a group whose metric has no spread (every sample the
  same) carries no GRPO signal; the worker drops it and samples a fresh prompt on the same ticket, so
  every step still gets ``groups_per_step`` groups that all carry one. verl filters the same way
  (``std > 0``, a group of one kept) after generating whole batches.

Pure functions, so the rules are tested without a fleet.
"""

from __future__ import annotations

from collections.abc import Sequence

# filter_groups metrics read from the reward function's score (before shaping) or the reward pushed
RAW_METRICS = ("acc", "score")


def overlong_penalty(length: int, max_tokens: int, buffer_len: int, penalty_factor: float) -> float:
    """The (<= 0) reward added to a response of ``length`` tokens; see the module docstring."""
    if buffer_len < 1 or buffer_len > max_tokens:
        raise ValueError(f"overlong buffer length must be in 1..max_tokens={max_tokens}, got {buffer_len}")
    exceed = length - (max_tokens - buffer_len)
    return min(-exceed / buffer_len * penalty_factor, 0.0)


def shape(
    rewards: Sequence[float], lengths: Sequence[int], max_tokens: int, buffer_len: int, penalty_factor: float
) -> list[float]:
    """``rewards`` with each response's overlong penalty added."""
    return [
        float(r) + overlong_penalty(int(n), max_tokens, buffer_len, penalty_factor)
        for r, n in zip(rewards, lengths, strict=True)
    ]


def uniform(values: Sequence[float]) -> bool:
    """True if a group of two or more has the same value everywhere (verl: metric std == 0; a group of one
    is kept)."""
    return len(values) > 1 and max(values) == min(values)
