"""Which of the learner's fast paths an FSDP engine uses, resolved once from the config and the device.

The choices (``learner.*`` config keys; ``auto`` means on for a GPU rank, off for a CPU rank, so the CPU
system keeps the plain, reference computation):

- ``logprobs``: ``chunked`` computes response log-probs and entropies from the last hidden state in
  vocabulary chunks (learner/logprobs.py), ``full`` materialises the full logits (learner/engine.py).
- ``attn_implementation``: ``varlen`` is document-masked flash attention over the packed row
  (learner/attention.py, CUDA only); ``sdpa``/``eager``/``flash_attention_2`` are transformers' own.
- ``fused_optimizer``: AdamW's fused CUDA kernel (one launch for all parameters) instead of foreach.
- ``meta_init``: build on the meta device and read each rank's shards from safetensors
  (learner/loading.py) instead of a full fp32 copy of the model per rank.
- ``compile_blocks``: ``torch.compile`` of each decoder layer's forward (off by default: it pays only
  when its compile time is amortised, and it recompiles for new row lengths).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from learner import attention


@dataclass(frozen=True)
class FastPaths:
    chunked_logprobs: bool
    logprob_chunk: int
    attn_implementation: str  # the name to load the transformers model with
    varlen: bool
    fused_optimizer: bool
    meta_init: bool
    compile_blocks: bool

    @classmethod
    def resolve(cls, cfg, on_gpu: bool) -> FastPaths:
        def pick(value: str) -> bool:
            return on_gpu if value == "auto" else value == "on"

        attn = cfg.attn_implementation
        if attn == "auto":
            attn = "varlen" if on_gpu else "sdpa"
        if attn == "varlen" and not on_gpu:
            raise ValueError("learner.attn_implementation=varlen needs a GPU (PyTorch's flash kernel is CUDA-only); "
                             "use sdpa on CPU")
        varlen = attn == "varlen"
        return cls(chunked_logprobs=(cfg.logprobs == "chunked") or (cfg.logprobs == "auto" and on_gpu),
                   logprob_chunk=cfg.logprob_chunk, varlen=varlen,
                   attn_implementation=attention.register() if varlen else attn,
                   fused_optimizer=pick(cfg.fused_optimizer), meta_init=pick(cfg.meta_init),
                   compile_blocks=cfg.compile_blocks)

    def forward_kwargs(self, mb) -> dict:
        if not self.varlen:
            return {}
        if mb.cu_seqlens is None:
            cu, longest = attention.cu_seqlens(mb.position_ids)
            mb.cu_seqlens, mb.max_seqlen = cu.to(mb.input_ids.device), longest
        return attention.varlen_kwargs(mb.cu_seqlens, mb.max_seqlen)


def compile_blocks(blocks: list[torch.nn.Module]) -> None:
    """Compile each decoder layer's forward in place (parameter names and FSDP's hooks stay as they are)."""
    import torch._dynamo

    # One graph serves every layer of a class; the limit covers a few row lengths per layer before dynamic shapes.
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 8 * len(blocks))
    for m in blocks:
        m.forward = torch.compile(m.forward)
