"""The shared CPU vLLM server, started as fleetrl starts one with the run's token
(core.engine_auth): calls without the token are refused on every route that can drive the
engine, and the fleet's own clients, which send it, work."""

from __future__ import annotations

import asyncio
import os

import httpx
import pytest

from core.engine_auth import OPEN_PATHS, TOKEN_ENV, auth_headers
from engines.vllm.generation import VLLMGenerationClient

pytestmark = pytest.mark.timeout(600)

# (method, path, body): the RL endpoints (pause, weights, collective_rpc) and the OpenAI API
DRIVING = [
    ("POST", "/pause", None),
    ("POST", "/resume", None),
    ("GET", "/is_paused", None),
    ("POST", "/update_weights", {"update_info": {}}),
    ("POST", "/start_weight_update", None),
    ("POST", "/update_weight_version", {"new_version": "999"}),
    ("POST", "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": "/tmp/x"}}),
    ("POST", "/init_weight_transfer_engine", {"init_info": {}}),
    ("POST", "/sleep", None),
    ("POST", "/reset_prefix_cache", None),
    ("GET", "/weight_info", None),
    ("GET", "/v1/models", None),
    ("POST", "/v1/completions", {"model": "tiny-adder", "prompt": "1+1=", "max_tokens": 1}),
]


def test_calls_without_the_run_token_are_refused_and_the_fleet_clients_work(vllm_server):
    assert os.environ.get(TOKEN_ENV), "the integration conftest sets the session's token"
    assert "core.engine_auth.RequireEngineToken" in vllm_server.command()
    url = vllm_server.url
    wrong = {"Authorization": "Bearer " + "x" * 40}
    for method, path, body in DRIVING:
        for headers in ({}, wrong, {"Authorization": os.environ[TOKEN_ENV]}):  # none, wrong, no "Bearer"
            r = httpx.request(method, url + path, json=body, headers=headers, timeout=30)
            assert r.status_code == 401, (method, path, headers, r.status_code, r.text[:200])
    for path in sorted(OPEN_PATHS):  # read-only probes stay open (liveness, Prometheus)
        assert httpx.get(url + path, timeout=30).status_code == 200, path

    async def fleet_client() -> tuple[bool, bool, str | None]:
        c = VLLMGenerationClient("auth-test", url, model=vllm_server.model_name, timeout_s=60, request_timeout_s=120)
        try:
            await c.pause()
            paused = await c.is_paused()
            await c.resume()
            return paused, await c.is_paused(), await c.server_weight_version()
        finally:
            await c.close()

    paused, still, version = asyncio.run(fleet_client())
    assert paused and not still  # the authenticated pause and resume took effect
    assert version != "999"  # the refused /update_weight_version changed nothing
    r = httpx.post(
        url + "/collective_rpc", json={"method": "fleetrl_weight_sync_status"}, headers=auth_headers(), timeout=60
    )
    assert r.status_code == 200, r.text[:300]
