"""A vLLM generation client keeps every group it is given in flight at once, not httpx's default 100.

A server's batch is as full as the requests it has: with httpx's default pool (100 connections) a
fleet slot with more groups in flight than that held the rest in the client, and the server ran
below its ``max_num_seqs``. The stand-in server (a real socket, one thread per request) answers no
request until it has held ``CONCURRENT`` of them open at the same time, or its wait has passed.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
from json_http import json_http_server

from engines.base import SamplingParams
from engines.vllm.generation import VLLMGenerationClient

pytestmark = pytest.mark.timeout(60)

CONCURRENT = 150  # above httpx's default max_connections (100)
WAIT_S = 10.0


class Gate:
    """Counts open requests; each answer waits until ``CONCURRENT`` were open at once (or ``wait_s``)."""

    def __init__(self, wait_s: float = WAIT_S) -> None:
        self.cond = threading.Condition()
        self.open = self.most = 0
        self.wait_s = wait_s

    def answer(self, method, path, body):
        with self.cond:
            self.open += 1
            self.most = max(self.most, self.open)
            self.cond.notify_all()
            self.cond.wait_for(lambda: self.most >= CONCURRENT, timeout=self.wait_s)
            self.open -= 1
        n = len(body["prompt"])
        choice = {"index": 0, "token_ids": [n], "finish_reason": "length", "logprobs": {"token_logprobs": [-0.5]}}
        return {"choices": [choice]}, 200


def _run(client: VLLMGenerationClient) -> list:
    async def go():
        try:
            params = SamplingParams(n=1, max_tokens=1)
            return await asyncio.gather(*(client.generate([1] * (i + 1), params) for i in range(CONCURRENT)))
        finally:
            await client.close()

    return asyncio.run(go())


def test_every_group_is_open_at_the_server_at_once():
    gate = Gate()
    with json_http_server(gate.answer) as url:
        results = _run(VLLMGenerationClient("v", url, model="m"))
    assert gate.most == CONCURRENT
    assert [int(s.token_ids[0]) for (s,) in results] == list(range(1, CONCURRENT + 1))  # each its own answer


def test_a_smaller_pool_is_the_callers_choice_and_holds():
    gate = Gate(wait_s=0.5)
    with json_http_server(gate.answer) as url:
        _run(VLLMGenerationClient("v", url, model="m", max_connections=40))
    assert gate.most == 40  # the rest waited in the client's pool


def test_a_pool_of_no_connections_is_refused():
    with pytest.raises(ValueError, match="max_connections must be at least 1, got 0"):
        VLLMGenerationClient("v", "http://127.0.0.1:1", model="m", max_connections=0)
