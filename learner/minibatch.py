"""Several optimizer steps per step batch: whole prompt groups split into mini-batches, run for epochs.

``learner.ppo_mini_batch_size`` (prompt groups per optimizer step; None: all) and
``learner.ppo_epochs`` (verl's names) turn one step batch into
``ceil(trainable groups / mini) * epochs`` optimizer steps. The proximal
log-probs are computed once, for every mini-batch, before the first optimizer
step (the loop calls ``engine.prepare_logprobs`` on every plan first), so from the
second optimizer step on the policy differs from ``prox`` and the clip of
``tis``/``decoupled`` binds: the trust region. The policy version still advances
by one per step batch (one publish).

Guarantees: a mini-batch holds whole groups (GRPO advantages are per group and
were computed over the whole step batch); only groups with a trainable row (after
``mask_truncated``) are split, so no mini-batch is empty unless the whole batch is; every rank builds the same split
(a pure function of the batch, the step and the epoch).

Example::

    plans = plan_mini_batches(batch, groups_per_mini=8, rank=0, world_size=1, micro_batch_tokens=4096,
                              advantage="mean_std", drop_uniform=True, aggregation="token")
    for order in epoch_orders(len(plans), epochs=2, step=5): ...
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from learner.batch import StepPlan, plan_step, trainable_rows


def group_split(batch: pa.RecordBatch, trainable: np.ndarray, groups_per_mini: int | None) -> list[np.ndarray]:
    """Bool row masks, one per mini-batch, of whole trainable groups in order of first appearance."""
    gids = batch.column("group_id").to_numpy(zero_copy_only=False)
    order: dict[str, None] = {}
    for g, ok in zip(gids, trainable, strict=True):
        if ok:
            order.setdefault(g, None)
    groups = list(order)
    if groups_per_mini is None or groups_per_mini >= len(groups):
        return [trainable.copy()]
    masks = []
    for k in range(0, len(groups), groups_per_mini):
        chosen = np.isin(gids, np.asarray(groups[k : k + groups_per_mini], dtype=object))
        masks.append(chosen & trainable)
    return masks


def epoch_orders(n_mini: int, epochs: int, step: int) -> list[list[int]]:
    """The mini-batch order of each epoch: as built in epoch 0, then a permutation seeded by (step, epoch)."""
    orders = [list(range(n_mini))]
    for e in range(1, epochs):
        orders.append([int(i) for i in np.random.default_rng([step, e]).permutation(n_mini)])
    return orders


def plan_mini_batches(
    batch: pa.RecordBatch,
    *,
    groups_per_mini: int | None,
    rank: int,
    world_size: int,
    micro_batch_tokens: int,
    advantage: str,
    drop_uniform: bool,
    aggregation: str,
    learner_version: int | None = None,
    mask_truncated: bool = False,
    loss_scale_factor: int | None = None,
    uniform_in_mean: bool = False,
) -> tuple[list[StepPlan], dict[str, float]]:
    """One :class:`StepPlan` per mini-batch and the whole step batch's stats.

    With ``uniform_in_mean`` the mini-batches are cut from every group, uniform ones included, as if they were
    trained (each mini-batch's mean counts its own). A mini-batch of uniform groups alone is left out: it has
    nothing to compute, and verl's AdamW step on its zero gradient (momentum and decay) is the one difference."""
    # the same rows plan_step trains on: a group whose every response was cut (mask_truncated) must not make a
    # mini-batch of its own, which would be an empty optimizer step averaged into the step's metrics
    trainable = trainable_rows(batch, advantage, drop_uniform and not uniform_in_mean, mask_truncated)
    kw = dict(
        rank=rank,
        world_size=world_size,
        micro_batch_tokens=micro_batch_tokens,
        advantage=advantage,
        drop_uniform=drop_uniform,
        aggregation=aggregation,
        learner_version=learner_version,
        mask_truncated=mask_truncated,
        loss_scale_factor=loss_scale_factor,
        uniform_in_mean=uniform_in_mean,
    )
    masks = group_split(batch, trainable, groups_per_mini)
    if len(masks) == 1:
        plans = [plan_step(batch, **kw)]  # exactly today's single optimizer step
    else:
        plans = [plan_step(batch, select=m, **kw) for m in masks]
        if uniform_in_mean:  # the same on every rank: samples_trained counts the whole step batch's rows
            plans = [p for p in plans if p.stats["samples_trained"] > 0] or plans[:1]
    stats = dict(plans[0].stats)
    for name in ("samples_trained", "response_tokens", "micro_batches"):
        stats[name] = float(sum(p.stats[name] for p in plans))
    stats["mini_batches"] = float(len(plans))
    return plans, stats


def combine_steps(parts: list[dict[str, float]]) -> dict[str, float]:
    """Metrics of a step batch from those of its optimizer steps: the mean (each optimizer step's metrics are
    already means over its mini-batch), the max for ``*_max`` names, the sum of seconds; plus the count and
    the last optimizer step's ``clip_frac``/``ratio_mean`` (the most off-proximal one)."""
    out: dict[str, float] = {}
    for k in parts[0]:
        vals = [p[k] for p in parts if k in p]
        if k.endswith("_max"):
            out[k] = max(vals)
        elif k.endswith("_seconds"):
            out[k] = sum(vals)
        else:
            out[k] = sum(vals) / len(vals)
    out["optimizer_steps"] = float(len(parts))
    for k in ("clip_frac", "ratio_mean"):
        if k in parts[-1]:
            out[f"{k}_last"] = parts[-1][k]
    return out
