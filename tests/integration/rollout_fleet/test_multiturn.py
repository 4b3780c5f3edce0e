"""Multi-turn episodes on the real vLLM CPU server (conftest's session fixture, models/tiny-adder).

What is checked: an episode's token record is exactly the engine's sampled turns and the
observations' ids, in order (no re-rendering, no drift), the loss mask is 1 exactly on sampled
tokens, log-probs are the sampler's and agree with a teacher-forced transformers forward over
the WHOLE recorded sequence (so each turn's context equals the record; tolerance 5e-4 nats:
fp32 on both sides, see test_vllm_engine.py), every turn carries its server's policy version,
and a failing environment is a counted, named error. Runs through the real fleet controller
and the multi-turn worker; the broker end is an in-memory producer that validates each batch.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from broker_groups import MemoryProducer

from broker.protocol import Ticket
from broker.schema import from_record_batch
from engines.vllm.generation import VLLMGenerationClient
from learner.batch import plan_step
from rollout_fleet.config import RolloutConfig, SamplingConfig
from rollout_fleet.controller import FleetController
from rollout_fleet.envs.base import EpisodeLimits, HFCodec, StepResult
from rollout_fleet.envs.chain_addition import ChainAdditionEnv
from rollout_fleet.envs.worker import MultiTurnWorker
from rollout_fleet.worker import AsyncProducer, Prompt

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
TINY_MODEL = Path(__file__).resolve().parents[3] / "models" / "tiny-adder"
TOL = 5e-4
EOS = 2


class SharedServerFactory:
    """Engine clients of the one session server; client i labels its samples with ``versions[i]``
    (the label a weight update would set: what the record must carry per turn)."""

    def __init__(self, url: str, versions: list[int]) -> None:
        self.url, self.versions, self.calls = url, versions, []

    async def start(self, index: int) -> VLLMGenerationClient:
        client = VLLMGenerationClient(
            f"vllm-{index}", self.url, model="tiny-adder", initial_version=self.versions[index]
        )
        inner = client.generate

        async def generate(prompt_ids, params):  # records what the engine was asked and what it sampled
            out = await inner(prompt_ids, params)
            self.calls.append((client.engine_id, list(prompt_ids), out[0]))
            return out

        client.generate = generate
        return client

    async def restart(self, engine):
        return engine

    async def stop(self, engine) -> None:
        await engine.close()


class ExplodingEnv(ChainAdditionEnv):
    name = "exploding"

    async def step(self, turn):
        if turn.index == 1:
            raise RuntimeError("tool backend down")
        return await super().step(turn)


class StallingEnv(ChainAdditionEnv):
    name = "stalling"

    async def step(self, turn):
        await asyncio.sleep(60)
        return StepResult(done=True)


LIMITS = EpisodeLimits(max_turns=4, max_tokens=40, turn_max_tokens=6, wall_time_s=60, env_timeout_s=2)


def run_group(url: str, versions: list[int], env_factory, prompt: Prompt, n: int = 4, step: int = 1):
    async def main():
        factory = SharedServerFactory(url, versions)
        cfg = RolloutConfig(engine="vllm", health_interval_s=30, request_timeout_s=60, startup_timeout_s=30)
        fleet = FleetController(cfg, factory)
        await fleet.start(len(versions))
        producer = MemoryProducer()
        worker = MultiTurnWorker(
            fleet,
            AsyncProducer(producer),
            None,
            None,
            SamplingConfig(n=n, max_tokens=6, temperature=1.0),
            max_inflight_groups=4,
            env_factory=env_factory,
            codec=HFCodec.from_pretrained(str(TINY_MODEL)),
            limits=LIMITS,
            stop_token_ids=[EOS],
        )
        try:
            await worker._group(Ticket(step=step, ticket_id=0), prompt)
        finally:
            await fleet.close()
            await worker.producer.close()
        return worker, producer, factory

    return asyncio.run(main())


def chain_prompt(codec) -> Prompt:
    return Prompt(
        prompt_ids=codec.encode("23+41="),
        ground_truth=str(23 + 41 + 7 + 15),
        data_source="chain_addition",
        extra_info={"first": 23 + 41, "addends": [7, 15]},
    )


@pytest.fixture(scope="module")
def episodes(vllm_server):
    codec = HFCodec.from_pretrained(str(TINY_MODEL))
    prompt = chain_prompt(codec)
    worker, producer, factory = run_group(vllm_server.url, [0], ChainAdditionEnv, prompt)
    return codec, prompt, worker, producer, factory


def test_episode_record_is_exactly_what_the_engine_sampled(episodes):
    codec, prompt, worker, producer, factory = episodes
    (batch,) = producer.batches
    rows = from_record_batch(batch)
    assert len(rows) == 4 and worker.groups_pushed == 1 and not worker.env_errors
    # the engine's calls, grouped by episode: each call's context is the prompt plus the record so far
    # (episodes of one prompt share their first context: each engine answer is matched once)
    unused = set(range(len(factory.calls)))
    multi = 0
    for t in rows:
        resp, mask = t.response_ids.tolist(), t.loss_mask
        assert len(mask) == len(resp) and set(np.unique(mask)) <= {0, 1}
        pos, turns = 0, 0
        while pos < len(resp):
            ctx = tuple(list(prompt.prompt_ids) + resp[:pos])
            match = [
                j
                for j in sorted(unused)
                if tuple(factory.calls[j][1]) == ctx
                and resp[pos : pos + len(factory.calls[j][2].token_ids)] == factory.calls[j][2].token_ids.tolist()
            ]
            assert match, f"{t.traj_id}: the record at {pos} is no turn the engine sampled on this context"
            unused.remove(match[0])  # the turn, exactly as sampled
            s = factory.calls[match[0]][2]
            n = len(s.token_ids)
            assert (mask[pos : pos + n] == 1).all()
            np.testing.assert_array_equal(t.behaviour_logprobs[pos : pos + n], s.logprobs)
            pos += n
            turns += 1
            # an observation follows a turn (until the end): the environment's text, tokenised once
            obs_end = pos
            while obs_end < len(resp) and mask[obs_end] == 0:
                obs_end += 1
            if obs_end > pos:
                parsed = int(re.match(r"\s*(-?\d+)", codec.decode(s.token_ids.tolist())).group(1))
                addend = prompt.extra_info["addends"][turns - 1]
                assert resp[pos:obs_end] == codec.encode(f"{parsed}+{addend}=")
                assert (t.behaviour_logprobs[pos:obs_end] == 0).all()
                pos = obs_end
        multi += turns > 1
        assert t.finish_reason in ("stop", "length")
    assert sum(worker.episode_ends.values()) == 4
    assert not unused, "the engine sampled turns that are in no record"
    assert multi >= 1, "no episode got past its first turn: nothing multi-turn was checked"


def test_logprobs_match_a_teacher_forced_forward_of_the_whole_record(episodes):
    from transformers import AutoModelForCausalLM

    _, prompt, _, producer, _ = episodes
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(str(TINY_MODEL), dtype=torch.float32).eval()
    for t in from_record_batch(producer.batches[0]):
        ids = torch.tensor([list(prompt.prompt_ids) + t.response_ids.tolist()])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0].float()
        p = len(prompt.prompt_ids)
        lp = torch.log_softmax(logits[p - 1 : -1], -1).gather(
            1, torch.tensor(t.response_ids, dtype=torch.long)[:, None]
        )[:, 0]
        m = t.loss_mask.astype(bool)
        err = np.abs(lp.numpy()[m] - t.behaviour_logprobs[m]).max()
        assert err < TOL, f"{t.traj_id}: sampled log-probs differ from the forward over the record by {err:.2e}"


def test_learner_trains_only_on_sampled_tokens(episodes):
    _, _, _, producer, _ = episodes
    batch = producer.batches[0]
    plan = plan_step(
        batch,
        rank=0,
        world_size=1,
        micro_batch_tokens=10_000,
        advantage="mean",
        drop_uniform=False,
        aggregation="token",
    )
    rows = from_record_batch(batch)
    targets = torch.cat([mb.targets for mb in plan.micro_batches])
    want = np.concatenate([rows[i].response_ids[rows[i].loss_mask == 1] for mb in plan.micro_batches for i in mb.rows])
    assert targets.tolist() == want.tolist()
    for mb in plan.micro_batches:  # each target is predicted from the position before it in the packed row
        cu = mb.cu_seqlens.tolist()
        for j, i in enumerate(mb.rows):
            full = rows[i].prompt_ids.tolist() + rows[i].response_ids.tolist()  # the row feeds full[:-1]
            sel = (mb.target_index >= cu[j]) & (mb.target_index < cu[j + 1])
            assert [full[p - cu[j] + 1] for p in mb.target_index[sel].tolist()] == mb.targets[sel].tolist()
            assert int(sel.sum()) == int(rows[i].loss_mask.sum()) == int(mb.seq_lens[j])


def test_each_turn_carries_the_version_of_the_server_that_sampled_it(vllm_server):
    # two clients of the one server labelled v3 and v5: after a turn at v5 the next turn may not go to v3
    codec = HFCodec.from_pretrained(str(TINY_MODEL))
    worker, producer, factory = run_group(vllm_server.url, [3, 5], ChainAdditionEnv, chain_prompt(codec), n=4)
    label = {"vllm-0": 3, "vllm-1": 5}
    for t in from_record_batch(producer.batches[0]):
        starts, versions = t.segment_starts.tolist(), t.segment_versions.tolist()
        assert versions == sorted(versions) and set(versions) <= {3, 5}
        assert len(starts) == len(versions) and starts[0] == 0
    seen = [label[e] for e, _, _ in factory.calls]
    assert 3 in seen and 5 in seen
    # whichever turn a v5 server sampled, every later turn of that episode is tagged 5
    for t in from_record_batch(producer.batches[0]):
        if 5 in t.segment_versions.tolist():
            first5 = t.segment_starts.tolist()[t.segment_versions.tolist().index(5)]
            ctx = list(codec.encode("23+41=")) + t.response_ids.tolist()[:first5]
            assert any(e == "vllm-1" and c == ctx for e, c, _ in factory.calls)


@pytest.mark.parametrize("env, reason", [(ExplodingEnv, "env_step"), (StallingEnv, "env_step_timeout")])
def test_a_failing_environment_is_a_counted_named_error(vllm_server, env, reason):
    codec = HFCodec.from_pretrained(str(TINY_MODEL))
    prompt = chain_prompt(codec)
    worker, producer, _ = run_group(vllm_server.url, [0], env, prompt, n=2)
    assert producer.batches == [] and worker.groups_pushed == 0
    if reason == "env_step" and not worker.env_errors:
        pytest.skip("no episode reached a second turn (the model gave no number): the failure path did not run")
    assert worker.env_errors == {reason: 1}
    assert worker.status()["env_errors"] == {reason: 1}
