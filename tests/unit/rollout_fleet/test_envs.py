"""Environments, tool calls and the loss mask in the schema and the learner's plan (no server needed)."""

from __future__ import annotations

import asyncio

import numpy as np
import pyarrow as pa
import pytest

from broker.schema import SchemaError, Trajectory, to_record_batch, validate_batch
from learner.batch import plan_step
from rollout_fleet.envs.base import EpisodeLimits, Turn
from rollout_fleet.envs.chain_addition import ChainAdditionEnv, make_rows
from rollout_fleet.envs.tools import ToolCallError, calculator, calculator_env, parse_tool_calls
from tests.support.broker_groups import batch_from_rows, passes_row_checks


def turn(text, k=0):
    return Turn(index=k, token_ids=np.zeros(0, np.int32), text=text, finish_reason="stop")


def test_parse_hermes_tool_calls():
    text = (
        'Let me compute.<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*7"}}\n</tool_call>'
        '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"1+1\\"}"}</tool_call>'
    )
    calls = parse_tool_calls(text)
    assert [(c.name, c.arguments) for c in calls] == [
        ("calculator", {"expression": "12*7"}),
        ("calculator", {"expression": "1+1"}),
    ]
    assert parse_tool_calls("no calls here") == []
    with pytest.raises(ToolCallError, match="not JSON"):
        parse_tool_calls("<tool_call>{name: calculator}</tool_call>")
    with pytest.raises(ToolCallError, match="'name'"):
        parse_tool_calls('<tool_call>{"arguments": {}}</tool_call>')


def test_calculator_is_arithmetic_only():
    assert calculator("(12+7)*3") == "57" and calculator("7/2") == "3.5" and calculator("-2**3") == "-8"
    assert calculator("1/0").startswith("error") and calculator("__import__('os')").startswith("error")
    assert calculator("2**1000").startswith("error")


def test_tool_env_answers_calls_then_scores_the_final_answer():
    async def main():
        env = calculator_env()
        await env.reset("84", {})
        r1 = await env.step(
            turn('<tool_call>{"name": "calculator", "arguments": {"expression": "12*7"}}</tool_call><|im_end|>')
        )
        r2 = await env.step(turn('<tool_call>{"name": "search", "arguments": {}}</tool_call><|im_end|>', 1))
        r3 = await env.step(turn("The answer is 84.<|im_end|>", 2))
        return r1, r2, r3

    r1, r2, r3 = asyncio.run(main())
    assert not r1.done and "<tool_response>\n84\n</tool_response>" in r1.observation
    assert r1.observation.startswith("\n<|im_start|>user\n") and r1.observation.endswith("<|im_start|>assistant\n")
    assert "no tool named 'search'" in r2.observation
    assert r3.done and r3.reward == 1.0


def test_chain_addition_env_carries_the_models_answer():
    async def main():
        env = ChainAdditionEnv()
        await env.reset("30", {"first": 22, "addends": [5, 3]})
        a = await env.step(turn("22<eos>"))
        b = await env.step(turn("28<eos>", 1))  # wrong: 22+5 is 27
        c = await env.step(turn("31<eos>", 2))  # right for what it was asked: 28+3
        return a, b, c

    a, b, c = asyncio.run(main())
    assert (a.observation, a.done, a.reward) == ("22+5=", False, 1 / 3)
    assert (b.observation, b.reward) == ("28+3=", 0.0)
    assert c.done and c.reward == 1 / 3 and c.info["chain_ok"] is False
    rows = make_rows(3, seed=1, turns=3)
    for r in rows:
        a_, b_ = map(int, r["prompt"][0]["content"][:-1].split("+"))
        assert int(r["reward_model"]["ground_truth"]) == a_ + b_ + sum(r["extra_info"]["addends"])
        assert r["extra_info"]["first"] == a_ + b_


def test_episode_limits_are_validated():
    with pytest.raises(ValueError, match="max_turns"):
        EpisodeLimits(max_turns=0, max_tokens=8, turn_max_tokens=4, wall_time_s=1)
    with pytest.raises(ValueError, match="wall_time_s"):
        EpisodeLimits(max_turns=1, max_tokens=8, turn_max_tokens=4, wall_time_s=0)


def traj(i, resp, mask, reward=0.0):
    return Trajectory(
        traj_id=f"g/{i}",
        group_id="g",
        sample_index=i,
        group_size=2,
        step=1,
        prompt_ids=[1, 2],
        response_ids=resp,
        behaviour_logprobs=[-0.5] * len(resp),
        reward=reward,
        loss_mask=mask,
    )


def test_schema_checks_the_loss_mask():
    ok = to_record_batch([traj(0, [3, 4, 5], [1, 0, 1]), traj(1, [6], [])])
    assert validate_batch(ok) is ok
    bad_len = batch_from_rows(
        [
            dict(
                traj_id="g/0",
                group_id="g",
                sample_index=0,
                group_size=1,
                step=1,
                prompt_ids=[1],
                response_ids=[3, 4],
                behaviour_logprobs=[-0.1, -0.1],
                segment_starts=[0],
                segment_versions=[0],
                reward=0.0,
                finish_reason="stop",
                engine_id="e",
                data_source="d",
                t_start=0.0,
                t_end=0.0,
                loss_mask=[1],
            )
        ]
    )
    with pytest.raises(SchemaError, match="row 0: 'loss_mask' has 1 values but 'response_ids' has 2"):
        validate_batch(bad_len)
    assert not passes_row_checks(bad_len)
    cols = ok.columns
    cols[-1] = pa.array([[1, 2, 1], []], pa.list_(pa.int8()))
    with pytest.raises(SchemaError, match="other than 0 or 1"):
        validate_batch(pa.RecordBatch.from_arrays(cols, schema=ok.schema))


def test_a_v1_batch_names_both_schema_versions():
    v1 = to_record_batch([traj(0, [3], [])]).drop_columns(["loss_mask"])
    v1 = v1.replace_schema_metadata({b"fleetrl.schema_version": b"1"})
    with pytest.raises(SchemaError, match=r"schema v1, this reader expects v2.*missing \['loss_mask'\]"):
        validate_batch(v1)


def test_plan_step_trains_only_unmasked_tokens():
    b = to_record_batch([traj(0, [3, 4, 5, 6], [1, 0, 0, 1], reward=1.0), traj(1, [7, 8], [], reward=0.0)])
    plan = plan_step(
        b, rank=0, world_size=1, micro_batch_tokens=1000, advantage="mean", drop_uniform=False, aggregation="token"
    )
    (mb,) = plan.micro_batches
    assert sorted(mb.targets.tolist()) == [3, 6, 7, 8]
    assert plan.stats["response_tokens"] == 4.0
    assert float(mb.weights.sum()) == pytest.approx(1.0, abs=1e-6)  # token weights: 1/4 each, float32 sum
    seq = plan_step(
        b, rank=0, world_size=1, micro_batch_tokens=1000, advantage="mean", drop_uniform=False, aggregation="sequence"
    )
    assert sorted(seq.micro_batches[0].seq_lens.tolist()) == [2, 2]
    # a row whose tokens are all masked is not trained on
    none = to_record_batch([traj(0, [3, 4], [0, 0], reward=1.0), traj(1, [7, 8], [1, 1], reward=0.0)])
    p = plan_step(
        none, rank=0, world_size=1, micro_batch_tokens=1000, advantage="mean", drop_uniform=False, aggregation="token"
    )
    assert p.stats["samples_trained"] == 1.0 and p.micro_batches[0].targets.tolist() == [7, 8]


def test_the_broker_fast_path_takes_masked_groups_and_leaves_bad_masks_to_the_row_checks():
    from broker import group_check
    from broker.schema import _LAYOUT

    good = to_record_batch([traj(0, [3, 4, 5], [1, 0, 1]), traj(1, [6, 7], [1, 1])])
    ipc = pa.ipc.open_stream(_ipc(good)).read_next_batch()  # the layout the broker reads
    assert group_check.whole_group(ipc, _LAYOUT) is not None
    empty = pa.ipc.open_stream(_ipc(to_record_batch([traj(0, [3], []), traj(1, [6], [])]))).read_next_batch()
    assert group_check.whole_group(empty, _LAYOUT) is not None
    for mask in ([[1, 2, 1], [1, 1]], [[1, 1], [1, 1]], [[1, 0, 1], []]):
        cols = good.columns
        cols[-1] = pa.array(mask, pa.list_(pa.int8()))
        bad = pa.ipc.open_stream(_ipc(pa.RecordBatch.from_arrays(cols, schema=good.schema))).read_next_batch()
        assert group_check.whole_group(bad, _LAYOUT) is None, mask
        if mask[1]:  # an empty mask is legal on its own: [[1, 0, 1], []] is valid, just not the fast path's
            with pytest.raises(SchemaError, match="loss_mask"):
                validate_batch(bad)
        else:
            validate_batch(bad)


def _ipc(batch):
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as w:
        w.write_batch(batch)
    return sink.getvalue()
