"""Where the learner's step batches come from: the ``BatchSource`` protocol and an in-process source.

The broker client implements :class:`BatchSource` over ZMQ; :class:`InProcessSource`
serves record batches held in memory (tests, replay of a spool, offline runs).

Delivery contract the loop relies on:

* ``next_batch(step)`` returns the batch for learner step ``step`` (= version + 1)
  under a lease, or raises ``TimeoutError`` naming what it waited for;
* the loop calls ``ack(lease_id)`` only after the optimizer step, the publish and
  ``report_version``: a learner that dies before acking gets the same data again
  (the broker re-leases it), so a resumed run sees the data it had not finished;
* ``report_version(v)`` tells the source (and through it the admission control)
  that policy version ``v`` exists.

Example::

    src = InProcessSource([to_record_batch(trajs_step1), to_record_batch(trajs_step2)])
    b = src.next_batch(1); ...; src.report_version(1); src.ack(b.lease_id)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import pyarrow as pa

from broker.schema import TRAJECTORY_SCHEMA, validate_batch


@dataclass(frozen=True, slots=True)
class StepBatch:
    """The trajectories of one learner step, held under a lease until acked."""

    step: int
    lease_id: str
    batch: pa.RecordBatch  # TRAJECTORY_SCHEMA


@runtime_checkable
class BatchSource(Protocol):
    def next_batch(self, step: int, timeout_s: float | None = None) -> StepBatch:
        """The batch for learner step ``step``; raises TimeoutError after ``timeout_s``."""

    def ack(self, lease_id: str) -> None:
        """The step that used this lease is applied; the data may be forgotten."""

    def report_version(self, version: int) -> None:
        """Policy version ``version`` is published."""


class InProcessSource:
    """Serves a fixed list of record batches: step ``s`` gets ``batches[(s - 1) % len]``.

    It keeps the same lease discipline as the broker (one lease per step; an ack
    must name an outstanding lease), so the loop is tested against the contract.
    ``position`` is the data position a checkpoint stores (the last acked step).
    """

    def __init__(self, batches: list[pa.RecordBatch], cycle: bool = False) -> None:
        if not batches:
            raise ValueError("InProcessSource needs at least one record batch")
        for b in batches:
            if b.schema.remove_metadata() != TRAJECTORY_SCHEMA.remove_metadata():
                raise ValueError("InProcessSource batches must use broker.schema.TRAJECTORY_SCHEMA")
            validate_batch(b)
        self.batches = batches
        self.cycle = cycle
        self.outstanding: dict[str, int] = {}
        self.acked_step = 0
        self.versions: list[int] = []

    def next_batch(self, step: int, timeout_s: float | None = None) -> StepBatch:
        if step < 1:
            raise ValueError(f"learner steps start at 1, got {step}")
        if not self.cycle and step > len(self.batches):
            raise TimeoutError(f"in-process source has {len(self.batches)} batches; none for step {step}")
        lease = f"inproc-{step}"
        self.outstanding[lease] = step
        return StepBatch(step=step, lease_id=lease, batch=self.batches[(step - 1) % len(self.batches)])

    def ack(self, lease_id: str) -> None:
        step = self.outstanding.pop(lease_id, None)
        if step is None:
            raise KeyError(f"ack of unknown lease {lease_id!r}; outstanding: {sorted(self.outstanding)}")
        self.acked_step = max(self.acked_step, step)

    def report_version(self, version: int) -> None:
        self.versions.append(version)

    # Data position, saved in checkpoints so a resumed learner continues where it stopped.
    def position(self) -> dict:
        return {"acked_step": self.acked_step}

    def restore(self, position: dict) -> None:
        self.acked_step = int(position["acked_step"])
