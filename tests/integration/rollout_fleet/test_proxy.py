"""The OpenAI-compatible proxy in front of the real vLLM CPU server, driven by the stock ``openai`` client.

An agent written against ``openai.OpenAI`` (chat completions with tools, two turns, the assistant
message appended back as the SDK returns it) runs unchanged; the proxy's record must hold exactly
the engine's sampled ids and log-probs (as reported to the client too), with the second user
message tokenised once and masked, and no re-rendering of the first turn.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import numpy as np
import openai
import pytest
from vllm_cpu import AttachedServerFactory

from broker.protocol import Ticket
from engines.vllm.generation import VLLMGenerationClient
from rollout_fleet.envs.tools import CALCULATOR_SCHEMA
from rollout_fleet.proxy import ChatProxy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
TINY_MODEL = Path(__file__).resolve().parents[3] / "models" / "tiny-adder"
EOS = 2


@pytest.fixture(scope="module")
def proxy(vllm_server):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(TINY_MODEL))
    loop = asyncio.new_event_loop()
    calls = []
    box = {}

    async def setup():
        client = VLLMGenerationClient("vllm-0", vllm_server.url, model="tiny-adder", initial_version=4)

        async def generate(context, params, min_version):
            (s,) = await client.generate(context, params)
            calls.append((list(context), s))
            return client.engine_id, s

        box["client"] = client
        box["proxy"] = ChatProxy(generate, tok, model_name="tiny-adder", stop_token_ids=[EOS])
        await box["proxy"].start("127.0.0.1", 0)

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(setup(), loop).result(30)
    yield box["proxy"], calls, tok
    asyncio.run_coroutine_threadsafe(box["proxy"].stop(), loop).result(30)
    asyncio.run_coroutine_threadsafe(box["client"].close(), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def agent(base_url: str) -> list:
    """An agent as anyone writes it against the OpenAI SDK: nothing fleetrl-specific."""
    client = openai.OpenAI(base_url=base_url, api_key="unused", timeout=60, max_retries=0)
    messages = [{"role": "user", "content": "23+41="}]
    out = []
    for follow_up in ("+7=", None):
        r = client.chat.completions.create(
            model="tiny-adder",
            messages=messages,
            tools=[CALCULATOR_SCHEMA],
            max_tokens=6,
            temperature=1.0,
            logprobs=True,
        )
        out.append(r)
        messages.append(r.choices[0].message.model_dump())
        if follow_up:
            messages.append({"role": "user", "content": follow_up})
    return out


def test_a_stock_openai_agent_runs_and_the_proxy_records_exactly_what_was_sampled(proxy):
    p, calls, tok = proxy
    responses = agent(f"{p.url}/s/ep-1/v1")
    assert [r.model for r in responses] == ["tiny-adder"] * 2
    assert all(r.choices[0].finish_reason in ("stop", "length") for r in responses)
    rec = p.pop("ep-1")
    (ctx1, s1), (ctx2, s2) = calls[-2:]
    assert rec.prompt_ids == ctx1 == tok.encode("23+41=", add_special_tokens=False)
    n1 = len(s1.token_ids)
    delta = rec.response_ids[n1 : len(rec.response_ids) - len(s2.token_ids)].tolist()
    stopped = s1.token_ids[-1] == EOS
    assert delta == tok.encode(("" if stopped else "<eos>") + "+7=", add_special_tokens=False)
    assert rec.response_ids.tolist() == s1.token_ids.tolist() + delta + s2.token_ids.tolist()
    assert ctx2 == rec.prompt_ids + rec.response_ids[: n1 + len(delta)].tolist()  # turn 2 ran on the record itself
    assert rec.loss_mask.tolist() == [1] * n1 + [0] * len(delta) + [1] * len(s2.token_ids)
    np.testing.assert_array_equal(
        rec.behaviour_logprobs[rec.loss_mask == 1], np.concatenate([s1.logprobs, s2.logprobs])
    )
    # the log-probs the client saw are the recorded ones
    seen = [e.logprob for r in responses for e in r.choices[0].logprobs.content]
    np.testing.assert_allclose(seen, rec.behaviour_logprobs[rec.loss_mask == 1], rtol=0, atol=1e-6)
    assert rec.segment_versions == [4] and rec.turns == 2
    assert responses[0].choices[0].message.content == tok.decode(s1.token_ids.tolist(), skip_special_tokens=True)
    assert p.counts["proxy/history_restarts"] == 0


def test_an_edited_history_restarts_the_record_and_is_counted(proxy):
    p, _, _ = proxy
    client = openai.OpenAI(base_url=f"{p.url}/s/ep-2/v1", api_key="unused", timeout=60, max_retries=0)
    client.chat.completions.create(model="tiny-adder", messages=[{"role": "user", "content": "5+6="}], max_tokens=4)
    before = p.counts["proxy/history_restarts"]
    client.chat.completions.create(model="tiny-adder", messages=[{"role": "user", "content": "7+8="}], max_tokens=4)
    assert p.counts["proxy/history_restarts"] == before + 1
    assert p.pop("ep-2").turns == 1  # the record holds only the restarted conversation


def test_bad_requests_get_openai_errors(proxy):
    p, _, _ = proxy
    client = openai.OpenAI(base_url=f"{p.url}/v1", api_key="unused", timeout=30, max_retries=0)
    with pytest.raises(openai.BadRequestError, match="'n' must be 1"):
        client.chat.completions.create(model="tiny-adder", messages=[{"role": "user", "content": "1+1="}], n=2)
    assert [m.id for m in client.models.list()] == ["tiny-adder"]


def test_agent_worker_pushes_the_proxy_records_of_a_stock_async_openai_agent(vllm_server):
    from transformers import AutoTokenizer

    from broker.schema import from_record_batch, validate_batch
    from rollout_fleet.config import RolloutConfig, SamplingConfig
    from rollout_fleet.controller import FleetController
    from rollout_fleet.envs.agent_worker import AgentWorker, fleet_generate
    from rollout_fleet.worker import AsyncProducer, Prompt

    pushed = []

    class Producer:
        def push(self, batch):
            pushed.append(validate_batch(batch))

    async def agent(base_url, prompt):  # an agent as written against the OpenAI SDK, async flavour
        client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", timeout=60, max_retries=0)
        messages = [{"role": "user", "content": prompt.extra_info["question"]}]
        r = await client.chat.completions.create(model="tiny-adder", messages=messages, max_tokens=5)
        messages += [r.choices[0].message.model_dump(), {"role": "user", "content": "+1="}]
        r = await client.chat.completions.create(model="tiny-adder", messages=messages, max_tokens=5)
        await client.close()
        return float(r.choices[0].message.content.strip() == prompt.ground_truth)

    async def main():
        fleet = FleetController(
            RolloutConfig(engine="vllm", health_interval_s=30, request_timeout_s=60, startup_timeout_s=30),
            AttachedServerFactory(vllm_server.url, initial_version=2),
        )
        await fleet.start(1)
        tok = AutoTokenizer.from_pretrained(str(TINY_MODEL))
        proxy = ChatProxy(fleet_generate(fleet), tok, model_name="tiny-adder", stop_token_ids=[EOS])
        await proxy.start("127.0.0.1", 0)
        worker = AgentWorker(
            fleet,
            AsyncProducer(Producer()),
            None,
            None,
            SamplingConfig(n=3, max_tokens=5),
            max_inflight_groups=2,
            proxy=proxy,
            agent=agent,
        )
        prompt = Prompt(prompt_ids=[], ground_truth="58", extra_info={"question": "12+45="})
        await worker._group(Ticket(step=1, ticket_id=0), prompt)

        async def broken(base_url, prompt):
            raise ConnectionError("agent sandbox died")

        worker.agent = broken
        await worker._group(Ticket(step=1, ticket_id=1), prompt)
        await proxy.stop()
        await fleet.close()
        await worker.producer.close()
        return worker, proxy, tok

    worker, proxy, tok = asyncio.run(main())
    assert worker.groups_pushed == 1 and worker.record().env_errors == {"agent": 1} and proxy.sessions == {}
    rows = from_record_batch(pushed[0])
    assert len(rows) == 3 and worker.turns == 6
    for t in rows:
        assert t.prompt_ids.tolist() == tok.encode("12+45=", add_special_tokens=False)
        m = t.loss_mask
        obs = t.response_ids[m == 0].tolist()
        assert obs in (tok.encode("+1=", add_special_tokens=False), tok.encode("<eos>+1=", add_special_tokens=False))
        assert t.segment_versions.tolist() == [2] and (t.behaviour_logprobs[m == 0] == 0).all()
