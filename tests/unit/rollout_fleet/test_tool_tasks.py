"""The calculator word problems (rollout_fleet/envs/tool_tasks.py): the worked exchange before each problem
is one the environment itself would produce, and never a problem of its own."""

import asyncio

import numpy as np
import pytest

from rollout_fleet.envs.base import Turn
from rollout_fleet.envs.tool_tasks import DEMO, make_rows
from rollout_fleet.envs.tools import (
    CALCULATOR_SCHEMA,
    ChatMLFormat,
    Tool,
    ToolEnv,
    calculator,
    parse_tool_calls,
)


def _turn(text: str) -> Turn:
    return Turn(index=0, token_ids=np.zeros(0, np.int32), text=text, finish_reason="stop")


def test_the_demonstration_is_a_real_exchange_of_the_environment():
    env = ToolEnv([Tool(CALCULATOR_SCHEMA, calculator)])
    asyncio.run(env.reset("1776", {}))
    call = DEMO[1]["content"]
    assert parse_tool_calls(call)[0].arguments == {"expression": "37*48"}
    out = asyncio.run(env.step(_turn(call + ChatMLFormat.end)))
    assert not out.done and f"<|im_start|>user\n{DEMO[2]['content']}<|im_end|>" in out.observation
    final = asyncio.run(env.step(_turn(DEMO[3]["content"] + ChatMLFormat.end)))
    assert final.done and final.reward == 1.0


def test_rows_carry_the_demonstration_before_the_problem_and_never_its_question():
    rows = make_rows(400, seed=3, split="train")
    for r in rows:
        assert [m["role"] for m in r["prompt"]] == ["system", "user", "assistant", "user", "assistant", "user"]
        assert r["prompt"][1:5] == DEMO
        assert r["prompt"][-1]["content"] != DEMO[0]["content"]
    plain = make_rows(5, seed=3, split="train", shots=0)
    assert [m["role"] for m in plain[0]["prompt"]] == ["system", "user"]
    with pytest.raises(ValueError, match="shots must be 0 or 1"):
        make_rows(1, seed=0, split="train", shots=2)
