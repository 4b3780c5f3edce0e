"""Shared asynchronous mode's memory split: engine and learner resident on one device at once.

In colocated sync mode the engine sleeps while the learner trains, so each may use the whole
device in turn. In shared async mode (``colocate.mode: async``) neither gives its memory back:
the engine holds ``rollout.gpu_memory_utilization`` of the device for its whole life (vLLM
reserves weights + KV cache up front) and the learner needs its parameters, gradients, AdamW
state, the gathered compute copy and one micro-batch's activations on top. The split must fit
before anything starts, or the learner dies of an out-of-memory error minutes into the run
(or, worse, vLLM's start-up profile sees the learner's memory as taken and refuses to start).

Everything here is pure (numbers in, numbers out); the launcher reads the device's total memory
and the model's shape and calls :func:`check_memory_split` (launch/shared_gpu.py).
"""

from __future__ import annotations

import json
import struct
from dataclasses import asdict, dataclass
from pathlib import Path

GiB = 1 << 30
# Per process: a CUDA context, cuBLAS/NCCL workspaces, the allocator's slack. Two processes share the
# device, and only the learner's is outside the engine's own fraction (vLLM counts its context in it).
CONTEXT_BYTES = 1 * GiB
# Bytes of saved activations per token, per layer, per hidden unit for one decoder layer without
# checkpointing, bf16, flash/varlen attention (no s^2 term): the usual transformer estimate (~34 s h
# bytes per layer), rounded up for the gated MLP's third projection.
ACT_BYTES_PER_TOKEN_LAYER_HIDDEN = 40
# With activation checkpointing only each layer's input is kept (bf16), plus one layer recomputed.
CKPT_BYTES_PER_TOKEN_LAYER_HIDDEN = 2


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelShape:
    params: int
    hidden: int
    layers: int
    vocab: int


def _safetensors_params(folder: Path) -> int | None:
    """Parameter count from the safetensors headers (8-byte length, then a JSON index of tensors)."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for f in files:
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            count = 1
            for d in meta["shape"]:
                count *= int(d)
            total += count
    return total


def model_shape(model_path: str | Path) -> ModelShape:
    """The model's size from its folder: exact parameter count from the safetensors headers (else an
    estimate from config.json), hidden size, layer count and vocabulary size from config.json."""
    folder = Path(model_path)
    cfg_file = folder / "config.json"
    if not cfg_file.exists():
        raise ValueError(f"model folder {str(folder)!r} has no config.json: cannot size the learner's memory")
    c = json.loads(cfg_file.read_text())
    c = c.get("text_config", c)
    try:
        hidden, layers, vocab = int(c["hidden_size"]), int(c["num_hidden_layers"]), int(c["vocab_size"])
    except KeyError as exc:
        raise ValueError(f"{cfg_file} lacks {exc.args[0]!r}: cannot size the learner's memory") from None
    params = _safetensors_params(folder)
    if params is None:  # dense decoder: 12 h^2 per layer (attention + 4h MLP) plus the embeddings
        inter = int(c.get("intermediate_size", 4 * hidden))
        params = layers * (4 * hidden * hidden + 3 * hidden * inter) + vocab * hidden * (
            1 if c.get("tie_word_embeddings", False) else 2
        )
    return ModelShape(params=params, hidden=hidden, layers=layers, vocab=vocab)


@dataclass(frozen=True, kw_only=True, slots=True)
class LearnerMemory:
    """The learner's estimated peak on one device, by part (bytes)."""

    states: int  # fp32 parameters + fp32 gradients + AdamW's two moments, this rank's shard
    compute_copy: int  # the gathered bf16 parameters (FSDP2 unshards a layer at a time; the whole model bounds it)
    activations: int  # one micro-batch's saved activations
    logits: int  # log-probs of one micro-batch (or one chunk of it)
    reference: int  # the KL reference model, when on the device
    context: int

    @property
    def total(self) -> int:
        return self.states + self.compute_copy + self.activations + self.logits + self.reference + self.context


def learner_memory(
    shape: ModelShape,
    *,
    world_size: int = 1,
    micro_batch_tokens: int,
    activation_checkpointing: bool = False,
    chunked_logprobs: bool = True,
    logprob_chunk: int = 4096,
    reference_on_device: bool = False,
    offload: bool = False,
) -> LearnerMemory:
    """Estimate the FSDP learner's peak memory on one device of ``world_size`` (see module docstring)."""
    if world_size < 1 or micro_batch_tokens < 1:
        raise ValueError(f"world_size and micro_batch_tokens must be >= 1, got {world_size}, {micro_batch_tokens}")
    states = 0 if offload else 16 * shape.params // world_size
    per = CKPT_BYTES_PER_TOKEN_LAYER_HIDDEN if activation_checkpointing else ACT_BYTES_PER_TOKEN_LAYER_HIDDEN
    act = micro_batch_tokens * shape.layers * shape.hidden * per
    # fp32 logits, their log-softmax and its gradient: three vocab-wide rows per token in flight
    rows = min(micro_batch_tokens, logprob_chunk) if chunked_logprobs else micro_batch_tokens
    logits = 3 * 4 * rows * shape.vocab
    return LearnerMemory(
        states=states,
        compute_copy=2 * shape.params,
        activations=act,
        logits=logits,
        reference=2 * shape.params if reference_on_device else 0,
        context=CONTEXT_BYTES,
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class MemorySplit:
    device: str
    total_bytes: int
    engine_fraction: float
    learner_bytes: int
    headroom: float

    @property
    def learner_fraction(self) -> float:
        return self.learner_bytes / self.total_bytes

    def describe(self) -> dict:
        return {
            **asdict(self),
            "learner_fraction": round(self.learner_fraction, 4),
            "free_fraction": round(1.0 - self.engine_fraction - self.learner_fraction, 4),
        }


def check_memory_split(
    *, device: str, total_bytes: int, engine_fraction: float, learner_bytes: int, headroom: float = 0.0
) -> MemorySplit:
    """Refuse a split of ``device`` that cannot hold both at once: ``engine_fraction`` (the engine's
    reservation, a fraction of the total) + the learner's need + ``headroom`` must be <= 1."""
    if total_bytes <= 0:
        raise ValueError(f"{device}: total memory must be > 0 bytes, got {total_bytes}")
    if not 0 < engine_fraction <= 1:
        raise ValueError(f"{device}: the engine's memory fraction must be in (0, 1], got {engine_fraction}")
    if not 0 <= headroom < 1:
        raise ValueError(f"{device}: headroom must be in [0, 1), got {headroom}")
    split = MemorySplit(
        device=device,
        total_bytes=total_bytes,
        engine_fraction=engine_fraction,
        learner_bytes=learner_bytes,
        headroom=headroom,
    )
    need = engine_fraction + split.learner_fraction + headroom
    if need > 1.0:
        room = 1.0 - split.learner_fraction - headroom
        raise ValueError(
            f"{device}: shared async mode cannot fit: engine {engine_fraction:.2f} + learner "
            f"{learner_bytes / GiB:.2f} GiB ({split.learner_fraction:.2f} of {total_bytes / GiB:.1f} GiB) + headroom "
            f"{headroom:.2f} = {need:.2f} > 1. Lower rollout.gpu_memory_utilization "
            + (f"to <= {room:.2f}" if room > 0 else "(the learner alone does not fit)")
            + ", shrink learner.micro_batch_tokens, turn on learner.activation_checkpointing, or state the "
            "learner's need (colocate.learner_memory_gb) if the estimate is wrong"
        )
    return split
