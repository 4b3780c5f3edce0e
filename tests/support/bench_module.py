"""Load a bench/ script as a module for a test, leaving sys.path as it was (bench scripts put the repository
first on it when they run as scripts)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]


def load_bench(relpath: str, name: str) -> ModuleType:
    """``load_bench("bench/lora_publish.py", "bench_lora_publish")``: the script's module, executed once."""
    spec = importlib.util.spec_from_file_location(name, REPO / relpath)
    mod = importlib.util.module_from_spec(spec)
    path = list(sys.path)
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path[:] = path
    return mod
