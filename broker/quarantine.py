"""Replay that cannot be poisoned: spool records that fail validation are moved aside, not replayed.

A spool written by this broker holds only validated batches and bounded records, but a spool
may come from an older broker (which spooled values that killed it at the next lease), or be
damaged on disk in a way its crc does not catch (a segment has none). On recovery every
batch of a segment gets the checks a push gets (schema, whole groups, steps and versions in
range) and every log record the bounds of :mod:`broker.limits`; one that fails is copied to
``<spool>/quarantine/<file>@<offset>.bin`` (once: a restart finds it again and only counts
it), logged with its file and byte offset, counted (``broker/spool_quarantined_total``), and
left out of the replay. Everything else is replayed as before.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pyarrow as pa

from broker import limits as L
from broker.groups import split_groups
from broker.protocol import BrokerError
from broker.schema import ArrowDataError, SchemaError, inspect_batch

log = logging.getLogger(__name__)

LOG_KINDS = ("lease", "ack", "expire", "drop", "version")


def batch_problem(batch: pa.RecordBatch) -> str | None:
    """Why a spooled batch must not be replayed, or None if it is fine."""
    try:
        view = inspect_batch(batch)
        groups = split_groups(batch, None, view)
    except ArrowDataError as e:
        return f"bad_arrow: {e}"
    except SchemaError as e:
        return f"bad_schema: {e}"
    except BrokerError as e:
        return f"{e.code}: {e.message}"
    for g in groups:
        if not 1 <= g.label <= L.MAX_STEP:
            return f"group {g.group_id!r}: step {g.label} outside 1..{L.MAX_STEP}"
        if g.vmax > L.MAX_VERSION:
            return f"group {g.group_id!r}: policy version {g.vmax} above {L.MAX_VERSION}"
        if len(g.group_id) > L.MAX_ID_CHARS:
            return f"group id of {len(g.group_id)} characters (at most {L.MAX_ID_CHARS})"
    return None


def record_problem(rec) -> str | None:
    """Why a spool log record must not be replayed, or None if it is fine."""
    if rec.kind not in LOG_KINDS:
        return f"unknown record kind {rec.kind!r}"
    if rec.kind == "version":
        if not 0 <= rec.step <= L.MAX_VERSION:
            return f"version {rec.step} outside 0..{L.MAX_VERSION}"
    elif rec.kind in ("lease", "ack") and not 1 <= rec.step <= L.MAX_STEP:
        return f"{rec.kind} of step {rec.step} outside 1..{L.MAX_STEP}"
    if len(rec.lease_id) > L.MAX_ID_CHARS or len(rec.consumer_id) > L.MAX_ID_CHARS:
        return "id longer than the broker accepts"
    return None


class Quarantine:
    """Moves bad spool records aside (see the module docstring). ``count``: records held
    back in this recovery."""

    def __init__(self, root: str | Path) -> None:
        self.dir = Path(root) / "quarantine"
        self.count = 0

    def put(self, source: Path, offset: int, data: bytes, reason: str) -> None:
        self.count += 1
        self.dir.mkdir(exist_ok=True)
        path = self.dir / f"{source.name}@{offset}.bin"
        if not path.exists():
            path.write_bytes(data)
            (self.dir / f"{source.name}@{offset}.reason.txt").write_text(reason + "\n")
        log.warning(
            "spool record at %s offset %d quarantined (copied to %s), not replayed: %s",
            source,
            offset,
            path,
            reason[:300],
        )
