"""HF <-> Megatron weight conversion (learner/megatron/convert.py): pure tensors, CPU, no megatron-core needed."""

import json
from pathlib import Path

import pytest
import torch

from learner.megatron import convert as cv

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[3]
TINY = json.loads((REPO / "models/tiny-adder/config.json").read_text())
# GQA with 4 query heads per group, tied embeddings, a vocab that needs padding, llama (no qkv bias).
GQA = dict(
    model_type="llama",
    hidden_act="silu",
    num_attention_heads=8,
    num_key_value_heads=2,
    hidden_size=64,
    head_dim=16,
    intermediate_size=96,
    num_hidden_layers=3,
    vocab_size=1000,
    tie_word_embeddings=True,
)


def random_hf(cfg: dict, seed: int = 0, dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    shape = cv.ModelShape.from_hf(cfg)
    g = torch.Generator().manual_seed(seed)
    out = {}
    for m in cv.megatron_names(shape):
        for name, s in cv.hf_shape_of(m, shape):
            out[name] = torch.randn(s, generator=g).to(dtype)
    return out


@pytest.mark.parametrize("cfg", [TINY, GQA], ids=["tiny-adder", "gqa-llama"])
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("fused_norms", [False, True])
def test_round_trip_bit_identical(cfg, tp, fused_norms):
    shape = cv.ModelShape.from_hf(cfg, tp=tp)
    hf = random_hf(cfg)
    shards = cv.hf_to_megatron(hf, shape, tp, fused_norms=fused_norms)
    assert len(shards) == tp
    back = cv.megatron_to_hf(shards, shape, fused_norms=fused_norms)
    assert list(back) == cv.hf_state_names(shape)
    assert set(back) == set(hf)
    for n, t in hf.items():
        assert back[n].dtype == t.dtype and torch.equal(back[n], t), n


def test_every_tp_shard_has_megatron_local_shape():
    tp = 2
    shape = cv.ModelShape.from_hf(GQA, tp=tp)
    shards = cv.hf_to_megatron(random_hf(GQA), shape, tp)
    qkv_rows = (GQA["num_attention_heads"] + 2 * GQA["num_key_value_heads"]) * GQA["head_dim"]
    s0 = shards[0]
    assert shape.padded_vocab == 1024  # 1000 rounded up to 128 * tp
    assert s0["embedding.word_embeddings.weight"].shape == (512, 64)
    assert s0["decoder.layers.0.self_attention.linear_qkv.weight"].shape == (qkv_rows // tp, 64)
    assert s0["decoder.layers.0.self_attention.linear_proj.weight"].shape == (64, 8 * 16 // tp)
    assert s0["decoder.layers.0.mlp.linear_fc1.weight"].shape == (2 * 96 // tp, 64)
    assert s0["decoder.layers.0.mlp.linear_fc2.weight"].shape == (64, 96 // tp)
    assert "output_layer.weight" not in s0  # tied
    # the padding rows (1000..1023, all on rank 1) are zero
    assert torch.count_nonzero(shards[1]["embedding.word_embeddings.weight"][1000 - 512 :]) == 0


def test_qwen2_untied_has_qkv_bias_and_output_layer():
    shape = cv.ModelShape.from_hf(TINY)
    names = cv.megatron_names(shape)
    assert "decoder.layers.1.self_attention.linear_qkv.bias" in names and "output_layer.weight" in names
    assert shape.head_dim == 32 and shape.kv_heads == 2 and not shape.tied


def test_known_layout_by_hand():
    """4 query heads, 2 kv groups, head_dim 1, hidden 1: Megatron's 'q1 q2 k1 v1 | q3 q4 k2 v2', split over TP=2;
    fc1 per rank = cat(gate_r, up_r)."""
    cfg = dict(
        model_type="qwen2",
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_size=1,
        head_dim=1,
        intermediate_size=4,
        num_hidden_layers=1,
        vocab_size=4,
        tie_word_embeddings=True,
    )
    shape = cv.ModelShape.from_hf(cfg, tp=2, divisible_by=1)
    p = "model.layers.0."
    hf = {
        p + "self_attn.q_proj.weight": torch.tensor([[1.0], [2.0], [3.0], [4.0]]),
        p + "self_attn.k_proj.weight": torch.tensor([[10.0], [20.0]]),
        p + "self_attn.v_proj.weight": torch.tensor([[100.0], [200.0]]),
        p + "self_attn.q_proj.bias": torch.tensor([1.0, 2.0, 3.0, 4.0]),
        p + "self_attn.k_proj.bias": torch.tensor([10.0, 20.0]),
        p + "self_attn.v_proj.bias": torch.tensor([100.0, 200.0]),
        p + "mlp.gate_proj.weight": torch.tensor([[1.0], [2.0], [3.0], [4.0]]),
        p + "mlp.up_proj.weight": torch.tensor([[-1.0], [-2.0], [-3.0], [-4.0]]),
    }
    qkv = cv.from_hf("decoder.layers.0.self_attention.linear_qkv.weight", hf, shape, tp=2)
    assert qkv[0].flatten().tolist() == [1, 2, 10, 100]
    assert qkv[1].flatten().tolist() == [3, 4, 20, 200]
    (full,) = cv.from_hf("decoder.layers.0.self_attention.linear_qkv.bias", hf, shape, tp=1)
    assert full.tolist() == [1, 2, 10, 100, 3, 4, 20, 200]
    fc1 = cv.from_hf("decoder.layers.0.mlp.linear_fc1.weight", hf, shape, tp=2)
    assert fc1[0].flatten().tolist() == [1, 2, -1, -2]
    assert fc1[1].flatten().tolist() == [3, 4, -3, -4]
    (fc1_full,) = cv.from_hf("decoder.layers.0.mlp.linear_fc1.weight", hf, shape, tp=1)
    assert fc1_full.flatten().tolist() == [1, 2, 3, 4, -1, -2, -3, -4]


def test_row_parallel_splits_input_dim():
    shape = cv.ModelShape.from_hf(TINY, tp=2)
    hf = random_hf(TINY)
    o = hf["model.layers.0.self_attn.o_proj.weight"]
    shards = cv.from_hf("decoder.layers.0.self_attention.linear_proj.weight", hf, shape, tp=2)
    assert torch.equal(shards[0], o[:, :64]) and torch.equal(shards[1], o[:, 64:])


def test_pipeline_stage_names_use_global_layers():
    shape = cv.ModelShape.from_hf(GQA)
    first = cv.megatron_names(shape, layers=[0], post_process=False)
    last = cv.megatron_names(shape, layers=[1, 2], pre_process=False)
    assert first[0] == "embedding.word_embeddings.weight" and all("layers.0." in n for n in first[1:])
    assert last[-1] == "decoder.final_layernorm.weight" and "decoder.layers.2.mlp.linear_fc2.weight" in last
    assert sorted(first + last) == sorted(cv.megatron_names(shape))


@pytest.mark.parametrize(
    ("cfg", "needle"),
    [
        (dict(GQA, model_type="gpt2"), "supports model_type"),
        (dict(GQA, hidden_act="gelu"), "SwiGLU"),
    ],
)
def test_unsupported_models_are_named(cfg, needle):
    with pytest.raises(ValueError, match=needle):
        cv.ModelShape.from_hf(cfg)


def test_tp_must_divide_kv_heads():
    shape = cv.ModelShape.from_hf(GQA, tp=4)
    with pytest.raises(ValueError, match="key/value heads"):
        cv.hf_to_megatron(random_hf(GQA), shape, tp=4)


# Qwen3: QK-norm, head_dim set apart from hidden / heads (as Qwen3 does), no qkv bias, untied.
QWEN3 = dict(
    model_type="qwen3",
    hidden_act="silu",
    num_attention_heads=4,
    num_key_value_heads=2,
    hidden_size=48,
    head_dim=16,
    intermediate_size=64,
    num_hidden_layers=2,
    vocab_size=300,
    tie_word_embeddings=False,
    attention_bias=False,
    rms_norm_eps=1e-6,
)


def test_qwen3_qk_norm_maps_to_megatron_q_and_k_layernorm():
    shape = cv.ModelShape.from_hf(QWEN3, tp=2)
    assert shape.qk_norm and not shape.qkv_bias and shape.head_dim == 16
    names = cv.megatron_names(shape)
    assert "decoder.layers.1.self_attention.q_layernorm.weight" in names
    assert "decoder.layers.1.self_attention.k_layernorm.weight" in names
    assert cv.hf_names_of("decoder.layers.1.self_attention.q_layernorm.weight", shape) == [
        "model.layers.1.self_attn.q_norm.weight"
    ]
    assert cv.hf_shape_of("decoder.layers.0.self_attention.k_layernorm.weight", shape) == [
        ("model.layers.0.self_attn.k_norm.weight", [16])
    ]
    assert cv.tp_dim("decoder.layers.0.self_attention.q_layernorm.weight") is None  # replicated per rank
    hf = random_hf(QWEN3)
    shards = cv.hf_to_megatron(hf, shape, tp=2)
    for r in range(2):  # every TP rank holds the whole per-head norm
        assert torch.equal(
            shards[r]["decoder.layers.0.self_attention.q_layernorm.weight"],
            hf["model.layers.0.self_attn.q_norm.weight"],
        )
    back = cv.megatron_to_hf(shards, shape)
    assert set(back) == set(hf)
    assert all(torch.equal(back[n], t) for n, t in hf.items())


def test_qwen3_names_match_transformers_qwen3():
    """The HF names the conversion expects are exactly those of transformers' own Qwen3 model."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(**{k: v for k, v in QWEN3.items() if k != "model_type"})
    model = Qwen3ForCausalLM(cfg)
    shape = cv.ModelShape.from_hf(cfg.to_dict())
    theirs = {n: list(t.shape) for n, t in model.state_dict().items()}
    ours = {n: s for m in cv.megatron_names(shape) for n, s in cv.hf_shape_of(m, shape)}
    assert ours == theirs
