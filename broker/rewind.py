"""Rewind a stopped broker's spool to a learner checkpoint, so a resumed run trains every group once.

The learner acks a batch after its step is applied, but checkpoints only every N steps, so
when a run dies the spool may hold acks of steps the newest checkpoint (version ``c``) does not
contain: the resumed learner redoes those steps, and their groups must be handed out again.
:func:`rewind` rewrites ``log.bin`` (atomically: a new file, fsynced, renamed over the old) so
that, replayed by the next broker:

* acks, leases and version records of steps ``> c`` are gone: those groups are pending again;
* a lease of a step ``<= c`` that was never acked (the checkpoint was written, the ack was not)
  becomes an ack: its groups are in the checkpoint and must not be trained again;
* a pending group sampled by a policy version ``> c`` (weights the resumed learner never had)
  is dropped with the reason ``rewound_future_version``.

Only for a spool no broker has open. Example::

    report = rewind(Path("runs/x/spool"), version=20)   # {"acks_undone": 3, ...}
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import numpy as np

from broker.spool import _HEAD, LogRecord, _rec_enc, read_log_entries, read_segments

DROP_REASON = "rewound_future_version"


def _frame(rec: LogRecord) -> bytes:
    body = _rec_enc.encode(rec)
    return _HEAD.pack(len(body), zlib.crc32(body)) + body


def rewind(root: Path, version: int) -> dict[str, int]:
    """Rewind the spool at ``root`` to learner version ``version`` (see the module docstring)."""
    log_path = Path(root) / "log.bin"
    entries, _ = read_log_entries(log_path)
    keep: list[bytes] = []
    leases: dict[str, LogRecord] = {}
    closed: set[str] = set()
    done: set[str] = set()
    undone = 0
    for _, raw, rec in entries:
        if rec.kind in ("lease", "ack", "version") and rec.step > version:
            undone += rec.kind == "ack"
            continue
        if rec.kind == "lease":
            leases[rec.lease_id] = rec
        elif rec.kind in ("ack", "expire"):
            closed.add(rec.lease_id)
        if rec.kind in ("ack", "drop"):
            done.update(rec.group_ids)
        keep.append(raw)
    acked_open = 0
    for lid, lease in leases.items():
        if lid not in closed:  # checkpointed, not acked: the checkpoint holds these groups
            keep.append(_frame(LogRecord(kind="ack", lease_id=lid, step=lease.step, group_ids=lease.group_ids)))
            done.update(lease.group_ids)
            acked_open += 1
    future: list[str] = []
    batches, _ = read_segments(Path(root))
    for b in batches:
        gids = b.column("group_id").to_pylist()
        vmax = [int(np.max(v)) for v in b.column("segment_versions").to_pylist()]
        for gid, v in zip(gids, vmax, strict=True):
            if gid not in done and v > version:
                future.append(gid)
                done.add(gid)
    future = list(dict.fromkeys(future))
    if future:
        keep.append(_frame(LogRecord(kind="drop", reason=DROP_REASON, group_ids=future)))
    tmp = log_path.with_suffix(".rewind.tmp")
    with open(tmp, "wb") as f:
        f.write(b"".join(keep))
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(log_path)
    return {"acks_undone": undone, "open_leases_acked": acked_open, "future_groups_dropped": len(future)}
