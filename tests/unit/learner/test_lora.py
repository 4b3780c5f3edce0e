"""learner/lora.py on the repo's tiny model, no process group: injection, merge, the peft folder, the config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from core.configbase import ConfigError
from engines.vllm.lora import lora_server_settings
from learner import lora
from learner.config import LearnerConfig
from learner.lora_config import LoraConfig

TINY = Path(__file__).resolve().parents[3] / "models" / "tiny-adder"
LINEARS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def _model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32)


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def test_inject_freezes_base_and_starts_at_the_base_model():
    model = _model()
    ids = torch.tensor([[5, 9, 12, 40, 7, 3]])
    before = _logits(model, ids)
    names = lora.inject(model, LoraConfig(rank=4, alpha=8))
    lora.init_adapters(model, seed=0)
    assert {n.rsplit(".", 1)[-1] for n in names} == LINEARS  # all-linear: never the output layer
    assert "lm_head" not in " ".join(names)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(lora.is_adapter_name(n) for n in trainable)
    assert len(trainable) == 2 * len(names)
    # B = 0: exactly the base function (the adapter branch adds zeros).
    assert torch.equal(_logits(model, ids), before)
    with torch.no_grad():
        for _, p in lora.adapter_parameters(model):
            p.add_(0.1)
    assert not torch.equal(_logits(model, ids), before)
    with lora.adapters_off(model):  # the KL reference: the base exactly, no second model
        assert torch.equal(_logits(model, ids), before)


def test_merged_weights_give_the_adapted_model():
    model = _model()
    ids = torch.tensor([[5, 9, 12, 40, 7, 3]])
    lora.inject(model, LoraConfig(rank=4, alpha=8, target_modules=["q_proj", "down_proj"]))
    lora.init_adapters(model, seed=1)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in lora.adapter_parameters(model):
            if ".lora_B." in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    adapted = _logits(model, ids)
    scales = {n: m.lora_scale for n, m in model.named_modules() if isinstance(m, lora.LoraLinear)}
    merged_sd = lora.merge_state_dict(model.state_dict(), scales)
    plain = _model()
    plain.load_state_dict(merged_sd)
    # fp32: W x + s B (A x) and (W + s B A) x differ only in rounding order (~1e-6 relative on logits of
    # magnitude ~10); 1e-4 absolute is two orders above that and far below the change the adapter makes.
    assert (adapted - _logits(_model(), ids)).abs().max() > 1e-2
    torch.testing.assert_close(_logits(plain, ids), adapted, rtol=0, atol=1e-4)


def test_adapter_folder_round_trip_is_bit_exact(tmp_path):
    cfg = LoraConfig(rank=8, alpha=16, exclude_modules=["model.layers.1.mlp.down_proj", "o_proj"])
    model = _model()
    names = lora.inject(model, cfg)
    assert not any(n.endswith("o_proj") for n in names) and "model.layers.1.mlp.down_proj" not in names
    lora.init_adapters(model, seed=3)
    with torch.no_grad():
        for _, p in lora.adapter_parameters(model):
            p.add_(torch.rand(p.shape))
    n_bytes = lora.save_adapter(tmp_path / "a", model, cfg, base_model_path=str(TINY), rank=0)
    meta = json.loads((tmp_path / "a" / lora.ADAPTER_CONFIG).read_text())
    assert meta["peft_type"] == "LORA" and meta["r"] == 8 and meta["lora_alpha"] == 16
    assert set(meta["target_modules"]) == LINEARS - {"o_proj"}
    from safetensors.torch import load_file

    stored = load_file(str(tmp_path / "a" / lora.ADAPTER_WEIGHTS))
    assert all(k.startswith("base_model.model.model.layers.") for k in stored)
    assert n_bytes == sum(t.numel() * 4 for t in stored.values())
    other = _model()
    lora.inject(other, cfg)
    lora.init_adapters(other, seed=99)
    lora.load_adapter(tmp_path / "a", other, cfg)
    for (n, p), (m, q) in zip(lora.adapter_parameters(model), lora.adapter_parameters(other), strict=True):
        assert n == m and torch.equal(p, q)
    with pytest.raises(ValueError, match="rank=4"):
        lora.load_adapter(tmp_path / "a", other, LoraConfig(rank=4, alpha=16))


def test_bad_targets_are_named():
    with pytest.raises(ValueError, match="qkv_proj"):
        lora.inject(_model(), LoraConfig(rank=4, alpha=8, target_modules=["qkv_proj"]))
    with pytest.raises(ValueError, match="selects no linear layer"):
        lora.inject(_model(), LoraConfig(rank=4, alpha=8, target_modules=["q_proj"], exclude_modules=["q_proj"]))


def test_config_refuses_megatron_and_empty_targets():
    base = {"loss": {"correction": "tis"}, "lora": {"rank": 8, "alpha": 16}}
    assert LearnerConfig.model_validate(base).lora.target_modules == "all-linear"
    with pytest.raises((ConfigError, ValueError), match="megatron-core ships no LoRA"):
        LearnerConfig.model_validate({**base, "engine": "megatron"})
    with pytest.raises((ConfigError, ValueError), match="empty list"):
        LoraConfig(rank=8, alpha=16, target_modules=[])
    with pytest.raises((ConfigError, ValueError)):
        LoraConfig(rank=8, alpha=16, rnak=3)


def test_vllm_server_settings_round_the_rank_up():
    args, env = lora_server_settings(12)
    assert args[args.index("--max-lora-rank") + 1] == "16" and env == {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
    with pytest.raises(ValueError, match="512"):
        lora_server_settings(600)


def test_a_server_keeps_every_version_the_staleness_bound_lets_run():
    from engines.base import adapter_versions
    from engines.registry import weight_client
    from launch.config import load_run_config

    assert [adapter_versions(k) for k in (0, 1, 2, 4)] == [2, 2, 3, 5]
    args, _ = lora_server_settings(8, adapter_versions(2))
    assert args[args.index("--max-loras") + 1] == "3" and args[args.index("--max-cpu-loras") + 1] == "4"
    with pytest.raises(ValueError, match="at least 2"):
        lora_server_settings(8, 1)
    cfg = load_run_config("smollm2-lora")  # broker.max_staleness 2
    client = weight_client(cfg, "gloo", "vllm-0", "http://127.0.0.1:1")
    assert client.adapter_prefix and client.adapter_versions == 3


def test_adapter_publish_only_for_a_lora_fleet_whose_engines_stay_resident():
    from engines.sglang.lora import sglang_lora_server_args
    from launch.config import load_run_config
    from weight_sync.adapter_publisher import adapter_publish

    assert adapter_publish(load_run_config("tiny-lora"))
    assert not adapter_publish(load_run_config("tiny"))
    # shared async: the engines never sleep, so they take adapters; colocated sync: they sleep, merged weights
    shared = ["colocate.enabled=true", "colocate.mode=async", "broker.max_staleness=2"]
    assert adapter_publish(load_run_config("tiny-lora", shared))
    assert not adapter_publish(load_run_config("tiny-lora", ["colocate.enabled=true", "broker.max_staleness=0"]))
    assert "--enable-lora" in sglang_lora_server_args(8)
