"""The SIMULATED engine: labelled, long-tailed lengths, rate-bound timing, pause modes, segments."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from broker.schema import Trajectory, to_record_batch
from engines.base import EngineError, SamplingParams
from engines.simulated import SimulatedEngine
from rollout_fleet.config import SimulatedEngineConfig

pytestmark = pytest.mark.timeout(60)


def _engine(**kw) -> SimulatedEngine:
    return SimulatedEngine("7", SimulatedEngineConfig(**kw), seed=0)


def test_labelled_as_simulation():
    e = _engine()
    assert e.simulated is True and e.engine_id == "sim-7"


def test_lengths_are_long_tailed_and_capped():
    async def main():
        e = _engine(tokens_per_s=1e6, length_median=20, length_sigma=1.0)
        return await e.generate([1, 2], SamplingParams(n=2000, max_tokens=400))

    samples = asyncio.run(main())
    lengths = np.array([len(s.token_ids) for s in samples])
    assert 15 <= np.median(lengths) <= 25
    assert lengths.max() <= 400 and np.percentile(lengths, 99) > 5 * np.median(lengths)  # a long tail
    assert {s.finish_reason for s in samples if len(s.token_ids) == 400} == {"length"}
    assert all(len(s.logprobs) == len(s.token_ids) and (s.logprobs <= 0).all() for s in samples)


def test_generation_time_follows_the_token_rate():
    async def main():
        e = _engine(tokens_per_s=1000, length_median=100, length_sigma=0.0)
        t0 = time.monotonic()
        await e.generate([1], SamplingParams(n=4, max_tokens=1000))
        return time.monotonic() - t0

    assert 0.09 <= asyncio.run(main()) < 0.5  # 100 tokens at 1000 tok/s


def test_keep_pause_freezes_and_version_change_opens_a_segment():
    async def main():
        e = _engine(tokens_per_s=1000, length_median=200, length_sigma=0.0)
        task = asyncio.create_task(e.generate([1], SamplingParams(n=2, max_tokens=1000)))
        await asyncio.sleep(0.05)
        await e.pause("keep")
        await asyncio.sleep(0.2)  # frozen: no progress while paused
        await e.weights.update_weights(1, "any")
        await e.resume()
        t0 = time.monotonic()
        samples = await task
        return samples, time.monotonic() - t0

    samples, rest = asyncio.run(main())
    assert rest > 0.1  # the 0.2 s pause did not count as decoding time
    for s in samples:
        assert s.segment_versions == [0, 1] and 20 <= s.segment_starts[1] <= 100
    trajs = [
        Trajectory(
            traj_id=f"g/{i}",
            group_id="g",
            sample_index=i,
            group_size=2,
            step=1,
            prompt_ids=[1],
            response_ids=s.token_ids,
            behaviour_logprobs=s.logprobs,
            segment_starts=s.segment_starts,
            segment_versions=s.segment_versions,
            engine_id="sim-7",
        )
        for i, s in enumerate(samples)
    ]
    to_record_batch(trajs)  # the schema accepts what the engine produces


def test_abort_and_death():
    async def main():
        e = _engine(tokens_per_s=100, length_median=100, length_sigma=0.0)
        task = asyncio.create_task(e.generate([1], SamplingParams(n=2, max_tokens=1000)))
        await asyncio.sleep(0.05)
        await e.pause("abort")
        aborted = await task
        await e.resume()
        task = asyncio.create_task(e.generate([1], SamplingParams(n=2, max_tokens=1000)))
        await asyncio.sleep(0.05)
        e.kill()
        with pytest.raises(EngineError, match="SIMULATED"):
            await task
        assert not await e.health()
        await e.restart()
        return aborted, e.weight_version, await e.health()

    aborted, version, healthy = asyncio.run(main())
    assert all(s.finish_reason == "abort" and 0 < len(s.token_ids) < 100 for s in aborted)
    assert version == 0 and healthy


def test_wait_pause_lets_running_requests_finish():
    async def main():
        e = _engine(tokens_per_s=1000, length_median=100, length_sigma=0.0)
        task = asyncio.create_task(e.generate([1], SamplingParams(n=1, max_tokens=1000)))
        await asyncio.sleep(0.02)
        await e.pause("wait")  # returns once the running request is done
        done = task.done()
        await e.weights.update_weights(3, "p")
        await e.resume()
        return done, (await task)[0]

    done, sample = asyncio.run(main())
    assert done and sample.segment_versions == [0] and sample.finish_reason == "stop"


def test_length_growth_lengthens_responses_with_the_version():
    async def main():
        e = _engine(tokens_per_s=1e7, length_median=20, length_sigma=0.0, length_growth=0.5)
        before = await e.generate([1], SamplingParams(n=4, max_tokens=1000))
        for v in (1, 2, 3, 4):
            await e.weights.update_weights(v, "any")
        after = await e.generate([1], SamplingParams(n=4, max_tokens=1000))
        return before, after

    before, after = asyncio.run(main())
    # sigma 0: every length is the median, 20 at version 0 and 20 * (1 + 0.5 * 4) = 60 at version 4
    assert {len(s.token_ids) for s in before} == {20}
    assert {len(s.token_ids) for s in after} == {60}
