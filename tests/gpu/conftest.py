"""GPU-test fixtures (helpers live in gpu_helpers.py, importable by the tests and bench/)."""

from __future__ import annotations

import os

import pytest

# The 2-GPU machine shares its NVLink fabric: multicast stays off in every process we start.
for _k, _v in {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    "VLLM_USE_FLASHINFER_SAMPLER": "0",
    "HF_HUB_OFFLINE": "1",
}.items():
    os.environ.setdefault(_k, _v)


@pytest.fixture(scope="session")
def qwen_checkpoints(tmp_path_factory):
    """(v0 folder, v1 folder, v0 state, v1 state): two random versions of the same architecture."""
    import torch
    from gpu_helpers import random_qwen2_state, save_checkpoint

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    root = tmp_path_factory.mktemp("qwen2-0.5b-random")
    s0, s1 = random_qwen2_state(0), random_qwen2_state(1)
    return save_checkpoint(s0, root / "v0"), save_checkpoint(s1, root / "v1"), s0, s1


@pytest.fixture(scope="module")
def loop():
    """One event loop per test module for the async engine clients."""
    import asyncio

    lp = asyncio.new_event_loop()
    yield lp
    lp.close()
