"""The learner's fast paths and micro-batch sizing, resolved once per run from the config and the device.

:func:`resolve_fast_path` is the one place where ``auto`` in the learner config becomes a choice; it is a
pure function of the config, a :class:`DeviceProps` (what the rank's device is, how much memory is free)
and the model's :class:`ModelShape`, so every rule below is tested on CPU with a made-up GPU. The engines
(learner/fsdp.py, learner/megatron/engine.py) call it once, log :meth:`ResolvedSettings.describe` and hand
:meth:`ResolvedSettings.as_dict` to the run's summary. ``auto`` means on for a GPU rank, off for a CPU
rank, so the CPU system keeps the plain reference computation:

- ``logprobs``: ``chunked`` computes response log-probs and entropies from the last hidden state in
  vocabulary chunks (learner/logprobs.py), ``full`` materialises the full logits (learner/engine.py).
- ``attn_implementation``: ``varlen`` is document-masked flash attention over the packed row
  (learner/attention.py, CUDA only); ``sdpa``/``eager``/``flash_attention_2`` are transformers' own.
- ``fused_optimizer``: AdamW's fused CUDA kernel (one launch for all parameters) instead of foreach.
- ``meta_init``: build on the meta device and read each rank's shards from safetensors
  (learner/loading.py) instead of a full fp32 copy of the model per rank (FSDP).
- ``compile_blocks``: ``torch.compile`` of each decoder layer's forward and of the chunked head's
  per-chunk fp32 arithmetic (FSDP; Megatron compiles each layer's MLP).
- ``micro_batch_tokens``: on GPU, the largest power of two whose estimated peak memory fits the GPU's
  free memory (:func:`micro_batch_budget`), at most :data:`MAX_AUTO_TOKENS`; on CPU 8192.
- ``activation_checkpointing``: on GPU, only when without it the budget would fall below
  :data:`AC_BELOW_TOKENS` and with it the budget is larger (recomputing the layers costs about a third
  more compute; small rows cost more: launch-bound steps).

Also resolved here: the dtype FSDP's root (embeddings, final norm, output layer) computes in. With the
chunked head on GPU it is bf16, as in the inference engines: the head's matmul takes bf16 operands
anyway and returns fp32 logits (learner/logprobs.py), and the fp32 root only doubled the root's
all-gathered bytes. With the full-logits head the root stays fp32 (fp32 logits and log-softmax).

Old behaviour, in the config: ``logprobs=full attn_implementation=sdpa fused_optimizer=off meta_init=off
compile_blocks=false micro_batch_tokens=8192 activation_checkpointing=false``.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

GIB = 1 << 30
CPU_MICRO_BATCH_TOKENS = 8192  # the CPU default before "auto": small models, no launch overhead to amortise
MIN_AUTO_TOKENS = 2048  # below this a GPU step is launch-bound; "auto" refuses rather than crawl
AC_BELOW_TOKENS = 8192  # without checkpointing a budget under this is slower than checkpointing's bigger one
MAX_AUTO_TOKENS = 32768  # the largest budget measured to fit and pay off (bench/results/learner_issue21.md)

# Memory model of one training micro-batch, fitted to the peak GPU memory bench/learner.py recorded
# (bench/results/learner_issue21.json; derivation in docs/fast_default.md). Activation bytes kept per token
# and decoder layer = coefficient x (hidden + intermediate); compiled layers fuse the MLP's and norms'
# elementwise temporaries away.
ACT_COEF = {("fsdp", True): 7, ("fsdp", False): 10, ("megatron", True): 10, ("megatron", False): 12}
CKPT_COEF = 4  # with checkpointing a layer keeps its input (bf16 hidden, with slack): bytes per hidden unit
HEAD_CHUNK_COPIES = 3  # fp32 [chunk, vocab] buffers alive at once in the chunked head (logits, p, grad)
FULL_LOGITS_COPIES = 4  # fp32 [T, vocab] buffers of the full-logits path (logits, selection, log-softmax, exp)
RESERVE_FRACTION = 0.10  # of free memory: allocator fragmentation, per-shape compile workspaces
RESERVE_BYTES = 3 * GIB  # NCCL buffers, cuBLAS workspaces, the CUDA graphs of compiled blocks


@dataclass(frozen=True)
class DeviceProps:
    """What the resolution needs to know of a rank's device; build one by hand in tests."""

    type: str  # "cuda" or "cpu"
    free_bytes: int = 0  # free memory now (on several ranks: the least any rank has)
    total_bytes: int = 0
    name: str = "cpu"
    capability: tuple[int, int] | None = None  # CUDA compute capability
    compiler: bool = True  # torch.compile can generate GPU kernels here (Triton importable)

    @property
    def is_gpu(self) -> bool:
        return self.type == "cuda"

    @classmethod
    def probe(cls, device) -> DeviceProps:
        """The live device (``torch.device``); the only part of this module that touches torch."""
        import torch

        if device.type != "cuda":
            return cls(type="cpu")
        import importlib.util

        free, total = torch.cuda.mem_get_info(device)
        return cls(
            type="cuda",
            free_bytes=int(free),
            total_bytes=int(total),
            name=torch.cuda.get_device_name(device),
            capability=torch.cuda.get_device_capability(device),
            compiler=importlib.util.find_spec("triton") is not None,
        )


@dataclass(frozen=True)
class ModelShape:
    """The sizes the memory model needs, from a Hugging Face config.json."""

    hidden: int
    intermediate: int
    layers: int
    vocab: int
    params: int  # parameters (a tied head counted once)
    layer_params: int  # parameters of one decoder layer

    @classmethod
    def from_hf(cls, hf: dict) -> ModelShape:
        try:
            h, f, n_layers, v = (
                int(hf[k]) for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size")
            )
            heads = int(hf["num_attention_heads"])
        except KeyError as e:
            raise ValueError(
                f"model config.json lacks {e.args[0]!r}; cannot size learner.micro_batch_tokens=auto "
                "(set it to a number)"
            ) from None
        kv = int(hf.get("num_key_value_heads") or heads)
        hd = int(hf.get("head_dim") or h // heads)
        layer = h * (heads * hd + 2 * kv * hd) + heads * hd * h + 3 * h * f + 2 * h  # qkv, o, MLP, two norms
        embed = v * h * (1 if hf.get("tie_word_embeddings", True) else 2)
        return cls(
            hidden=h, intermediate=f, layers=n_layers, vocab=v, params=n_layers * layer + embed + h, layer_params=layer
        )

    @classmethod
    def from_folder(cls, path: str | Path) -> ModelShape:
        return cls.from_hf(json.loads((Path(path) / "config.json").read_text()))


@dataclass(frozen=True)
class MemoryPlan:
    """How the training state is laid out on a GPU, for :func:`memory_estimate`."""

    engine: str = "fsdp"
    shards: int = 1  # FSDP: ranks sharding the state; Megatron: data-parallel ranks (distributed optimizer)
    model_parallel: int = 1  # Megatron: TP x PP
    compiled: bool = True
    chunked: bool = True
    logprob_chunk: int = 4096
    root_fp32: bool = False  # FSDP root gathered and computed in fp32
    offload: bool = False  # FSDP CPUOffloadPolicy: parameters, gradients and optimizer state on the CPU
    reference_on_gpu: bool = False  # the KL reference model kept on the GPU


def memory_estimate(tokens: int, shape: ModelShape, plan: MemoryPlan, activation_checkpointing: bool) -> dict[str, int]:
    """Estimated peak GPU bytes of a training step with ``tokens``-token micro-batches, by part."""
    p, vh = shape.params, shape.vocab * shape.hidden
    if plan.engine == "megatron":
        # bf16 weights and fp32 gradient buffer per model-parallel part; fp32 main weights and Adam state
        # sharded over the data-parallel ranks by the distributed optimizer
        state = (2 + 4 + 12 / plan.shards) * p / plan.model_parallel
        ref = 2 * p / plan.model_parallel if plan.reference_on_gpu else 0
    else:
        # fp32 weights, gradients and two Adam moments (16 bytes/param) sharded; two decoder layers
        # unsharded in bf16 (FSDP prefetches the next); the root unsharded with its fp32 gradient
        state = 0 if plan.offload else 16 * p / plan.shards
        state += 2 * 2 * shape.layer_params + vh * ((4 if plan.root_fp32 else 2) + 4)
        ref = 4 * p / plan.shards if plan.reference_on_gpu else 0
    coef = ACT_COEF[(plan.engine, plan.compiled)]
    per_layer = coef * (shape.hidden + shape.intermediate)
    if activation_checkpointing:  # every layer's input kept, one layer's activations alive in its recompute
        act = tokens * (shape.layers * CKPT_COEF * shape.hidden + per_layer)
    else:
        act = tokens * shape.layers * per_layer
    if plan.chunked:
        head = HEAD_CHUNK_COPIES * min(tokens, plan.logprob_chunk) * shape.vocab * 4
    else:
        head = FULL_LOGITS_COPIES * tokens * shape.vocab * 4
    out = {"state": int(state), "reference": int(ref), "activations": int(act), "head": int(head)}
    out["total"] = sum(out.values())
    return out


def usable_bytes(free_bytes: int) -> int:
    return int(free_bytes * (1 - RESERVE_FRACTION)) - RESERVE_BYTES


def micro_batch_budget(free_bytes: int, shape: ModelShape, plan: MemoryPlan, activation_checkpointing: bool) -> int:
    """The largest power-of-two token budget (at most :data:`MAX_AUTO_TOKENS`) whose estimated peak fits in
    ``free_bytes`` less the reserve; 0 if not even :data:`MIN_AUTO_TOKENS` fits. Non-decreasing in free memory."""
    room = usable_bytes(free_bytes)
    tokens = MAX_AUTO_TOKENS
    while tokens >= MIN_AUTO_TOKENS:
        if memory_estimate(tokens, shape, plan, activation_checkpointing)["total"] <= room:
            return tokens
        tokens //= 2
    return 0


def choose_micro_batch(
    free_bytes: int, shape: ModelShape, plan: MemoryPlan, activation_checkpointing: bool | str = "auto"
) -> tuple[int, bool, str]:
    """(tokens, activation checkpointing, why) for ``micro_batch_tokens=auto`` on a GPU.

    Raises ValueError naming the memory it found and needed when not even :data:`MIN_AUTO_TOKENS` fits."""
    options = [activation_checkpointing] if isinstance(activation_checkpointing, bool) else [False, True]
    budgets = {ac: micro_batch_budget(free_bytes, shape, plan, ac) for ac in options}
    plain = budgets.get(False, 0)
    if activation_checkpointing == "auto" and plain < AC_BELOW_TOKENS and budgets[True] > plain:
        ac = True
    else:
        ac = False if False in budgets else True
    tokens = budgets[ac]
    free_gib = free_bytes / GIB
    if tokens == 0:
        need = memory_estimate(MIN_AUTO_TOKENS, shape, plan, options[-1])
        raise ValueError(
            f"learner.micro_batch_tokens=auto: even {MIN_AUTO_TOKENS} tokens do not fit: {free_gib:.1f} GiB free "
            f"on the GPU, {usable_bytes(free_bytes) / GIB:.1f} GiB usable, an estimated {need['total'] / GIB:.1f} GiB "
            f"needed ({', '.join(f'{k} {v / GIB:.1f}' for k, v in need.items() if k != 'total')} GiB); use more "
            "GPUs, learner.param_offload=true, or set learner.micro_batch_tokens to a number"
        )
    why = (
        f"auto: {free_gib:.1f} GiB free, estimated peak "
        f"{memory_estimate(tokens, shape, plan, ac)['total'] / GIB:.1f} GiB"
        + (f"; activation checkpointing on (without it {plain} tokens)" if ac and False in budgets else "")
    )
    return tokens, ac, why


@dataclass(frozen=True)
class ResolvedSettings:
    """What the learner runs with, every ``auto`` decided (:func:`resolve_fast_path`)."""

    engine: str
    device: str
    chunked_logprobs: bool
    logprob_chunk: int
    attn_implementation: str  # varlen | sdpa | eager | flash_attention_2 (varlen: learner/attention.py)
    fused_optimizer: bool
    meta_init: bool
    compile_blocks: bool
    fused_head: bool  # the chunked head's per-chunk arithmetic compiled (with compile_blocks)
    root_dtype: str  # FSDP root's (embeddings, final norm, output layer) compute dtype
    micro_batch_tokens: int
    activation_checkpointing: bool
    micro_batch_source: str  # "config" or how auto sized it
    pending: bool = False  # budget and checkpointing not decided yet (size_now=False): sized at the first step

    @property
    def varlen(self) -> bool:
        return self.attn_implementation == "varlen"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        return "learner settings: " + ", ".join(f"{k}={v}" for k, v in self.as_dict().items())


def _device_label(d: DeviceProps) -> str:
    if not d.is_gpu:
        return "cpu"
    cap = f" sm{d.capability[0]}{d.capability[1]}" if d.capability else ""
    return f"cuda {d.name}{cap}, {d.free_bytes / GIB:.1f} GiB free of {d.total_bytes / GIB:.1f}"


def resolve_fast_path(
    cfg, device: DeviceProps, shape: ModelShape | None = None, world_size: int = 1, size_now: bool = True
) -> ResolvedSettings:
    """Every ``auto`` of the learner config (``learner.config.LearnerConfig``) decided for ``device``.

    ``shape`` is needed only to size ``micro_batch_tokens=auto`` on a GPU; ``world_size``: the ranks of the
    learner. Explicit settings win. Raises ValueError for a choice the device cannot run (varlen on CPU) or
    an ``auto`` budget that cannot fit. ``size_now=False`` leaves what depends on GPU memory (the budget and
    checkpointing when either is auto) ``pending``: the FSDP engine decides them at its first step, when the
    memory it will train in is known (in colocated mode the inference engines sleep only then);
    ``device.free_bytes`` must then count the memory the learner already holds as free (the estimate
    includes it).

    Example::

        s = resolve_fast_path(cfg, DeviceProps(type="cuda", free_bytes=79 << 30, total_bytes=80 << 30),
                              ModelShape.from_folder("models/qwen2-0.5b"))
        s.micro_batch_tokens, s.compile_blocks   # 32768, True
    """
    gpu = device.is_gpu
    megatron = cfg.engine == "megatron"
    tp, pp = cfg.megatron.tensor_model_parallel_size, cfg.megatron.pipeline_model_parallel_size

    def pick(value) -> bool:  # "auto" | "on" | "off" | bool
        return gpu if value == "auto" else value in (True, "on")

    attn = cfg.attn_implementation
    if megatron:
        # Megatron's varlen core attention needs unpadded, unsplit rows; otherwise its masked attention
        can_varlen = gpu and pp == 1 and not cfg.megatron.sequence_parallel
        if attn == "auto":
            attn = "varlen" if can_varlen else "masked"
        elif attn == "varlen" and not can_varlen:
            logger.warning(
                "learner.attn_implementation=varlen needs a GPU, PP=1 and no sequence parallelism; "
                "using Megatron's masked attention"
            )
            attn = "masked"
        elif attn != "varlen":
            attn = "masked"  # Megatron has one attention besides varlen: the block-diagonal mask
        chunked = tp == 1 and (cfg.logprobs == "chunked" or (cfg.logprobs == "auto" and gpu))
        meta_init = False  # Megatron builds its own modules and copies the HF shards in
    else:
        if attn == "auto":
            attn = "varlen" if gpu else "sdpa"
        if attn == "varlen" and not gpu:
            raise ValueError(
                "learner.attn_implementation=varlen needs a GPU (PyTorch's flash kernel is CUDA-only); use sdpa on CPU"
            )
        chunked = cfg.logprobs == "chunked" or (cfg.logprobs == "auto" and gpu)
        meta_init = pick(cfg.meta_init)
    compiled = pick(cfg.compile_blocks) and (device.compiler or cfg.compile_blocks is True)
    if cfg.compile_blocks == "auto" and gpu and not device.compiler:
        logger.warning("learner.compile_blocks=auto: no Triton here, so the decoder layers run eagerly")
    fused = pick(cfg.fused_optimizer) and (gpu or not megatron)
    root_dtype = "bfloat16" if gpu and chunked else "float32"
    ac_cfg = cfg.activation_checkpointing
    pending = gpu and not size_now and "auto" in (cfg.micro_batch_tokens, ac_cfg)
    if pending:
        tokens = 0 if cfg.micro_batch_tokens == "auto" else int(cfg.micro_batch_tokens)
        ac, source = ac_cfg is True, "pending: sized at the first step from the GPU memory free then"
    elif cfg.micro_batch_tokens != "auto":
        tokens, ac, source = int(cfg.micro_batch_tokens), ac_cfg, "config"
        if ac == "auto":  # checkpoint only when the given budget is estimated not to fit without it
            ac = (
                gpu
                and shape is not None
                and memory_estimate(tokens, shape, _plan(cfg, world_size, compiled, chunked, root_dtype), False)[
                    "total"
                ]
                > usable_bytes(device.free_bytes)
            )
    elif not gpu:
        tokens, ac, source = CPU_MICRO_BATCH_TOKENS, ac_cfg is True, "auto: CPU default"
    else:
        if shape is None:
            raise ValueError("learner.micro_batch_tokens=auto on a GPU needs the model's shape (config.json)")
        tokens, ac, source = choose_micro_batch(
            device.free_bytes, shape, _plan(cfg, world_size, compiled, chunked, root_dtype), ac_cfg
        )
    return ResolvedSettings(
        engine=cfg.engine,
        device=_device_label(device),
        chunked_logprobs=chunked,
        logprob_chunk=cfg.logprob_chunk,
        attn_implementation=attn,
        fused_optimizer=fused,
        meta_init=meta_init,
        compile_blocks=compiled,
        fused_head=compiled and chunked,
        root_dtype=root_dtype,
        micro_batch_tokens=tokens,
        activation_checkpointing=bool(ac),
        micro_batch_source=source,
        pending=pending,
    )


def _plan(cfg, world_size: int, compiled: bool, chunked: bool, root_dtype: str) -> MemoryPlan:
    if cfg.engine == "megatron":
        mp = cfg.megatron.tensor_model_parallel_size * cfg.megatron.pipeline_model_parallel_size
        dp = max(1, world_size // mp) if cfg.megatron.use_distributed_optimizer else 1
        return MemoryPlan(
            engine="megatron",
            shards=dp,
            model_parallel=mp,
            compiled=compiled,
            chunked=chunked,
            logprob_chunk=cfg.logprob_chunk,
            reference_on_gpu=cfg.loss.kl_coef > 0 and not cfg.reference_offload,
        )
    return MemoryPlan(
        engine="fsdp",
        shards=world_size,
        compiled=compiled,
        chunked=chunked,
        logprob_chunk=cfg.logprob_chunk,
        root_fp32=root_dtype == "float32",
        offload=cfg.param_offload or cfg.optimizer_offload,
        reference_on_gpu=cfg.loss.kl_coef > 0 and not cfg.reference_offload,
    )


def forward_kwargs(settings: ResolvedSettings, mb) -> dict:
    """The model's extra forward arguments for one micro-batch (varlen attention's segments)."""
    if not settings.varlen:
        return {}
    from learner import attention

    if mb.cu_seqlens is None:
        cu, longest = attention.cu_seqlens(mb.position_ids)
        mb.cu_seqlens, mb.max_seqlen = cu.to(mb.input_ids.device), longest
    return attention.varlen_kwargs(mb.cu_seqlens, mb.max_seqlen)


def compile_blocks(blocks: list) -> None:
    """Compile each decoder layer's forward in place (parameter names and FSDP's hooks stay as they are)."""
    import torch
    import torch._dynamo

    # One graph serves every layer of a class (per grad mode and train/eval). dynamic=True: the first graph
    # already takes any token count, so a later micro-batch of a new length does not recompile; the default
    # (static first, dynamic at the second length seen) recompiled in the measured steps of an H100 run.
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 8 * len(blocks))
    # A recompile costs seconds of a step (each step's count: learner_steps.jsonl compiled_graphs); its reason
    # goes to the learner's log. TORCH_LOGS, when set, is the user's choice and stays.
    if not os.environ.get("TORCH_LOGS"):
        torch._logging.set_logs(recompiles=True)
    for m in blocks:
        m.forward = torch.compile(m.forward, dynamic=True)
