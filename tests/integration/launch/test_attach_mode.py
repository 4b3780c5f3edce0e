"""Attach mode (``rollout.urls``): the fleet uses a vLLM server it did not start, joins it to weight
sync, and never starts, restarts or stops it.

The server is conftest's session server (a real vLLM CPU process on the tiny model, started by the
test session, not by the fleet). The weights go through the learner's own client choice
(``engines.registry.weight_client``) and the gloo publisher, as a learner rank would send them.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from engines.base import SamplingParams
from engines.vllm.factory import VLLMFactory
from launch.config import load_run_config
from rollout_fleet.controller import FleetController
from rollout_fleet.status import ServerState

TINY_MODEL = Path(__file__).resolve().parents[3] / "models" / "tiny-adder"
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_attached_server_serves_takes_weights_and_is_never_restarted(vllm_server, tmp_path):
    from safetensors.torch import load_file

    from engines.registry import weight_client
    from weight_sync.config import WeightSyncConfig
    from weight_sync.plan import build_plan
    from weight_sync.publisher import Publisher

    cfg = load_run_config(
        "tiny", [f"run.run_dir={tmp_path}", f"rollout.urls=[{vllm_server.url}]", "rollout.startup_timeout_s=30"]
    )
    pid = vllm_server.pid

    async def body():
        factory = VLLMFactory(cfg, tmp_path, {})
        fleet = FleetController(cfg.rollout, factory)
        await fleet.start(1)
        try:
            (server,) = fleet.servers.values()
            assert server.engine.url == vllm_server.url and server.engine.server is None
            assert server.engine.model == vllm_server.model_name  # learned from /v1/models, not assumed
            _, samples = await fleet.run_group("g0", [5, 6, 7], SamplingParams(n=2, max_tokens=4, temperature=1.0))
            assert len(samples) == 2 and all(len(s.token_ids) >= 1 for s in samples)
            with pytest.raises(ValueError, match="has 1 server"):  # the fleet starts none of its own
                await fleet.scale_to(2)
            with pytest.raises(ValueError, match="does not own it"):
                server.engine.kill()

            # weight sync: the learner's client of this URL, the gloo publisher, a version the server reports
            base = load_file(str(TINY_MODEL / "model.safetensors"))
            plan = build_plan([(k, v.shape, v.dtype) for k, v in base.items()], bucket_bytes=256 * 1024)
            urls = {s.engine_id: s.engine.url for s in fleet.servers.values() if s.state == ServerState.HEALTHY}
            endpoints = [weight_client(cfg, "gloo", eid, url) for eid, url in urls.items()]
            pub = Publisher(WeightSyncConfig(backend="gloo", timeout_s=60), plan, engines=endpoints)
            try:
                rep = await asyncio.to_thread(pub.publish, 11, base.items())
            finally:
                pub.close()
            assert rep.per_engine_checksums == {"vllm-0": rep.checksum}
            assert await server.engine.refresh_version() == 11

            # a "restart" of an attached server only reconnects: same process, same URL
            again = await factory.restart(server.engine)
            assert again.url == vllm_server.url and vllm_server.pid == pid
            await again.close()
        finally:
            await fleet.close()  # stops the fleet's clients only

    asyncio.run(body())
    assert vllm_server.pid == pid and vllm_server.alive
    assert httpx.get(vllm_server.url + "/health", timeout=10).status_code == 200


def test_attach_to_a_dead_url_fails_naming_it(tmp_path):
    from core.http_client import free_port

    url = f"http://127.0.0.1:{free_port()}"
    cfg = load_run_config("tiny", [f"run.run_dir={tmp_path}", f"rollout.urls=[{url}]", "rollout.startup_timeout_s=2"])

    async def body():
        factory = VLLMFactory(cfg, tmp_path, {})
        with pytest.raises(Exception, match=r"attached server .* did not answer /health within 2 s"):
            await factory.start(0)

    asyncio.run(body())
