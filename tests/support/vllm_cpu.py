"""The vLLM CPU server as the tests start it: one place for the settings every CPU test server shares."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


@contextmanager
def cpu_vllm_server(model: str | Path, run_dir: str | Path, **args: Any) -> Iterator[Any]:
    """A running :class:`engines.vllm.server.VLLMServer` on CPU: fp32, ``--enforce-eager`` (a far quicker
    start on 2 cores), 1 GB of KV cache, 480 s to become healthy; ``args`` are further or other
    ``VLLMServerArgs``. Stopped (its whole process group) on the way out."""
    from engines.vllm.server import VLLMServer, VLLMServerArgs

    settings = {"dtype": "float32", "cpu_kvcache_gb": 1, "enforce_eager": True, "startup_timeout_s": 480, **args}
    server = VLLMServer(VLLMServerArgs(model=str(model), **settings), run_dir)
    server.start()
    try:
        yield server
    finally:
        server.stop()
