"""From a trajectory record batch to this rank's packed micro-batches for one optimizer step.

Every rank holds the whole step batch (rank 0 pulls it and broadcasts it), so
advantages, the split across ranks and the micro-batch plan are computed
identically everywhere without further communication. Each micro-batch is one
row of concatenated sequences whose ``position_ids`` restart at 0 per sequence
(transformers' padding-free path: no pad tokens, attention kept inside each
sequence). All ranks run the same number of micro-batches, because every
FSDP forward/backward is a collective; a rank with less work runs empty ones
(one token, weight zero).

Example::

    plan = plan_step(record_batch, rank=0, world_size=2, micro_batch_tokens=4096,
                     advantage="mean_std", drop_uniform=True, aggregation="token")
    for mb in plan.micro_batches: ...
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import torch

from broker.schema import loss_mask_of, token_versions, validate_batch
from learner.losses import aggregation_scale, aggregation_weights, group_advantages, mean_share

logger = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class MicroBatch:
    """One packed row. Token tensors are [n_targets]: one entry per response token."""

    input_ids: torch.Tensor  # [1, T] int64
    position_ids: torch.Tensor  # [1, T] int64, restarting at 0 for each sequence
    target_index: torch.Tensor  # [n] positions in the row whose logits predict a response token
    targets: torch.Tensor  # [n] the response token ids
    behaviour_logp: torch.Tensor  # [n] float32
    advantages: torch.Tensor  # [n] float32 (the sequence's advantage repeated)
    weights: torch.Tensor  # [n] aggregation weights (sum to 1 over the whole step)
    loss_scale: float = 1.0  # the sum modes' factor on sum(weights * loss) (learner.losses.aggregation_scale)
    seq_lens: torch.Tensor  # [s] trained response tokens of the packed sequences (loss mask applied)
    rows: list[int] = field(default_factory=list)  # rows of the step batch packed here
    fresh: torch.Tensor | None = None  # [n] bool: sampled by the policy version the learner holds (staleness 0)
    # int32 [s + 1] starts of the packed sequences plus T, and the longest one: varlen attention's segments
    # (learner/attention.py), known at planning time so no forward reads positions back from the device.
    cu_seqlens: torch.Tensor | None = None
    max_seqlen: int = 0
    prox_logp: torch.Tensor | None = None  # filled by the engine when the correction needs it
    is_weights: torch.Tensor | None = None  # [n] decoupled's behaviour weight from learner/correction.py
    # (SP rank, SP size) once learner/ulysses.py cut this row to one sequence-parallel slice; None: whole row
    sp_shard: tuple[int, int] | None = None
    ref_logp: torch.Tensor | None = None  # filled by the engine when kl_coef > 0
    # advantage=gae (learner/critic.py): [s] each sequence's reward (on its last trained token), then, filled
    # by the critic before training, [n] its values (no grad) and the value targets
    rewards: torch.Tensor | None = None
    values: torch.Tensor | None = None
    returns: torch.Tensor | None = None

    @property
    def n_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    def to(self, device: torch.device) -> MicroBatch:
        for name in (
            "input_ids",
            "position_ids",
            "target_index",
            "targets",
            "behaviour_logp",
            "advantages",
            "weights",
            "fresh",
            "cu_seqlens",
            "is_weights",
        ):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.to(device, non_blocking=True))
        return self


@dataclass(kw_only=True, slots=True)
class StepPlan:
    micro_batches: list[MicroBatch]
    stats: dict[str, float]  # whole-step numbers, identical on every rank


def _pack(lengths: list[int], budget: int) -> list[list[int]]:
    """First-fit decreasing bin packing of sequence indices under a token budget."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        for b in range(len(bins)):
            if lengths[i] <= room[b]:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            if lengths[i] > budget:
                logger.warning(
                    "a sequence of %d tokens exceeds micro_batch_tokens=%d; it gets its own micro-batch",
                    lengths[i],
                    budget,
                )
            bins.append([i])
            room.append(budget - lengths[i])
    return [sorted(b) for b in bins]


def _split_ranks(lengths: list[int], world_size: int) -> list[list[int]]:
    """Longest first, each sequence to the rank with the fewest tokens (ties: lowest rank)."""
    load = [0] * world_size
    out: list[list[int]] = [[] for _ in range(world_size)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(world_size), key=lambda r: (load[r], r))
        out[r].append(i)
        load[r] += lengths[i]
    return [sorted(x) for x in out]


def _empty_micro_batch() -> MicroBatch:
    """A one-token row with one target of weight zero: keeps collectives in step, changes nothing."""
    z = torch.zeros(1, dtype=torch.int64)
    return MicroBatch(
        input_ids=z.view(1, 1),
        position_ids=z.view(1, 1),
        target_index=z.clone(),
        targets=z.clone(),
        behaviour_logp=torch.zeros(1),
        advantages=torch.zeros(1),
        weights=torch.zeros(1),
        seq_lens=torch.ones(1, dtype=torch.int64),
        fresh=torch.zeros(1, dtype=torch.bool),
        cu_seqlens=torch.tensor([0, 1], dtype=torch.int32),
        max_seqlen=1,
    )


def trainable_rows(
    batch: pa.RecordBatch, advantage: str, drop_uniform: bool, mask_truncated: bool = False
) -> np.ndarray:
    """Bool mask of the rows :func:`plan_step` would train on (kept groups, non-empty responses, and with
    ``mask_truncated`` no response cut at the length limit)."""
    _, keep = _advantages(batch, advantage, drop_uniform)
    rows = keep.numpy() & (_trained_lengths(batch) > 0)
    if mask_truncated:
        rows &= batch.column("finish_reason").to_numpy(zero_copy_only=False) != "length"
    return rows


def _advantages(batch: pa.RecordBatch, advantage: str, drop_uniform: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row advantages and keep mask over the whole step batch (learner/advantages.py); for ``gae`` zeros and
    every row kept: its advantages are per token, from the critic's values at training time
    (learner/critic.py), and a group of one sample is legal."""
    rewards = torch.from_numpy(batch.column("reward").to_numpy(zero_copy_only=False).astype(np.float32))
    if advantage == "gae":
        return torch.zeros_like(rewards), torch.ones(rewards.shape, dtype=torch.bool)
    _, gidx = np.unique(batch.column("group_id").to_numpy(zero_copy_only=False), return_inverse=True)
    lengths = torch.from_numpy(_trained_lengths(batch).astype(np.int64))
    return group_advantages(rewards, torch.from_numpy(gidx.astype(np.int64)), advantage, drop_uniform, lengths=lengths)


def _trained_lengths(batch: pa.RecordBatch) -> np.ndarray:
    """Response tokens trained on per row: all of them, or the ones its loss mask keeps."""
    r_len = np.diff(batch.column("response_ids").offsets.to_numpy())
    mask = batch.column("loss_mask")
    m_off = mask.offsets.to_numpy()
    if m_off[-1] == m_off[0]:  # no row carries a mask (single-turn batches)
        return r_len
    rel = m_off - m_off[0]
    cs = np.concatenate(
        [[0], np.cumsum(mask.values.to_numpy(zero_copy_only=False)[m_off[0] : m_off[-1]], dtype=np.int64)]
    )
    return np.where(rel[1:] == rel[:-1], r_len, cs[rel[1:]] - cs[rel[:-1]])


def plan_step(
    batch: pa.RecordBatch,
    *,
    rank: int,
    world_size: int,
    micro_batch_tokens: int,
    advantage: str,
    drop_uniform: bool,
    aggregation: str,
    select: np.ndarray | None = None,
    learner_version: int | None = None,
    mask_truncated: bool = False,
    loss_scale_factor: int | None = None,
    uniform_in_mean: bool = False,
) -> StepPlan:
    """Advantages, the rank split and this rank's micro-batches for one optimizer step.

    Advantages are computed over the whole step batch; ``select`` (bool mask over its
    rows, whole groups: learner/minibatch.py) restricts what this optimizer step trains
    on, and the aggregation weights sum to one over the selection. ``learner_version``:
    the version the learner holds; tokens sampled by it are marked ``fresh``.
    ``mask_truncated``: responses cut at the length limit (finish reason ``length``) still
    count in their group's advantage baseline but are not trained on. ``loss_scale_factor``: the
    constant length of ``aggregation='seq_mean_token_sum_norm'`` (learner.losses.aggregation_scale).
    ``uniform_in_mean`` (with ``drop_uniform``): the dropped groups' rows are not trained, yet count in the
    loss's mean (``loss_scale`` times :func:`learner.losses.mean_share`): the gradient of training them at
    advantage 0. Only exact where their token loss is zero (the config checks: learner/config.py).
    """
    validate_batch(batch)
    if batch.num_rows == 0:
        raise ValueError("a step batch must hold at least one trajectory")
    if select is not None and (select.dtype != np.bool_ or select.shape != (batch.num_rows,)):
        raise ValueError(
            f"select must be a bool mask of the batch's {batch.num_rows} rows, got {select.dtype} {select.shape}"
        )
    prompts = batch.column("prompt_ids")
    responses = batch.column("response_ids")
    behaviour = batch.column("behaviour_logprobs")
    p_len = np.diff(prompts.offsets.to_numpy())
    r_len = np.diff(responses.offsets.to_numpy())
    if (bad := p_len < 1).any():
        raise ValueError(f"row {int(np.flatnonzero(bad)[0])}: a trajectory needs at least one prompt token")
    rewards = torch.from_numpy(batch.column("reward").to_numpy(zero_copy_only=False).astype(np.float32))
    adv, keep = _advantages(batch, advantage, drop_uniform)
    t_len = _trained_lengths(batch)  # masked-out tokens (observations) are fed but not trained on
    truncated = batch.column("finish_reason").to_numpy(zero_copy_only=False) == "length"
    in_mean = t_len > 0  # the rows of this optimizer step's mean; uniform_in_mean counts the dropped ones there
    if mask_truncated:
        in_mean &= ~truncated
    if select is not None:
        in_mean &= select
    keep_np = keep.numpy() & in_mean
    rows = [int(i) for i in np.flatnonzero(keep_np)]
    total_tokens = int(t_len[rows].sum())
    loss_scale = aggregation_scale(aggregation, total_tokens, len(rows), loss_scale_factor)
    if uniform_in_mean and rows:
        mean_rows = np.flatnonzero(in_mean)
        loss_scale *= mean_share(aggregation, total_tokens, len(rows), int(t_len[mean_rows].sum()), len(mean_rows))
    stats = {
        "samples": float(batch.num_rows),
        "samples_trained": float(len(rows)),
        "samples_dropped_uniform": float((~keep.numpy()).sum()),
        "samples_truncated": float(truncated.sum()),
        "response_tokens": float(total_tokens),
        "reward_mean": float(rewards.mean()),
        "advantage_abs_mean": float(adv[keep].abs().mean()) if bool(keep.any()) else 0.0,
    }
    if not rows:
        logger.warning("no trainable sample in this step (all groups uniform or responses empty)")

    p_off, r_off, b_off = prompts.offsets.to_numpy(), responses.offsets.to_numpy(), behaviour.offsets.to_numpy()
    p_val = prompts.values.to_numpy(zero_copy_only=False)
    r_val = responses.values.to_numpy(zero_copy_only=False)
    b_val = behaviour.values.to_numpy(zero_copy_only=False)
    seg_s, seg_v = batch.column("segment_starts"), batch.column("segment_versions")
    ss_off, sv_off = seg_s.offsets.to_numpy(), seg_v.offsets.to_numpy()
    ss_val, sv_val = seg_s.values.to_numpy(zero_copy_only=False), seg_v.values.to_numpy(zero_copy_only=False)
    lm = batch.column("loss_mask")
    lm_off, lm_val = lm.offsets.to_numpy(), lm.values.to_numpy(zero_copy_only=False)
    # The last response token predicts nothing we train on, so it is not fed: L - 1 inputs per sequence.
    in_len = [int(p_len[i] + r_len[i] - 1) for i in rows]
    per_rank = _split_ranks(in_len, world_size)
    packed = [
        [[per_rank[r][j] for j in b] for b in _pack([in_len[k] for k in per_rank[r]], micro_batch_tokens)]
        for r in range(world_size)
    ]
    n_micro = max(1, max(len(p) for p in packed))

    mbs: list[MicroBatch] = []
    for members in packed[rank]:
        ids, pos, tidx, tgt, blp, advs, lens, used, fr = [], [], [], [], [], [], [], [], []
        offset = 0
        for k in members:
            i = rows[k]
            resp = r_val[r_off[i] : r_off[i + 1]]
            seq = np.concatenate([p_val[p_off[i] : p_off[i + 1]], resp])[:-1]
            ids.append(seq)
            pos.append(np.arange(len(seq)))
            m = loss_mask_of(lm_val[lm_off[i] : lm_off[i + 1]], int(r_len[i]))
            tidx.append((offset + p_len[i] - 1 + np.arange(r_len[i]))[m])
            tgt.append(resp[m])
            blp.append(b_val[b_off[i] : b_off[i + 1]][m])
            advs.append(np.full(int(t_len[i]), float(adv[i]), dtype=np.float32))
            versions = token_versions(
                ss_val[ss_off[i] : ss_off[i + 1]], sv_val[sv_off[i] : sv_off[i + 1]], int(r_len[i])
            )
            fr.append(versions[m] == learner_version if learner_version is not None else np.zeros(int(t_len[i]), bool))
            lens.append(int(t_len[i]))
            used.append(i)
            offset += len(seq)
        seq_lens = torch.tensor(lens, dtype=torch.int64)
        in_lens = [len(x) for x in ids]
        mbs.append(
            MicroBatch(
                input_ids=torch.from_numpy(np.concatenate(ids).astype(np.int64)).view(1, -1),
                position_ids=torch.from_numpy(np.concatenate(pos).astype(np.int64)).view(1, -1),
                target_index=torch.from_numpy(np.concatenate(tidx).astype(np.int64)),
                targets=torch.from_numpy(np.concatenate(tgt).astype(np.int64)),
                behaviour_logp=torch.from_numpy(np.concatenate(blp).astype(np.float32)),
                advantages=torch.from_numpy(np.concatenate(advs)),
                weights=aggregation_weights(seq_lens, aggregation, total_tokens, len(rows)),
                loss_scale=loss_scale,
                seq_lens=seq_lens,
                rows=used,
                fresh=torch.from_numpy(np.concatenate(fr)),
                rewards=rewards[used].double(),
                cu_seqlens=torch.tensor(np.concatenate([[0], np.cumsum(in_lens)]), dtype=torch.int32),
                max_seqlen=max(in_lens),
            )
        )
    while len(mbs) < n_micro:
        mbs.append(_empty_micro_batch())
    stats["micro_batches"] = float(n_micro)
    return StepPlan(micro_batches=mbs, stats=stats)
