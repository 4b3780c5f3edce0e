"""Reward functions and the pool that scores them off the generation path.

A reward function has the signature ``fn(response_text, ground_truth, **extra) -> float``.
Three kinds are named in ``RewardConfig.function``:

- ``exact_match``: the stripped response equals the stripped ground truth (the
  synthetic addition task);
- ``math``: GSM8K-style answers checked with HF ``math-verify`` (ground truth such as
  ``"72"`` or a full solution ending ``"#### 72"``);
- ``package.module:function``: any importable function.

The name is resolved once, at config time (:func:`resolve`): a bad name is a
:class:`RewardConfigError` that names it. At scoring time a function that raises,
returns a non-number, or runs past the limit gives a :class:`RewardError` naming the
function and the row or trajectory. The caller decides what to do with it (the
rollout worker should count it as ``rollout/reward_errors`` and drop the sample's
group rather than train on a made-up reward); nothing is swallowed here.

:class:`RewardPool` runs the scoring in worker threads or processes with a timeout
per call, so a slow reward never stalls generation::

    pool = RewardPool("exact_match", workers=2, timeout_s=5.0)
    reward = await pool.score("432", "432", where="prompt 17 sample 3")  # 1.0
    pool.close()
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import importlib
import logging
import math
import multiprocessing
import re
import threading
from collections.abc import Callable, Sequence
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Literal

logger = logging.getLogger(__name__)

RewardFn = Callable[..., float]


class RewardConfigError(ValueError):
    """The configured reward function name cannot be resolved; the message names it."""


class RewardError(RuntimeError):
    """A reward function failed on one row or trajectory; names the function and where."""

    # Defaults let the error unpickle when it comes back from a worker process
    # (pickle rebuilds it from the message, then restores the attributes).
    def __init__(self, message: str, *, function: str = "", where: str = "") -> None:
        super().__init__(message)
        self.function = function
        self.where = where


class RewardTimeout(RewardError):
    """A reward call ran past the pool's per-call limit."""


def exact_match(response_text: str, ground_truth: str, **extra: Any) -> float:
    """1.0 when the response, stripped of surrounding whitespace, equals the ground truth."""
    return 1.0 if response_text.strip() == str(ground_truth).strip() else 0.0


_HASH_ANSWER = re.compile(r"####[ \t]*([^\n]*)")


def _final_answer(text: str) -> str:
    """The line after the last ``####`` (GSM8K's answer marker), or the whole text.

    Only that line: a model that keeps writing after its answer must not have the
    rest read as the answer.
    """
    if "####" in text:
        m = _HASH_ANSWER.search(text[text.rindex("####") :])
        if m:
            return m.group(1).strip().replace(",", "")
    return text


def math_answer(response_text: str, ground_truth: str, **extra: Any) -> float:
    """1.0 when math-verify finds the response's final answer equal to the ground truth's."""
    from math_verify import parse, verify

    # math-verify's own timeouts use SIGALRM, which only works in the main thread;
    # elsewhere the pool's per-call timeout bounds the work instead.
    limit = 5 if threading.current_thread() is threading.main_thread() else None
    gold = parse(_final_answer(str(ground_truth)), parsing_timeout=limit)
    if not gold:
        raise ValueError(f"ground truth {ground_truth!r} has no parsable answer")
    pred = parse(_final_answer(response_text), parsing_timeout=limit)
    return 1.0 if pred and verify(gold, pred, timeout_seconds=limit) else 0.0


BUILTIN: dict[str, RewardFn] = {"exact_match": exact_match, "math": math_answer}


def resolve(name: str) -> RewardFn:
    """The function for a config name: a built-in or ``package.module:function``."""
    if name in BUILTIN:
        return BUILTIN[name]
    module_name, sep, attr = name.partition(":")
    if not sep or not module_name or not attr:
        raise RewardConfigError(
            f"reward function {name!r} is neither a built-in ({', '.join(BUILTIN)}) "
            f"nor of the form 'package.module:function'"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise RewardConfigError(f"reward function {name!r}: cannot import module {module_name!r}: {exc}") from exc
    fn = module
    for part in attr.split("."):
        if not hasattr(fn, part):
            raise RewardConfigError(f"reward function {name!r}: module {module_name!r} has no attribute {attr!r}")
        fn = getattr(fn, part)
    if not callable(fn):
        raise RewardConfigError(f"reward function {name!r} is not callable (it is a {type(fn).__name__})")
    return fn


def call_reward(fn: RewardFn, name: str, response_text: str, ground_truth: Any, where: str, extra: dict[str, Any]) -> float:
    """Run one reward call; any failure becomes a :class:`RewardError` naming ``name`` and ``where``."""
    try:
        value = fn(response_text, ground_truth, **extra)
    except Exception as exc:
        raise RewardError(
            f"reward function {name!r} raised on {where}: {type(exc).__name__}: {exc}", function=name, where=where
        ) from exc
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RewardError(
            f"reward function {name!r} returned {value!r} on {where}; expected a finite float",
            function=name,
            where=where,
        )
    return float(value)


_process_fns: dict[str, RewardFn] = {}


def _score_in_process(name: str, response_text: str, ground_truth: Any, where: str, extra: dict[str, Any]) -> float:
    # Worker processes resolve by name: functions are not shipped, only their names.
    fn = _process_fns.get(name)
    if fn is None:
        fn = _process_fns[name] = resolve(name)
    return call_reward(fn, name, response_text, ground_truth, where, extra)


class RewardPool:
    """Scores responses concurrently in threads or processes, with a timeout per call.

    ``mode="thread"`` suits cheap Python rewards (exact match); ``mode="process"``
    suits CPU-heavy ones (math verification) and is the only mode in which a call
    that overruns its limit is actually stopped: the pool's processes are replaced.
    A timed-out thread cannot be stopped; it finishes in the background and its
    result is discarded.
    """

    def __init__(
        self, function: str, *, workers: int = 2, timeout_s: float = 30.0, mode: Literal["thread", "process"] = "thread"
    ) -> None:
        if workers < 1 or timeout_s <= 0:
            raise ValueError(f"need workers >= 1 and timeout_s > 0, got workers={workers}, timeout_s={timeout_s}")
        if mode not in ("thread", "process"):
            raise ValueError(f"mode must be 'thread' or 'process', got {mode!r}")
        self.name = function
        self.fn = resolve(function)  # fail at config time, not at the first sample
        self.workers, self.timeout_s, self.mode = workers, timeout_s, mode
        self.timeouts = 0
        self.errors = 0
        self.reruns = 0  # calls re-run because another call's timeout ended their process
        self._executor = self._new_executor()
        self._slots = asyncio.Semaphore(workers)

    @classmethod
    def from_config(cls, cfg: Any) -> RewardPool:
        """A pool from a :class:`rollout_fleet.config.RewardConfig`."""
        return cls(cfg.function, workers=cfg.workers, timeout_s=cfg.timeout_s, mode=cfg.mode)

    def _new_executor(self) -> cf.Executor:
        if self.mode == "thread":
            return cf.ThreadPoolExecutor(self.workers, thread_name_prefix="reward")
        # spawn: rollout workers hold sockets and threads that a fork would copy half-alive.
        return cf.ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"))

    def _submit(self, executor: cf.Executor, args: tuple[str, Any, str, dict[str, Any]]) -> cf.Future:
        if self.mode == "thread":
            return executor.submit(call_reward, self.fn, self.name, *args)
        return executor.submit(_score_in_process, self.name, *args)

    async def score(self, response_text: str, ground_truth: Any, *, where: str, extra: dict[str, Any] | None = None) -> float:
        """The reward of one response; raises :class:`RewardError` (or :class:`RewardTimeout`).

        The time limit starts when a worker is free, not when the call is queued, so a
        busy pool does not turn waiting into timeouts.
        """
        args = (response_text, ground_truth, where, extra or {})
        async with self._slots:
            for attempt in range(2):
                executor = self._executor
                fut = self._submit(executor, args)
                try:
                    return await asyncio.wait_for(asyncio.wrap_future(fut), self.timeout_s)
                except TimeoutError:
                    self.timeouts += 1
                    if self.mode == "process" and executor is self._executor:
                        self._replace_processes()
                    raise RewardTimeout(
                        f"reward function {self.name!r} timed out after {self.timeout_s:g} s on {where}",
                        function=self.name,
                        where=where,
                    ) from None
                except RewardError:
                    self.errors += 1
                    raise
                except BrokenProcessPool as exc:
                    if executor is not self._executor and attempt == 0:
                        self.reruns += 1
                        continue  # ended by another call's timeout, not by this one: run it again
                    self.errors += 1
                    if executor is self._executor:
                        self._executor = self._new_executor()
                    raise RewardError(
                        f"reward function {self.name!r} crashed its worker process on {where}: {exc}",
                        function=self.name,
                        where=where,
                    ) from exc
        raise AssertionError("unreachable")

    async def score_many(
        self, items: Sequence[tuple[str, Any, str, dict[str, Any] | None]]
    ) -> list[float | RewardError]:
        """Score ``(response_text, ground_truth, where, extra)`` items concurrently.

        Failures come back in place as :class:`RewardError` values, so one bad sample
        does not hide the rewards of its group; the caller decides what to do.
        """

        async def one(item: tuple[str, Any, str, dict[str, Any] | None]) -> float | RewardError:
            try:
                return await self.score(item[0], item[1], where=item[2], extra=item[3])
            except RewardError as err:
                return err

        return list(await asyncio.gather(*(one(i) for i in items)))

    def _replace_processes(self) -> None:
        old, self._executor = self._executor, self._new_executor()
        _stop(old)
        logger.warning("reward pool: replaced worker processes after a timeout of %r", self.name)

    def close(self) -> None:
        _stop(self._executor)

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _stop(executor: cf.Executor) -> None:
    """Shut an executor down without waiting on a stuck call; end its processes (ours, by PID)."""
    # A running call cannot be cancelled through the executor API, and a runaway
    # reward must not hold a core for the rest of the run: terminate the processes.
    procs = list((getattr(executor, "_processes", None) or {}).values())
    executor.shutdown(wait=False, cancel_futures=True)
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=5)
