"""Engines sample what the learner scores: every request pins every sampling field, vLLM is told to ignore the
model folder's generation_config.json, training refuses truncated sampling, evaluation samples apart.

The request bodies are read off a real local HTTP server (a thread of http.server) the clients talk to.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from json_http import json_http_server

from engines.base import SamplingParams, model_sampling_defaults
from engines.vllm.server import VLLMServer, VLLMServerArgs

PINNED = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
}


class _Recorder:
    """The requests a client made (path, JSON body) and the JSON reply (bytes) it gets next."""

    def __init__(self) -> None:
        self.bodies: list = []
        self.reply: bytes = b"{}"

    def answer(self, method, path, body):
        self.bodies.append((path, body))
        return json.loads(self.reply), 200


@pytest.fixture
def recorder():
    rec = _Recorder()
    with json_http_server(rec.answer) as url:
        yield rec, url


def test_vllm_requests_pin_every_sampling_field(recorder):
    from engines.vllm.generation import VLLMGenerationClient

    handler, url = recorder
    handler.reply = json.dumps(
        {"choices": [{"index": 0, "token_ids": [5], "finish_reason": "stop", "logprobs": {"token_logprobs": [-0.1]}}]}
    ).encode()

    async def run():
        c = VLLMGenerationClient("e", url, model="m", timeout_s=5, request_timeout_s=5)
        try:
            return await c.generate([1, 2], SamplingParams(n=1, max_tokens=3))
        finally:
            await c.close()

    (s,) = asyncio.run(run())
    assert s.token_ids.tolist() == [5]
    path, body = handler.bodies[-1]
    assert path == "/v1/completions"
    assert {k: body[k] for k in PINNED} == PINNED


def test_sglang_requests_pin_every_sampling_field(recorder):
    from engines.sglang.generation import SGLangGenerationClient

    handler, url = recorder
    handler.reply = json.dumps(
        {
            "output_ids": [7],
            "meta_info": {"output_token_logprobs": [[-0.2, 7, None]], "finish_reason": {"type": "stop"}},
        }
    ).encode()

    async def run():
        c = SGLangGenerationClient("e", url, timeout_s=5, control_timeout_s=5)
        try:
            return await c.generate([1, 2], SamplingParams(n=1, max_tokens=3, top_k=-1))
        finally:
            await c.close()

    (s,) = asyncio.run(run())
    assert s.token_ids.tolist() == [7]
    path, body = handler.bodies[-1]
    assert path == "/generate"
    assert {k: body["sampling_params"][k] for k in PINNED} == PINNED


def test_both_clients_send_ignore_eos_and_the_limit(recorder):
    """rollout.sampling.ignore_eos reaches the engine as its own field (vLLM's completions body and SGLang's
    sampling_params both call it ignore_eos), False included, beside the request's max_tokens."""
    from engines.sglang.generation import SGLangGenerationClient
    from engines.vllm.generation import VLLMGenerationClient

    handler, url = recorder

    async def run(client, params):
        try:
            return await client.generate([1, 2], params)
        finally:
            await client.close()

    handler.reply = json.dumps(
        {"choices": [{"index": 0, "token_ids": [5], "finish_reason": "length", "logprobs": {"token_logprobs": [-0.1]}}]}
    ).encode()
    for flag in (True, False):
        client = VLLMGenerationClient("e", url, model="m", timeout_s=5, request_timeout_s=5)
        asyncio.run(run(client, SamplingParams(n=1, max_tokens=7, ignore_eos=flag)))
        _, body = handler.bodies[-1]
        assert (body["ignore_eos"], body["max_tokens"]) == (flag, 7)
    handler.reply = json.dumps(
        {
            "output_ids": [7],
            "meta_info": {"output_token_logprobs": [[-0.2, 7, None]], "finish_reason": {"type": "length"}},
        }
    ).encode()
    for flag in (True, False):
        client = SGLangGenerationClient("e", url, timeout_s=5, control_timeout_s=5)
        asyncio.run(run(client, SamplingParams(n=1, max_tokens=9, ignore_eos=flag)))
        _, body = handler.bodies[-1]
        assert (body["sampling_params"]["ignore_eos"], body["sampling_params"]["max_new_tokens"]) == (flag, 9)
    # n > 1 with a seed: SGLang gets one sampling_params per sample, each with the flag
    handler.reply = json.dumps([json.loads(handler.reply)] * 2).encode()
    client = SGLangGenerationClient("e", url, timeout_s=5, control_timeout_s=5)
    asyncio.run(run(client, SamplingParams(n=2, max_tokens=9, seed=3, ignore_eos=True)))
    _, body = handler.bodies[-1]
    assert [sp["ignore_eos"] for sp in body["sampling_params"]] == [True, True]
    assert [sp["sampling_seed"] for sp in body["sampling_params"]] == [3, 4]


def test_sglang_sends_n_copies_of_the_prompt_without_the_radix_cache(recorder):
    """Without the radix cache (the fleet's servers) a group is n copies of its prompt, not SGLang's n, whose prefix
    step prefills the prompt once more for a cache that is not there; with the cache, SGLang's n."""
    from engines.sglang.generation import SGLangGenerationClient

    handler, url = recorder
    one = {"output_ids": [7], "meta_info": {"output_token_logprobs": [[-0.2, 7, None]], "finish_reason": None}}
    handler.reply = json.dumps([one] * 3).encode()

    async def run(client):
        try:
            return await client.generate([1, 2], SamplingParams(n=3, max_tokens=4))
        finally:
            await client.close()

    samples = asyncio.run(run(SGLangGenerationClient("e", url, radix_cache=False, timeout_s=5, control_timeout_s=5)))
    _, body = handler.bodies[-1]
    assert len(samples) == 3 and body["input_ids"] == [[1, 2]] * 3
    assert len(body["sampling_params"]) == 3 and all(
        "n" not in sp and "sampling_seed" not in sp for sp in body["sampling_params"]
    )
    assert all({k: sp[k] for k in PINNED} == PINNED for sp in body["sampling_params"])
    asyncio.run(run(SGLangGenerationClient("e", url, radix_cache=True, timeout_s=5, control_timeout_s=5)))
    _, body = handler.bodies[-1]
    assert body["input_ids"] == [1, 2] and body["sampling_params"]["n"] == 3


def test_vllm_server_ignores_the_folders_generation_config(tmp_path):
    cmd = VLLMServer(VLLMServerArgs(model="m"), tmp_path).command()
    assert cmd[cmd.index("--generation-config") + 1] == "vllm"
    server = VLLMServer(VLLMServerArgs(model="m", extra_args=["--generation-config=auto"]), tmp_path)
    with pytest.raises(ValueError, match="--generation-config is set by fleetrl"):
        server.command()


def test_a_models_sampling_defaults_are_read_and_reported(tmp_path):
    assert model_sampling_defaults(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text(
        json.dumps(
            {
                "bos_token_id": 1,
                "do_sample": True,
                "temperature": 0.7,
                "top_p": 0.8,
                "top_k": 20,
                "repetition_penalty": 1.05,
                "min_p": 0.0,
            }
        )
    )
    assert model_sampling_defaults(tmp_path) == {
        "temperature": 0.7,
        "top_p": 0.8,
        "top_k": 20,
        "repetition_penalty": 1.05,
    }
    (tmp_path / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="expected a JSON object"):
        model_sampling_defaults(tmp_path)


def _cfg(**rollout):
    from launch.config import load_run_config

    overrides = [f"rollout.{k}={v}" for k, v in rollout.items()]
    return load_run_config("tiny", overrides)


def test_training_refuses_truncated_sampling_and_evaluation_may_truncate():
    with pytest.raises(Exception, match="top_k=20 truncates"):
        _cfg(**{"sampling.top_k": 20})
    cfg = _cfg(
        **{
            "sampling.top_k": -1,
            "eval_sampling.top_k": 20,
            "eval_sampling.top_p": 0.9,
            "eval_sampling.temperature": 0.6,
            "eval_sampling.n": 4,
            "eval_sampling.do_sample": True,
        }
    )
    ev = cfg.rollout.eval_sampling
    assert (ev.top_k, ev.top_p, ev.n, ev.effective_temperature) == (20, 0.9, 4, 0.6)
    # verl's val_kwargs default: greedy unless do_sample
    assert _cfg().rollout.eval_sampling.effective_temperature == 0.0
