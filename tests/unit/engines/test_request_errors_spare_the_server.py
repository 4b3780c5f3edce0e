"""An engine's HTTP 4xx is the request's fault: the group fails once and is counted, the server is not blamed.

A real HTTP server on loopback answers ``/v1/completions`` as vLLM does for a prompt over its
model length (400); the real vLLM client and the fleet controller talk to it.
"""

from __future__ import annotations

import asyncio

import pytest
from json_http import json_http_server

from core.http_client import BadRequest, EngineError
from engines.base import SamplingParams
from engines.vllm.generation import VLLMGenerationClient
from rollout_fleet.config import RolloutConfig
from rollout_fleet.controller import FleetController

pytestmark = pytest.mark.timeout(60)

VLLM_400 = {
    "object": "error",
    "type": "BadRequestError",
    "code": 400,
    "message": "This model's maximum context length is 64 tokens. However, you requested 80 tokens "
    "(72 in the messages, 8 in the completion).",
}


class _Engine:
    """Counts the calls per path; every POST gets ``status`` (vLLM's 400 body for 400), every GET 200."""

    def __init__(self, status: int) -> None:
        self.calls: dict[str, int] = {}
        self.status = status

    def answer(self, method, path, body):
        self.calls[path] = self.calls.get(path, 0) + 1
        if method == "GET":
            return {}, 200
        return (VLLM_400 if self.status == 400 else {"error": "busy"}), self.status


@pytest.fixture(params=[400, 503, 429])
def server(request):
    engine = _Engine(request.param)
    with json_http_server(engine.answer) as url:
        yield url, engine


class _Factory:
    def __init__(self, url: str) -> None:
        self.url = url

    async def start(self, index: int):
        return VLLMGenerationClient(f"vllm-{index}", self.url, model="m", timeout_s=5, request_timeout_s=5)

    async def restart(self, engine):
        return engine

    async def stop(self, engine) -> None:
        await engine.close()


def test_4xx_fails_the_group_once_and_keeps_the_server(server):
    url, handler = server
    cfg = RolloutConfig(health_interval_s=60, startup_timeout_s=2, health_failures=1)

    async def go():
        fleet = FleetController(cfg, _Factory(url), max_attempts=3)
        await fleet.add_server()
        try:
            with pytest.raises(EngineError) as err:
                await fleet.run_group("g1", [1, 2, 3], SamplingParams(n=2, max_tokens=8))
            return fleet, err.value, [s["state"] for s in fleet.status()["servers"]]
        finally:
            await fleet.close()

    fleet, exc, states = asyncio.run(go())
    if handler.status == 400:
        assert isinstance(exc, BadRequest) and exc.status == 400
        assert "maximum context length is 64 tokens" in str(exc)
        assert handler.calls["/v1/completions"] == 1  # not retried: another try gets the same answer
        assert fleet.groups_bad_request == 1 and fleet.groups_requeued == 0 and fleet.server_deaths == 0
        assert states == ["healthy"]
    else:  # 5xx and 429 are the server's state: retried (and the server probed), never a bad request
        assert not isinstance(exc, BadRequest)
        assert fleet.groups_bad_request == 0 and handler.calls["/v1/completions"] >= 2
