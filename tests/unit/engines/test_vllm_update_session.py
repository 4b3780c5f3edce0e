"""vLLM's weight-update session, as fleetrl's client opens and closes it.

vLLM's worker keeps one flag for an update session (vllm/v1/worker/gpu_worker.py, 0.26 and 0.32): a start while
it is set is refused ("start_weight_update called while a weight update is already active"), an update that
raises clears it, a finish without a start is refused. A load cancelled between its start and its finish (the
publisher aborts a publish when another engine fails) leaves the flag set. Seen on the emulated cluster
(2026-12-08, ``test_job_across_emulated_hosts_survives_losing_one``): the surviving server refused every later
publish this way and stayed paused at an old version.

A stand-in HTTP server with that state machine, not vLLM: the fault is a cancel landing between the start and
the finish, which a real server gives no way to time (a load cancelled inside vLLM's receive would wedge a
shared test server); the stand-in answers vLLM's errors with vLLM's words, as its HTTP 500 bodies carry them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
import torch
from aiohttp import web
from vllm_standin import PausableStandIn

from engines.base import EngineError
from engines.vllm.weights import VLLMWeightClient
from weight_sync.plan import build_plan

pytestmark = pytest.mark.timeout(60)


class SessionStandIn(PausableStandIn):
    def __init__(self) -> None:
        super().__init__()
        self.active = False  # vLLM's Worker._weight_update_active
        self.hang = asyncio.Event()  # set: /update_weights waits for `release`
        self.release = asyncio.Event()
        self.in_update = asyncio.Event()
        self.fail_update = False
        self.start_error: str | None = None  # set: every start is refused with this
        self.calls: list[str] = []
        self.finished_versions: list[str | None] = []
        for route, handler in {
            "/start_weight_update": self._start,
            "/update_weights": self._update,
            "/finish_weight_update": self._finish,
            "/reset_prefix_cache": self._ok,
        }.items():
            self.app.router.add_post(route, handler)

    @staticmethod
    def _refused(message: str) -> web.Response:
        body = {"error": {"message": f"Call to collective_rpc method failed: Worker failed with error '{message}'"}}
        return web.json_response(body, status=500)

    async def _ok(self, request):
        return web.json_response({})

    async def _start(self, request):
        self.calls.append("start")
        if self.start_error is not None:
            return self._refused(self.start_error)
        if self.active:
            return self._refused(
                "start_weight_update called while a weight update is already active. Call finish_weight_update first."
            )
        self.active = True
        return web.json_response({"message": "Weight update started"})

    async def _update(self, request):
        self.calls.append("update")
        if not self.active:
            return self._refused("start_weight_update must be called before update_weights.")
        self.in_update.set()
        if self.hang.is_set():
            await asyncio.shield(self.release.wait())  # the worker's receive goes on when the client leaves
        if self.fail_update:
            self.active = False  # vLLM clears the session when an update raises
            return self._refused("receive failed")
        return web.json_response({"message": "Weights updated"})

    async def _finish(self, request):
        self.calls.append("finish")
        if not self.active:
            return self._refused("finish_weight_update called without a matching start_weight_update.")
        self.active = False
        self.finished_versions.append((await request.json()).get("weight_version"))
        return web.json_response({"message": "Weight update finished"})


@contextlib.asynccontextmanager
async def _served(s: SessionStandIn) -> AsyncIterator[VLLMWeightClient]:
    """The stand-in listening, and a client of it with a one-tensor plan announced."""
    runner = await s.serve()
    c = VLLMWeightClient(
        "vllm-standin",
        s.url,
        model="tiny",
        weight_backend="nccl",  # no checksum call: the session is what is under test
        timeout_s=5,
        request_timeout_s=5,
        update_pause_mode="wait",
    )
    c._plan = build_plan([("w", [4], torch.float32)], 1 << 20)
    try:
        yield c
    finally:
        await c.close()
        await runner.cleanup()


async def _cancel_mid_update(s: SessionStandIn, c: VLLMWeightClient) -> None:
    s.hang.set()
    task = asyncio.create_task(c.update_weights(5, c._plan.plan_id))
    await asyncio.wait_for(s.in_update.wait(), 10)
    task.cancel()  # the publisher cancels this engine's load: another engine failed
    with pytest.raises(asyncio.CancelledError):
        await task
    s.hang.clear()
    s.release.set()  # the server's receive completes on its own; nobody sends the finish
    await asyncio.sleep(0.05)


def test_a_load_cancelled_between_start_and_finish_does_not_lock_the_next_one_out():
    async def main():
        s = SessionStandIn()
        async with _served(s) as c:
            await _cancel_mid_update(s, c)
            left = (s.active, s.paused)
            s.calls.clear()
            await c.update_weights(6, c._plan.plan_id)
            return left, list(s.calls), s.active, s.paused, s.finished_versions, c.weight_version

    left, calls, active, paused, finished, version = asyncio.run(main())
    assert left == (True, True), "the cancelled load must leave vLLM's session open and the server paused"
    # refused once, the open session finished (no version label: it is not a policy), then a whole load
    assert calls == ["start", "finish", "start", "update", "finish"], calls
    assert finished == [None, "6"]
    assert not active and not paused and version == 6


def test_a_session_the_server_already_closed_is_not_finished_again():
    async def main():
        s = SessionStandIn()
        async with _served(s) as c:
            s.fail_update = True  # vLLM clears its session itself when the update raises
            with pytest.raises(EngineError, match="stays paused"):
                await c.update_weights(5, c._plan.plan_id)
            s.fail_update = False
            s.calls.clear()
            await c.update_weights(6, c._plan.plan_id)
            return list(s.calls), s.paused, c.weight_version

    calls, paused, version = asyncio.run(main())
    assert calls == ["start", "update", "finish"], calls
    assert not paused and version == 6


def test_other_start_refusals_are_not_taken_for_an_open_session():
    async def main():
        s = SessionStandIn()
        s.start_error = "Weight transfer engine not initialized"
        async with _served(s) as c:
            with pytest.raises(EngineError, match="not initialized"):
                await c.update_weights(5, c._plan.plan_id)
            return s.calls

    assert "finish" not in asyncio.run(main())
