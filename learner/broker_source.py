"""The learner's BatchSource (learner/source.py) on the broker's consumer client.

Example::

    src = BrokerSource("tcp://10.0.0.5:5555", consumer_id="learner", timeout_s=30)
    sb = src.next_batch(step=v + 1, timeout_s=600)   # StepBatch(step, lease_id, batch)
    ...                                              # optimizer step, publish
    src.report_version(v + 1); src.ack(sb.lease_id)

The lease is renewed in the background (every ``lease_timeout_s / 3``) from
``next_batch`` until ``ack``, so a slow optimizer step or publish never lets it
expire; only a dead learner does, and then the broker hands the data out again.
An ack the broker refuses with ``lease_expired`` raises RuntimeError: the step
used data that went to another lease, and must not be counted.
"""

from __future__ import annotations

import logging
import time

from broker.client import BrokerError, BrokerTimeout, SyncConsumer
from broker.protocol import ErrorCode
from learner.source import StepBatch

log = logging.getLogger(__name__)


class BrokerSource:
    def __init__(
        self,
        address: str,
        *,
        consumer_id: str = "learner",
        timeout_s: float = 30.0,
        lease_timeout_s: float = 120.0,
        poll_s: float = 5.0,
        curve_keys_dir: str | None = None,
    ) -> None:
        self.address = address
        self.poll_s = poll_s
        self.renew_every_s = max(0.5, lease_timeout_s / 3)
        self.consumer = SyncConsumer(
            address, consumer_id=consumer_id, timeout_s=timeout_s, curve_keys_dir=curve_keys_dir
        )
        self.last_staleness = None  # per-row staleness of the latest batch (for logging)
        self.last_batch = None  # the latest batch (rank 0's per-step metrics read it)

    def next_batch(self, step: int, timeout_s: float | None = None) -> StepBatch:
        """The batch of ``step``; raises TimeoutError naming the broker and step after ``timeout_s``."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            wait = self.poll_s if deadline is None else min(self.poll_s, max(0.0, deadline - time.monotonic()))
            lease = self.consumer.next_batch(step, wait, renew_every_s=self.renew_every_s)
            if lease is not None:
                self.last_staleness = lease.staleness
                self.last_batch = lease.batch
                return StepBatch(step=lease.step, lease_id=lease.lease_id, batch=lease.batch)
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(
                    f"broker {self.address}: no batch for learner step {step} "
                    f"within {timeout_s:.1f}s (fleet too slow or stopped?)"
                )

    def ack(self, lease_id: str) -> None:
        try:
            reply = self.consumer.ack(lease_id)
        except BrokerError as e:
            if e.code == ErrorCode.LEASE_EXPIRED:
                raise RuntimeError(f"broker refused the ack of lease {lease_id}: {e.message}") from None
            raise
        if reply.late:
            log.warning("lease %s had expired but was acked late (its groups were not handed out again)", lease_id)

    def report_version(self, version: int) -> None:
        self.consumer.report_version(version)

    def status(self) -> dict:
        return self.consumer.status()

    def close(self) -> None:
        try:
            self.consumer.close()
        except BrokerTimeout:
            log.warning("closing the consumer client of %s timed out", self.address)
