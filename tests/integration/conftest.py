"""Shared integration fixtures: ONE vLLM CPU server on models/tiny-adder for the whole session.

Starting vLLM costs 40-170 s on a 2-core machine, so every test that needs a
real vLLM server shares this one (session scope). It runs fp32 with
``--enforce-eager`` (no torch.compile: a far quicker start, same numerics
class as transformers' eager fp32), block size 32 so prompts of 32+ tokens
hit the prefix cache, and ``--enable-prompt-tokens-details`` so responses
report cached prompt tokens (the prefix-cache-reset test reads them), and
``--enable-scale-out`` for the token-in/token-out ``/inference/v1/generate``
API (the one that reports per-sample ``weight_versions``).

It serves a copy of the tiny model whose ``generation_config.json`` asks for ``top_k=2`` and
``repetition_penalty=1.3`` (what instruct checkpoints such as Qwen2.5's ship, made extreme): every test
on it then checks that fleetrl's samples follow fleetrl's sampling, never the model folder's.
"""

from __future__ import annotations

import logging
import os
import secrets
from pathlib import Path

import pytest

from core.engine_auth import TOKEN_ENV
from tests.support.vllm_cpu import cpu_vllm_server, model_copy_with_generation_config

# The session's engine token, as a launcher run has one (core.engine_auth): the shared server
# requires it, every client of this process and of the processes the tests start sends it.
os.environ.setdefault(TOKEN_ENV, "session-" + secrets.token_urlsafe(24))

REPO = Path(__file__).resolve().parents[2]
TINY_MODEL = REPO / "models" / "tiny-adder"

log = logging.getLogger(__name__)


# Sampling defaults a model folder may carry; fleetrl must neither apply them nor be fooled by them.
HOSTILE_GENERATION_CONFIG = {"top_k": 2, "repetition_penalty": 1.3}


def hostile_generation_config_copy(out: Path) -> Path:
    """The tiny model's files (symlinked) with a generation_config.json that adds HOSTILE_GENERATION_CONFIG."""
    return model_copy_with_generation_config(TINY_MODEL, out, lambda gen: {**gen, **HOSTILE_GENERATION_CONFIG})


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory):
    """A running :class:`engines.vllm.server.VLLMServer` on the tiny model (fleetrl weight backend over gloo)."""
    if not (TINY_MODEL / "config.json").exists():
        pytest.fail(f"the tiny model is missing at {TINY_MODEL}: build it with `python -m tools.pretrain_tiny`")
    model = hostile_generation_config_copy(tmp_path_factory.mktemp("tiny-adder-topk2"))
    with cpu_vllm_server(
        model,
        tmp_path_factory.mktemp("vllm_server"),
        max_model_len=64,
        max_num_seqs=16,
        served_model_name="tiny-adder",
        extra_args=["--block-size", "32", "--enable-prompt-tokens-details", "--enable-scale-out"],
    ) as s:
        yield s


@pytest.fixture(scope="session")
def smollm2_model():
    """SmolLM2-135M-Instruct converted once from the PyPI GGUF into the checkout's cache (``.cache/models``)."""
    from tools.smollm2 import DEFAULT_OUT, convert

    return convert(DEFAULT_OUT)
