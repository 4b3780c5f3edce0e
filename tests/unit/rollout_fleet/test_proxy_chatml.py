"""The proxy's token record under a ChatML template (Qwen, SmolLM2), where the template writes a newline
after the sampled ``<|im_end|>`` and renders tool calls in its own way: the record must hold the
sampled turn as sampled, then exactly the template's text for the new messages, tokenised once.

The engine here is a scripted stand-in (it returns fixed turns): the template and record logic are
under test; tests/integration/rollout_fleet/test_proxy.py runs the same proxy on the real vLLM server.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest

from engines.base import Sample
from rollout_fleet.envs.tools import CALCULATOR_SCHEMA
from rollout_fleet.proxy import ChatProxy

TINY_MODEL = Path(__file__).resolve().parents[3] / "models" / "tiny-adder"
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m.get('tool_calls') %}{% for c in m['tool_calls'] %}<tool_call>\n{{ c['function'] | tojson }}\n</tool_call>"
    "{% endfor %}{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(str(TINY_MODEL))
    t.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    t.chat_template = CHATML
    return t


def test_chatml_record_with_a_tool_call(tok):
    end = tok.convert_tokens_to_ids("<|im_end|>")
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "37*48"}}</tool_call>'
    turns = [tok.encode(call, add_special_tokens=False) + [end], tok.encode("1776", add_special_tokens=False) + [end]]
    contexts = []

    async def generate(context, params, min_version):
        contexts.append(list(context))
        ids = turns[len(contexts) - 1]
        return "scripted-0", Sample(
            token_ids=np.asarray(ids, np.int32),
            logprobs=np.full(len(ids), -0.5, np.float32),
            finish_reason="stop",
            segment_starts=[0],
            segment_versions=[2],
        )

    proxy = ChatProxy(generate, tok, model_name="m", stop_token_ids=[end])
    msgs = [{"role": "user", "content": "37*48?"}]

    async def main():
        r1 = await proxy._complete("e", {"messages": msgs, "tools": [CALCULATOR_SCHEMA]})
        (tc,) = r1["choices"][0]["message"]["tool_calls"]
        assert r1["choices"][0]["finish_reason"] == "tool_calls"
        assert json.loads(tc["function"]["arguments"]) == {"expression": "37*48"}
        msgs.append(r1["choices"][0]["message"])
        msgs.append({"role": "tool", "tool_call_id": tc["id"], "content": "1776"})
        r2 = await proxy._complete("e", {"messages": msgs, "tools": [CALCULATOR_SCHEMA]})
        assert r2["choices"][0]["message"]["content"] == "1776"

    asyncio.run(main())
    rec = proxy.pop("e")
    first = tok.encode("<|im_start|>user\n37*48?<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    delta = tok.encode("\n<|im_start|>tool\n1776<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    assert rec.prompt_ids == first == contexts[0]
    assert rec.response_ids.tolist() == turns[0] + delta + turns[1]
    assert rec.loss_mask.tolist() == [1] * len(turns[0]) + [0] * len(delta) + [1] * len(turns[1])
    assert contexts[1] == first + turns[0] + delta  # the sampled call itself, not the template's re-render of it
    assert proxy.counts["proxy/history_restarts"] == 0 and rec.segment_versions == [2]
