"""Document-masked (varlen) flash attention for packed rows, as a transformers attention implementation.

A packed micro-batch is one row of several sequences (learner/batch.py). transformers' ``sdpa`` keeps
them apart with a [T, T] block-diagonal mask derived from the restarting ``position_ids``; SDPA with an
arbitrary mask cannot use the flash kernel, so every layer runs the memory-efficient or math kernel over
the whole T x T square, most of it masked. Here each sequence is its own segment of the flash kernel's
variable-length mode (``cu_seqlens``): causal inside a sequence, nothing across, no mask tensor, and the
work is sum(len^2) instead of T^2.

Guarantees: the function computed equals causal attention of each sequence on its own (compared against
``sdpa`` on the GPU by tests/gpu/test_fsdp_fast_paths_gpu.py). CUDA only: PyTorch's flash kernel has no CPU
build, so on CPU the engine keeps ``sdpa``. Grouped-query attention is passed through as it is (the flash
kernel takes fewer key/value heads than query heads).

Use: :func:`register` once, load the model with ``attn_implementation=VARLEN`` and pass
``**varlen_kwargs(mb)`` to its forward (transformers hands them to every attention call).
"""

from __future__ import annotations

import torch

VARLEN = "fleetrl_varlen"
_registered = False


def cu_seqlens(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(int32 [s + 1] sequence starts plus the total, longest length) from restarting ``position_ids`` [1, T].

    Reads the positions on the host: call it on the micro-batch's CPU tensors (learner/batch.py fills
    ``MicroBatch.cu_seqlens`` at planning time) so a forward needs no device-to-host copy.
    """
    pos = position_ids.reshape(-1).cpu()
    if pos.numel() == 0:
        raise ValueError("an empty row has no sequences")
    if int(pos[0]) != 0:
        raise ValueError(f"a packed row must start a sequence at position 0, got {int(pos[0])}")
    starts = torch.nonzero(pos == 0).view(-1)
    cu = torch.cat([starts, torch.tensor([pos.numel()])]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


def _varlen_attention(
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
    # transformers layout [1, heads, T, head_dim] -> the kernel's [T, heads, head_dim]
    if cu_seq_lens_q is None or max_length_q is None:
        raise RuntimeError(f"attention {VARLEN!r} needs cu_seq_lens_q and max_length_q in the model's forward kwargs")
    if query.shape[0] != 1:
        raise ValueError(f"attention {VARLEN!r} takes one packed row, got batch {query.shape[0]}")
    q = query[0].transpose(0, 1).contiguous()
    k = key[0].transpose(0, 1).contiguous()
    v = value[0].transpose(0, 1).contiguous()
    cu = cu_seq_lens_q.to(device=q.device, dtype=torch.int32, non_blocking=True)
    out = torch.ops.aten._flash_attention_forward(
        q, k, v, cu, cu, int(max_length_q), int(max_length_q), float(dropout), True, False, scale=scaling
    )[0]
    return out.unsqueeze(0), None  # [1, T, heads, head_dim], no attention weights


def register() -> str:
    """Register :data:`VARLEN` with transformers (idempotent); returns the name to load models with."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface

        # No mask function is registered for the name on purpose: transformers then builds no [T, T] mask.
        AttentionInterface.register(VARLEN, _varlen_attention)
        _registered = True
    return VARLEN


def varlen_kwargs(cu: torch.Tensor, max_len: int) -> dict:
    """The forward kwargs transformers passes through to :func:`_varlen_attention`."""
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": max_len, "max_length_k": max_len}
