"""Ulysses sequence parallelism for the FSDP learner: one packed row split over the ranks of an SP group.

Layout. The ``W`` learner ranks form ``W / sp`` data-parallel replicas of ``sp`` consecutive ranks each
(rank ``r`` is in SP group ``r // sp`` at SP rank ``r % sp``). The step batch is split by replica
(``data_rank = r // sp``, learner/batch.py), so the ranks of one SP group plan the same micro-batches; each
then keeps a contiguous ``1 / sp`` slice of every packed row (the row padded with a dummy sequence to a
multiple of ``sp``). Everything position-wise (embeddings, MLPs, norms, RoPE with the slice's own
``position_ids``, the LM head, the log-probs and the loss) runs on the slice. Attention needs the whole row,
so around it the group swaps a sequence split for a head split (two all-to-alls):

    q, k, v  [1, heads, T/sp, d]  --all-to-all-->  [1, heads/sp, T, d]   (every token, some heads)
    the existing document-masked attention over the whole row (varlen on CUDA, sdpa with a block mask)
    out      [1, T, heads/sp, d]  --all-to-all-->  [1, T/sp, heads, d]   (back to the slice, all heads)

Key/value heads: ``heads`` must be divisible by ``sp``; with ``kv_heads`` not divisible by ``sp`` each
key/value head is repeated ``sp / gcd(kv_heads, sp)`` times before the exchange (as verl does for
``kv_heads < sp``); the query-to-key/value grouping is unchanged by it (a query head's group is still the
same original key/value head), and the backward of the repeat sums the copies' gradients.

Loss and gradients (docs/long_context.md derives it). A response token is scored on the one SP rank
whose slice holds the position predicting it, so each token's aggregation weight is counted exactly once
and the loss summed over every rank is the step's loss, as without SP. The all-to-all's backward is the
reverse all-to-all, so backward on all ranks together computes the gradient of the sum of the ranks'
losses; each rank's parameter gradient is the part of it from its own slice's computation. FSDP averages
gradients over all ``W`` ranks; summed over a replica's ``sp`` ranks they give that replica's gradient, so
the existing ``loss * W`` before backward is still the global gradient: SP ranks are data ranks for the
gradient reduction and nothing is rescaled.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from learner import attention

ULYSSES = "fleetrl_ulysses"
logger = logging.getLogger(__name__)


def kv_repeat(heads: int, kv_heads: int, sp: int) -> int:
    """How many times each key/value head is repeated so both head counts split over ``sp`` ranks."""
    if sp < 1:
        raise ValueError(f"sequence_parallel_size must be >= 1, got {sp}")
    if heads % sp:
        raise ValueError(f"sequence_parallel_size={sp} does not divide the model's {heads} attention heads")
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"{kv_heads} key/value heads do not divide {heads} attention heads")
    return sp // math.gcd(kv_heads, sp)


# ---- collectives ---------------------------------------------------------------------------------------------
def _all_to_all(x: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Split ``x`` in ``sp`` equal parts along ``scatter_dim``, send part j to SP rank j, and concatenate what
    arrives (in SP-rank order) along ``gather_dim``."""
    sp = dist.get_world_size(group)
    if x.shape[scatter_dim] % sp:
        raise ValueError(f"all-to-all: dim {scatter_dim} of {tuple(x.shape)} does not split into {sp} parts")
    send = torch.stack(x.chunk(sp, dim=scatter_dim)).contiguous()  # [sp, ...part]
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, scatter_dim: int, gather_dim: int):
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        # The exchange is a permutation of blocks between ranks; its adjoint is the reverse exchange.
        return _all_to_all(grad, ctx.group, gather_dim, scatter_dim), None, None, None


def all_to_all(x: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Differentiable :func:`_all_to_all` (collective: every rank of ``group`` calls it alike)."""
    return _AllToAll.apply(x, group, scatter_dim, gather_dim)


# ---- attention -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _State:
    group: Any
    kv_repeat: int
    varlen: bool


_state: _State | None = None  # one engine per process: its SP group, set by SequenceParallel.setup
_registered = False


def block_causal_mask(cu: torch.Tensor, device: torch.device) -> torch.Tensor:
    """[T, T] bool: query i may attend to key j iff both lie in the same packed sequence and j <= i."""
    cu = cu.to(device=device, dtype=torch.int64)
    seg = torch.repeat_interleave(torch.arange(cu.numel() - 1, device=device), cu[1:] - cu[:-1])
    return (seg[:, None] == seg[None, :]) & torch.ones(seg.numel(), seg.numel(), dtype=torch.bool, device=device).tril()


def _sdpa_full(q, k, v, cu, scaling, dropout):
    # q [1, h, T, d]; k, v [1, h_kv, T, d] with h_kv dividing h
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    mask = block_causal_mask(cu, q.device)
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=float(dropout), scale=scaling
    )
    return out.transpose(1, 2)  # [1, T, h, d]


def _ulysses_attention(
    module,
    query,
    key,
    value,
    attention_mask,
    scaling=None,
    dropout=0.0,
    cu_seq_lens_q=None,
    max_length_q=None,
    **_kwargs,
):
    st = _state
    if st is None:
        raise RuntimeError(f"attention {ULYSSES!r} used before SequenceParallel.setup() set its group")
    if cu_seq_lens_q is None or max_length_q is None:
        raise RuntimeError(f"attention {ULYSSES!r} needs the whole row's cu_seq_lens_q and max_length_q")
    if query.shape[0] != 1:
        raise ValueError(f"attention {ULYSSES!r} takes one packed row, got batch {query.shape[0]}")
    if st.kv_repeat > 1:
        key = key.repeat_interleave(st.kv_repeat, dim=1)
        value = value.repeat_interleave(st.kv_repeat, dim=1)
    # [1, heads, T/sp, d] -> [1, heads/sp, T, d]: scatter heads (dim 1), gather the sequence (dim 2)
    q, k, v = (all_to_all(t, st.group, 1, 2) for t in (query, key, value))
    if st.varlen:
        out, _ = attention._varlen_attention(
            module,
            q,
            k,
            v,
            None,
            scaling=scaling,
            dropout=dropout,
            cu_seq_lens_q=cu_seq_lens_q,
            max_length_q=max_length_q,
        )
    else:
        out = _sdpa_full(q, k, v, cu_seq_lens_q, scaling, dropout)
    # [1, T, heads/sp, d] -> [1, T/sp, heads, d]: scatter the sequence (dim 1), gather heads (dim 2)
    return all_to_all(out, st.group, 1, 2), None


def register() -> str:
    """Register :data:`ULYSSES` with transformers (idempotent); returns the name to load models with."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface

        # No mask function for the name: transformers builds no (slice-sized, wrong) mask; the whole row's
        # segments come in through cu_seq_lens_q.
        AttentionInterface.register(ULYSSES, _ulysses_attention)
        _registered = True
    return ULYSSES


# ---- the micro-batch slice -----------------------------------------------------------------------------------
_PER_TOKEN = ("targets", "behaviour_logp", "advantages", "weights", "fresh", "prox_logp", "ref_logp")


def shard_micro_batch(mb, sp_rank: int, sp: int):
    """Turn ``mb`` (a whole packed row) into this SP rank's slice, in place, and return it.

    The row is padded to a multiple of ``sp`` with one dummy sequence (token 0, positions from 0, no
    targets), so it never attends to or from a real token. The slice keeps the response tokens whose
    predicting position lies in it (``target_index`` made relative to the slice) and the same entries of
    every per-token tensor; ``cu_seqlens``/``max_seqlen`` become the whole padded row's, which attention
    needs. Idempotent: a slice is left as it is.
    """
    if mb.sp_shard is not None:
        if mb.sp_shard != (sp_rank, sp):
            raise RuntimeError(f"micro-batch already sliced for SP rank/size {mb.sp_shard}, not {(sp_rank, sp)}")
        return mb
    if not 0 <= sp_rank < sp:
        raise ValueError(f"sp_rank must be in [0, {sp}), got {sp_rank}")
    n = mb.n_tokens
    pad = (-n) % sp
    cu, longest = (mb.cu_seqlens, mb.max_seqlen) if mb.cu_seqlens is not None else attention.cu_seqlens(mb.position_ids)
    ids, pos = mb.input_ids, mb.position_ids
    if pad:
        ids = torch.cat([ids, ids.new_zeros(1, pad)], dim=1)
        pos = torch.cat([pos, torch.arange(pad, dtype=pos.dtype, device=pos.device).view(1, -1)], dim=1)
        cu = torch.cat([cu, torch.tensor([n + pad], dtype=cu.dtype, device=cu.device)])
        longest = max(int(longest), pad)
    t = (n + pad) // sp
    lo, hi = sp_rank * t, (sp_rank + 1) * t
    keep = (mb.target_index >= lo) & (mb.target_index < hi)
    mb.input_ids, mb.position_ids = ids[:, lo:hi].contiguous(), pos[:, lo:hi].contiguous()
    mb.target_index = mb.target_index[keep] - lo
    for name in _PER_TOKEN:
        v = getattr(mb, name)
        if v is not None:
            setattr(mb, name, v[keep.to(v.device)])
    mb.cu_seqlens, mb.max_seqlen = cu, int(longest)
    mb.sp_shard = (sp_rank, sp)
    return mb


# ---- per-engine setup ----------------------------------------------------------------------------------------
def sp_ranks(world_size: int, sp: int) -> list[list[int]]:
    """The SP groups: ``world_size / sp`` blocks of consecutive ranks."""
    if sp < 1 or world_size % sp:
        raise ValueError(f"sequence_parallel_size={sp} does not divide the learner's {world_size} ranks")
    return [list(range(d * sp, (d + 1) * sp)) for d in range(world_size // sp)]


@dataclass(frozen=True)
class SequenceParallel:
    """This rank's place in the SP x DP layout and its SP process group."""

    size: int
    rank: int  # within the SP group
    dp_rank: int
    dp_size: int
    group: Any

    @classmethod
    def setup(cls, sp: int, heads: int, kv_heads: int, varlen: bool) -> SequenceParallel:
        """Create every SP group (collective: all ranks call it, in the same order) and point the
        :data:`ULYSSES` attention at this rank's."""
        global _state
        rank, world = dist.get_rank(), dist.get_world_size()
        rep = kv_repeat(heads, kv_heads, sp)
        mine = None
        for ranks in sp_ranks(world, sp):  # new_group is collective over the whole world, for every group
            g = dist.new_group(ranks)
            if rank in ranks:
                mine = g
        _state = _State(group=mine, kv_repeat=rep, varlen=varlen)
        register()
        logger.info(
            "Ulysses SP: rank %d is SP rank %d of %d in data replica %d of %d (key/value heads x%d, %s inside)",
            rank,
            rank % sp,
            sp,
            rank // sp,
            world // sp,
            rep,
            "varlen" if varlen else "sdpa",
        )
        return cls(size=sp, rank=rank % sp, dp_rank=rank // sp, dp_size=world // sp, group=mine)

    def shard(self, mb):
        return shard_micro_batch(mb, self.rank, self.size)

    @staticmethod
    def forward_kwargs(mb) -> dict:
        return attention.varlen_kwargs(mb.cu_seqlens, mb.max_seqlen)


def setup_engine(cfg, model_path: str, fast) -> SequenceParallel:
    """The FSDP engine's hook: check the layout against the model and the attention, then :meth:`SequenceParallel.setup`."""
    import json
    from pathlib import Path

    inner = fast.attn_implementation
    if inner not in ("sdpa", "varlen", attention.VARLEN):
        raise ValueError(
            f"learner.sequence_parallel_size={cfg.sequence_parallel_size} wraps the varlen or sdpa "
            f"attention, not {inner!r}: set learner.attn_implementation to auto, varlen or sdpa"
        )
    hf = json.loads((Path(model_path) / "config.json").read_text())
    cfg.check_sequence_parallel(dist.get_world_size(), hf)
    heads = hf["num_attention_heads"]
    return SequenceParallel.setup(
        cfg.sequence_parallel_size, heads, hf.get("num_key_value_heads") or heads, varlen=fast.varlen
    )
