"""Document-masked flash attention as Megatron-core's core attention (no Transformer Engine needed).

Megatron's local layer spec computes attention with ``DotProductAttention``: [b, heads, T, T] scores, a
[T, T] mask of the packed row, an unfused softmax, all kept for the backward. That is T^2 memory per
layer (a 16k-token row does not fit 24 layers on an H200) and T^2 work of which most is masked. This
module replaces it with PyTorch's flash kernel in variable-length mode, one segment per packed sequence:
causal inside each sequence, nothing across, sum(len^2) work, no mask tensor.

The segments of the row being run are set by the engine before each forward (:func:`set_segments`):
Megatron's no-pipelining schedule runs each micro-batch's forward and backward back to back, so the
segments are still those of the micro-batch when a full-recompute backward re-runs the forward. Hence
PP = 1 and no sequence parallelism (both pad or split the row); the engine falls back otherwise.

Guarantees: the same function as DotProductAttention with the packed causal mask (grouped-query heads
are passed to the kernel as they are, the scale is 1/sqrt(head_dim) unless the config sets one).
"""

from __future__ import annotations

import torch

_segments: dict[str, object] = {"cu": None, "max": 0}


def set_segments(cu: torch.Tensor, max_len: int) -> None:
    """int32 [s + 1] sequence starts (plus T) on the GPU and the longest sequence of the row about to run."""
    _segments["cu"], _segments["max"] = cu, int(max_len)


def core_attention_class():
    from megatron.core.transformer.module import MegatronModule

    class VarlenCoreAttention(MegatronModule):
        def __init__(
            self,
            config,
            layer_number,
            attn_mask_type,
            attention_type,
            attention_dropout=None,
            softmax_scale=None,
            cp_comm_type=None,
            pg_collection=None,
            **_unused,
        ) -> None:
            super().__init__(config=config)
            self.scale = softmax_scale if softmax_scale is not None else config.softmax_scale

        def forward(
            self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
        ):
            cu, longest = _segments["cu"], _segments["max"]
            if cu is None:
                raise RuntimeError("VarlenCoreAttention: no segments set for this row (learner.megatron.varlen)")
            sq, b, heads, dim = query.shape
            if b != 1:
                raise ValueError(f"VarlenCoreAttention takes one packed row, got batch {b}")
            out = torch.ops.aten._flash_attention_forward(
                query[:, 0].contiguous(),
                key[:, 0].contiguous(),
                value[:, 0].contiguous(),
                cu,
                cu,
                longest,
                longest,
                0.0,
                True,
                False,
                scale=self.scale,
            )[0]
            return out.reshape(sq, b, heads * dim)  # [sq, b, hidden per partition], as DotProductAttention

    return VarlenCoreAttention
