"""The episode loop: model turns from an engine, observations from an environment, one token record.

Dataflow of one episode::

    prompt ids --generate(context, min_version)--> turn tokens + log-probs + versions (kept as sampled)
        -> decode (for the environment only) -> env.step -> observation text
        -> tokenised once, appended with loss mask 0 -> context for the next turn ...

Invariants: the record's response is exactly the concatenation, in order, of every turn's
sampled ids and every observation's ids; a turn's log-probs are the sampler's, observations
carry log-prob 0 and mask 0; each turn starts on weights no older than the previous turn's
last segment, so segment versions never decrease (a turn is never sent to a server behind the
one that sampled the turn before). A limit on turns or tokens truncates the episode
(finish reason ``length``); the wall-time limit, an environment that raises or stalls, fail
it with an :class:`EnvError` naming the reason.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engines.base import Sample, SamplingParams
from rollout_fleet.envs.base import (
    Codec,
    EnvError,
    EnvFactory,
    Environment,
    EpisodeLimits,
    StepResult,
    Turn,
)

# (context ids, params with n=1, oldest acceptable version) -> (engine id, the one sample)
GenerateFn = Callable[[list[int], SamplingParams, int], Awaitable[tuple[str, Sample]]]


@dataclass(kw_only=True, slots=True)
class Episode:
    """One finished episode as the trajectory schema stores it (``response`` = after the prompt)."""

    prompt_ids: list[int]
    token_ids: np.ndarray  # int32: turns and observations in order
    logprobs: np.ndarray  # float32: the sampler's on turn tokens, 0 on observation tokens
    loss_mask: np.ndarray  # int8: 1 on turn tokens, 0 on observation tokens
    segment_starts: list[int]
    segment_versions: list[int]
    turn_spans: list[tuple[int, int]]  # [start, end) of each model turn in token_ids
    reward: float
    finish_reason: str  # "stop": the environment ended it; "length": a turn or token limit did
    end: str  # "done", "max_turns", "max_tokens"
    engine_ids: list[str] = field(default_factory=list)
    infos: list[dict[str, Any]] = field(default_factory=list)
    t_start: float = 0.0


class TokenRecord:
    """An episode's tokens after its prompt: sampled turns (mask 1) and observations (mask 0), with segments."""

    def __init__(self) -> None:
        self.ids: list[np.ndarray] = []
        self.lps: list[np.ndarray] = []
        self.mask: list[np.ndarray] = []
        self.starts: list[int] = []
        self.versions: list[int] = []
        self.n = 0

    def add_turn(self, s: Sample) -> tuple[int, int]:
        a = self.n
        for st, v in zip(s.segment_starts, s.segment_versions, strict=True):
            if self.versions and v < self.versions[-1]:
                raise AssertionError(f"turn sampled at version {v} after version {self.versions[-1]}")
            if not self.versions or v != self.versions[-1]:
                self.starts.append(a + int(st))
                self.versions.append(int(v))
        self._add(np.asarray(s.token_ids, np.int32), np.asarray(s.logprobs, np.float32), 1)
        return a, self.n

    def add_observation(self, ids: list[int]) -> None:
        self._add(np.asarray(ids, np.int32), np.zeros(len(ids), np.float32), 0)

    def _add(self, ids: np.ndarray, lps: np.ndarray, m: int) -> None:
        self.ids.append(ids)
        self.lps.append(lps)
        self.mask.append(np.full(len(ids), m, np.int8))
        self.n += len(ids)

    def cat(self, parts: list[np.ndarray], dtype) -> np.ndarray:
        return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype)


async def _env_call(coro: Awaitable, reason: str, env: Environment, timeout_s: float):
    try:
        return await asyncio.wait_for(coro, timeout_s)
    except TimeoutError:
        raise EnvError(f"{reason}_timeout", f"environment {env.name!r} did not answer in {timeout_s:g} s") from None
    except EnvError:
        raise
    except Exception as exc:  # an environment's own bug or failure: named, counted, never a reward
        raise EnvError(reason, f"environment {env.name!r} raised {type(exc).__name__}: {exc}") from exc


async def run_episode(
    generate: GenerateFn,
    env: Environment,
    codec: Codec,
    prompt_ids: list[int],
    *,
    ground_truth: str,
    extra_info: dict[str, Any],
    limits: EpisodeLimits,
    temperature: float = 1.0,
    top_p: float = 1.0,
    stop_token_ids: list[int] | None = None,
    min_version: int = 0,
) -> Episode:
    """Run one episode of ``env`` against ``generate``. Example::

    ep = await run_episode(gen, ChainAdditionEnv(), HFCodec.from_pretrained(model), ids,
                           ground_truth="7", extra_info={"addends": [3]}, limits=limits)
    """
    t0 = time.time()
    try:
        async with asyncio.timeout(limits.wall_time_s):
            return await _episode(
                generate,
                env,
                codec,
                list(prompt_ids),
                ground_truth,
                extra_info,
                limits,
                temperature,
                top_p,
                list(stop_token_ids or []),
                min_version,
                t0,
            )
    except TimeoutError:
        raise EnvError("wall_time", f"episode of {env.name!r} ran past its {limits.wall_time_s:g} s limit") from None
    finally:
        try:
            await asyncio.wait_for(env.close(), limits.env_timeout_s)
        except Exception:  # noqa: BLE001 (closing must not hide the episode's own outcome)
            pass


async def _episode(
    generate, env, codec, prompt_ids, ground_truth, extra_info, limits, temperature, top_p, stop_ids, min_version, t0
) -> Episode:
    await _env_call(env.reset(ground_truth, extra_info), "env_reset", env, limits.env_timeout_s)
    rec, spans, engines, infos = TokenRecord(), [], [], []
    reward, end = 0.0, "max_turns"
    for k in range(limits.max_turns):
        room = limits.max_tokens - rec.n
        params = SamplingParams(
            n=1,
            max_tokens=min(limits.turn_max_tokens, room),
            temperature=temperature,
            top_p=top_p,
            stop_token_ids=stop_ids,
        )
        context = prompt_ids + (rec.cat(rec.ids, np.int32).tolist() if rec.ids else [])
        floor = max(min_version, rec.versions[-1] if rec.versions else 0)
        engine_id, sample = await generate(context, params, floor)
        engines.append(engine_id)
        spans.append(rec.add_turn(sample))
        turn = Turn(
            index=k,
            token_ids=sample.token_ids,
            text=codec.decode(sample.token_ids.tolist()),
            finish_reason=sample.finish_reason,
        )
        res: StepResult = await _env_call(env.step(turn), "env_step", env, limits.env_timeout_s)
        if not isinstance(res, StepResult):
            raise EnvError("env_step", f"environment {env.name!r} returned {type(res).__name__}, not a StepResult")
        if not np.isfinite(res.reward):
            raise EnvError("env_reward", f"environment {env.name!r} gave a non-finite reward {res.reward!r}")
        reward += float(res.reward)
        infos.append(res.info)
        if res.done:
            end = "done"
            break
        if res.observation is None:
            raise EnvError("env_step", f"environment {env.name!r} gave no observation for a turn that is not done")
        obs = codec.encode(res.observation) if isinstance(res.observation, str) else list(res.observation)
        if rec.n + len(obs) >= limits.max_tokens:  # no room left for another turn: truncated here
            end = "max_tokens"
            break
        rec.add_observation(obs)
    return Episode(
        prompt_ids=prompt_ids,
        token_ids=rec.cat(rec.ids, np.int32),
        logprobs=rec.cat(rec.lps, np.float32),
        loss_mask=rec.cat(rec.mask, np.int8),
        segment_starts=rec.starts or [0],
        segment_versions=rec.versions or [min_version],
        turn_spans=spans,
        reward=reward,
        finish_reason="stop" if end == "done" else "length",
        end=end,
        engine_ids=engines,
        infos=infos,
        t_start=t0,
    )


async def run_episode_group(
    n: int, generate: GenerateFn, env_factory: EnvFactory, codec: Codec, prompt_ids: list[int], **kw
) -> list[Episode]:
    """``n`` episodes of one prompt (a GRPO group), each with a fresh environment; whole or not at all:
    the first failure cancels the others and is raised."""
    tasks = [asyncio.create_task(run_episode(generate, env_factory(), codec, prompt_ids, **kw)) for _ in range(n)]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
