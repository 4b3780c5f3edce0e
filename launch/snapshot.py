"""The job's snapshot: the fleet's, the learner's and the broker's status records plus the job's own
numbers, as the driver collects them (every ``--status-interval``) and the monitor, the summary and
the ``status`` subcommand read them.

Every part is a declared msgspec Struct (``forbid_unknown_fields``): a misspelt key is an error,
not a silent 0. The ``status`` answer on the control endpoint is the flat form
(:meth:`JobSnapshot.to_wire`: the fleet's, the learner's and the job's fields side by side, the
broker's under ``broker``), read back by :meth:`JobSnapshot.from_wire`.
"""

from __future__ import annotations

from typing import Any

import msgspec

from learner.status import LearnerStatus
from rollout_fleet.status import FleetStatus, ServerStatus


class BrokerView(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The broker's status reply in the terms the job uses (see :mod:`launch.broker_view`)."""

    version: int = 0
    queued_groups: int = 0
    leased_groups: int = 0
    queue_bytes: int = 0
    outstanding_tickets: int = 0
    groups_accepted: int = 0
    groups_acked: int = 0
    redelivered_groups: int = 0
    tickets_expired: int = 0
    produce_groups_per_s: float | None = None
    consume_groups_per_s: float | None = None
    drops: dict[str, int] = {}  # groups dropped, by reason
    duplicate_pushes: int = 0  # retried pushes of a group already accepted (not groups)
    errors: dict[str, int] = {}
    engine_lag: dict[str, Any] = {}
    staleness_hist: dict[str, int] = {}
    stale_drop_lengths: dict[str, int] = {}  # rows dropped as stale, by response-length bucket (upper bound)
    from_spool: bool = False  # the broker was gone: these counts were read from its spool


class JobSnapshot(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    fleet: FleetStatus
    learner: LearnerStatus
    broker: BrokerView | None = None  # None while the broker does not answer
    max_steps: int
    max_staleness: int
    simulated: bool
    wall_s: float
    eval_accuracy_before: float | None = None
    eval_accuracy: float | None = None  # the latest evaluation during the run
    mode: str = "disaggregated"  # colocated-sync | shared-async | disaggregated (core/colocate_config.py label)

    @property
    def queue_groups(self) -> int | None:
        return None if self.broker is None else self.broker.queued_groups

    @property
    def servers(self) -> list[ServerStatus]:
        return self.fleet.servers

    def to_wire(self) -> dict[str, Any]:
        """The flat ``status`` answer: fleet, learner and job fields side by side (the learner's win a
        name both have, as the job's do), the broker's view under ``broker``, and the names the answer
        had before it was typed (``queue_groups``, ``groups_produced``, ``groups_dropped``,
        ``fleet_servers``)."""
        job = {f: getattr(self, f) for f in self.__struct_fields__ if f not in ("fleet", "learner")}
        return {
            **msgspec.to_builtins(self.fleet),
            **msgspec.to_builtins(self.learner),
            **msgspec.to_builtins(job),
            "queue_groups": self.queue_groups,
            "groups_produced": self.fleet.groups_pushed,
            "groups_dropped": {} if self.broker is None else dict(self.broker.drops),
            "fleet_servers": msgspec.to_builtins(self.fleet.servers),
        }

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> JobSnapshot:
        """The snapshot in a ``status`` answer; raises ``msgspec.ValidationError`` naming a bad field."""

        def part(t) -> dict[str, Any]:
            return {k: d[k] for k in t.__struct_fields__ if k in d}

        job = {k: d[k] for k in cls.__struct_fields__ if k in d and k not in ("fleet", "learner")}
        return msgspec.convert({**job, "fleet": part(FleetStatus), "learner": part(LearnerStatus)}, cls)
