"""Suite-wide settings: one thread per process (2-core machines), GPU tests skipped without CUDA."""

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA GPUs: run on the GPU machine (see bench/results/)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
