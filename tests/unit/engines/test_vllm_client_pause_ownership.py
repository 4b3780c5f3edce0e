"""The vLLM client's own pauses: a load it paused the server for, and that ended half-way (an error, or
the publish cancelling it because another engine failed), leaves the server paused, and the next load
through the same client resumes it.

Seen on the emulated cluster (2026-12-02): a publish paused the surviving server, was cancelled when
the other host vanished, and every later publish found the server paused, took the pause for somebody
else's and left it so; the fleet's 32 group slots then waited on a server that generated nothing.

A stand-in HTTP server here, not vLLM: the fault is a cancel landing between the pause and the load,
which a real server gives no way to time (a load cancelled inside vLLM's receive would wedge the shared
test server); the stand-in keeps vLLM's pause state and endpoints as fleetrl's client uses them.
"""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web
from vllm_standin import PausableStandIn

from engines.base import EngineError
from engines.vllm.weights import VLLMWeightClient

pytestmark = pytest.mark.timeout(60)


class StandIn(PausableStandIn):
    def __init__(self) -> None:
        super().__init__()
        self.hang = asyncio.Event()  # set: reload_weights hangs (until released)
        self.release = asyncio.Event()
        self.in_rpc = asyncio.Event()  # a reload_weights call has arrived
        self.fail = False
        self.app.router.add_post("/collective_rpc", self._rpc)
        self.app.router.add_post("/update_weight_version", self._ok)
        self.app.router.add_post("/reset_prefix_cache", self._ok)

    async def _ok(self, request):
        return web.json_response({"success": True})

    async def _rpc(self, request):
        self.in_rpc.set()
        if self.hang.is_set():
            await self.release.wait()
        if self.fail:
            return web.json_response({"error": "reload failed"}, status=500)
        return web.json_response({"results": [None]})


async def _serve(stand_in: StandIn):
    runner = await stand_in.serve()
    return runner, stand_in.url


def _client(url: str) -> VLLMWeightClient:
    return VLLMWeightClient(
        "vllm-standin", url, model="tiny", timeout_s=5, request_timeout_s=5, update_pause_mode="wait"
    )


def test_a_cancelled_load_leaves_the_pause_to_the_next_load():
    async def main():
        s = StandIn()
        runner, url = await _serve(s)
        c = _client(url)
        try:
            s.hang.set()
            task = asyncio.create_task(c.load_weights_from_path("/exports/v3", 3))
            await asyncio.wait_for(s.in_rpc.wait(), 10)  # paused, and inside the (hanging) load now
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            paused_after_cancel = s.paused
            s.hang.clear()
            s.release.set()
            await c.load_weights_from_path("/exports/v4", 4)  # the server is paused already: ours
            return paused_after_cancel, s.paused, c.weight_version
        finally:
            await c.close()
            await runner.cleanup()

    paused_after_cancel, paused_at_end, version = asyncio.run(main())
    assert paused_after_cancel, "the cancelled load must leave the server paused (weights may be half-loaded)"
    assert not paused_at_end, "the next load did not resume the server it had paused"
    assert version == 4


def test_a_failed_load_too_and_a_pause_of_somebody_else_is_left_alone():
    async def main():
        s = StandIn()
        runner, url = await _serve(s)
        c = _client(url)
        try:
            s.fail = True
            with pytest.raises(EngineError):
                await c.load_weights_from_path("/exports/v3", 3)
            failed_paused = s.paused
            s.fail = False
            await c.load_weights_from_path("/exports/v4", 4)
            resumed = not s.paused
            s.paused = True  # paused by another client (the fleet): a load must not resume it
            await c.load_weights_from_path("/exports/v5", 5)
            return failed_paused, resumed, s.paused
        finally:
            await c.close()
            await runner.cleanup()

    failed_paused, resumed, foreign_kept = asyncio.run(main())
    assert failed_paused and resumed and foreign_kept


class _Members:
    """The publisher's membership as the learner rank uses it (engines by id, add, remove)."""

    backend = "gloo"

    def __init__(self) -> None:
        self.engines: dict = {}

    def add_engine(self, client, export_path=None, version=0) -> None:
        self.engines[client.engine_id] = client

    def remove_engine(self, engine_id: str) -> None:
        self.engines.pop(engine_id, None)


def test_a_server_the_publisher_dropped_and_takes_back_keeps_the_client_that_owns_its_pause(tmp_path):
    """Seen on the emulated cluster (2026-12-02, after the fix above): a publish failed half-way and left
    the surviving server paused; the next epoch's join failed and the publisher dropped that server; the
    learner rank took it back with a new client, which found the server paused, took the pause for
    somebody else's, loaded the next version and left it paused: the fleet stalled with 32 groups on it."""
    from launch.config import load_run_config
    from learner.rank import LearnerRank

    class Fleet:
        def __init__(self, url: str) -> None:
            self.url = url

        def server_urls(self) -> dict[str, str]:
            return {"vllm-standin": self.url}

    async def main():
        s = StandIn()
        runner, url = await _serve(s)
        # the recipe's rollout.weight_update 'pause': the registry's client pauses with 'wait'
        cfg = load_run_config(
            "tiny", [f"run.run_dir={tmp_path}", "rollout.weight_update=pause", "weight_sync.timeout_s=5"]
        )
        rank = LearnerRank(cfg, "tcp://127.0.0.1:1", str(tmp_path), Fleet(url))
        weights = rank.weights  # learner/publishing.py: rank 0's group, clients and counters
        weights.pub = _Members()
        try:
            weights.sync_members()
            first = weights.pub.engines["vllm-standin"]
            assert isinstance(first, VLLMWeightClient) and first.update_pause_mode == "wait"
            s.fail = True
            with pytest.raises(EngineError):
                await first.load_weights_from_path("/exports/v5", 5)  # half-way: the server stays paused
            weights.pub.remove_engine("vllm-standin")  # the next epoch's join failed: dropped
            s.fail = False
            weights.sync_members()  # back in the fleet's list: taken back
            again = weights.pub.engines["vllm-standin"]
            await again.load_weights_from_path("/exports/v7", 7)
            return again is first, len(weights.clients), s.paused
        finally:
            for c in weights.clients.values():
                await c.close()
            await runner.cleanup()

    same, n_clients, paused = asyncio.run(main())
    assert not paused, "the server stayed paused after a full load: the pause had lost its owner"
    assert same and n_clients == 1
