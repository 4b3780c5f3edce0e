"""The vLLM CPU server as the tests start it: one place for the settings every CPU test server shares."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


@contextmanager
def cpu_vllm_server(model: str | Path, run_dir: str | Path, **args: Any) -> Iterator[Any]:
    """A running :class:`engines.vllm.server.VLLMServer` on CPU: fp32, ``--enforce-eager`` (a far quicker
    start on 2 cores), 1 GB of KV cache, 480 s to become healthy; ``args`` are further or other
    ``VLLMServerArgs``. Its caches are a launch's servers' own (:func:`engines.vllm.server.shared_cache_dir`),
    shared by every test server. Stopped (its whole process group) on the way out."""
    from engines.vllm.server import VLLMServer, VLLMServerArgs, shared_cache_dir

    settings = {"dtype": "float32", "cpu_kvcache_gb": 1, "enforce_eager": True, "startup_timeout_s": 480, **args}
    server = VLLMServer(VLLMServerArgs(model=str(model), **settings), run_dir, cache_dir=shared_cache_dir())
    server.start()
    try:
        yield server
    finally:
        server.stop()


def model_copy_with_generation_config(src: Path, out: Path, edit: Callable[[dict], dict]) -> Path:
    """``src``'s files symlinked into ``out``, except ``generation_config.json``, written as ``edit`` of ``src``'s."""
    import json

    for f in src.iterdir():
        if f.name != "generation_config.json":
            (out / f.name).symlink_to(f)
    gen = json.loads((src / "generation_config.json").read_text())
    (out / "generation_config.json").write_text(json.dumps(edit(gen), indent=2))
    return out


class AttachedServerFactory:
    """A fleet factory whose every server is one already running vLLM server at ``url`` (a test's shared CPU
    server): ``start`` gives a new generation client of it (``client_kw``: the client's own arguments), and a
    restart keeps the client."""

    def __init__(self, url: str, **client_kw: Any) -> None:
        self.url, self.client_kw = url, client_kw

    async def start(self, index: int) -> Any:
        from engines.vllm.generation import VLLMGenerationClient

        return VLLMGenerationClient(f"vllm-{index}", self.url, model="tiny-adder", **self.client_kw)

    async def restart(self, engine: Any) -> Any:
        return engine

    async def stop(self, engine: Any) -> None:
        await engine.close()
