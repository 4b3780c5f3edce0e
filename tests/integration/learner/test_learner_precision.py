"""FSDP2 under bf16 mixed precision computes the output layer and log-softmax in fp32 (a real gloo rank
on CPU, where FSDP2's bf16 policy runs the same way as on GPU); dropout is forced to 0."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from learner_testkit import make_tiny_model, run_procs


def _rank(rank, world_size, port, kw):
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from learner.fsdp import _load_model, _shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    model = _load_model(kw["model"], "sdpa")
    _shard(
        model,
        init_device_mesh("cpu", (1,)),
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        offload=False,
    )
    seen = {}

    def layer_hook(m, args, out):  # forward hooks must return None, or they replace the output
        seen["layer"] = str((out[0] if isinstance(out, tuple) else out).dtype)

    def head_hook(m, args, out):
        seen["lm_head_in"] = str(args[0].dtype)

    model.model.layers[0].register_forward_hook(layer_hook)
    model.lm_head.register_forward_hook(head_hook)
    ids = torch.tensor([[5, 6, 7, 8]])
    logits = model(input_ids=ids, use_cache=False).logits
    seen["logits"] = str(logits.dtype)
    Path(kw["out"]).write_text(json.dumps(seen))
    dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_bf16_layers_fp32_output_layer(tmp_path):
    torch.set_num_threads(1)
    model = make_tiny_model(tmp_path / "model")
    out = tmp_path / "dtypes.json"
    run_procs(_rank, 1, {"model": str(model), "out": str(out)}, timeout=90, start_method="fork")
    seen = json.loads(out.read_text())
    assert seen == {"layer": "torch.bfloat16", "lm_head_in": "torch.float32", "logits": "torch.float32"}, seen


def test_dropout_is_forced_to_zero(tmp_path):
    from transformers import AutoModelForCausalLM, Qwen2Config

    from learner.engine import disable_dropout

    cfg = Qwen2Config(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        intermediate_size=128,
        vocab_size=96,
        attention_dropout=0.5,
    )
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").train()
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    torch.manual_seed(0)
    a = model(input_ids=ids).logits
    b = model(input_ids=ids).logits
    assert not torch.equal(a, b)  # dropout 0.5 really draws
    assert disable_dropout(model) > 0 and model.config.attention_dropout == 0.0
    # Exact: with no dropout the two forwards are the same computation on the same inputs.
    assert torch.equal(model(input_ids=ids).logits, model(input_ids=ids).logits)
