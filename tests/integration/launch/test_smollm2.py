"""A real pretrained model end to end on CPU: SmolLM2-135M-Instruct from PyPI.

* the conversion (``python -m tools.smollm2``): every tensor equal to the GGUF's own dequantization,
  and a corrupted tensor is caught;
* a vLLM CPU server on it returns chat-templated samples that end at the chat template's
  end-of-turn token, with log-probs that match the learner's forward;
* a short run of the whole system (launcher, broker, vLLM, FSDP learner, gloo weight sync) on the
  real-model recipe.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from tests.support.vllm_cpu import cpu_vllm_server

REPO = Path(__file__).resolve().parents[3]
DATA = REPO / "data" / "word_problems"
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture()
def short_tmp():
    """A short run directory: vLLM puts ZMQ ipc sockets under it, and a socket path has at most 107 bytes."""
    d = Path(tempfile.mkdtemp(prefix="fr19-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_conversion_matches_the_gguf_and_catches_a_corrupted_tensor(smollm2_model):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer

    from tools.smollm2 import ConversionError, check_against_gguf, gguf_path

    info = json.loads((smollm2_model / "fleetrl-converted.json").read_text())
    assert info["tensors_checked"] == 272 and info["parameters"] == 134_515_008
    cfg = AutoConfig.from_pretrained(smollm2_model)
    assert cfg.model_type == "llama" and cfg.tie_word_embeddings and cfg.num_hidden_layers == 30
    tok = AutoTokenizer.from_pretrained(smollm2_model)
    assert len(tok) == 49152 and tok.eos_token == "<|im_end|>"
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n")
    state = load_file(smollm2_model / "model.safetensors")
    assert all(t.dtype == torch.bfloat16 for t in state.values())
    state["model.layers.3.self_attn.k_proj.weight"][0, 0] += 1.0
    with pytest.raises(ConversionError, match="model.layers.3.self_attn.k_proj.weight differs"):
        check_against_gguf(state, gguf_path(), cfg)


def test_the_conversion_takes_the_ggufs_eos_whatever_transformers_reads(smollm2_model):
    """transformers 5.17 (the GPU machine's) read this GGUF's EOS as ``<|im_start|>``, the token that starts a turn:
    the converted model then stopped only once the next turn began. ``set_gguf_eos`` puts the GGUF's own back."""
    from transformers import AutoTokenizer

    from tools.smollm2 import set_gguf_eos

    # the GGUF's id (tools.smollm2.gguf_eos_id, 2) is checked by the conversion test: its folder's EOS is <|im_end|>
    tok = AutoTokenizer.from_pretrained(smollm2_model)
    tok.eos_token = "<|im_start|>"  # what transformers 5.17 read
    assert tok.eos_token_id == 1
    set_gguf_eos(tok, 2)
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    set_gguf_eos(tok, 2)  # already right: unchanged
    assert tok.eos_token_id == 2


@pytest.fixture(scope="module")
def smollm2_server(smollm2_model, tmp_path_factory):
    with cpu_vllm_server(
        smollm2_model,
        tmp_path_factory.mktemp("smollm2_server"),
        max_model_len=256,
        max_num_seqs=16,
        served_model_name="smollm2",
    ) as s:
        yield s


def test_vllm_serves_chat_templated_samples_with_the_learners_logprobs(smollm2_model, smollm2_server):
    import torch
    from transformers import AutoModelForCausalLM

    from engines.base import SamplingParams
    from engines.vllm.generation import VLLMGenerationClient
    from learner.batch import MicroBatch
    from learner.engine import packed_forward
    from rollout_fleet.data import PromptDataset, load_tokenizer

    tok = load_tokenizer(smollm2_model)
    ds = PromptDataset([DATA / "test.parquet"], tok, shuffle=False, max_model_len=256, response_tokens=48)
    row = ds.next()
    prompt = row.prompt_ids.tolist()
    assert tok.decode(prompt).startswith("<|im_start|>system\nAnswer with only the final number.<|im_end|>")

    async def sample():
        c = VLLMGenerationClient("smollm2", smollm2_server.url, model="smollm2", request_timeout_s=300)
        try:
            return await c.generate(prompt, SamplingParams(n=4, max_tokens=48, temperature=1.0, seed=0))
        finally:
            await c.close()

    samples = asyncio.run(sample())
    stopped = [s for s in samples if s.finish_reason == "stop"]
    assert stopped, [tok.decode(s.token_ids) for s in samples]
    for s in stopped:  # a finished answer ends with the chat template's end of turn
        assert int(s.token_ids[-1]) == tok.eos_token_id

    model = AutoModelForCausalLM.from_pretrained(smollm2_model, dtype=torch.float32).eval()
    diffs = []
    for s in samples:
        ids = torch.tensor(prompt + s.token_ids.tolist(), dtype=torch.int64)
        n = len(s.token_ids)
        mb = MicroBatch(
            input_ids=ids[:-1].view(1, -1),
            position_ids=torch.arange(len(ids) - 1).view(1, -1),
            target_index=torch.arange(len(prompt) - 1, len(ids) - 1),
            targets=ids[len(prompt) :],
            behaviour_logp=torch.zeros(n),
            advantages=torch.zeros(n),
            weights=torch.zeros(n),
            seq_lens=torch.tensor([n]),
            fresh=torch.zeros(n, dtype=torch.bool),
        )
        with torch.no_grad():
            ours, _ = packed_forward(model, mb, 1.0)
        diffs.append(np.abs(ours.numpy() - s.logprobs))
    d = np.concatenate(diffs)
    # Both sides fp32 on the same weights (vLLM got the bf16 checkpoint upcast, the learner the same);
    # what differs is the kernels' summation order (vLLM's CPU attention and GEMMs vs torch SDPA), which
    # moves a log-prob by about 1e-3 nats at most here. 0.02 per token is far below the
    # 0.1-1 nats a wrong token, position or temperature would cost.
    assert d.max() < 0.02 and d.mean() < 0.005, (d.max(), d.mean())


def test_short_real_model_run_through_the_launcher(smollm2_model, short_tmp):
    run_dir = short_tmp / "run"
    summary = short_tmp / "summary.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "launch/cluster.py",
        "--rollout-gpus",
        "0",
        "--learner-gpus",
        "0",
        "--recipe",
        "smollm2",
        "--max-steps",
        "2",
        "--run-dir",
        str(run_dir),
        "--summary",
        str(summary),
        "--no-live",
        f"model.path={smollm2_model}",
        "broker.groups_per_step=2",
        "broker.max_staleness=1",
        "rollout.sampling.max_tokens=16",
        "run.eval_samples=8",
        "reward.on_truncated=penalize",
    ]
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=540)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    s = json.loads(summary.read_text())
    assert s["steps"] == 2 and s["groups_lost"] == 0 and s["error"] is None
    assert s["eval_accuracy_before"] is not None and s["eval_accuracy_after"] is not None
    # every step either published (and the fleet counted the update) or changed nothing and skipped it
    assert s["publishes"] + s["publishes_skipped"] == 2 and s["publish_errors"] == 0
    assert s["weight_updates"] == s["publishes"]
    assert s["samples_truncated"] >= 0 and s["tokens_generated"] > 0
