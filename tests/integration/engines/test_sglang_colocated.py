"""Colocated mode on SGLang, on CPU: the fleet's sleep / wake through the SGLang client's memory release, and
the publish over gloo into SGLang's own update group, against the stand-in (sglang_standin.py).

The fleet controller, the colocated gate (rollout_fleet/colocated_gate.py), the clients, the publisher and
its gloo group are the real ones; the stand-in plays SGLang's server as 0.5.16 answers these calls
(the real server: tests/gpu/test_sglang_colocated_gpu.py). Checked: the order of the calls of each
step (release all, resume weights, the update, resume the KV cache), that the engine answers with the
published weights after the wake and generates nothing while released, that the client waits for its
requests before a release, that a failed resume is named and leaves the engine released, and that
each call is bounded by a timeout that names it.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from health import wait_healthy  # tests/support (pyproject: pytest pythonpath)
from sglang_standin import state

from core.http_client import EngineError, EngineErrorCode, free_port
from engines.base import SamplingParams
from engines.sglang.generation import SGLangGenerationClient
from engines.sglang.weights import SGLangPublishClient
from rollout_fleet.colocated_gate import ColocatedEngines
from rollout_fleet.config import RolloutConfig
from rollout_fleet.controller import FleetController
from weight_sync.config import WeightSyncConfig
from weight_sync.plan import build_plan
from weight_sync.publisher import Publisher

REPO = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.timeout(180)
PARAMS = SamplingParams(n=2, max_tokens=3, temperature=1.0)


@pytest.fixture()
def standin(tmp_path):
    port = free_port()
    log = open(tmp_path / "standin.log", "w")
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "tests" / "support" / "sglang_standin.py"), "--port", str(port)],
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
    )
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc, tmp_path / "standin.log", "the SGLang stand-in")
    yield url
    proc.kill()
    proc.wait(10)


class _Factory:
    def __init__(self, url: str, **kw) -> None:
        self.url, self.kw = url, kw

    async def start(self, index: int) -> SGLangGenerationClient:
        return SGLangGenerationClient(f"sglang-{index}", self.url, **self.kw)

    async def stop(self, engine) -> None:
        await engine.close()


class _Worker:
    inflight = generating = 0  # the rollout worker's groups in flight (none between two colocated steps)


def _token(s: dict[str, torch.Tensor]) -> int:
    """The first token the stand-in generates from weights ``s`` (its Tiny model's qkv and padded norm)."""
    total = torch.cat([s["q"], s["k"], s["v"]]).sum() + torch.cat([s["norm"], torch.zeros(1)]).sum()
    return int(abs(float(total)) * 1000) % 997


def _calls(url: str) -> list[tuple[str, tuple | None]]:
    return [(c["path"], tuple(c["tags"]) if c["tags"] else None) for c in httpx.get(url + "/calls", timeout=10).json()]


def _fail(url: str, path: str, **kw) -> None:
    httpx.post(url + "/fail", json={"path": path, **kw}, timeout=10).raise_for_status()


async def _fleet(url: str, level: int = 2, timeout_s: float = 30.0, **client_kw):
    fleet = FleetController(RolloutConfig(), _Factory(url, **client_kw))
    await fleet.add_server(0)
    return fleet, ColocatedEngines(fleet, _Worker(), level=level, timeout_s=timeout_s)


def test_colocated_steps_release_publish_and_resume_in_order(standin):
    states = {v: state(v) for v in range(3)}
    plan = build_plan([(n, list(t.shape), t.dtype) for n, t in states[1].items()], bucket_bytes=200)
    assert len(plan.buckets) > 1
    learner_side = SGLangPublishClient("sglang-0", standin, timeout_s=30, control_timeout_s=30)
    pub = Publisher(
        WeightSyncConfig(backend="gloo", nccl_impl="sglang", timeout_s=30),
        plan,
        rank=0,
        engines=[learner_side],
        device="cpu",
    )

    async def steps():
        fleet, ce = await _fleet(standin)
        engine = fleet.servers["sglang-0"].engine
        try:
            first = None
            for step in (1, 2):
                _, samples = await fleet.run_group(f"g{step}", [1, 2, 3], PARAMS)
                first = first if first is not None else int(samples[0].token_ids[0])
                rel = await ce.release(step)  # the learner has step s's batch
                assert rel["sleep_seconds"] > 0 and await engine.is_sleeping()
                with pytest.raises(
                    EngineError, match="generate while its GPU memory is released"
                ):  # SGLang would run on unmapped pages
                    await engine.generate([1, 2, 3], PARAMS)
                await ce.wake(step, "weights")  # the learner trained step s
                rep = await asyncio.to_thread(pub.publish, step, iter(states[step].items()))
                assert set(rep.engines) == {"sglang-0"}
                await ce.wake(step, "rest")
                assert not await engine.is_sleeping() and ce.gate.is_open
                _, samples = await fleet.run_group(f"g{step}b", [1, 2, 3], PARAMS)
                assert [int(t) for t in samples[0].token_ids] == [_token(states[step]) + i for i in range(3)]
            await engine.wake_up(["kv_cache"])  # nothing released: no call (SGLang's scheduler dies on one)
            return first
        finally:
            await fleet.close()
            await learner_side.close()

    try:
        first = asyncio.run(steps())
    finally:
        pub.close()
    assert first != _token(states[1])  # the start weights (zeros) answered differently
    calls = [c for c in _calls(standin) if c[0] not in ("/pause_generation", "/continue_generation")]
    release, resume = "/release_memory_occupation", "/resume_memory_occupation"
    update = [("/update_weights_from_distributed", None)] * len(plan.buckets)
    step = [(release, ("kv_cache", "weights")), (resume, ("weights",))]
    assert calls == [
        ("/generate", None),
        *step,
        ("/init_weights_update_group", None),
        *update,
        (resume, ("kv_cache",)),
        ("/generate", None),
        ("/generate", None),
        *step,
        *update,
        (resume, ("kv_cache",)),
        ("/generate", None),
    ], calls


def test_release_waits_for_running_requests(standin):
    httpx.post(standin + "/slow", json={"generate_s": 1.0}, timeout=10).raise_for_status()

    async def run():
        fleet, ce = await _fleet(standin)
        try:
            gen = asyncio.ensure_future(fleet.run_group("g", [1, 2, 3], PARAMS))
            await asyncio.sleep(0.3)  # the request is running on the server
            await ce.release(1)  # SGLang refuses (and its scheduler dies) on a release with a request running
            await gen
        finally:
            await fleet.close()

    asyncio.run(run())
    calls = httpx.get(standin + "/calls", timeout=10).json()
    assert [c["path"] for c in calls] == ["/generate", "/release_memory_occupation"]
    assert calls[1]["t"] - calls[0]["t"] >= 0.9


def test_failed_resume_is_named_and_leaves_the_engine_released(standin):
    async def run():
        fleet, ce = await _fleet(standin)
        engine = fleet.servers["sglang-0"].engine
        try:
            await ce.release(1)
            _fail(standin, "/resume_memory_occupation", status=500)
            with pytest.raises(
                EngineError,
                match=r"memory resume of \['weights'\] failed: engine sglang-0: "
                r"POST /resume_memory_occupation -> HTTP 500",
            ):
                await ce.wake(1, "weights")
            assert await engine.is_sleeping()
            with pytest.raises(EngineError, match="generate while its GPU memory is released"):
                await engine.generate([1, 2, 3], PARAMS)
            await ce.wake(1, "weights")  # the next resume goes through
            await ce.wake(1, "rest")
            assert not await engine.is_sleeping()
        finally:
            await fleet.close()

    asyncio.run(run())
    resumes = [c for c in _calls(standin) if c[0] == "/resume_memory_occupation"]
    assert resumes == [("/resume_memory_occupation", ("weights",))] * 2 + [("/resume_memory_occupation", ("kv_cache",))]


def test_a_memory_call_times_out_naming_engine_and_call(standin):
    async def run():
        fleet, _ = await _fleet(standin, control_timeout_s=1.0)
        engine = fleet.servers["sglang-0"].engine
        try:
            _fail(standin, "/release_memory_occupation", delay_s=3.0)
            t0 = time.monotonic()
            with pytest.raises(
                EngineError,
                match=r"memory release of \['kv_cache', 'weights'\] failed: "
                r"engine sglang-0: POST /release_memory_occupation got no answer "
                r"within 1s",
            ) as e:
                await engine.sleep(2)
            assert e.value.code == EngineErrorCode.TIMEOUT and time.monotonic() - t0 < 2.5
        finally:
            await fleet.close()

    asyncio.run(run())


def test_the_gates_wake_times_out_naming_the_engines(standin):
    async def run():
        fleet, ce = await _fleet(standin, timeout_s=1.0)
        try:
            await ce.release(1)
            _fail(standin, "/resume_memory_occupation", delay_s=3.0)
            with pytest.raises(
                TimeoutError,
                match=r"colocated wake \(weights\) of engines \['sglang-0'\] "
                r"took over 1 s \(colocate.timeout_s\)",
            ):
                await ce.wake(1, "weights")
        finally:
            await fleet.close()

    asyncio.run(run())
