"""Reward functions and the pool that scores them off the generation path.

``RewardConfig.function`` names one of:

- a built-in (:mod:`rollout_fleet.scorers`): ``default`` (routes by the row's ``data_source``:
  GSM8K's ``####`` rule, math-verify for math sets, exact match for the addition task),
  ``exact_match``, ``gsm8k``, ``gsm8k_flexible``, ``math``;
- ``package.module:function``: any importable function, in fleetrl's signature
  ``fn(response_text, ground_truth, **extra) -> float`` (``extra``: ``data_source``,
  ``extra_info``; a function without ``**extra`` gets only the keywords it names) or in verl's,
  ``compute_score(data_source, solution_str, ground_truth, extra_info)`` (told apart by the
  parameter names; a ``{"score": x, ...}`` result counts as ``x``), so a verl reward file drops in;
- ``async def`` functions are awaited on the fleet's event loop (judges, sandboxes over the
  network), with the same per-call limit; with ``reward.batched`` the function scores a whole
  group in one call, verl's batch signature ``fn(data_sources, solution_strs, ground_truths,
  extra_infos) -> list[float]``.

The name is resolved once, when the pool is built (:func:`resolve`): a bad name is a
:class:`RewardConfigError` that names it. At scoring time a function that raises,
returns a non-number, or runs past the limit gives a :class:`RewardError` naming the
function and the row or trajectory. The caller decides what to do with it (the
rollout worker counts it as ``rollout/reward_errors`` and drops the sample's
group rather than train on a made-up reward); nothing is swallowed here.

:class:`RewardPool` runs the scoring in worker threads or processes (``reward.mode``) with a
timeout per call, so a slow reward never stalls generation::

    pool = RewardPool("exact_match", workers=2, timeout_s=5.0)
    reward = await pool.score("432", "432", where="prompt 17 sample 3")  # 1.0
    pool.close()
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import importlib
import inspect
import logging
import math
import multiprocessing
from collections.abc import Callable, Sequence
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Literal

from rollout_fleet import scorers

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


BUILTIN: dict[str, RewardFn] = {**scorers.SCORERS, "default": scorers.default}
exact_match, math_answer = scorers.exact_match, scorers.math_answer  # the names tests and users import


def signature_of(fn: RewardFn) -> Literal["fleetrl", "verl"]:
    """``verl`` for a verl ``compute_score(data_source, solution_str, ground_truth, extra_info)``
    (told by its parameter names), else fleetrl's ``fn(response_text, ground_truth, **extra)``."""
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # a builtin without a signature: call it fleetrl's way
        return "fleetrl"
    return (
        "verl" if "solution_str" in params or (params and params[0] in ("data_source", "data_sources")) else "fleetrl"
    )


def _accepted(fn: RewardFn, extra: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of ``extra`` that ``fn`` takes (all of them with ``**kwargs``)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return extra
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return extra
    return {k: v for k, v in extra.items() if k in params}


def _as_score(value: Any) -> Any:
    """verl lets compute_score return ``{"score": x, ...}`` (other keys are metrics)."""
    return value["score"] if isinstance(value, dict) and "score" in value else value


def _load_file(path: str) -> Any:
    """A reward module given as a file (verl's ``custom_reward_function.path``)."""
    import importlib.util
    import sys
    from pathlib import Path

    p = Path(path).resolve()
    if not p.exists():
        raise ImportError(f"file {path} does not exist")
    mod_name = f"fleetrl_reward_{abs(hash(str(p)))}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    spec = importlib.util.spec_from_file_location(mod_name, p)
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[mod_name]
        raise ImportError(f"{type(exc).__name__}: {exc}") from exc
    return module


def resolve(name: str) -> RewardFn:
    """The function for a config name: a built-in or ``package.module:function``."""
    if name in BUILTIN:
        return BUILTIN[name]
    module_name, sep, attr = name.rpartition(":")
    if not sep or not module_name or not attr:
        raise RewardConfigError(
            f"reward function {name!r} is neither a built-in ({', '.join(BUILTIN)}) "
            f"nor of the form 'package.module:function' or 'path/to/file.py:function'"
        )
    try:
        module = _load_file(module_name) if module_name.endswith(".py") else importlib.import_module(module_name)
    except (ImportError, OSError) as exc:
        raise RewardConfigError(f"reward function {name!r}: cannot import module {module_name!r}: {exc}") from exc
    fn = module
    for part in attr.split("."):
        if not hasattr(fn, part):
            raise RewardConfigError(f"reward function {name!r}: module {module_name!r} has no attribute {attr!r}")
        fn = getattr(fn, part)
    if not callable(fn):
        raise RewardConfigError(f"reward function {name!r} is not callable (it is a {type(fn).__name__})")
    return fn


def invoke(fn: RewardFn, response_text: str, ground_truth: Any, extra: dict[str, Any]) -> Any:
    """One call in the function's own signature (``extra`` holds ``data_source``, ``extra_info``, ...)."""
    if signature_of(fn) == "verl":
        return fn(
            data_source=extra.get("data_source", ""),
            solution_str=response_text,
            ground_truth=ground_truth,
            extra_info=extra.get("extra_info"),
        )
    return fn(response_text, ground_truth, **_accepted(fn, extra))


def check_value(value: Any, name: str, where: str) -> float:
    value = _as_score(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RewardError(
            f"reward function {name!r} returned {value!r} on {where}; expected a finite float",
            function=name,
            where=where,
        )
    return float(value)


def call_reward(
    fn: RewardFn, name: str, response_text: str, ground_truth: Any, where: str, extra: dict[str, Any]
) -> float:
    """Run one reward call; any failure becomes a :class:`RewardError` naming ``name`` and ``where``."""
    try:
        value = invoke(fn, response_text, ground_truth, extra)
    except Exception as exc:
        raise RewardError(
            f"reward function {name!r} raised on {where}: {type(exc).__name__}: {exc}", function=name, where=where
        ) from exc
    return check_value(value, name, where)


_process_fns: dict[str, RewardFn] = {}


def call_batch(fn: RewardFn, name: str, items: Sequence[tuple[str, Any, str, dict[str, Any]]]) -> list[float]:
    """One batched call (verl's batch signature) for a group; its failure names every row."""
    where = f"{items[0][2]} .. {items[-1][2]}" if items else "an empty batch"
    try:
        values = fn(
            data_sources=[i[3].get("data_source", "") for i in items],
            solution_strs=[i[0] for i in items],
            ground_truths=[i[1] for i in items],
            extra_infos=[i[3].get("extra_info") for i in items],
        )
    except Exception as exc:
        raise RewardError(
            f"reward function {name!r} raised on {where}: {type(exc).__name__}: {exc}", function=name, where=where
        ) from exc
    return _check_batch(values, name, items, where)


def _check_batch(values: Any, name: str, items: Sequence, where: str) -> list[float]:
    if not isinstance(values, (list, tuple)) or len(values) != len(items):
        raise RewardError(
            f"batched reward function {name!r} returned {values!r:.80} on {where}; expected a list "
            f"of {len(items)} floats",
            function=name,
            where=where,
        )
    return [check_value(v, name, i[2]) for v, i in zip(values, items, strict=True)]


def _batch_in_process(name: str, items: list[tuple[str, Any, str, dict[str, Any]]]) -> list[float]:
    fn = _process_fns.get(name)
    if fn is None:
        fn = _process_fns[name] = resolve(name)
    return call_batch(fn, name, items)


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
        self,
        function: str,
        *,
        workers: int = 2,
        timeout_s: float = 30.0,
        mode: Literal["thread", "process"] = "thread",
        batched: bool = False,
    ) -> None:
        if workers < 1 or timeout_s <= 0:
            raise ValueError(f"need workers >= 1 and timeout_s > 0, got workers={workers}, timeout_s={timeout_s}")
        if mode not in ("thread", "process"):
            raise ValueError(f"mode must be 'thread' or 'process', got {mode!r}")
        self.name = function
        self.fn = resolve(function)  # fail at config time, not at the first sample
        self.batched = batched
        self.is_async = inspect.iscoroutinefunction(self.fn)
        self.workers, self.timeout_s, self.mode = workers, timeout_s, mode
        self.timeouts = 0
        self.errors = 0
        self.reruns = 0  # calls re-run because another call's timeout ended their process
        self._executor = self._new_executor()
        self._slots = asyncio.Semaphore(workers)

    @classmethod
    def from_config(cls, cfg: Any) -> RewardPool:
        """A pool from a :class:`rollout_fleet.config.RewardConfig`."""
        return cls(cfg.function, workers=cfg.workers, timeout_s=cfg.timeout_s, mode=cfg.mode, batched=cfg.batched)

    def _new_executor(self) -> cf.Executor:
        if self.mode == "thread":
            return cf.ThreadPoolExecutor(self.workers, thread_name_prefix="reward")
        # spawn: rollout workers hold sockets and threads that a fork would copy half-alive.
        return cf.ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"))

    def _submit(self, executor: cf.Executor, args: tuple[str, Any, str, dict[str, Any]]) -> cf.Future:
        if self.mode == "thread":
            return executor.submit(call_reward, self.fn, self.name, *args)
        return executor.submit(_score_in_process, self.name, *args)

    async def score(
        self, response_text: str, ground_truth: Any, *, where: str, extra: dict[str, Any] | None = None
    ) -> float:
        """The reward of one response; raises :class:`RewardError` (or :class:`RewardTimeout`).

        The time limit starts when a worker is free, not when the call is queued, so a
        busy pool does not turn waiting into timeouts.
        """
        args = (response_text, ground_truth, where, extra or {})
        if self.is_async:
            return await self._score_async(args)
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

    async def _score_async(self, args: tuple[str, Any, str, dict[str, Any]]) -> float:
        """An ``async def`` reward: awaited on this loop (it waits on the network, not the CPU)."""
        text, truth, where, extra = args
        async with self._slots:
            try:
                value = await asyncio.wait_for(invoke(self.fn, text, truth, extra), self.timeout_s)
            except TimeoutError:
                self.timeouts += 1
                raise RewardTimeout(
                    f"reward function {self.name!r} timed out after {self.timeout_s:g} s on {where}",
                    function=self.name,
                    where=where,
                ) from None
            except Exception as exc:
                self.errors += 1
                raise RewardError(
                    f"reward function {self.name!r} raised on {where}: {type(exc).__name__}: {exc}",
                    function=self.name,
                    where=where,
                ) from exc
        return check_value(value, self.name, where)

    async def score_batch(self, items: Sequence[tuple[str, Any, str, dict[str, Any] | None]]) -> list[float]:
        """Score one group in one call (``batched``); raises :class:`RewardError` for the whole group."""
        items = [(t, g, w, e or {}) for t, g, w, e in items]
        where = f"{items[0][2]} .. {items[-1][2]}" if items else "an empty batch"
        async with self._slots:
            try:
                if self.is_async:
                    coro = self.fn(
                        data_sources=[i[3].get("data_source", "") for i in items],
                        solution_strs=[i[0] for i in items],
                        ground_truths=[i[1] for i in items],
                        extra_infos=[i[3].get("extra_info") for i in items],
                    )
                    return _check_batch(await asyncio.wait_for(coro, self.timeout_s), self.name, items, where)
                fut = (
                    self._executor.submit(call_batch, self.fn, self.name, items)
                    if self.mode == "thread"
                    else self._executor.submit(_batch_in_process, self.name, items)
                )
                return await asyncio.wait_for(asyncio.wrap_future(fut), self.timeout_s)
            except TimeoutError:
                self.timeouts += 1
                if self.mode == "process" and not self.is_async:
                    self._replace_processes()
                raise RewardTimeout(
                    f"reward function {self.name!r} timed out after {self.timeout_s:g} s on {where}",
                    function=self.name,
                    where=where,
                ) from None
            except RewardError:
                self.errors += 1
                raise
            except Exception as exc:
                self.errors += 1
                raise RewardError(
                    f"reward function {self.name!r} raised on {where}: {type(exc).__name__}: {exc}",
                    function=self.name,
                    where=where,
                ) from exc

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
