"""The durable spool: accepted batches in Arrow IPC files, acks and leases in a log.

Layout of a spool directory::

    segments/seg-00000001.arrows   Arrow IPC streams of accepted rows, in arrival order;
                                   each broker start opens a new segment (a torn tail of an
                                   old one, left by kill -9, is never appended to)
    log.bin                        records: [u32 length][u32 crc32][msgpack LogRecord] ...

Write order is what makes restarts exact: the broker writes a batch *before* it
changes its state, and every ack, lease, drop, expiry and version record of a server
loop iteration at that iteration's :meth:`Spool.commit` (one write), *before* any of
its replies (``fsync=always``: each record at once). A crash before the commit loses
only records of requests that were never answered (the client times out and retries:
pushes and acks are idempotent) and of expiries and drops the restarted broker redoes
itself. A record cut short by a crash fails its length or crc check and is ignored,
and the log is truncated there; it was never answered either.

fsync policy (``BrokerConfig.fsync``):

* ``never``: write() only. Survives ``kill -9`` of the broker (the OS holds the
  pages), not a power loss.
* ``batch``: group commit: one fsync of the data and the log per server loop
  iteration, before any reply of that iteration is sent.
* ``always``: fsync after every record.

Segments are kept (not compacted) so a run's trajectories can be exported:
``python -m broker export SPOOL --out x.parquet --steps 3:7``.
"""

from __future__ import annotations

import logging
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pyarrow as pa
import pyarrow.parquet as pq

from broker.protocol import EOS, batch_message, schema_message
from broker.quarantine import Quarantine, batch_problem, record_problem
from broker.schema import TRAJECTORY_SCHEMA

log = logging.getLogger(__name__)

_HEAD = struct.Struct("<II")
_SCHEMA = schema_message(TRAJECTORY_SCHEMA)
assert _SCHEMA is not None  # the trajectory schema has no dictionary columns
_SCHEMA_MSG: bytes = _SCHEMA


class LogRecord(msgspec.Struct, omit_defaults=True):
    kind: str  # lease | ack | expire | drop | version
    lease_id: str = ""
    step: int = 0  # lease/ack: the learner step; version: the version
    consumer_id: str = ""
    group_ids: list[str] = []
    reason: str = ""


_rec_enc = msgspec.msgpack.Encoder()
_rec_dec = msgspec.msgpack.Decoder(LogRecord)


@dataclass
class Recovered:
    batches: list[pa.RecordBatch]
    records: list[LogRecord]
    torn_segments: int = 0
    torn_log_bytes: int = 0
    quarantined: int = 0  # records that failed validation, moved aside (broker.quarantine)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class UndecodableBatch(str):
    """In place of a batch in :func:`read_segment_entries`: a whole message that does not
    decode as a record batch; the text says why."""


def read_segments(root: Path) -> tuple[list[pa.RecordBatch], int]:
    entries, torn = read_segment_entries(root)
    return [b for _, _, _, b in entries if not isinstance(b, UndecodableBatch)], torn


def read_segment_entries(root: Path) -> tuple[list[tuple[Path, int, int, pa.RecordBatch]], int]:
    """(segment, byte offset, message bytes, batch) of every spooled batch, and the torn count.

    Read message by message so each batch's offset is known (quarantine names it)."""
    entries, torn = [], 0
    for path in sorted((root / "segments").glob("seg-*.arrows")):
        try:
            data = pa.memory_map(str(path))
            reader = pa.ipc.MessageReader.open_stream(data)
            first = reader.read_next_message()
            schema = pa.ipc.read_schema(first)
        except (pa.ArrowException, OSError, StopIteration, ValueError):
            torn += 1  # died before the schema was written
            continue
        pos = 8 + first.metadata.size + first.body.size
        while True:
            try:
                msg = reader.read_next_message()
            except StopIteration:
                break
            except (pa.ArrowException, OSError, ValueError):
                torn += 1
                log.warning(
                    "spool segment %s ends in a torn batch at offset %d (crash while writing); ignored", path, pos
                )
                break
            size = 8 + msg.metadata.size + msg.body.size
            try:
                batch = pa.ipc.read_record_batch(msg, schema)
            except (pa.ArrowException, OSError, ValueError) as e:
                # The message is whole (its length prefix and body are there) but its batch
                # does not decode: a damaged record, not a torn tail. Recovery quarantines
                # it and replays the rest of the segment.
                batch = UndecodableBatch(f"bad_arrow: record batch does not decode: {e}")
            entries.append((path, pos, size, batch))
            pos += size
    return entries, torn


def read_log(path: Path) -> tuple[list[LogRecord], int]:
    """Records up to the first torn one, and the byte offset where the good part ends."""
    entries, pos = read_log_entries(path)
    return [rec for _, _, rec in entries], pos


def read_log_entries(path: Path) -> tuple[list[tuple[int, bytes, LogRecord]], int]:
    """(byte offset, record bytes, record) up to the first torn record, and where the good part ends."""
    if not path.exists():
        return [], 0
    data = path.read_bytes()
    out, pos = [], 0
    while pos + _HEAD.size <= len(data):
        length, crc = _HEAD.unpack_from(data, pos)
        body = data[pos + _HEAD.size : pos + _HEAD.size + length]
        if len(body) != length or zlib.crc32(body) != crc:
            break
        try:
            rec = _rec_dec.decode(body)
        except (msgspec.DecodeError, RecursionError):
            break
        out.append((pos, data[pos : pos + _HEAD.size + length], rec))
        pos += _HEAD.size + length
    return out, pos


class Spool:
    """Journal of a BrokerState on disk. Example::

    spool = Spool("/run/spool", fsync="batch")
    recovered = spool.recover()              # before the first write
    state.restore(recovered.batches, recovered.records, now)
    state.journal = spool
    ...; spool.commit()                      # once per loop iteration, before replies
    """

    def __init__(self, root: str | os.PathLike, *, fsync: str = "batch", segment_max_bytes: int = 256 << 20) -> None:
        if fsync not in ("never", "batch", "always"):
            raise ValueError(f"fsync must be one of never|batch|always, got {fsync!r}")
        self.root = Path(root)
        self.fsync = fsync
        self.segment_max_bytes = segment_max_bytes
        (self.root / "segments").mkdir(parents=True, exist_ok=True)
        self._log_path = self.root / "log.bin"
        self._log_fd: int | None = None
        self._sink: pa.OSFile | None = None
        self._data_fd: int | None = None
        self._dirty = False
        self._log_buf: list[bytes] = []  # records not written yet (see commit)
        self.bytes_written = 0
        self.quarantined = 0

    def recover(self) -> Recovered:
        """Everything to replay; records failing validation are quarantined (broker.quarantine)."""
        q = Quarantine(self.root)
        entries, torn = read_segment_entries(self.root)
        batches = []
        for path, offset, size, batch in entries:
            why = batch if isinstance(batch, UndecodableBatch) else batch_problem(batch)
            if why is None:
                batches.append(batch)
            else:
                with open(path, "rb") as fh:
                    fh.seek(offset)
                    q.put(path, offset, fh.read(size), why)
        log_entries, good = read_log_entries(self._log_path)
        records = []
        for offset, raw, rec in log_entries:
            if (why := record_problem(rec)) is None:
                records.append(rec)
            else:
                q.put(self._log_path, offset, raw, why)
        size = self._log_path.stat().st_size if self._log_path.exists() else 0
        if size > good:
            log.warning("spool log has a torn tail of %d bytes (crash while writing); truncated", size - good)
            os.truncate(self._log_path, good)
        self.quarantined = q.count
        return Recovered(batches, records, torn, size - good, q.count)

    # -- writing ---------------------------------------------------------------------------------
    def _open_segment(self) -> None:
        self._close_segment()
        existing = sorted((self.root / "segments").glob("seg-*.arrows"))
        n = int(existing[-1].stem.split("-")[1]) + 1 if existing else 1
        path = self.root / "segments" / f"seg-{n:08d}.arrows"
        self._sink = sink = pa.OSFile(str(path), "wb")
        # An IPC stream written message by message (the schema now, then each batch's
        # encapsulated message, the end marker at close): what pa.ipc.new_stream writes.
        sink.write(_SCHEMA_MSG)
        self._data_fd = os.open(path, os.O_RDONLY)
        self._seg_bytes = len(_SCHEMA_MSG)
        if self.fsync != "never":
            _fsync_dir(self.root / "segments")

    def _close_segment(self) -> None:
        if self._sink is not None:
            self._sink.write(EOS)
            self._sink.close()
            if self._data_fd is not None:
                os.close(self._data_fd)
            self._sink = self._data_fd = None

    def _after_write(self, fd: int) -> None:
        if self.fsync == "always":
            os.fsync(fd)
        else:
            self._dirty = True

    def on_accept(self, batch: pa.RecordBatch, payload=None) -> None:
        """``payload``: the IPC frame ``batch`` was read from, if it holds exactly that batch.
        In the usual form (broker.protocol.batch_message) its record batch message is
        appended as it came, instead of serialising the batch again (a copy of all of it)."""
        if self._sink is None or self._seg_bytes > self.segment_max_bytes:
            self._open_segment()
        sink, data_fd = self._sink, self._data_fd
        assert sink is not None and data_fd is not None  # _open_segment sets both
        msg = None
        if payload is not None:
            msg = batch_message(payload.buffer if hasattr(payload, "buffer") else payload)
        if msg is None:
            if not batch.schema.equals(TRAJECTORY_SCHEMA, check_metadata=True):
                batch = pa.RecordBatch.from_arrays(batch.columns, schema=TRAJECTORY_SCHEMA)
            msg = batch.serialize()  # the encapsulated message a stream writer writes
        sink.write(msg)
        written = msg.nbytes if isinstance(msg, memoryview) else msg.size
        self._seg_bytes += written
        self.bytes_written += written
        self._after_write(data_fd)

    def _append(self, rec: LogRecord) -> None:
        body = _rec_enc.encode(rec)
        self._log_buf.append(_HEAD.pack(len(body), zlib.crc32(body)) + body)
        if self.fsync == "always":
            self._write_log()
        else:
            self._dirty = True

    def _write_log(self) -> None:
        """Write the records gathered since the last call: one syscall per loop iteration
        rather than two or three per batch (its lease and ack)."""
        if not self._log_buf:
            return
        if self._log_fd is None:
            self._log_fd = os.open(self._log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        data = b"".join(self._log_buf) if len(self._log_buf) > 1 else self._log_buf[0]
        self._log_buf.clear()
        os.write(self._log_fd, data)
        self._after_write(self._log_fd)

    def on_lease(self, lease_id: str, step: int, consumer_id: str, group_ids: list[str]) -> None:
        self._append(LogRecord("lease", lease_id=lease_id, step=step, consumer_id=consumer_id, group_ids=group_ids))

    def on_ack(self, lease_id: str, step: int, group_ids: list[str]) -> None:
        self._append(LogRecord("ack", lease_id=lease_id, step=step, group_ids=group_ids))

    def on_expire(self, lease_id: str) -> None:
        self._append(LogRecord("expire", lease_id=lease_id))

    def on_drop(self, reason: str, group_ids: list[str]) -> None:
        self._append(LogRecord("drop", reason=reason, group_ids=group_ids))

    def on_version(self, version: int) -> None:
        self._append(LogRecord("version", step=version))

    def commit(self) -> None:
        """Write the log records gathered, and for ``fsync=batch`` sync data and log (group
        commit): call before sending the replies of a loop iteration."""
        self._write_log()
        if self._dirty and self.fsync == "batch":
            if self._data_fd is not None:
                os.fsync(self._data_fd)
            if self._log_fd is not None:
                os.fsync(self._log_fd)
        self._dirty = False

    def close(self) -> None:
        self.commit()
        self._close_segment()
        if self._log_fd is not None:
            os.close(self._log_fd)
            self._log_fd = None


def export_parquet(root: str | os.PathLike, out: str | os.PathLike, steps: tuple[int, int] | None = None) -> int:
    """Write a spool's rows to Parquet with their fate; returns the row count.

    Adds ``status`` (``acked``, ``dropped:<reason>``, ``pending``) and ``consumed_step``
    (the learner step that acked the row, null otherwise). ``steps=(a, b)`` keeps rows
    whose ``step`` (the admission step) is in ``[a, b)``.
    """
    root = Path(root)
    if not (root / "segments").is_dir():
        raise FileNotFoundError(f"{root} is not a broker spool (no segments/ folder)")
    batches, _ = read_segments(root)
    records, _ = read_log(root / "log.bin")
    fate: dict[str, tuple[str, int | None]] = {}
    for rec in records:
        if rec.kind == "ack":
            fate.update({g: ("acked", rec.step) for g in rec.group_ids})
        elif rec.kind == "drop":
            fate.update({g: (f"dropped:{rec.reason}", None) for g in rec.group_ids})
    table = pa.Table.from_batches(batches, schema=TRAJECTORY_SCHEMA)
    if steps is not None:
        st = table.column("step").to_numpy()
        table = table.filter(pa.array((st >= steps[0]) & (st < steps[1])))
    gids = table.column("group_id").to_pylist()
    status = [fate.get(g, ("pending", None)) for g in gids]
    table = table.append_column("status", pa.array([s for s, _ in status], pa.string()))
    table = table.append_column("consumed_step", pa.array([c for _, c in status], pa.int64()))
    pq.write_table(table, str(out))
    return table.num_rows
