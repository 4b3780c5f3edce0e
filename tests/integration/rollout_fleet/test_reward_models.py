"""Reward-model clients over real sockets: a judge server that hangs (timeouts counted, retried, never a
silent zero), the real vLLM CPU server as a judge (its answers hold no verdict: counted as
``unparsable_verdict``), and small aiohttp servers answering in vLLM's formats (retries on 503, no
retry on 400, the /pooling format of a classifier reward model). They are stand-ins for judge and
reward-model servers, labelled as such: no GPU reward model runs on this machine.
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest
from aiohttp import web
from vllm_cpu import AttachedServerFactory

from broker.protocol import Ticket
from rollout_fleet.config import RolloutConfig, SamplingConfig
from rollout_fleet.controller import FleetController
from rollout_fleet.envs.base import HFCodec
from rollout_fleet.reward_models import (
    ClassifierClient,
    JudgeClient,
    ModelRewardScorer,
    RewardModelError,
)
from rollout_fleet.worker import AsyncProducer, Prompt, RolloutWorker

pytestmark = pytest.mark.timeout(120)
TINY_MODEL = Path(__file__).resolve().parents[3] / "models" / "tiny-adder"


class HangingServer:
    """Accepts TCP connections, reads the request, never answers."""

    async def __aenter__(self):
        self.conns = 0

        async def handle(reader, writer):
            self.conns += 1
            try:
                await reader.read(1 << 16)
                await asyncio.sleep(3600)
            finally:
                writer.close()

        self.server = await asyncio.start_server(handle, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc):
        self.server.close()


class CannedServer:
    """An aiohttp server answering each POST with the next (status, json) of ``answers``."""

    def __init__(self, answers):
        self.answers, self.bodies = list(answers), []

    async def __aenter__(self):
        async def handle(request):
            self.bodies.append(await request.json())
            status, body = self.answers.pop(0)
            return web.json_response(body, status=status)

        app = web.Application()
        app.router.add_post("/{tail:.*}", handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc):
        await self.runner.cleanup()


def verdict(text):
    return 200, {"choices": [{"index": 0, "message": {"role": "assistant", "content": text}}]}


def test_a_hanging_judge_times_out_is_retried_and_counted():
    async def main():
        async with HangingServer() as srv:
            judge = JudgeClient(srv.url, model="judge", timeout_s=0.3, retries=2, backoff_s=0.01)
            with pytest.raises(RewardModelError, match="timeout") as e:
                await judge.score(question="2+2=", response="4", reference="4")
            await judge.close()
            return judge, e.value, srv.conns

    judge, err, conns = asyncio.run(main())
    assert err.reason == "timeout"
    assert judge.failures == {"timeout": 3} and judge.calls_failed == 1 and judge.calls_ok == 0
    assert conns == 3  # each retry really went to the server
    assert judge.status()["failures"] == {"timeout": 3}


def test_retry_after_503_then_a_verdict_and_no_retry_after_400():
    async def main():
        async with CannedServer(
            [
                (503, {"error": "busy"}),
                verdict("VERDICT: CORRECT"),
                verdict("I think... VERDICT: incorrect"),
                (400, {"error": "too long"}),
            ]
        ) as srv:
            judge = JudgeClient(srv.url, model="judge", timeout_s=5, retries=2, backoff_s=0.01)
            first = await judge.score(question="q", response="r", reference="a")
            second = await judge.score(question="q", response="r")
            with pytest.raises(RewardModelError, match="HTTP 400"):
                await judge.score(question="q", response="r")
            await judge.close()
            return judge, first, second, srv.bodies

    judge, first, second, bodies = asyncio.run(main())
    assert (first, second) == (1.0, 0.0)
    assert judge.failures == {"http_status": 2} and judge.calls_ok == 2 and judge.calls_failed == 1
    assert len(bodies) == 4  # 503 retried once, 400 not retried
    assert "Reference answer:\na" in bodies[0]["messages"][0]["content"]


def test_classifier_reward_model_pooling_format():
    async def main():
        async with CannedServer(
            [
                (200, {"data": [{"index": 1, "data": [-0.5]}, {"index": 0, "data": [2.0]}]}),
                (200, {"data": [{"index": 0, "data": [1.0]}]}),
            ]
        ) as srv:
            rm = ClassifierClient(srv.url, model="rm", timeout_s=5, retries=1, backoff_s=0.01)
            scores = await rm.score_texts(["a", "b"])
            with pytest.raises(RewardModelError, match="1 scores for 2 inputs"):
                await rm.score_texts(["a", "b"])
            await rm.close()
            return rm, scores

    rm, scores = asyncio.run(main())
    assert scores == [2.0, -0.5]
    assert rm.failures == {"bad_response": 1}  # a malformed answer is not retried


def first_token(*pairs):
    """A chat answer whose first token has the top logprobs ``pairs`` ((token, logprob), ...)."""
    top = [{"token": t, "logprob": lp, "bytes": None} for t, lp in pairs]
    return 200, {
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": pairs[0][0]},
                "logprobs": {"content": [{"token": pairs[0][0], "logprob": pairs[0][1], "top_logprobs": top}]},
            }
        ]
    }


def test_a_logprob_judge_scores_the_verdicts_probability_weighted():
    """SmolLM2 writes YES as 'Y' + 'ES': a first token that starts one verdict counts for it, in any case and
    with its leading space; tokens of no verdict, or of two, count for none; the reward is renormalised."""
    answers = [
        first_token(
            ("Y", math.log(0.3)),
            ("NO", math.log(0.1)),
            (" Yes", math.log(0.1)),
            ("The", math.log(0.4)),
            ("no", math.log(0.05)),
        ),
        first_token(("Maybe", math.log(0.9)), ("I", math.log(0.1))),  # no verdict: counted, not retried
        first_token(("Y", float("nan"))),  # not a log-probability: bad_response
        first_token(("Y", 1e6)),  # above 0 (exp would overflow): bad_response
    ]

    async def main():
        async with CannedServer(answers) as srv:
            judge = JudgeClient(
                srv.url,
                model="judge",
                template="Ref {reference}: {response}?",
                scores={"YES": 1.0, "NO": 0.0, "NOPE": 0.0},
                verdict_from="logprobs",
                top_logprobs=5,
                timeout_s=5,
                retries=2,
                backoff_s=0.01,
            )
            r = await judge.score(question="q", response="7", reference="7")
            errors = []
            for _ in range(3):
                with pytest.raises(RewardModelError) as e:
                    await judge.score(question="q", response="7", reference="7")
                errors.append(e.value.reason)
            await judge.close()
            return judge, r, errors, srv.bodies

    judge, r, errors, bodies = asyncio.run(main())
    # YES: 0.3 + 0.1; NO: 'NO' starts both NO and NOPE (ambiguous), 'no' too: the verdicts found are YES only
    assert r == pytest.approx(1.0)
    assert errors == ["unparsable_verdict", "bad_response", "bad_response"]
    assert len(bodies) == 4  # none of the failures was retried
    assert bodies[0]["max_tokens"] == 1 and bodies[0]["logprobs"] is True and bodies[0]["top_logprobs"] == 5
    assert bodies[0]["temperature"] == 1.0
    assert judge.status()["verdict_mass_mean"] == pytest.approx(0.4)


def test_a_logprob_judge_between_two_verdicts():
    async def main():
        async with CannedServer(
            [first_token(("NO", math.log(0.6)), ("Y", math.log(0.2)), (" yes", math.log(0.1)))]
        ) as srv:
            judge = JudgeClient(
                srv.url, model="judge", scores={"YES": 1.0, "NO": -1.0}, verdict_from="logprobs", timeout_s=5, retries=0
            )
            r = await judge.score(question="q", response="r")
            await judge.close()
            return r

    # (0.3 * 1.0 + 0.6 * -1.0) / 0.9
    assert asyncio.run(main()) == pytest.approx(-1.0 / 3.0, abs=1e-12)


@pytest.mark.slow
def test_the_real_vllm_server_as_logprob_judge_matches_transformers(vllm_server):
    """The judge's graded score from the real vLLM server's top logprobs equals the same weighted mean
    computed from a transformers forward of the same model on the same prompt. Both are fp32 on CPU
    with different kernels: log-probs agree to ~1e-5, so the weighted mean of probabilities to 1e-3."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    scores = {"1": 1.0, "2": 0.25, "9": 0.0}
    questions = [("12+", "3="), ("40+", "45="), ("7+", "2=")]

    async def main():
        judge = JudgeClient(
            vllm_server.url,
            model="tiny-adder",
            template="{question}{response}",
            scores=scores,
            verdict_from="logprobs",
            top_logprobs=20,
            timeout_s=30,
            retries=1,
            backoff_s=0.01,
        )
        out = [await judge.score(question=q, response=r) for q, r in questions]
        await judge.close()
        return out, judge

    got, judge = asyncio.run(main())
    tok = AutoTokenizer.from_pretrained(TINY_MODEL)
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL, dtype=torch.float32).eval()
    for (q, r), score in zip(questions, got, strict=True):
        ids = tok.apply_chat_template([{"role": "user", "content": q + r}], add_generation_prompt=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids  # a BatchEncoding in newer transformers
        with torch.no_grad():
            probs = model(torch.tensor([ids])).logits[0, -1].float().softmax(-1)
        top = probs.topk(20)
        mass: dict[str, float] = {}
        for p, i in zip(top.values, top.indices, strict=True):  # ids past the tokenizer's vocabulary decode to ''
            text = tok.decode([int(i)]).strip()
            mass[text] = mass.get(text, 0.0) + float(p)
        found = {k: mass[k] for k in scores if k in mass}
        assert found, f"none of {sorted(scores)} among the top tokens of {q + r!r}"
        expected = sum(scores[k] * p for k, p in found.items()) / sum(found.values())
        assert score == pytest.approx(expected, abs=1e-3), (q + r, score, expected, found)
    assert judge.failures == {} and judge.calls_ok == len(questions)
    assert len(set(round(x, 3) for x in got)) > 1  # graded, not one constant for every prompt


@pytest.mark.slow
def test_the_real_vllm_server_as_judge_gives_no_verdict_and_that_is_counted(vllm_server):
    async def main():
        judge = JudgeClient(
            vllm_server.url,
            model="tiny-adder",
            template="{question}{response}",
            max_tokens=4,
            timeout_s=30,
            retries=1,
            backoff_s=0.01,
        )
        with pytest.raises(RewardModelError) as e:
            await judge.score(question="12+", response="3=")
        await judge.close()
        return judge, e.value

    judge, err = asyncio.run(main())
    assert err.reason == "unparsable_verdict" and judge.failures == {"unparsable_verdict": 2}


@pytest.mark.slow
def test_a_group_scored_by_a_hanging_judge_is_dropped_and_counted_never_zero(vllm_server):
    pushed = []

    class Producer:
        def push(self, batch):
            pushed.append(batch)

    async def main():
        fleet = FleetController(
            RolloutConfig(engine="vllm", health_interval_s=30, request_timeout_s=60, startup_timeout_s=30),
            AttachedServerFactory(vllm_server.url),
        )
        await fleet.start(1)
        async with HangingServer() as srv:
            judge = JudgeClient(srv.url, model="judge", timeout_s=0.2, retries=1, backoff_s=0.01)
            codec = HFCodec.from_pretrained(str(TINY_MODEL))
            worker = RolloutWorker(
                fleet,
                AsyncProducer(Producer()),
                None,
                ModelRewardScorer(judge, codec),
                SamplingConfig(n=2, max_tokens=4),
                max_inflight_groups=2,
            )
            await worker._group(Ticket(step=1, ticket_id=0), Prompt(prompt_ids=codec.encode("3+4="), ground_truth="7"))
            await judge.close()
        await fleet.close()
        await worker.producer.close()
        return worker, judge

    worker, judge = asyncio.run(main())
    assert pushed == [] and worker.groups_reward_failed == 1 and worker.groups_pushed == 0
    assert judge.failures == {"timeout": 4}  # 2 samples x (1 + 1 retry)
