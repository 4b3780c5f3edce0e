"""The fleet's stall detector: a server that answers its health probe but generates nothing is taken out.

Real HTTP stand-ins on loopback (aiohttp) play vLLM's surface as fleetrl's client uses it (``/health``,
``/is_paused``, ``/pause``, ``/resume``, ``/v1/completions``); the real vLLM client and the real fleet
controller talk to them. One stand-in can hang every generation while its probe answers (a hung
scheduler), answer one request at a time slowly, or stay paused as a publish from the learner pauses it.
The controller's own weight update runs on the simulated engine (in-process, the same controller path).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time

import pytest
from aiohttp import web
from vllm_standin import PausableStandIn

from engines.base import SamplingParams
from engines.simulated import SimulatedFactory
from engines.vllm.generation import VLLMGenerationClient
from engines.vllm.weights import VLLMWeightClient
from launch.monitor import format_status
from launch.snapshot import JobSnapshot
from learner.status import LearnerStatus
from rollout_fleet.config import RolloutConfig, SimulatedEngineConfig
from rollout_fleet.controller import FleetController
from rollout_fleet.progress import ProgressWatch
from rollout_fleet.status import FleetStatus, ServerState, ServerStatus

pytestmark = pytest.mark.timeout(60)

PARAMS = SamplingParams(n=2, max_tokens=8)


class StandIn(PausableStandIn):
    """One engine server: answers ``/health`` always; generation answers after ``delay_s``, one request at a
    time if ``serial``, waits while paused, and never answers while ``hang`` (until a restart).

    ``tokens``: serve vLLM's ``/metrics`` with ``vllm:generation_tokens_total`` at this count (None: no
    ``/metrics``, as before), which every held request raises by ``tokens_per_tick`` every 10 ms (0: a hung
    scheduler; > 0: responses still being decoded)."""

    def __init__(
        self,
        *,
        delay_s: float = 0.02,
        hang: bool = False,
        serial: bool = False,
        tokens: int | None = None,
        tokens_per_tick: int = 0,
    ) -> None:
        super().__init__()
        self.delay_s, self.hang = delay_s, hang
        self._serial = asyncio.Lock() if serial else None
        self.received = self.answered = self.dropped = 0  # dropped: the client went away mid-request
        self.tokens, self.tokens_per_tick, self.metrics_reads = tokens, tokens_per_tick, 0
        self.app.router.add_get("/health", self._ok)
        self.app.router.add_post("/v1/completions", self._completions)
        if tokens is not None:
            self.app.router.add_get("/metrics", self._metrics)

    async def _ok(self, request):
        return web.json_response({})

    async def _metrics(self, request):
        self.metrics_reads += 1
        text = (
            "# HELP vllm:generation_tokens_total Number of generation tokens processed.\n"
            "# TYPE vllm:generation_tokens_total counter\n"
            f'vllm:generation_tokens_total{{engine="0",model_name="tiny"}} {float(self.tokens)}\n'
        )
        return web.Response(text=text, content_type="text/plain")

    async def _completions(self, request):
        body = await request.json()
        self.received += 1
        try:
            while self.paused or self.hang:  # noqa: ASYNC110 (flags the handlers and the factory set)
                await asyncio.sleep(0.01)
                if self.tokens is not None and not self.paused:
                    self.tokens += self.tokens_per_tick
            if self._serial is not None:
                async with self._serial:
                    await asyncio.sleep(self.delay_s)
            else:
                await asyncio.sleep(self.delay_s)
        except asyncio.CancelledError:
            self.dropped += 1
            raise
        self.answered += 1
        marker = body["prompt"][0]  # each sample names its prompt: a group's samples are its own
        choices = [
            {
                "index": i,
                "token_ids": [marker, 7, 8],
                "logprobs": {"token_logprobs": [-0.5, -0.5, -0.5]},
                "finish_reason": "stop",
            }
            for i in range(body["n"])
        ]
        return web.json_response({"choices": choices})


class StandInFactory:
    """Server ``i`` is stand-in ``i``; a restart brings it back as a fresh process would be: unpaused, working.
    It ends the old server slowly (a wedged vLLM may sit out SIGTERM's grace): the fleet must not wait
    for that to re-queue the groups the server held."""

    def __init__(self, stand_ins: list[StandIn]) -> None:
        self.stand_ins = stand_ins
        self.restarted: list[str] = []

    def _client(self, index: int) -> VLLMGenerationClient:
        return VLLMGenerationClient(
            f"vllm-{index}", self.stand_ins[index].url, model="tiny", timeout_s=5, request_timeout_s=30
        )

    async def start(self, index: int) -> VLLMGenerationClient:
        return self._client(index)

    async def restart(self, engine: VLLMGenerationClient) -> VLLMGenerationClient:
        await asyncio.sleep(1.2)
        await engine.close()
        index = int(engine.engine_id.rsplit("-", 1)[1])
        s = self.stand_ins[index]
        s.hang = s.paused = False
        self.restarted.append(engine.engine_id)
        return self._client(index)

    async def stop(self, engine: VLLMGenerationClient) -> None:
        await engine.close()


def _cfg(stall_timeout_s: float | None, **kw) -> RolloutConfig:
    return RolloutConfig(
        engine="vllm",
        health_interval_s=0.05,
        health_timeout_s=2.0,
        request_timeout_s=30.0,
        startup_timeout_s=10.0,
        stall_timeout_s=stall_timeout_s,
        **kw,
    )


async def _fleet(cfg: RolloutConfig, stand_ins: list[StandIn]) -> tuple[FleetController, list[web.AppRunner]]:
    runners = [await s.serve() for s in stand_ins]
    fleet = FleetController(cfg, StandInFactory(stand_ins))
    await fleet.start(len(stand_ins))
    return fleet, runners


async def _close(fleet: FleetController, runners: list[web.AppRunner]) -> None:
    await fleet.close()
    for r in runners:
        await r.cleanup()


async def _groups(fleet: FleetController, markers: range, limit_s: float = 15.0):
    return await asyncio.wait_for(
        asyncio.gather(*(fleet.run_group(f"g{m}", [m, 1, 2], PARAMS) for m in markers)), limit_s
    )


async def _until(cond, limit_s: float = 10.0) -> None:
    deadline = time.monotonic() + limit_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


def _check_own_samples(results, markers: range) -> None:
    for m, (_, samples) in zip(markers, results, strict=True):
        assert len(samples) == PARAMS.n and all(int(s.token_ids[0]) == m for s in samples)


def test_a_hung_server_is_stalled_its_groups_run_once_on_the_healthy_one(caplog):
    stall_s = 0.6

    async def main():
        good, hung = StandIn(), StandIn(hang=True)
        fleet, runners = await _fleet(_cfg(stall_s), [good, hung])
        try:
            t0 = time.monotonic()
            first = await _groups(fleet, range(100, 108))
            took = time.monotonic() - t0
            counts = (good.answered, hung.received, hung.answered, hung.dropped)
            st = fleet.status()
            # the existing recovery applies: restarted, back in rotation, and taking work again
            await _until(lambda: fleet.servers["vllm-1"].state == "healthy")
            second = await _groups(fleet, range(200, 204))
            return took, first, counts, st, second, fleet.factory.restarted, fleet.status()
        finally:
            await _close(fleet, runners)

    with caplog.at_level(logging.INFO, logger="rollout_fleet.controller"):
        took, first, counts, st, second, restarted, st_end = asyncio.run(main())
    assert stall_s <= took < stall_s + 0.8, f"the stall took {took:.2f} s to clear (stall_timeout_s={stall_s})"
    assert [eid for eid, _ in first] == ["vllm-0"] * 8  # the held groups ran on the healthy server
    _check_own_samples(first, range(100, 108))
    good_answered, hung_received, hung_answered, hung_dropped = counts
    assert hung_received == 4 and hung_answered == 0 and hung_dropped == 4  # its requests were cancelled
    assert good_answered == 8  # every group generated once where it succeeded: none lost, none twice
    assert st["server_stalls"] == 1 and st["server_deaths"] == 0 and st["groups_requeued"] == 4
    assert restarted == ["vllm-1"] and [s["restarts"] for s in st_end["servers"]] == [0, 1]
    assert {eid for eid, _ in second} == {"vllm-0", "vllm-1"} and st_end["server_stalls"] == 1
    _check_own_samples(second, range(200, 204))
    lines = [r.getMessage() for r in caplog.records if "stalled" in r.getMessage()]
    assert len(lines) == 1, lines
    assert re.search(r"server vllm-1 stalled: .* none of its 4 requests in flight for 0\.\d s", lines[0]), lines[0]


def test_a_server_decoding_long_responses_is_kept_while_its_token_count_rises(caplog):
    """Every request held 2 s (over three stall timeouts) with no answer, while the server's generated-token
    count rises all along (long responses being decoded): kept, its groups end on it, one INFO line."""
    stall_s = 0.6

    async def main():
        decoding = StandIn(hang=True, tokens=1000, tokens_per_tick=1)
        fleet, runners = await _fleet(_cfg(stall_s), [decoding])

        async def finish():
            await asyncio.sleep(2.0)
            decoding.hang = False

        try:
            t0 = time.monotonic()
            finisher = asyncio.create_task(finish())
            results = await _groups(fleet, range(4))
            await finisher
            took = time.monotonic() - t0
            return took, results, fleet.status(), decoding, list(fleet.factory.restarted)
        finally:
            await _close(fleet, runners)

    with caplog.at_level(logging.INFO, logger="rollout_fleet.controller"):
        took, results, st, decoding, restarted = asyncio.run(main())
    assert took >= 2.0
    assert st["server_stalls"] == 0 and st["groups_requeued"] == 0 and restarted == []
    assert decoding.dropped == 0 and decoding.answered == 4
    assert [eid for eid, _ in results] == ["vllm-0"] * 4
    _check_own_samples(results, range(4))
    # kept at about 0.6, 1.2 and 1.8 s (each after a count read earlier in the silence): counted and logged once
    assert decoding.metrics_reads >= 4, decoding.metrics_reads
    assert st["servers_kept_generating"] == 1
    lines = [r.getMessage() for r in caplog.records if "generated-token count" in r.getMessage()]
    assert len(lines) == 1, lines
    assert re.search(
        r"vllm-0 has answered none of its 4 requests for 0\.\d s but its generated-token count rose", lines[0]
    )
    assert not [r for r in caplog.records if "stalled" in r.getMessage()]


def test_a_server_whose_token_count_stays_put_is_stalled_as_before():
    """A hung scheduler that serves /metrics: its count does not move, so it is taken out as one without."""
    stall_s = 0.6

    async def main():
        good, hung = StandIn(), StandIn(hang=True, tokens=500, tokens_per_tick=0)
        fleet, runners = await _fleet(_cfg(stall_s), [good, hung])
        try:
            t0 = time.monotonic()
            results = await _groups(fleet, range(100, 108))
            return time.monotonic() - t0, results, fleet.status(), hung.metrics_reads
        finally:
            await _close(fleet, runners)

    took, results, st, reads = asyncio.run(main())
    assert stall_s <= took < stall_s + 0.8, f"the stall took {took:.2f} s to clear (stall_timeout_s={stall_s})"
    assert reads >= 2  # the count was read (at half the timeout and at the timeout), and did not excuse it
    assert st["server_stalls"] == 1 and st["groups_requeued"] == 4 and st["servers_kept_generating"] == 0
    assert [eid for eid, _ in results] == ["vllm-0"] * 8
    _check_own_samples(results, range(100, 108))


def test_a_server_whose_token_count_stops_is_stalled_a_timeout_later():
    """Decoding for 1 s, then hung: kept while the count rose, stalled once it has not moved for a timeout."""
    stall_s = 0.6

    async def main():
        good, server = StandIn(), StandIn(hang=True, tokens=0, tokens_per_tick=1)
        fleet, runners = await _fleet(_cfg(stall_s), [good, server])

        async def hang_up():
            await asyncio.sleep(1.0)
            server.tokens_per_tick = 0

        try:
            t0 = time.monotonic()
            hanger = asyncio.create_task(hang_up())
            results = await _groups(fleet, range(4))
            await hanger
            return time.monotonic() - t0, results, fleet.status()
        finally:
            await _close(fleet, runners)

    took, results, st = asyncio.run(main())
    # kept at ~0.6 and ~1.2 s (the count rose), found still at ~1.8 s; never later than its stop + 2 timeouts
    assert 1.0 + stall_s <= took < 1.0 + 2 * stall_s + 0.5, took
    assert st["server_stalls"] == 1 and st["servers_kept_generating"] == 1 and st["groups_requeued"] == 2
    assert [eid for eid, _ in results] == ["vllm-0"] * 4


def test_a_slow_server_that_answers_is_not_stalled():
    """One request at a time, 0.3 s each, five in flight: the last waits 1.5 s, past the stall timeout,
    but the server answers every 0.3 s."""

    async def main():
        slow = StandIn(delay_s=0.3, serial=True)
        fleet, runners = await _fleet(_cfg(1.0), [slow])
        try:
            t0 = time.monotonic()
            results = await _groups(fleet, range(5))
            return time.monotonic() - t0, results, fleet.status()
        finally:
            await _close(fleet, runners)

    took, results, st = asyncio.run(main())
    assert took > 1.3  # requests were in flight far longer than the stall timeout
    assert st["server_stalls"] == 0 and st["groups_requeued"] == 0
    assert [eid for eid, _ in results] == ["vllm-0"] * 5
    _check_own_samples(results, range(5))


def test_a_server_paused_for_a_publish_is_not_stalled_one_left_paused_is(caplog):
    """The learner's publisher pauses servers over HTTP, out of the fleet's sight: a paused server is given
    stall_timeout_s more once the detector finds it paused; one that stays paused past that is stalled."""
    stall_s = 1.0

    async def main():
        loading, left = StandIn(), StandIn()
        fleet, runners = await _fleet(_cfg(stall_s, restart_dead_servers=False), [loading, left])
        publisher = [
            VLLMWeightClient(f"pub-{i}", s.url, model="tiny", timeout_s=5) for i, s in enumerate((loading, left))
        ]
        try:
            for p in publisher:
                await p.pause("keep")

            async def load_then_resume():
                await asyncio.sleep(1.5)  # past stall_timeout_s: silent, but paused
                await publisher[0].resume()

            t0 = time.monotonic()
            resumer = asyncio.create_task(load_then_resume())
            results = await _groups(fleet, range(4))
            await resumer
            return time.monotonic() - t0, results, fleet.status(), left.dropped
        finally:
            for p in publisher:
                await p.close()
            await _close(fleet, runners)

    with caplog.at_level(logging.INFO, logger="rollout_fleet.controller"):
        took, results, st, left_dropped = asyncio.run(main())
    # vllm-1 never resumed: stalled once its pause outlasted the grace (stall_s silent + stall_s paused)
    assert st["server_stalls"] == 1 and left_dropped == 2 and st["groups_requeued"] == 2
    assert [s["engine_id"] for s in st["servers"]] == ["vllm-0"]  # dropped (restart_dead_servers=false)
    assert [eid for eid, _ in results] == ["vllm-0"] * 4  # vllm-0, paused 1.5 s, was not stalled
    _check_own_samples(results, range(4))
    assert 2 * stall_s <= took < 2 * stall_s + 1.0
    msgs = [r.getMessage() for r in caplog.records]
    assert [m for m in msgs if re.search(r"vllm-1 stalled: .*paused for 1\.\d s", m)]
    assert not [m for m in msgs if "vllm-0 stalled" in m]
    assert [m for m in msgs if "vllm-0 has answered none" in m and "is paused" in m]


def test_the_fleets_own_weight_update_stops_the_clock():
    """An in-flight update (pause keep) freezes the running groups for the 1.5 s of the transfer: longer
    than the stall timeout without an answer, and no stall."""
    sim = SimulatedEngineConfig(
        tokens_per_s=100.0, length_median=50.0, length_sigma=0.0, weight_bytes=1.5e9, transfer_gb_per_s=1.0
    )
    cfg = RolloutConfig(
        engine="simulated", weight_update="inflight", health_interval_s=0.05, stall_timeout_s=1.0, simulated=sim
    )

    async def main():
        fleet = FleetController(cfg, SimulatedFactory(sim))
        await fleet.start(1)
        try:
            groups = asyncio.gather(
                *(fleet.run_group(f"g{i}", [i], SamplingParams(n=2, max_tokens=64)) for i in range(4))
            )
            await asyncio.sleep(0.1)
            update_s = await fleet.update_fleet(1)
            results = await asyncio.wait_for(groups, 10)
            return update_s, results, fleet.status()
        finally:
            await fleet.close()

    update_s, results, st = asyncio.run(main())
    assert update_s >= 1.5 and len(results) == 4
    assert st["server_stalls"] == 0 and st["groups_requeued"] == 0
    assert all(s.segment_versions == [0, 1] for _, samples in results for s in samples)  # frozen across it


def test_progress_watch_counts_only_time_in_flight_and_ends_at_answers():
    w = ProgressWatch()
    w.sent(0.0)
    w.failed(50.0)  # a timeout: no answer
    assert w.silent_s(90.0) == 50.0  # idle time does not count
    w.sent(100.0)
    w.failed(150.0)
    w.sent(200.0)
    assert not w.stalled(210.0, 120.0) and w.stalled(220.0, 120.0)  # every request timing out adds up
    w.hold("weight update")
    assert not w.stalled(400.0, 120.0)
    w.release("weight update", 400.0)
    assert w.silent_s(410.0) == 10.0
    w.sent(410.0)
    w.answered(420.0)  # one of two answered: the silence starts again, the other still in flight
    assert w.inflight == 1 and w.silent_s(430.0) == 10.0
    assert w.excused(True, 600.0, 120.0) and w.excused(True, 719.0, 120.0) and not w.excused(True, 720.0, 120.0)
    assert not w.excused(None, 720.5, 120.0)  # paused, then it cannot say: no excuse
    assert w.excused(False, 721.0, 120.0) and w.silent_s(721.0) == 0.0  # running again: the pause ended
    assert not w.excused(None, 850.0, 120.0) and w.stalled(850.0, 120.0)  # and it still answers nothing


def test_progress_watch_takes_a_rising_token_count_as_progress():
    w = ProgressWatch()
    w.sent(0.0)
    assert not w.wants_baseline(59.0, 120.0) and w.wants_baseline(60.0, 120.0)
    w.baseline(1000, w.epoch)
    assert not w.wants_baseline(61.0, 120.0)  # read once per silence
    assert w.stalled(120.0, 120.0)
    assert w.tokens_moved(1000, 120.0) == "still" and w.stalled(120.0, 120.0)  # a hung scheduler: no excuse
    assert w.tokens_moved(1500, 125.0) == "moved" and w.silent_s(125.0) == 0.0  # generating: the clock restarts
    assert w.tokens_moved(None, 250.0) == "still" and w.stalled(250.0, 120.0)  # cannot say: answers decide
    assert w.tokens_moved(1600, 251.0) == "moved"  # the last count read (1500) stays the baseline
    # an answer ends the silence: a count read before it is no baseline for the next one
    epoch = w.epoch
    w.answered(260.0)
    w.baseline(1700, epoch)
    assert w.tokens is None and not w.tokens_read
    w.sent(261.0)
    assert w.tokens_moved(1800, 400.0) == "first"  # no count read in this silence: this one is the baseline
    assert w.tokens_moved(1800, 401.0) == "still"
    w.kept = True
    w.release("x", 402.0)  # a hold's end starts the silence again, as an answer does
    assert not w.kept and w.tokens is None


def test_status_shows_the_stalls_and_each_servers_silence():
    server = ServerStatus(
        engine_id="vllm-1",
        index=1,
        state=ServerState.HEALTHY,
        version=3,
        simulated=False,
        outstanding_tokens=64,
        inflight_groups=4,
        groups_done=9,
        tokens_done=90,
        restarts=1,
        pid=None,
        tok_per_s=0.0,
        silent_s=97.4,
    )
    snap = JobSnapshot(
        fleet=FleetStatus(servers=[server], server_stalls=1, server_deaths=2, groups_requeued=6),
        learner=LearnerStatus(),
        max_steps=3,
        max_staleness=2,
        simulated=False,
        wall_s=1.0,
    )
    text = format_status(json.loads(json.dumps(snap.to_wire())))
    assert "fleet: 6 groups re-queued, 2 server deaths, 1 server stalls" in text
    assert re.search(r"vllm-1 +healthy +3 +4 +9 +0 +97s", text), text


def test_stall_timeout_config():
    assert RolloutConfig().stall_timeout_s == 120.0
    assert RolloutConfig(stall_timeout_s=0).stall_timeout_s is None  # 0: off
    assert RolloutConfig(stall_timeout_s=900, request_timeout_s=60).stall_timeout_s == 900  # see its description
    with pytest.raises(ValueError, match="stall_timeout_s"):
        RolloutConfig(stall_timeout_s=-1)
