"""A SIMULATED learner for ``--simulate``: the real broker consumer protocol, no model.

Per step it does what the real training loop does at the boundaries, and sleeps instead
of computing: lease the batch of step ``v + 1`` from the broker, record its staleness and
rewards, "train" for ``rollout.simulated.learner_step_s`` seconds, publish the new version to the
fleet (simulated transfer time), report the version to the broker so admission moves
on, and ack the lease (the order of :mod:`learner.loop`). The lag view, the staleness bound and the accounting of
groups are therefore exercised exactly as in a real run; learning is not.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from typing import Any, Awaitable, Callable

import msgspec
import numpy as np

from broker.client import ConsumerClient
from learner.status import LearnerStatus

log = logging.getLogger(__name__)


class SimLearner:
    simulated = True

    def __init__(
        self,
        broker_address: str,
        *,
        step_s: float,
        max_staleness: int,
        publish: Callable[[int], Awaitable[Any]] | None = None,
        wait_s: float = 1.0,
    ) -> None:
        self.broker_address = broker_address
        self.step_s = step_s
        self.max_staleness = max_staleness
        self.publish = publish
        self.wait_s = wait_s
        self.version = 0
        self.wait_total_s = 0.0
        self.groups_consumed = 0
        self.samples_consumed = 0
        self.reward_per_step: list[float] = []
        self.staleness_hist: Counter[int] = Counter()
        self.max_staleness_seen = 0
        self.bound_violations = 0
        self.publish_s = 0.0
        self._stop = asyncio.Event()
        self._t0 = time.monotonic()
        self.done = False
        self.error: str | None = None

    def set_publisher(self, publish: Callable[[int], Awaitable[Any]]) -> None:
        self.publish = publish

    async def run(self, max_steps: int) -> dict[str, Any]:
        consumer = ConsumerClient(self.broker_address, consumer_id="sim-learner")
        self._t0 = time.monotonic()
        try:
            await _maybe_await(consumer.report_version(self.version))
            while self.version < max_steps and not self._stop.is_set():
                step = self.version + 1
                t0 = time.monotonic()
                lease = None
                while lease is None and not self._stop.is_set():
                    lease = await _maybe_await(consumer.next_batch(step, self.wait_s))
                self.wait_total_s += time.monotonic() - t0
                if lease is None:
                    break
                self._record(lease)
                await asyncio.sleep(self.step_s)  # SIMULATED optimizer step
                # the real loop's order: publish, report the version, then ack
                if self.publish is not None:
                    t1 = time.monotonic()
                    await self.publish(step)
                    self.publish_s += time.monotonic() - t1
                self.version = step
                await _maybe_await(consumer.report_version(step))
                await _maybe_await(consumer.ack(lease.lease_id))
        except Exception as exc:
            self.error = f"{type(exc).__name__}: {exc}"
            log.exception("[SIMULATED] learner failed at version %d", self.version)
            raise
        finally:
            self.done = True
            close = getattr(consumer, "close", None)
            if close is not None:
                await _maybe_await(close())
        return SimLearner.status(self)

    def _record(self, lease: Any) -> None:
        table = lease_table(lease)
        oldest = np.array([v[0] for v in table.column("segment_versions").to_pylist()], dtype=np.int64)
        stale = self.version - oldest
        for s, c in zip(*np.unique(stale, return_counts=True), strict=True):
            self.staleness_hist[int(s)] += int(c)
        if len(stale):
            self.max_staleness_seen = max(self.max_staleness_seen, int(stale.max()))
            self.bound_violations += int((stale > self.max_staleness).sum())
        groups = len(set(table.column("group_id").to_pylist()))
        self.groups_consumed += groups
        self.samples_consumed += table.num_rows
        rewards = table.column("reward").to_numpy()
        self.reward_per_step.append(float(rewards.mean()) if len(rewards) else float("nan"))

    def stop(self) -> None:
        self._stop.set()

    def status(self) -> dict[str, Any]:
        """:meth:`record` as plain data (the actor's answer)."""
        return msgspec.to_builtins(self.record())

    def record(self) -> LearnerStatus:
        wall = max(1e-9, time.monotonic() - self._t0)
        return LearnerStatus(
            simulated=True,
            step=self.version,
            learner_wait_s=round(self.wait_total_s, 3),
            learner_idle_fraction=self.wait_total_s / wall,
            groups_consumed=self.groups_consumed,
            samples_consumed=self.samples_consumed,
            reward=self.reward_per_step[-1] if self.reward_per_step else None,
            reward_per_step=list(self.reward_per_step),
            staleness_hist={str(k): v for k, v in sorted(self.staleness_hist.items())},
            max_staleness_seen=self.max_staleness_seen,
            bound_violations=self.bound_violations,
            publish_s=round(self.publish_s, 3),
            done=self.done,
            error=self.error,
        )


def lease_table(lease: Any):
    """The lease's rows as one Arrow table, whatever container the client hands out."""
    import pyarrow as pa

    for name in ("table", "batch", "batches"):
        data = getattr(lease, name, None)
        if data is None:
            continue
        if isinstance(data, pa.Table):
            return data
        if isinstance(data, pa.RecordBatch):
            return pa.Table.from_batches([data])
        return pa.Table.from_batches(list(data))
    raise TypeError(f"lease {type(lease).__name__} carries no table, batch or batches")


async def _maybe_await(x: Any) -> Any:
    if asyncio.iscoroutine(x) or isinstance(x, asyncio.Future):
        return await x
    return x
