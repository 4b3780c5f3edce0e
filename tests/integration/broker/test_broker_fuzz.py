"""Fuzzing the broker process: handcrafted frames for each defect of issue 25, and hypothesis
messages of every type with random and extreme field values, with valid traffic alongside.

One broker process (module scope) takes every hostile frame; after each the test checks it
still runs and answers. The valid producer and consumer run a real flow through it the
whole time, and at the end every group they pushed was acked exactly once or dropped with a
counted reason. A second part runs the serve loop in this process and makes every handler
(and each waiter path) raise, to show no exception leaves the loop.
"""

from __future__ import annotations

import threading
import time

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker import protocol as P
from broker.client import SyncConsumer, SyncProducer, get_status, ping
from broker.config import BrokerConfig
from broker.process import BrokerProcess
from broker.server import BrokerServer
from broker.spool import export_parquet
from tests.support.broker_groups import make_groups

pytestmark = pytest.mark.timeout(300)
V = P.PROTOCOL_VERSION


@pytest.fixture(scope="module")
def bp(tmp_path_factory):
    spool = tmp_path_factory.mktemp("fuzz-spool")
    with BrokerProcess(
        groups_per_step=1, max_staleness=2, spool_dir=str(spool), fsync="never", byte_budget_mb=64, lease_timeout_s=30
    ) as b:
        yield b


class Raw:
    """A raw DEALER: frames in, decoded replies out (or None when none came)."""

    def __init__(self, address: str) -> None:
        self.ctx = zmq.Context()
        self.s = self.ctx.socket(zmq.DEALER)
        self.s.setsockopt(zmq.LINGER, 0)
        self.s.connect(address)

    def ask(self, frames: list[bytes], timeout_ms: int = 5000):
        self.s.send_multipart(frames)
        if not self.s.poll(timeout_ms):
            return None
        return P.split_replies(self.s.recv_multipart())

    def drain(self) -> None:
        while self.s.poll(0):
            self.s.recv_multipart()

    def close(self) -> None:
        self.s.close(0)
        self.ctx.term()


@pytest.fixture(scope="module")
def raw(bp):
    r = Raw(bp.address)
    yield r
    r.close()


def hdr(**fields) -> bytes:
    return msgspec.msgpack.encode({"proto": V, "req": 9, **fields})


def ipc(batch: pa.RecordBatch, compression=None) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema, options=pa.ipc.IpcWriteOptions(compression=compression)) as w:
        w.write_batch(batch)
    return sink.getvalue().to_pybytes()


def _zeros(batch: pa.RecordBatch) -> pa.RecordBatch:
    """The batch with all-zero tokens and log-probs: valid, and it compresses ~1000x."""
    for name, typ in (("response_ids", pa.int32()), ("behaviour_logprobs", pa.float32())):
        i = batch.schema.get_field_index(name)
        col = batch.column(i)
        zeros = pa.ListArray.from_arrays(col.offsets, pa.array(np.zeros(len(col.values), typ.to_pandas_dtype())))
        batch = batch.set_column(i, batch.schema.field(i), zeros)
    return batch


def alive(bp) -> None:
    assert bp.proc.poll() is None, "the broker died"
    assert ping(bp.address, timeout_s=5.0), "the broker no longer answers"


def error_code(replies) -> str:
    assert replies, "no reply"
    reply = replies[-1][0]
    assert isinstance(reply, P.ErrorReply), reply
    return reply.code


# -- handcrafted: each defect of issue 25 ---------------------------------------------------------
def test_each_message_that_killed_the_broker_gets_its_error_and_it_keeps_serving(bp, raw):
    deep = b"\x83\xa5proto\x03\xa4type\xa4ping\xa1x" + b"\x91" * 1200 + b"\xc0"
    assert error_code(raw.ask([deep])) == "bad_frame"  # 1 (a)
    assert error_code(raw.ask([hdr(type="report_version", version=2**64 - 1)])) == "bad_request"  # 1 (b)
    replies = raw.ask([hdr(type="acquire", producer_id="evil", max_groups=1)])
    assert isinstance(replies[0][0], P.TicketsReply)  # the acquire that used to die on encode
    v40 = make_groups(["v40"], step=1, version=0)
    i = v40.schema.get_field_index("segment_versions")
    v40 = v40.set_column(i, v40.schema.field(i), pa.array([[2**40]] * 2, pa.list_(pa.int64())))
    assert error_code(raw.ask([hdr(type="push", producer_id="evil"), ipc(v40)])) == "bad_request"  # 1 (c)
    assert error_code(raw.ask([hdr(type="next_batch", consumer_id="evil", step=2**62)])) == "bad_request"  # 3
    for step in (-5, 2**62):  # 3
        push = [hdr(type="push", producer_id="evil"), ipc(make_groups([f"s{step}"], step=step, version=0))]
        assert error_code(raw.ask(push)) == "bad_request"
    good = P.batch_to_ipc(make_groups(["u"], step=1, version=0)).to_pybytes()
    not_utf8 = good.replace(b"traj_id", b"traj\xffid"[:7], 1)  # 4
    multi = [
        hdr(type="multi", frames=[2, 2]),
        hdr(type="push", producer_id="evil"),
        not_utf8,
        hdr(type="push", producer_id="evil"),
        not_utf8,
    ]
    assert [r.code for r, _ in raw.ask(multi)] == ["bad_schema", "bad_schema"]
    big = _zeros(make_groups(["zz"], step=1, version=0, resp_len=200_000))  # 2.4 MB, a few KB compressed
    for _ in range(3):  # 5
        body = ipc(big, "zstd")
        assert len(body) < 200_000
        assert error_code(raw.ask([hdr(type="push", producer_id="evil"), body])) == "bad_frame"
    alive(bp)
    st_ = get_status(bp.address)
    assert st_["status"]["broker/version"] <= 3 and st_["status"]["broker/queue_depth_groups"] == 0
    assert st_["errors"].get("internal", 0) == 0


def test_peer_state_is_bounded():
    from broker import limits as L

    # a broker of its own: the waiters left here would lease (and hold) the other tests' groups
    bp = BrokerProcess(groups_per_step=1, max_staleness=2).start()
    r = Raw(bp.address)
    try:
        for i in range(L.MAX_WAITERS_PER_PEER + 40):  # one peer, unbounded waits: its oldest are answered early
            r.s.send_multipart(
                [
                    msgspec.msgpack.encode(
                        {
                            "proto": V,
                            "req": 1000 + i,
                            "type": "next_batch",
                            "consumer_id": f"w{i}",
                            "step": 1,
                            "wait_s": 600.0,
                        }
                    )
                ]
            )
        early = []
        deadline = time.monotonic() + 10
        while len(early) < 40 and time.monotonic() < deadline:
            if r.s.poll(200):
                early += [x for x, _ in P.split_replies(r.s.recv_multipart())]
        assert len(early) == 40 and all(isinstance(x, P.NoBatch) for x in early)
        assert sorted(x.req for x in early) == list(range(1000, 1040))  # the oldest ones
        for i in range(3000):  # engine ids: bounded, the status reply too
            r.s.send_multipart([hdr(type="engine_version", engine_id=f"e{i}", version=0)])
        r.drain()
        alive(bp)
        st_ = get_status(bp.address, timeout_s=10)
        assert len(st_["engine_lag"]) <= L.MAX_ENGINES
        assert st_["status"]["broker/waiters"] <= L.MAX_WAITERS_PER_PEER + 1
        assert st_["status"]["broker/waiters_evicted_total"] >= 40
    finally:
        r.close()
        bp.stop()


# -- hypothesis: every message type, random and extreme values -------------------------------------
EXTREME_INTS = [-(2**63), -5, -1, 0, 1, 2, 2**31 - 1, 2**31, 2**40, 2**62, 2**63 - 1, 2**64 - 1]
values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.sampled_from(EXTREME_INTS),
        st.integers(-(2**63), 2**64 - 1),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=40),
        st.binary(max_size=40),
        st.just("x" * 1000),
    ),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=5), inner, max_size=3)),
    max_leaves=8,
)
FIELDS = {
    "acquire": ["producer_id", "max_groups", "wait_s", "min_groups"],
    "push": ["producer_id", "want_tickets"],
    "engine_version": ["engine_id", "version"],
    "next_batch": ["consumer_id", "step", "wait_s", "acks"],
    "ack": ["consumer_id", "lease_id"],
    "renew": ["lease_id"],
    "report_version": ["version"],
    "status": [],
    "ping": [],
    "multi": ["frames"],
}


@st.composite
def hostile_message(draw):
    typ = draw(st.sampled_from(sorted(FIELDS) + ["nonsense"]))
    fields = {"proto": draw(st.sampled_from([V, V, V, 0, 2**64 - 1])), "type": typ, "req": draw(st.integers(0, 2**32))}
    for f in FIELDS.get(typ, []):
        if draw(st.booleans()):  # often a plausible value, else anything
            fields[f] = draw(values)
        elif f.endswith("_id"):
            fields[f] = draw(st.text(max_size=8))
        elif f == "wait_s":
            fields[f] = draw(st.sampled_from([0.0, 0.01, 1e300, float("nan"), -1.0]))
        elif f == "acks":
            fields[f] = draw(st.lists(st.text(max_size=6), max_size=3))
        elif f == "frames":
            fields[f] = draw(st.lists(st.sampled_from([0, 1, 2, -1, 2**40]), max_size=3))
        else:
            fields[f] = draw(st.sampled_from(EXTREME_INTS))
    frames = [msgspec.msgpack.encode(fields)]
    if typ == "push" or draw(st.integers(0, 9)) == 0:
        kind = draw(st.sampled_from(["valid", "extreme", "zstd", "garbage", "none", "two"]))
        if kind in ("valid", "extreme", "zstd"):
            int64 = [x for x in EXTREME_INTS if x < 2**63]  # the schema's step is an int64
            step = draw(st.sampled_from([1, 2, 3])) if kind != "extreme" else draw(st.sampled_from(int64))
            version = draw(st.sampled_from([0, 1])) if kind != "extreme" else draw(st.integers(0, 2**63 - 1))
            b = make_groups([f"h{draw(st.integers(0, 10**6))}"], step=step, version=version)
            frames.append(ipc(b, "zstd" if kind == "zstd" else None))
        elif kind == "garbage":
            frames.append(draw(st.binary(max_size=64)))
        elif kind == "two":
            frames += [b"", b"\xff"]
    return frames


@pytest.fixture(scope="module")
def good_flow(bp):
    """A valid producer and consumer running through the broker while the fuzz goes on. They
    follow the broker's version (which the fuzz's valid report_version messages may move, as
    a learner restored from a checkpoint would): rows carry it, the consumer asks for v + 1."""
    pushed, leases, errors, stop = [], [], [], threading.Event()

    def produce():
        prod = SyncProducer(bp.address, producer_id="good", timeout_s=20)
        try:
            n = 0
            while not stop.is_set():
                v = int(get_status(bp.address)["status"]["broker/version"])
                for t in prod.acquire_tickets(2, wait_s=0.2):
                    gid = f"good-{n}"
                    n += 1
                    if prod.push(make_groups([gid], step=t.step, version=v)).groups == 1:
                        pushed.append(gid)
        except Exception as e:  # reported by the test
            errors.append(repr(e))
        finally:
            prod.close()

    def consume():
        cons = SyncConsumer(bp.address, consumer_id="good-learner", timeout_s=20)
        try:
            while not stop.is_set():
                step = int(cons.status()["status"]["broker/version"]) + 1
                try:
                    lease = cons.next_batch(step, wait_s=0.3)
                except P.BrokerError as e:
                    # The fuzz's report_version may move the version between our status read and this
                    # request; step_ahead is then the broker's right answer. Re-read and ask again.
                    if e.code != "step_ahead":
                        raise
                    continue
                if lease is not None:
                    cons.ack(lease.lease_id)
                    leases.append(lease.batch.column("group_id").to_pylist())
        except Exception as e:
            errors.append(repr(e))
        finally:
            cons.close()

    threads = [threading.Thread(target=produce, daemon=True), threading.Thread(target=consume, daemon=True)]
    for t in threads:
        t.start()
    flow = {"pushed": pushed, "leases": leases, "errors": errors, "stop": stop, "threads": threads}
    yield flow
    stop.set()
    for t in threads:
        t.join(30)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(msgs=st.lists(hostile_message(), min_size=1, max_size=6))
def test_random_messages_of_every_type_never_end_the_broker(bp, raw, good_flow, msgs):
    for frames in msgs:
        raw.s.send_multipart(frames)
    raw.drain()
    assert bp.proc.poll() is None, "the broker died"


def test_valid_traffic_alongside_was_delivered_exactly_once(bp, good_flow, tmp_path):
    alive(bp)
    n0 = len(good_flow["leases"])
    deadline = time.monotonic() + 30
    while len(good_flow["leases"]) < n0 + 5 and time.monotonic() < deadline:  # the flow goes on after the fuzz
        time.sleep(0.2)
    good_flow["stop"].set()
    for t in good_flow["threads"]:
        t.join(30)
    assert not good_flow["errors"], good_flow["errors"]
    consumed = [g for gs in good_flow["leases"] for g in set(gs)]  # rows -> groups
    assert len(consumed) == len(set(consumed)), "a group was trained twice"
    assert len(good_flow["leases"]) >= n0 + 5, "the valid flow stalled"
    # the fate of every valid group, from the broker's spool (written before each reply)
    export_parquet(bp.options["spool_dir"], tmp_path / "x.parquet")
    t = pq.read_table(tmp_path / "x.parquet", columns=["group_id", "status"]).to_pylist()
    fate = {r["group_id"]: r["status"] for r in t}
    assert all(g in fate for g in good_flow["pushed"]), "an accepted group is not in the spool"
    assert {g for g in good_flow["pushed"] if fate[g] == "acked"} == set(consumed) & set(good_flow["pushed"])
    assert {fate[g] for g in good_flow["pushed"]} <= {"acked", "dropped:stale", "pending"}
    assert get_status(bp.address)["errors"].get("internal", 0) == 0


# -- every handler raising: the loop survives ------------------------------------------------------
def test_an_exception_in_any_handler_or_waiter_is_an_internal_reply_and_the_loop_goes_on(monkeypatch):
    server = BrokerServer(BrokerConfig(address="tcp://127.0.0.1:0", groups_per_step=1, max_staleness=1))
    address = server.bind()
    stop = threading.Event()
    t = threading.Thread(target=server.serve, args=(stop,), daemon=True)
    t.start()
    r = Raw(address)
    st_ = server.state
    good = P.batch_to_ipc(make_groups(["g"], step=1, version=0)).to_pybytes()
    cases = {  # request -> the method its handler (or its waiter) calls
        "acquire": ([hdr(type="acquire", producer_id="p", max_groups=1)], (st_, "acquire")),
        "push": ([hdr(type="push", producer_id="p"), good], (st_, "accept")),
        "engine_version": ([hdr(type="engine_version", engine_id="e", version=0)], (st_, "set_engine_version")),
        "next_batch": ([hdr(type="next_batch", consumer_id="c", step=1)], (st_, "lease")),
        "ack": ([hdr(type="ack", consumer_id="c", lease_id="x")], (st_, "ack")),
        "renew": ([hdr(type="renew", lease_id="x")], (st_, "renew")),
        "report_version": ([hdr(type="report_version", version=1)], (st_, "set_version")),
        "status": ([hdr(type="status")], (server.ticket_wait, "cumulative")),
        "ping": ([hdr(type="ping")], (P, "OkReply")),
        "lease frames": ([hdr(type="next_batch", consumer_id="c2", step=1)], (server, "_lease_frames_hook")),
    }

    def boom(*a, **kw):
        raise RuntimeError("injected")

    try:
        for name, (frames, (obj, attr)) in cases.items():
            if name == "lease frames":  # a lease ready, its reply fails to build
                r.ask([hdr(type="push", producer_id="p"), good])
                monkeypatch.setattr("broker.server._lease_frames", boom)
            else:
                monkeypatch.setattr(obj, attr, boom)
            replies = r.ask(frames)
            monkeypatch.undo()
            assert replies and replies[-1][0].code == "internal", (name, replies)
            assert "injected" in replies[-1][0].message
            assert t.is_alive(), name
            assert isinstance(r.ask([hdr(type="ping")])[0][0], P.OkReply), name
        assert server.errors["internal"] == len(cases)
    finally:
        r.close()
        stop.set()
        t.join(10)
