"""Which policy version a vLLM sample is tagged with when the server gives no per-token spans.

A tiny HTTP server on a real socket answers ``/v1/completions`` the way vLLM does; while the
request is in flight the client learns of a newer version (an in-flight weight update). The
sample must carry the version held when it started: tokens before the update came from the
older weights, so the older version is the one that bounds its staleness.
"""

from __future__ import annotations

import asyncio

import pytest
from json_http import json_http_server

from engines.base import SamplingParams
from engines.vllm.generation import VLLMGenerationClient

pytestmark = pytest.mark.timeout(30)


def _completion(spans):
    choice = {
        "index": 0,
        "token_ids": [5, 6, 7],
        "finish_reason": "length",
        "logprobs": {"token_logprobs": [-0.1, -0.2, -0.3]},
    }
    if spans is not None:
        choice["weight_versions"] = spans
    return {"choices": [choice]}


@pytest.mark.parametrize(
    "spans, want_starts, want_versions",
    [
        (None, [0], [3]),  # no spans: the version at the start, not the 4 learned meanwhile
        ([{"version": "3", "start": 0, "end": 1}, {"version": "4", "start": 1, "end": 3}], [0, 1], [3, 4]),
    ],
)
def test_sample_versions_under_an_update_in_flight(spans, want_starts, want_versions):
    client = VLLMGenerationClient("v", "http://127.0.0.1:1", model="m", initial_version=3)

    def answer(method, path, body):
        client.record_version(4)  # the update lands while the request runs
        return _completion(spans), 200

    async def run():
        try:
            return await client.generate([1, 2], SamplingParams(n=1, max_tokens=3))
        finally:
            await client.close()

    with json_http_server(answer) as url:
        client.url = url
        (s,) = asyncio.run(run())
    assert s.segment_starts == want_starts and s.segment_versions == want_versions
    assert client.weight_version == 4
