"""Hugging Face <-> Megatron-core weight conversion (Llama / Qwen2 / Qwen3 family) as pure tensor functions.

No megatron import here: these run (and are unit-tested) on any machine.

Megatron layout (GPTModel, local or TE layer spec; names relative to the model):

* ``embedding.word_embeddings.weight`` / ``output_layer.weight``: [padded_vocab, h], vocab-parallel
  (rank r holds rows r*Vp/tp ...). Rows past the HF vocab are zero; the log-prob code
  drops their logits (learner/megatron/engine.py), so the padding never changes a probability.
* ``decoder.layers.i.self_attention.linear_qkv.weight``: q, k, v fused and *interleaved per query
  group*: for each of the ``ng`` key/value groups, that group's ``nq/ng`` query heads, then its key
  head, then its value head (``q1 q2 k1 v1 | q3 q4 k2 v2``, Megatron's attention.py). Column-parallel:
  rank r holds groups r*ng/tp ... whole, which is why TP must divide the key/value heads. Same for the
  Qwen2 qkv bias.
* ``decoder.layers.i.mlp.linear_fc1.weight``: gate and up fused, column-parallel, and the split into
  gate|up happens on each rank's *local* output (``torch.chunk(x, 2, -1)``), so rank r holds
  ``cat(gate_r, up_r)``; the concatenation of the shards is therefore not ``cat(gate, up)`` for TP > 1.
* ``linear_proj`` and ``linear_fc2``: row-parallel (split along the input dim 1).
* norms (replicated): ``input_layernorm.weight`` / ``pre_mlp_layernorm.weight`` in the local spec,
  ``self_attention.linear_qkv.layer_norm_weight`` / ``mlp.linear_fc1.layer_norm_weight`` in the TE
  spec (``fused_norms=True``); ``decoder.final_layernorm.weight``.
* Qwen3's QK-norm (replicated, [head_dim]): ``self_attention.q_layernorm.weight`` /
  ``k_layernorm.weight`` <- ``self_attn.q_norm.weight`` / ``k_norm.weight``; Megatron builds them with
  ``qk_layernorm=True`` and applies them per head before RoPE, as transformers' Qwen3 does.

Example::

    shape = ModelShape.from_hf(json.load(open("models/tiny-adder/config.json")), tp=2)
    shards = hf_to_megatron(hf_state, shape, tp=2)     # [rank0 dict, rank1 dict]
    assert all(torch.equal(a, b) for a, b in zip(megatron_to_hf(shards, shape).values(), hf_state.values()))
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")


def padded_vocab_size(vocab: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron's rule: round the vocab up to a multiple of ``divisible_by * tp`` (every TP shard equal)."""
    m = divisible_by * tp
    return ((vocab + m - 1) // m) * m


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    padded_vocab: int
    tied: bool
    qkv_bias: bool
    qk_norm: bool = False  # Qwen3: RMSNorm over each head's query and key (head_dim weights), before RoPE

    @classmethod
    def from_hf(cls, cfg: Mapping, tp: int = 1, divisible_by: int = 128) -> ModelShape:
        """From a transformers config dict (config.json); the padded vocab depends on ``tp``."""
        mt = cfg.get("model_type")
        if mt not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"Megatron conversion supports model_type {SUPPORTED_MODEL_TYPES}, got {mt!r}")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"Megatron conversion supports SwiGLU (hidden_act 'silu'), got {act!r}")
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        head_dim = cfg.get("head_dim") or hidden // heads
        qkv_bias = mt == "qwen2" or bool(cfg.get("attention_bias", False))
        if mt == "llama" and cfg.get("mlp_bias"):
            raise ValueError("llama with mlp_bias=true is not supported by the Megatron conversion")
        return cls(
            num_layers=cfg["num_hidden_layers"],
            hidden=hidden,
            heads=heads,
            kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            ffn=cfg["intermediate_size"],
            vocab=cfg["vocab_size"],
            padded_vocab=padded_vocab_size(cfg["vocab_size"], tp, divisible_by),
            tied=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            qk_norm=mt == "qwen3",
        )

    def check_tp(self, tp: int) -> None:
        problems = []
        if self.heads % tp or self.kv_heads % tp:
            problems.append(
                f"tensor parallel size {tp} must divide the {self.heads} attention heads "
                f"and the {self.kv_heads} key/value heads"
            )
        if self.ffn % tp:
            problems.append(f"tensor parallel size {tp} must divide intermediate_size {self.ffn}")
        if self.padded_vocab % tp:
            problems.append(f"tensor parallel size {tp} must divide the padded vocab {self.padded_vocab}")
        if problems:
            raise ValueError("; ".join(problems))


# ---- names ---------------------------------------------------------------------------------------

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def _norm_names(fused_norms: bool) -> tuple[str, str]:
    if fused_norms:
        return "self_attention.linear_qkv.layer_norm_weight", "mlp.linear_fc1.layer_norm_weight"
    return "input_layernorm.weight", "pre_mlp_layernorm.weight"


def megatron_names(
    shape: ModelShape,
    fused_norms: bool = False,
    layers: Sequence[int] | None = None,
    pre_process: bool = True,
    post_process: bool = True,
) -> list[str]:
    """Megatron parameter names in HF order; ``layers`` (global indices) and pre/post select a pipeline stage."""
    attn_norm, mlp_norm = _norm_names(fused_norms)
    names = ["embedding.word_embeddings.weight"] if pre_process else []
    for i in range(shape.num_layers) if layers is None else layers:
        p = f"decoder.layers.{i}."
        names += [p + attn_norm, p + "self_attention.linear_qkv.weight"]
        if shape.qkv_bias:
            names.append(p + "self_attention.linear_qkv.bias")
        if shape.qk_norm:
            names += [p + "self_attention.q_layernorm.weight", p + "self_attention.k_layernorm.weight"]
        names += [
            p + "self_attention.linear_proj.weight",
            p + mlp_norm,
            p + "mlp.linear_fc1.weight",
            p + "mlp.linear_fc2.weight",
        ]
    if post_process:
        names.append("decoder.final_layernorm.weight")
        if not shape.tied:
            names.append("output_layer.weight")
    return names


def hf_names_of(mname: str, shape: ModelShape) -> list[str]:
    """The HF tensors one Megatron parameter holds (in the order :func:`to_hf` returns them)."""
    if mname == "embedding.word_embeddings.weight":
        return ["model.embed_tokens.weight"]
    if mname == "output_layer.weight":
        return ["lm_head.weight"]
    if mname == "decoder.final_layernorm.weight":
        return ["model.norm.weight"]
    m = _LAYER.match(mname)
    if not m:
        raise KeyError(f"not a Llama/Qwen2 Megatron parameter: {mname!r}")
    p, rest = f"model.layers.{m.group(1)}.", m.group(2)
    table = {
        "input_layernorm.weight": ["input_layernorm.weight"],
        "self_attention.linear_qkv.layer_norm_weight": ["input_layernorm.weight"],
        "pre_mlp_layernorm.weight": ["post_attention_layernorm.weight"],
        "mlp.linear_fc1.layer_norm_weight": ["post_attention_layernorm.weight"],
        "self_attention.linear_qkv.weight": [f"self_attn.{x}_proj.weight" for x in "qkv"],
        "self_attention.linear_qkv.bias": [f"self_attn.{x}_proj.bias" for x in "qkv"],
        "self_attention.q_layernorm.weight": ["self_attn.q_norm.weight"],
        "self_attention.k_layernorm.weight": ["self_attn.k_norm.weight"],
        "self_attention.linear_proj.weight": ["self_attn.o_proj.weight"],
        "mlp.linear_fc1.weight": ["mlp.gate_proj.weight", "mlp.up_proj.weight"],
        "mlp.linear_fc2.weight": ["mlp.down_proj.weight"],
    }
    if rest not in table:
        raise KeyError(f"not a Llama/Qwen2 Megatron parameter: {mname!r}")
    return [p + n for n in table[rest]]


def tp_dim(mname: str) -> int | None:
    """Dimension along which tensor parallelism splits the parameter (None: replicated)."""
    if mname.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return 1
    if mname.endswith(
        ("word_embeddings.weight", "output_layer.weight", "linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight")
    ):
        return 0
    return None


# ---- one parameter ---------------------------------------------------------------------------------


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: ModelShape) -> torch.Tensor:
    ng, qpg, hd = s.kv_heads, s.heads // s.kv_heads, s.head_dim
    tail = q.shape[1:]
    parts = (q.reshape(ng, qpg * hd, *tail), k.reshape(ng, hd, *tail), v.reshape(ng, hd, *tail))
    return torch.cat(parts, dim=1).reshape(ng * (qpg + 2) * hd, *tail)


def _split_qkv(fused: torch.Tensor, s: ModelShape) -> list[torch.Tensor]:
    ng, qpg, hd = s.kv_heads, s.heads // s.kv_heads, s.head_dim
    tail = fused.shape[1:]
    g = fused.reshape(ng, (qpg + 2) * hd, *tail)
    q, k, v = torch.split(g, [qpg * hd, hd, hd], dim=1)
    return [q.reshape(ng * qpg * hd, *tail), k.reshape(ng * hd, *tail), v.reshape(ng * hd, *tail)]


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    out = t.new_zeros((rows, *t.shape[1:]))
    out[: t.shape[0]] = t
    return out


def from_hf(mname: str, hf: Mapping[str, torch.Tensor], shape: ModelShape, tp: int) -> list[torch.Tensor]:
    """The ``tp`` shards (rank order) of Megatron parameter ``mname`` built from HF tensors."""
    srcs = [hf[n] for n in hf_names_of(mname, shape)]
    if mname.endswith(("linear_qkv.weight", "linear_qkv.bias")):
        full = _fuse_qkv(*srcs, shape)
    elif mname.endswith("linear_fc1.weight"):
        gates, ups = srcs[0].chunk(tp, dim=0), srcs[1].chunk(tp, dim=0)
        return [torch.cat([g, u], dim=0).contiguous() for g, u in zip(gates, ups, strict=True)]
    elif mname in ("embedding.word_embeddings.weight", "output_layer.weight"):
        full = _pad_rows(srcs[0], shape.padded_vocab)
    else:
        (full,) = srcs
    d = tp_dim(mname)
    if d is None:
        return [full.clone() for _ in range(tp)]
    return [c.contiguous() for c in full.chunk(tp, dim=d)]


def to_hf(mname: str, shards: Sequence[torch.Tensor], shape: ModelShape) -> list[tuple[str, torch.Tensor]]:
    """HF (name, tensor) pairs from the TP shards (rank order) of one Megatron parameter."""
    names = hf_names_of(mname, shape)
    d = tp_dim(mname)
    if mname.endswith("linear_fc1.weight"):
        halves = [s.chunk(2, dim=0) for s in shards]
        gate = torch.cat([h[0] for h in halves], dim=0)
        up = torch.cat([h[1] for h in halves], dim=0)
        return list(zip(names, [gate, up], strict=True))
    full = shards[0] if d is None else torch.cat(list(shards), dim=d)
    if mname.endswith(("linear_qkv.weight", "linear_qkv.bias")):
        return list(zip(names, [t.contiguous() for t in _split_qkv(full, shape)], strict=True))
    if mname in ("embedding.word_embeddings.weight", "output_layer.weight"):
        full = full[: shape.vocab]
    return [(names[0], full.contiguous() if d is not None else full)]


def hf_shape_of(mname: str, shape: ModelShape) -> list[tuple[str, list[int]]]:
    """(HF name, HF shape) of each HF tensor one Megatron parameter holds (no tensors needed)."""
    h, hd = shape.hidden, shape.head_dim
    qkv = {"q": shape.heads * hd, "k": shape.kv_heads * hd, "v": shape.kv_heads * hd}
    out = []
    for n in hf_names_of(mname, shape):
        leaf = n.rsplit(".", 2)
        if n.endswith(("q_norm.weight", "k_norm.weight")):  # per head: one weight per head dimension
            s = [hd]
        elif n.endswith("norm.weight"):
            s = [h]
        elif n in ("model.embed_tokens.weight", "lm_head.weight"):
            s = [shape.vocab, h]
        elif ".self_attn." in n and leaf[-2] in ("q_proj", "k_proj", "v_proj"):
            rows = qkv[leaf[-2][0]]
            s = [rows, h] if leaf[-1] == "weight" else [rows]
        elif n.endswith("o_proj.weight"):
            s = [h, shape.heads * hd]
        elif n.endswith(("gate_proj.weight", "up_proj.weight")):
            s = [shape.ffn, h]
        elif n.endswith("down_proj.weight"):
            s = [h, shape.ffn]
        else:
            raise KeyError(n)
        out.append((n, s))
    return out


# ---- whole state dicts ---------------------------------------------------------------------------


def hf_to_megatron(
    hf: Mapping[str, torch.Tensor], shape: ModelShape, tp: int, fused_norms: bool = False
) -> list[dict[str, torch.Tensor]]:
    """One Megatron state dict (global layer numbers) per TP rank."""
    shape.check_tp(tp)
    out: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]
    for mname in megatron_names(shape, fused_norms):
        for r, t in enumerate(from_hf(mname, hf, shape, tp)):
            out[r][mname] = t
    return out


def iter_megatron_to_hf(
    shards: Sequence[Mapping[str, torch.Tensor]], shape: ModelShape, fused_norms: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    for mname in megatron_names(shape, fused_norms):
        yield from to_hf(mname, [s[mname] for s in shards], shape)


def megatron_to_hf(
    shards: Sequence[Mapping[str, torch.Tensor]], shape: ModelShape, fused_norms: bool = False
) -> dict[str, torch.Tensor]:
    """The HF state dict (without ``lm_head.weight`` when tied) from the TP rank state dicts."""
    return dict(iter_megatron_to_hf(shards, shape, fused_norms))


def hf_state_names(shape: ModelShape) -> list[str]:
    """HF tensor names the conversion produces, in order."""
    return [n for m in megatron_names(shape) for n in hf_names_of(m, shape)]
