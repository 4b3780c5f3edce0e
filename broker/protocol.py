"""Wire protocol of the broker: typed control messages, framing and error codes.

Every message is a ZMQ multipart message. A client (DEALER) sends::

    [header, *payload]           header: msgpack of one Request struct below
    [multi, header, *payload, header, *payload, ...]
                                 several requests in one message: ``Multi.frames`` gives
                                 each one's frame count (header included)

and the broker (ROUTER, which prepends and strips the peer identity) answers::

    [header, *payload, header, *payload, ...]   one or more replies (Reply structs below)

Replies to one peer that are ready in one loop iteration of the broker go out as one
message. Only ``LeaseReply`` has payload frames (``LeaseReply.frames`` of them), so a
reader splits a message by decoding each header in turn. ``Push`` carries one payload
frame and ``LeaseReply`` one or more, each an Arrow
IPC *stream* (schema message, one or more record batches, end marker) in the
trajectory schema of :mod:`broker.schema`; the lease's rows are the
concatenation of all of them, in order. Every message wakes libzmq's I/O threads on
both sides, which on a busy machine costs more than handling a small request: that is
why clients coalesce the requests of one event-loop turn into one ``Multi``, and the
broker its replies. Each request in a ``Multi`` is handled and answered exactly as if
it had come alone. Frames are sent and received with ``copy=False``
(the clients copy frames under ``broker.client.COPY_BELOW`` into the message all the same),
so Arrow reads the batch straight out of the ZMQ frame. No pickle anywhere.

Every header carries ``proto`` (:data:`PROTOCOL_VERSION`), ``type`` (the tag
of the struct) and ``req`` (a client-chosen id echoed in the reply, so one
socket can have many requests in flight). Decoding is two-step: a tolerant
:class:`Envelope` first (so an old protocol or an unknown type gets a precise
error reply), then the typed decoder of the full union.

Example::

    wire = encode(AcquireTickets(req=7, producer_id="w0", max_groups=4, wait_s=1.0))
    env = decode_envelope(wire)          # Envelope(proto=2, type='acquire', req=7)
    msg = decode_request(wire)           # AcquireTickets(...)

Version 3 (versus 2) adds ``Multi`` and ``LeaseReply.frames``, and replies with payload
are coalesced too. Version 2 (versus 1) saves round trips on the batch path: a ``Push`` may ask for
tickets (``want_tickets``) and its ``PushReply`` carries those granted;
``NextBatch`` carries the consumer's acks of earlier leases (``acks``), applied
before the batch is looked up, and its reply reports them; ``AcquireTickets``
may wait for ``min_groups`` at once.
"""

from __future__ import annotations

import enum
import struct
import typing
from typing import Annotated, Union

import msgspec
import pyarrow as pa
import zmq

from broker import limits as L
from broker.schema import TRAJECTORY_SCHEMA

PROTOCOL_VERSION = 3


class ErrorCode(enum.StrEnum):
    """The ``code`` of an :class:`ErrorReply`; each also counts ``broker/errors_total{code}``."""

    BAD_FRAME = "bad_frame"  # header not msgpack, payload not Arrow IPC, wrong frame count
    UNKNOWN_TYPE = "unknown_type"  # header decodes but its type is not one we know
    OLD_PROTOCOL = "old_protocol"  # proto differs from PROTOCOL_VERSION
    BAD_REQUEST = "bad_request"  # fields of the wrong type or value
    BAD_SCHEMA = "bad_schema"  # batch fails broker.schema.validate_batch
    BAD_ARROW = "bad_arrow"  # batch's Arrow data structurally invalid (offsets, lengths, nulls, UTF-8)
    INCOMPLETE_GROUP = "incomplete_group"  # a push holds part of a group only
    NO_TICKET = "no_ticket"  # no ticket for that step and no room for an unticketed group
    BUSY = "busy"  # byte budget full: retry after retry_after_s (backpressure)
    TOO_LARGE = "too_large"  # a single push larger than the whole byte budget
    LEASE_EXPIRED = "lease_expired"  # ack of a lease whose groups were handed out again
    UNKNOWN_LEASE = "unknown_lease"
    STEP_AHEAD = "step_ahead"  # next_batch for a step past v + k + 1: report_version first (a resumed learner)
    INTERNAL = "internal"  # the broker's own bug, never a client's mistake (logged with its traceback)


class BrokerError(Exception):
    """A request the broker refuses; ``code`` is an :class:`ErrorCode`, sent back in the error reply
    (the server raises it; the clients raise it again from the reply)."""

    def __init__(self, code: str, message: str, retry_after_s: float = 0.0, lease_id: str = "") -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s
        self.lease_id = lease_id  # the lease a refused ack or renew is about


class Envelope(msgspec.Struct):
    """The fields every header has; unknown fields are ignored on purpose."""

    proto: int = -1
    type: str = ""
    req: int = 0


class _Msg(msgspec.Struct, tag_field="type", kw_only=True):
    proto: int = PROTOCOL_VERSION
    req: int = 0


# -- requests ----------------------------------------------------------------------------------
# Field bounds (broker.limits) are part of the types: the decoder refuses a value out of range
# with bad_request naming the field, before any handler or the spool sees it.
Id = Annotated[str, msgspec.Meta(max_length=L.MAX_ID_CHARS)]
WaitS = Annotated[float, msgspec.Meta(ge=0.0, le=L.MAX_WAIT_S)]  # NaN fails both bounds
Count = Annotated[int, msgspec.Meta(ge=1, le=L.MAX_TICKETS_PER_REQUEST)]
Step = Annotated[int, msgspec.Meta(ge=1, le=L.MAX_STEP)]
Version = Annotated[int, msgspec.Meta(ge=0, le=L.MAX_VERSION)]


class AcquireTickets(_Msg, tag="acquire"):
    """Up to ``max_groups`` tickets; the reply waits up to ``wait_s`` until at least
    ``min(min_groups, max_groups)`` can be granted (then returns what there is, maybe none)."""

    producer_id: Id
    max_groups: Count
    wait_s: WaitS = 0.0
    min_groups: Count = 1


class Push(_Msg, tag="push"):
    """One payload frame: an Arrow IPC stream of rows of complete groups. With
    ``want_tickets`` the broker also grants up to that many tickets, without waiting,
    in the reply (none while other producers wait in ``AcquireTickets``: they go first)."""

    producer_id: Id
    want_tickets: Annotated[int, msgspec.Meta(ge=0, le=L.MAX_TICKETS_PER_REQUEST)] = 0


class EngineVersion(_Msg, tag="engine_version"):
    engine_id: Id
    version: Version


class NextBatch(_Msg, tag="next_batch"):
    """``acks``: leases to ack first, in order, exactly as ``Ack`` would. A refused one makes
    the whole reply an ``ErrorReply`` naming it in ``lease_id``: the acks before it are
    applied, those after it are not, and the batch is not looked up."""

    consumer_id: Id
    step: Step
    wait_s: WaitS = 0.0
    acks: Annotated[list[Id], msgspec.Meta(max_length=L.MAX_ACKS)] = []


class Ack(_Msg, tag="ack"):
    consumer_id: Id
    lease_id: Id


class Renew(_Msg, tag="renew"):
    lease_id: Id


class ReportVersion(_Msg, tag="report_version"):
    version: Version


class StatusRequest(_Msg, tag="status"):
    pass


class Ping(_Msg, tag="ping"):
    pass


class Multi(_Msg, tag="multi"):
    """Several requests in one message: ``frames[i]`` frames (header + payload) for the i-th.
    Each is answered on its own (its own ``req``); a ``Multi`` itself gets a reply only when
    its framing is wrong (``bad_frame``, and none of its requests is handled)."""

    frames: list[int]  # counts and their sum are checked by the server (bad_frame)


MAX_MULTI = 4096  # requests in one Multi


Request = Union[AcquireTickets, Push, EngineVersion, NextBatch, Ack, Renew, ReportVersion, StatusRequest, Ping, Multi]
REQUEST_TYPES = {c.__struct_config__.tag: c for c in typing.get_args(Request)}


# -- replies -----------------------------------------------------------------------------------


def min_version(step: int, max_staleness: int) -> int:
    """The oldest weights version a group for learner step ``step`` may be sampled with: trained at step
    ``s`` by the learner at version ``s - 1``, its staleness ``(s - 1) - version`` stays within ``k``. The one
    place this rule is written; the broker stamps it on every ticket, and the workers read it there."""
    return max(0, step - max_staleness - 1)


class Ticket(msgspec.Struct, frozen=True):
    """Permission to start one prompt group for learner step ``step``, sampled by weights of version
    ``min_version`` or newer (:func:`min_version`; 0 from a broker that predates the field)."""

    ticket_id: int
    step: int
    min_version: int = 0


class TicketsReply(_Msg, tag="tickets"):
    tickets: list[Ticket]


class PushReply(_Msg, tag="pushed"):
    groups: int
    rows: int
    duplicates: int = 0  # groups already accepted before (a retried push); not stored twice
    tickets: list[Ticket] = []  # granted for the push's want_tickets


class LeaseReply(_Msg, tag="lease"):
    """``frames`` payload frames follow: Arrow IPC streams whose rows, in order, form the batch.
    ``staleness``: int32 per row, little endian."""

    lease_id: str
    step: int
    groups: int
    staleness: bytes
    frames: int
    acks_duplicate: list[str] = []  # of the request's acks: those acked before
    acks_late: list[str] = []  # of the request's acks: expired, acked late (see AckReply.late)


class NoBatch(_Msg, tag="no_batch"):
    """``wait_s`` passed without ``groups_per_step`` fresh complete groups."""

    queued_groups: int
    acks_duplicate: list[str] = []
    acks_late: list[str] = []


class AckReply(_Msg, tag="acked"):
    duplicate: bool = False  # this lease was acked before (a retried ack)
    late: bool = False  # the lease had expired but none of its groups was handed out again


class StatusReply(_Msg, tag="status_reply"):
    status: dict[str, float]
    drops: dict[str, int]
    errors: dict[str, int]
    engine_lag: dict[str, int]
    staleness_hist: dict[str, int]
    # rows dropped as stale, by response-length bucket (power-of-two upper bound in tokens)
    stale_drop_lengths: dict[str, int] = {}


class OkReply(_Msg, tag="ok"):
    pass


class ErrorReply(_Msg, tag="error"):
    code: str
    message: str
    retry_after_s: float = 0.0
    lease_id: str = ""  # lease_expired / unknown_lease: the lease refused (e.g. one of a NextBatch's acks)


Reply = Union[TicketsReply, PushReply, LeaseReply, NoBatch, AckReply, StatusReply, OkReply, ErrorReply]

_encoder = msgspec.msgpack.Encoder()
_envelope_decoder = msgspec.msgpack.Decoder(Envelope)
_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)


class ProtocolError(Exception):
    """A frame the broker cannot take; ``code`` is an :class:`ErrorCode`."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


# Nesting deeper than this is refused before msgspec sees a header. msgspec recurses once per level, so
# without this the interpreter's recursion limit would be the bound, and torch.compile (in the same process,
# e.g. a test run) raises that limit: a 1,200-deep header then decoded instead of being refused.
MAX_NESTING = 64
_CONTAINERS = frozenset([*range(0x80, 0xA0), 0xDC, 0xDD, 0xDE, 0xDF])
_NOT_CONTAINER = bytes(b for b in range(256) if b not in _CONTAINERS)
# msgpack type byte -> (bytes of the length field, fixed payload bytes) for the scalar types with a length
_SIZED = {
    0xC4: (1, 0),
    0xC5: (2, 0),
    0xC6: (4, 0),
    0xC7: (1, 1),
    0xC8: (2, 1),
    0xC9: (4, 1),
    0xD9: (1, 0),
    0xDA: (2, 0),
    0xDB: (4, 0),
}
_FIXED = {
    0xC0: 0,
    0xC2: 0,
    0xC3: 0,
    0xCA: 4,
    0xCB: 8,
    0xCC: 1,
    0xCD: 2,
    0xCE: 4,
    0xCF: 8,
    0xD0: 1,
    0xD1: 2,
    0xD2: 4,
    0xD3: 8,
    0xD4: 2,
    0xD5: 3,
    0xD6: 5,
    0xD7: 9,
    0xD8: 17,
}


def _nesting_depth(data: bytes) -> int:
    """The deepest container nesting of a msgpack message (iterative; a truncated or malformed message is
    scanned as far as it goes: msgspec reports it)."""
    pos, n, depth, deepest = 0, len(data), 0, 0
    left: list[int] = []  # items still to read in each open container
    while pos < n:
        t = data[pos]
        pos += 1
        items = -1
        if t <= 0x7F or t >= 0xE0:
            pass
        elif t <= 0x8F:
            items = 2 * (t & 0x0F)
        elif t <= 0x9F:
            items = t & 0x0F
        elif t <= 0xBF:
            pos += t & 0x1F
        elif t in _FIXED:
            pos += _FIXED[t]
        elif t in _SIZED:
            k, extra = _SIZED[t]
            pos += k + extra + int.from_bytes(data[pos : pos + k], "big")
        elif t in (0xDC, 0xDE):
            items = int.from_bytes(data[pos : pos + 2], "big") * (2 if t == 0xDE else 1)
            pos += 2
        elif t in (0xDD, 0xDF):
            items = int.from_bytes(data[pos : pos + 4], "big") * (2 if t == 0xDF else 1)
            pos += 4
        else:
            return deepest  # 0xC1 (never used): malformed
        if left:
            left[-1] -= 1
        if items > 0:
            left.append(items)
            depth = len(left)
            deepest = max(deepest, depth)
            if deepest > MAX_NESTING:
                return deepest
        while left and left[-1] == 0:
            left.pop()
    return deepest


def _check_nesting(header: bytes | memoryview) -> None:
    data = bytes(header)
    if len(data.translate(None, _NOT_CONTAINER)) <= MAX_NESTING:
        return  # fewer container type bytes than the limit: it cannot nest deeper
    if _nesting_depth(data) > MAX_NESTING:
        raise ProtocolError(
            ErrorCode.BAD_FRAME, f"header nests msgpack containers too deeply (more than {MAX_NESTING} levels)"
        )


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode_envelope(header: bytes | memoryview) -> Envelope:
    if len(header) > L.MAX_HEADER_BYTES:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"header of {len(header)} bytes; at most {L.MAX_HEADER_BYTES}")
    _check_nesting(header)
    try:
        env = _envelope_decoder.decode(header)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"header is not a msgpack message header: {e}") from None
    except RecursionError:  # msgspec recurses per nesting level, even into fields it skips
        raise ProtocolError(ErrorCode.BAD_FRAME, "header nests msgpack containers too deeply") from None
    return env


def decode_request(header: bytes | memoryview) -> Request:
    """Decode a request header, raising ProtocolError with the precise code."""
    env = decode_envelope(header)
    if env.proto != PROTOCOL_VERSION:
        raise ProtocolError(
            ErrorCode.OLD_PROTOCOL,
            f"protocol version {env.proto} is not supported; this broker speaks {PROTOCOL_VERSION}",
        )
    if env.type not in REQUEST_TYPES:
        raise ProtocolError(
            ErrorCode.UNKNOWN_TYPE, f"unknown message type {env.type!r}; known: {sorted(REQUEST_TYPES)}"
        )
    try:
        return _request_decoder.decode(header)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"bad {env.type!r} message: {e}") from None
    except RecursionError:
        raise ProtocolError(ErrorCode.BAD_FRAME, "header nests msgpack containers too deeply") from None


def decode_reply(header: bytes | memoryview) -> Reply:
    return _reply_decoder.decode(header)


# Plain ints: pyzmq's send_multipart/recv_multipart combine and convert its flag enums in
# Python for every frame (a few microseconds each), which adds up on the batch path.
_NB = int(zmq.NOBLOCK)
_MORE_NB = int(zmq.SNDMORE) | _NB


def send_frames(sock, frames: list) -> None:
    """``sock.send_multipart(frames, zmq.NOBLOCK, copy=False)``, frame by frame with int flags.
    Raises zmq.Again (nothing sent) when the first frame does not fit, like send_multipart."""
    last = len(frames) - 1
    send = sock.send
    for i, f in enumerate(frames):
        send(f, _MORE_NB if i < last else _NB, copy=False)


def recv_frames(sock) -> list:
    """``sock.recv_multipart(zmq.NOBLOCK, copy=False)``, reading each frame's ``more`` flag
    (set by pyzmq's recv) instead of a getsockopt per frame. Raises zmq.Again if none."""
    recv = sock.recv
    f = recv(_NB, copy=False)
    parts = [f]
    while f.more:  # the rest of a multipart message is there already (delivered atomically)
        f = recv(_NB, copy=False)
        parts.append(f)
    return parts


def split_replies(frames: list) -> list[tuple[Reply, list]]:
    """The replies of one message from the broker, each with its payload frames.

    ``frames``: ``zmq.Frame`` objects or bytes. Raises msgspec.DecodeError or
    ValidationError if a header does not decode, ProtocolError if frames are missing."""
    out, i, n = [], 0, len(frames)
    while i < n:
        f = frames[i]
        reply = _reply_decoder.decode(f if isinstance(f, bytes) else f.buffer)
        k = reply.frames if type(reply) is LeaseReply else 0
        if i + 1 + k > n:
            raise ProtocolError(
                ErrorCode.BAD_FRAME, f"reply {reply.req} announces {k} payload frames, the message has {n - i - 1} left"
            )
        out.append((reply, frames[i + 1 : i + 1 + k]))
        i += 1 + k
    return out


EOS = b"\xff\xff\xff\xff\x00\x00\x00\x00"  # end-of-stream marker of the IPC stream format
_WRITE_OPTIONS = pa.ipc.IpcWriteOptions()  # given explicitly: the default reads two env variables per call
_SMALL_IPC = 1 << 20
_schema_messages: dict[pa.Schema, bytes | None] = {}


def schema_message(schema: pa.Schema) -> bytes | None:
    """The stream's schema message, or None if the schema needs dictionary messages."""
    try:
        return _schema_messages[schema]
    except KeyError:
        pass
    msg = None if any(pa.types.is_dictionary(f.type) for f in schema) else schema.serialize().to_pybytes()
    if len(_schema_messages) < 64:
        _schema_messages[schema] = msg
    return msg


def batch_to_ipc(batches: pa.RecordBatch | list[pa.RecordBatch], schema: pa.Schema | None = None) -> pa.Buffer:
    """Serialise record batches as one Arrow IPC stream.

    Small batches are assembled from their encapsulated messages (a fifth of a stream
    writer's fixed cost, which dominates below a megabyte); large ones go through the
    writer, which copies the data once instead of twice.
    """
    if isinstance(batches, pa.RecordBatch):
        batches = [batches]
    schema = schema if schema is not None else batches[0].schema
    if sum(b.nbytes for b in batches) < _SMALL_IPC and all(b.schema.equals(schema) for b in batches):
        head = schema_message(schema)
        if head is not None:
            return pa.py_buffer(b"".join([head, *(b.serialize() for b in batches), EOS]))
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema, options=_WRITE_OPTIONS) as writer:
        for b in batches:
            writer.write_batch(b)
    return sink.getvalue()


_u16, _i32, _u32 = struct.Struct("<H").unpack_from, struct.Struct("<i").unpack_from, struct.Struct("<I").unpack_from


def is_compressed(msg: pa.ipc.Message) -> bool:
    """Whether a record batch message has compressed buffers (its ``compression`` field set).

    Read from the message's flatbuffer (Message.header -> RecordBatch.compression), before
    Arrow decompresses anything: a few kilobytes of zstd can inflate to gigabytes, so the
    broker refuses compressed bodies instead of decompressing and then measuring them.
    Straight-line struct reads (this runs for every pushed batch). Raises struct.error for
    metadata that is not a well-formed flatbuffer."""
    m = msg.metadata.to_pybytes()  # a few hundred bytes; struct reads bytes fastest
    root = _u32(m, 0)[0]
    vt = root - _i32(m, root)[0]  # the table's vtable: u16 size, u16 table size, u16 per field
    f = _u16(m, vt + 8)[0] if _u16(m, vt)[0] > 8 else 0  # Message field 2: header
    if not f:
        return False
    header = root + f + _u32(m, root + f)[0]
    vt = header - _i32(m, header)[0]
    return _u16(m, vt)[0] > 10 and _u16(m, vt + 10)[0] != 0  # RecordBatch field 3: compression


def _check_uncompressed(msg: pa.ipc.Message) -> None:
    try:
        compressed = is_compressed(msg)
    except (struct.error, IndexError, ValueError):
        raise ProtocolError(ErrorCode.BAD_FRAME, "record batch message metadata is not a flatbuffer") from None
    if compressed:
        raise ProtocolError(
            ErrorCode.BAD_FRAME,
            "compressed Arrow IPC bodies are not accepted (the byte budget "
            "counts what the broker holds); send uncompressed batches",
        )


_schemas: dict[bytes, pa.Schema] = {}  # schema message -> schema: producers send one again and again
_head = schema_message(TRAJECTORY_SCHEMA)
assert _head is not None  # the trajectory schema has no dictionary columns
_TRAJ_HEAD_BYTES: bytes = _head
_TRAJ_HEAD = pa.py_buffer(_TRAJ_HEAD_BYTES)
_EOS_BUF = pa.py_buffer(EOS)


def trajectory_to_ipc(batch: pa.RecordBatch) -> pa.Buffer:
    """:func:`batch_to_ipc` of one batch, the same bytes, cheaper for the usual one: a batch
    in exactly the trajectory schema, under a megabyte of buffers. It skips what costs
    most there per call: ``RecordBatch.nbytes`` (a walk over every buffer) and hashing the
    schema to find its message; an equality check against the trajectory schema (metadata
    included) and ``get_total_buffer_size`` (one cheap call) stand in for them. Any other batch goes to :func:`batch_to_ipc`. The broker's producer
    client uses it; ``batch_to_ipc`` is unchanged (bench/broker.py's raw path uses it)."""
    if batch.schema.equals(TRAJECTORY_SCHEMA, check_metadata=True) and batch.get_total_buffer_size() < _SMALL_IPC:
        return pa.py_buffer(b"".join([_TRAJ_HEAD_BYTES, batch.serialize(), EOS]))
    return batch_to_ipc(batch)


def batch_message(buf) -> memoryview | None:
    """The one record batch message of a payload in the usual form (see ipc_to_batches),
    as a view of ``buf``; None for any other payload. The spool appends it to a segment
    as is: the same bytes a stream writer would write for that batch."""
    pb = pa.py_buffer(buf)
    n, h = pb.size, _TRAJ_HEAD.size
    if n > h + 16 and pb.slice(0, h).equals(_TRAJ_HEAD) and pb.slice(n - 8).equals(_EOS_BUF):
        try:
            msg = pa.ipc.read_message(pb.slice(h, n - h - 8))
        except (pa.ArrowException, OSError, ValueError):
            return None
        meta, body = msg.metadata.size, msg.body.size
        # 8-byte aligned parts, so a segment made of such messages stays aligned for readers
        if msg.type == "record batch" and 8 + meta + body == n - h - 8 and meta % 8 == 0 and body % 8 == 0:
            return memoryview(buf)[h : n - 8]
    return None


def ipc_to_batches(buf) -> list[pa.RecordBatch]:
    """Read an Arrow IPC stream without copying (``buf``: anything with the buffer protocol).

    Raises ProtocolError(BAD_FRAME) for anything that is not a well-formed stream of record
    batches: truncated messages, garbage, absurd length prefixes, dictionary messages.
    Reads message by message (a third of the cost of a stream reader for small batches)
    and parses each distinct schema message once. The usual payload, the trajectory
    schema's own message, one record batch and the end marker (what batch_to_ipc writes),
    is recognised by its bytes and read with two calls.
    """
    pb = pa.py_buffer(buf)
    n, h = pb.size, _TRAJ_HEAD.size
    if n > h + 16 and pb.slice(0, h).equals(_TRAJ_HEAD) and pb.slice(n - 8).equals(_EOS_BUF):
        try:
            msg = pa.ipc.read_message(pb.slice(h, n - h - 8))
            if msg.type == "record batch" and 8 + msg.metadata.size + msg.body.size == n - h - 8:
                _check_uncompressed(msg)
                return [pa.ipc.read_record_batch(msg, TRAJECTORY_SCHEMA)]
        except (pa.ArrowException, OSError, ValueError):
            pass  # the general path below names the problem
    try:
        reader = pa.ipc.MessageReader.open_stream(pb)
        try:
            first = reader.read_next_message()
        except StopIteration:
            raise ProtocolError(ErrorCode.BAD_FRAME, "payload is an empty Arrow IPC stream") from None
        if first.type != "schema":
            raise ProtocolError(
                ErrorCode.BAD_FRAME, f"Arrow IPC stream starts with a {first.type!r} message, not a schema"
            )
        key = first.metadata.to_pybytes()
        schema = _schemas.get(key)
        if schema is None:
            schema = pa.ipc.read_schema(first)
            if len(_schemas) < 64:
                _schemas[key] = schema
        out = []
        for msg in reader:
            if msg.type != "record batch":
                raise ProtocolError(ErrorCode.BAD_FRAME, f"unexpected {msg.type!r} message in the Arrow IPC stream")
            _check_uncompressed(msg)
            out.append(pa.ipc.read_record_batch(msg, schema))
        return out
    except (pa.ArrowException, OSError, ValueError) as e:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"payload is not an Arrow IPC stream: {e}") from None
