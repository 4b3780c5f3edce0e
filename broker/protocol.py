"""Wire protocol of the broker: typed control messages, framing and error codes.

Every message is a ZMQ multipart message. A client (DEALER) sends::

    [header, *payload]           header: msgpack of one Request struct below

and the broker (ROUTER, which prepends and strips the peer identity) answers::

    [header, *payload]           header: msgpack of one Reply struct below

``Push`` carries one payload frame and ``LeaseReply`` one or more, each an Arrow
IPC *stream* (schema message, one or more record batches, end marker) in the
trajectory schema of :mod:`broker.schema`; the lease's rows are the
concatenation of all of them, in order. Frames are sent and received with ``copy=False``,
so Arrow reads the batch straight out of the ZMQ frame. No pickle anywhere.

Every header carries ``proto`` (:data:`PROTOCOL_VERSION`), ``type`` (the tag
of the struct) and ``req`` (a client-chosen id echoed in the reply, so one
socket can have many requests in flight). Decoding is two-step: a tolerant
:class:`Envelope` first (so an old protocol or an unknown type gets a precise
error reply), then the typed decoder of the full union.

Example::

    wire = encode(AcquireTickets(req=7, producer_id="w0", max_groups=4, wait_s=1.0))
    env = decode_envelope(wire)          # Envelope(proto=1, type='acquire', req=7)
    msg = decode_request(wire)           # AcquireTickets(...)
"""

from __future__ import annotations

from typing import Union

import msgspec
import pyarrow as pa

PROTOCOL_VERSION = 1


class ErrorCode:
    """The ``code`` of an :class:`ErrorReply`; each also counts ``broker/errors_total{code}``."""

    BAD_FRAME = "bad_frame"  # header not msgpack, payload not Arrow IPC, wrong frame count
    UNKNOWN_TYPE = "unknown_type"  # header decodes but its type is not one we know
    OLD_PROTOCOL = "old_protocol"  # proto differs from PROTOCOL_VERSION
    BAD_REQUEST = "bad_request"  # fields of the wrong type or value
    BAD_SCHEMA = "bad_schema"  # batch fails broker.schema.validate_batch
    INCOMPLETE_GROUP = "incomplete_group"  # a push holds part of a group only
    NO_TICKET = "no_ticket"  # no ticket for that step and no room for an unticketed group
    BUSY = "busy"  # byte budget full: retry after retry_after_s (backpressure)
    TOO_LARGE = "too_large"  # a single push larger than the whole byte budget
    LEASE_EXPIRED = "lease_expired"  # ack of a lease whose groups were handed out again
    UNKNOWN_LEASE = "unknown_lease"
    INTERNAL = "internal"

    ALL = (BAD_FRAME, UNKNOWN_TYPE, OLD_PROTOCOL, BAD_REQUEST, BAD_SCHEMA, INCOMPLETE_GROUP,
           NO_TICKET, BUSY, TOO_LARGE, LEASE_EXPIRED, UNKNOWN_LEASE, INTERNAL)


class Envelope(msgspec.Struct):
    """The fields every header has; unknown fields are ignored on purpose."""

    proto: int = -1
    type: str = ""
    req: int = 0


class _Msg(msgspec.Struct, tag_field="type", kw_only=True):
    proto: int = PROTOCOL_VERSION
    req: int = 0


# -- requests ----------------------------------------------------------------------------------

class AcquireTickets(_Msg, tag="acquire"):
    producer_id: str
    max_groups: int
    wait_s: float = 0.0


class Push(_Msg, tag="push"):
    """One payload frame: an Arrow IPC stream of rows of complete groups."""

    producer_id: str


class EngineVersion(_Msg, tag="engine_version"):
    engine_id: str
    version: int


class NextBatch(_Msg, tag="next_batch"):
    consumer_id: str
    step: int
    wait_s: float = 0.0


class Ack(_Msg, tag="ack"):
    consumer_id: str
    lease_id: str


class Renew(_Msg, tag="renew"):
    lease_id: str


class ReportVersion(_Msg, tag="report_version"):
    version: int


class StatusRequest(_Msg, tag="status"):
    pass


class Ping(_Msg, tag="ping"):
    pass


Request = Union[AcquireTickets, Push, EngineVersion, NextBatch, Ack, Renew, ReportVersion, StatusRequest, Ping]
REQUEST_TYPES = {c.__struct_config__.tag: c for c in Request.__args__}


# -- replies -----------------------------------------------------------------------------------

class Ticket(msgspec.Struct, frozen=True):
    """Permission to start one prompt group for learner step ``step``."""

    ticket_id: int
    step: int


class TicketsReply(_Msg, tag="tickets"):
    tickets: list[Ticket]


class PushReply(_Msg, tag="pushed"):
    groups: int
    rows: int
    duplicates: int = 0  # groups already accepted before (a retried push); not stored twice


class LeaseReply(_Msg, tag="lease"):
    """Payload frames: Arrow IPC streams whose rows, in order, form the batch.
    ``staleness``: int32 per row, little endian."""

    lease_id: str
    step: int
    groups: int
    staleness: bytes


class NoBatch(_Msg, tag="no_batch"):
    """``wait_s`` passed without ``groups_per_step`` fresh complete groups."""

    queued_groups: int


class AckReply(_Msg, tag="acked"):
    duplicate: bool = False  # this lease was acked before (a retried ack)
    late: bool = False  # the lease had expired but none of its groups was handed out again


class StatusReply(_Msg, tag="status_reply"):
    status: dict[str, float]
    drops: dict[str, int]
    errors: dict[str, int]
    engine_lag: dict[str, int]
    staleness_hist: dict[str, int]


class OkReply(_Msg, tag="ok"):
    pass


class ErrorReply(_Msg, tag="error"):
    code: str
    message: str
    retry_after_s: float = 0.0


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


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode_envelope(header: bytes | memoryview) -> Envelope:
    try:
        env = _envelope_decoder.decode(header)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"header is not a msgpack message header: {e}") from None
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


def decode_reply(header: bytes | memoryview) -> Reply:
    return _reply_decoder.decode(header)


def batch_to_ipc(batches: pa.RecordBatch | list[pa.RecordBatch], schema: pa.Schema | None = None) -> pa.Buffer:
    """Serialise record batches as one Arrow IPC stream (one copy of the data)."""
    if isinstance(batches, pa.RecordBatch):
        batches = [batches]
    schema = schema if schema is not None else batches[0].schema
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema) as writer:
        for b in batches:
            writer.write_batch(b)
    return sink.getvalue()


def ipc_to_batches(buf) -> list[pa.RecordBatch]:
    """Read an Arrow IPC stream without copying (``buf``: anything with the buffer protocol).

    Raises ProtocolError(BAD_FRAME) for anything that is not a well-formed stream:
    truncated messages, garbage, absurd length prefixes.
    """
    try:
        reader = pa.ipc.open_stream(pa.py_buffer(buf))
        return list(reader)
    except (pa.ArrowException, OSError, ValueError) as e:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"payload is not an Arrow IPC stream: {e}") from None
