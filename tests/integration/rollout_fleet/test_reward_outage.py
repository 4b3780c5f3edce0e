"""A reward server that dies mid-run and comes back on its address: the scorer waits for it and scores the
group again (rollout_fleet/reward_models.py ModelRewardScorer), over real sockets.

The judge is a small aiohttp server answering ``/health`` and ``/v1/chat/completions`` in vLLM's format (a
stand-in for the judge server, labelled as such: the launcher's restart of a real vLLM reward server is
exercised by the chaos soak, tests/chaos/). It is stopped (its port refuses connections, as a ``kill -9``-ed
server's does) and started again on the same port, as launch/reward_servers.py restarts one.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np
import pytest
from aiohttp import web

from core.http_client import free_port
from rollout_fleet.envs.base import HFCodec
from rollout_fleet.reward_models import JudgeClient, ModelRewardScorer, RewardModelError
from rollout_fleet.worker import Prompt, Sample

pytestmark = pytest.mark.timeout(120)
TINY_MODEL = Path(__file__).resolve().parents[3] / "models" / "tiny-adder"


class Judge:
    """A judge on a fixed port that can be stopped and started again; it answers CORRECT when the response
    equals the reference, and counts the completions it served."""

    def __init__(self, port: int, healthy: bool = True) -> None:
        self.port, self.served, self.healthy, self.refuse = port, 0, healthy, False
        self.url = f"http://127.0.0.1:{port}"
        self.runner = None

    async def start(self) -> None:
        async def health(request):
            return web.Response(status=200 if self.healthy else 503)

        async def chat(request):
            body = await request.json()
            if self.refuse:
                return web.json_response({"error": "too long"}, status=400)
            text = body["messages"][0]["content"]
            ok = (
                text.split("Reference answer:\n")[1].split("\n")[0]
                == text.split("Candidate answer:\n")[1].split("\n")[0]
            )
            self.served += 1
            return web.json_response(
                {"choices": [{"message": {"content": "VERDICT: " + ("CORRECT" if ok else "INCORRECT")}}]}
            )

        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_post("/v1/chat/completions", chat)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port, reuse_address=True).start()

    async def stop(self) -> None:
        await self.runner.cleanup()


def _group(codec):
    prompt = Prompt(prompt_ids=codec.encode("3+4="), ground_truth="7")
    samples = [
        Sample(
            token_ids=np.asarray(codec.encode(a), np.int32),
            logprobs=np.zeros(len(codec.encode(a)), np.float32),
            finish_reason="stop",
        )
        for a in ("7", "8", "7")
    ]
    return prompt, samples


def test_a_judge_killed_and_restarted_on_its_address_is_waited_for_and_the_group_scored():
    async def main():
        codec = HFCodec.from_pretrained(str(TINY_MODEL))
        srv = Judge(free_port("127.0.0.1"))
        await srv.start()
        client = JudgeClient(srv.url, model="judge", timeout_s=2, retries=1, backoff_s=0.01)
        scorer = ModelRewardScorer(client, codec, outage_wait_s=30)
        prompt, samples = _group(codec)
        before = await scorer.score(prompt, samples)
        await srv.stop()  # dead: connections refused

        async def restart_later():
            await asyncio.sleep(2.0)
            await srv.start()

        t0 = time.monotonic()
        back = asyncio.create_task(restart_later())
        after = await scorer.score(prompt, samples)
        waited = time.monotonic() - t0
        await back
        await client.close()
        await srv.stop()
        return before, after, waited, scorer, client, srv

    before, after, waited, scorer, client, srv = asyncio.run(main())
    assert before == after == [1.0, 0.0, 1.0]
    assert scorer.outage_waits == 1
    assert waited >= 2.0  # it really waited for the restart, it did not score without the judge
    assert client.failures["unreachable"] >= 1 and client.calls_ok == 6  # 3 before, 3 after the restart
    assert srv.served == 6


def test_a_judge_that_stays_down_fails_the_group_after_the_wait_and_a_refusal_is_not_an_outage():
    async def main():
        codec = HFCodec.from_pretrained(str(TINY_MODEL))
        prompt, samples = _group(codec)
        client = JudgeClient(
            f"http://127.0.0.1:{free_port('127.0.0.1')}", model="judge", timeout_s=1, retries=0, backoff_s=0.01
        )  # nothing listens there
        scorer = ModelRewardScorer(client, codec, outage_wait_s=1.5)
        t0 = time.monotonic()
        with pytest.raises(RewardModelError) as down:
            await scorer.score(prompt, samples)
        down_s = time.monotonic() - t0
        await client.close()

        srv = Judge(free_port("127.0.0.1"))
        srv.refuse = True  # up, and answering 400: the request's fault, never waited for
        await srv.start()
        client2 = JudgeClient(srv.url, model="judge", timeout_s=1, retries=0, backoff_s=0.01)
        scorer2 = ModelRewardScorer(client2, codec, outage_wait_s=30)
        t1 = time.monotonic()
        with pytest.raises(RewardModelError) as refused:
            await scorer2.score(prompt, samples)
        refused_s = time.monotonic() - t1
        await client2.close()
        await srv.stop()
        return down.value, down_s, scorer, refused.value, refused_s, scorer2

    err, down_s, scorer, refused, refused_s, scorer2 = asyncio.run(main())
    assert err.reason == "unreachable" and "did not answer /health" in str(err)
    assert down_s >= 1.5 and scorer.outage_waits == 1  # it waited its limit once, then gave the group up
    assert refused.reason == "http_status" and "HTTP 400" in str(refused)
    assert scorer2.outage_waits == 0 and refused_s < 5
