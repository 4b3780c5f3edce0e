"""A step's count of graphs torch.compile made (learner/busy.py): non-zero where a step met a new shape."""

from __future__ import annotations

import torch

from learner.busy import StepTimer


def test_compiled_graphs_counts_the_compiles_of_each_step():
    torch._dynamo.reset()
    f = torch.compile(lambda x: torch.sin(x) * 2 + 1, dynamic=False)  # static: a new length is a new graph

    def step(*lengths: int) -> float:
        timer = StepTimer()
        for n in lengths:
            f(torch.ones(n))
        return timer.stop()["learner/compiled_graphs"]

    assert step(8) == 1  # the first compile
    assert step(8, 8) == 0  # nothing new
    assert step(8, 9, 10) == 2  # two new lengths
    assert step(9, 10) == 0


def test_compiled_blocks_take_every_token_count_with_one_graph():
    """learner.fastpath.compile_blocks compiles each decoder layer for any length at once: the micro-batches of
    later steps (each of its own token count) reuse it. torch's default (static, then dynamic at the second
    length) recompiled inside measured steps of an H100 run."""
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RotaryEmbedding

    from learner.fastpath import compile_blocks

    torch._dynamo.reset()
    cfg = Qwen2Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64)
    layers = [Qwen2DecoderLayer(cfg, i) for i in range(2)]
    rope = Qwen2RotaryEmbedding(cfg)
    compile_blocks(layers)

    def step(*lengths: int) -> float:
        timer = StepTimer()
        with torch.no_grad():
            for n in lengths:
                h = torch.randn(1, n, 32)
                pos = rope(h, torch.arange(n)[None])
                for layer in layers:
                    h = layer(h, position_embeddings=pos)
        return timer.stop()["learner/compiled_graphs"]

    assert step(17) >= 1  # the first compile
    assert step(23, 40) == 0  # new lengths, no new graph
    assert step(5, 64, 31) == 0
