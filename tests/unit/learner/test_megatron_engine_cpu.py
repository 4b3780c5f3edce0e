"""CPU checks of the Megatron backend's pure parts and wiring (megatron-core not needed; it needs Python >= 3.12
and CUDA). The engine itself is exercised by tests/gpu/test_megatron_gpu.py."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from learner.megatron import convert as cv
from learner.megatron.engine import packed_attention_mask, pad_row, rope_theta
from learner.megatron.weights import HFWeights, global_name

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[3]
TINY = REPO / "models" / "tiny-adder"
HAVE_MEGATRON = (
    importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None
)


def test_packed_mask_keeps_sequences_apart_and_causal():
    pos = torch.tensor([[0, 1, 2, 0, 1]])
    blocked = packed_attention_mask(pos)[0, 0]
    allowed = ~blocked
    want = torch.tensor(
        [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 0, 0, 1, 0], [0, 0, 0, 1, 1]], dtype=torch.bool
    )
    assert torch.equal(allowed, want)


def test_pad_row_adds_one_separate_sequence():
    from learner.batch import MicroBatch

    z = torch.zeros(1)
    mb = MicroBatch(
        input_ids=torch.tensor([[5, 6, 7]]),
        position_ids=torch.tensor([[0, 1, 2]]),
        target_index=torch.tensor([1]),
        targets=torch.tensor([7]),
        behaviour_logp=z,
        advantages=z,
        weights=z,
        seq_lens=torch.tensor([1]),
        fresh=torch.zeros(1, dtype=torch.bool),
    )
    ids, pos = pad_row(mb, 5)
    assert ids.tolist() == [[5, 6, 7, 0, 0]] and pos.tolist() == [[0, 1, 2, 0, 1]]
    # the padding is its own sequence: the real tokens never attend to it
    assert packed_attention_mask(pos)[0, 0, :3, 3:].all()


def test_rope_theta_from_either_config_style():
    assert rope_theta(json.loads((TINY / "config.json").read_text())) == 10000.0
    assert rope_theta({"rope_theta": 1e6}) == 1e6
    with pytest.raises(ValueError, match="plain RoPE"):
        rope_theta({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6}})


def test_stage_local_layer_names_become_global():
    assert global_name("decoder.layers.0.mlp.linear_fc1.weight", 12) == "decoder.layers.12.mlp.linear_fc1.weight"
    assert global_name("embedding.word_embeddings.weight", 12) == "embedding.word_embeddings.weight"


def test_tiny_adder_weights_round_trip_through_tp2_shards():
    """The shipped model's real tensors (fp32) through the conversion the engine uses, read lazily from disk."""
    cfg = json.loads((TINY / "config.json").read_text())
    shape = cv.ModelShape.from_hf(cfg, tp=2)
    with HFWeights(TINY) as hf:
        assert sorted(cv.hf_state_names(shape)) == sorted(hf)
        plan = {n: s for m in cv.megatron_names(shape) for n, s in cv.hf_shape_of(m, shape)}
        assert all(list(hf[n].shape) == s for n, s in plan.items())
        shards = cv.hf_to_megatron(hf, shape, tp=2)
        back = cv.megatron_to_hf(shards, shape)
        assert all(torch.equal(back[n], hf[n]) for n in hf)


@pytest.mark.skipif(HAVE_MEGATRON, reason="megatron-core is installed here")
def test_engine_megatron_without_megatron_core_says_how_to_install():
    from learner.config import LearnerConfig
    from learner.run import make_engine

    lc = LearnerConfig.model_validate({"engine": "megatron", "loss": {"correction": "tis"}})
    with pytest.raises(RuntimeError, match=r"pip install fleetrl\[megatron\]"):
        make_engine(lc, str(TINY), total_steps=1, seed=0)


@pytest.mark.skipif(HAVE_MEGATRON, reason="megatron-core is installed here")
def test_launcher_names_the_missing_extra_before_starting_anything():
    p = subprocess.run(
        [
            sys.executable,
            "launch/cluster.py",
            "--learner-gpus",
            "2",
            "--rollout-gpus",
            "1",
            "learner.engine=megatron",
            "learner.megatron.tensor_model_parallel_size=2",
            f"model.path={TINY}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 2, p.stderr
    assert "pip install 'fleetrl[megatron]'" in p.stderr
    assert "Ray" not in p.stderr
