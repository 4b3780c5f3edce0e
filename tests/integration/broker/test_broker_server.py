"""The broker process over real sockets: flow, metrics, hostile frames, kill -9 with spool, Curve, backpressure."""

import asyncio
import json
import socket
import subprocess
import sys
import time
import urllib.request

import msgspec
import pyarrow as pa
import pytest
import zmq

from broker import protocol as P
from broker.client import (
    BrokerError,
    BrokerTimeout,
    ConsumerClient,
    ProducerClient,
    SyncConsumer,
    SyncProducer,
    get_status,
    new_event_loop,
    ping,
)
from broker.process import BrokerProcess, make_curve_keys
from tests.support.broker_groups import make_groups

pytestmark = pytest.mark.timeout(90)


def run(coro):
    with asyncio.Runner(loop_factory=new_event_loop) as r:
        return r.run(coro)


@pytest.fixture
def broker(tmp_path):
    procs = []

    def start(**opts):
        bp = BrokerProcess(**opts).start()
        procs.append(bp)
        return bp

    yield start
    for bp in procs:
        bp.stop()


def test_flow_status_and_prometheus_metrics(broker):
    bp = broker(groups_per_step=2, max_staleness=1, metrics_port=0)

    async def flow():
        prod = ProducerClient(bp.address, producer_id="w0", timeout_s=10)
        cons = ConsumerClient(bp.address, consumer_id="learner", timeout_s=10)
        tickets = await prod.acquire_tickets(8, wait_s=1.0)
        assert [t.step for t in tickets] == [1, 1, 2, 2]
        await prod.report_engine_version("sim-0", 0)
        assert (await prod.push(make_groups(["a", "b"], step=1, version=0))).groups == 2
        assert (await prod.push(make_groups(["a"], step=1, version=0))).duplicates == 1
        lease = await cons.next_batch(1, wait_s=2.0)
        assert lease.batch.num_rows == 4 and lease.staleness.tolist() == [0, 0, 0, 0]
        assert set(lease.batch.column("group_id").to_pylist()) == {"a", "b"}
        assert not (await cons.ack(lease.lease_id)).duplicate
        assert (await cons.ack(lease.lease_id)).duplicate
        await prod.push(make_groups(["old"], step=2, version=0))  # will be too stale for step 4
        await prod.push(make_groups(["c", "d"], step=2, version=2))
        await cons.report_version(3)
        t0 = time.monotonic()
        assert await cons.next_batch(5, wait_s=0.3) is None  # only one fresh group... wait, then none
        assert time.monotonic() - t0 >= 0.25
        status = await cons.status()
        await prod.close()
        await cons.close()
        return status

    s = run(flow())
    st = s["status"]
    assert st["broker/produced_groups_total"] == 5 and st["broker/acked_groups_total"] == 2
    assert st["broker/version"] == 4  # next_batch(5) means training at version 4
    assert s["drops"] == {"duplicate": 1, "stale": 3}  # at version 4, k=1: everything left is too old
    assert s["staleness_hist"] == {"0": 4}
    assert s["engine_lag"] == {"sim-0": 4}
    assert st["broker/ticket_wait_seconds_count"] == 1 and st["broker/learner_wait_seconds_count"] == 1
    assert st["broker/queue_depth_groups"] == 0 and st["broker/queue_depth_bytes"] == 0
    time.sleep(0.6)  # the Prometheus view is refreshed twice a second
    text = urllib.request.urlopen(f"http://127.0.0.1:{bp.metrics_port}/metrics", timeout=5).read().decode()
    assert "broker_produced_groups_total 5.0" in text
    assert 'broker_drops_total{reason="stale"} 3.0' in text
    assert 'broker_engine_version_lag{engine="sim-0"} 4.0' in text
    assert 'broker_staleness_versions_bucket{le="0"} 4.0' in text
    out = subprocess.run(
        [sys.executable, "-m", "broker", "status", bp.address], capture_output=True, text=True, timeout=30
    )
    assert json.loads(out.stdout)["status"]["broker/produced_groups_total"] == 5


def _raw(address):
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(address)
    return ctx, s


def _ask(sock, frames):
    sock.send_multipart(frames)
    assert sock.poll(5000), "the broker did not answer a malformed request"
    return P.decode_reply(sock.recv_multipart()[0])


def test_hostile_frames_get_error_replies_and_the_broker_keeps_serving(broker):
    bp = broker(groups_per_step=1, max_staleness=1, max_message_mb=4)
    ctx, s = _raw(bp.address)
    good = P.batch_to_ipc(make_groups(["x"], step=1, version=0)).to_pybytes()
    push = P.encode(P.Push(producer_id="evil"))
    huge_prefix = b"\xff\xff\xff\xff" + (2**31 - 1).to_bytes(4, "little") + b"\x00" * 64
    wrong_schema = P.batch_to_ipc(pa.RecordBatch.from_pydict({"traj_id": ["a"]})).to_pybytes()
    dictionary = P.batch_to_ipc(pa.RecordBatch.from_pydict({"traj_id": pa.array(["a"]).dictionary_encode()}))
    v = P.PROTOCOL_VERSION
    cases = {
        "bad_frame": [
            [b"\x00garbage\xff"],
            [push, good[: len(good) // 2]],
            [push, b"\x93garbage" * 10],
            [push, huge_prefix],
            [push],
            [push, good, good],
            [push, dictionary.to_pybytes()],
            [push, good[good.index(b"\xff\xff\xff\xff", 8) :]],
        ],  # a batch message, no schema
        "unknown_type": [[msgspec.msgpack.encode({"proto": v, "type": "launch_missiles", "req": 5})]],
        "old_protocol": [
            [msgspec.msgpack.encode({"proto": 0, "type": "push", "req": 6})],
            [msgspec.msgpack.encode({"proto": 1, "type": "ack", "req": 6, "consumer_id": "c", "lease_id": "x"})],
        ],  # a version-1 client
        "bad_request": [
            [msgspec.msgpack.encode({"proto": v, "type": "next_batch", "req": 7, "step": "one"})],
            [P.encode(P.Push(producer_id="evil", want_tickets=-1)), good],
        ],
        "bad_schema": [[push, wrong_schema]],
    }
    for code, frames_list in cases.items():
        for frames in frames_list:
            reply = _ask(s, frames)
            assert isinstance(reply, P.ErrorReply) and reply.code == code, (code, reply)
            if code == "old_protocol":
                assert f"this broker speaks {v}" in reply.message
    # TCP garbage that is not even ZMTP, and an oversized message, just lose their connection
    host, port = bp.address.rsplit("/", 1)[1].split(":")
    with socket.create_connection((host, int(port)), timeout=5) as raw:
        raw.sendall(b"GET / HTTP/1.1\r\n\r\n" + bytes(range(256)) * 40)
    s.send_multipart([push, b"\x00" * (5 << 20)])
    s.close(0)
    ctx.term()
    prod = SyncProducer(bp.address, producer_id="good", timeout_s=10)
    cons = SyncConsumer(bp.address, consumer_id="learner", timeout_s=10)
    try:
        assert prod.push(make_groups(["ok"], step=1, version=0)).groups == 1
        lease = cons.next_batch(1, wait_s=2)
        assert lease.batch.column("group_id").to_pylist() == ["ok", "ok"]
        errors = cons.status()["errors"]
        assert errors["bad_frame"] >= 8 and errors["unknown_type"] == 1 and errors["old_protocol"] == 2
        assert errors["bad_schema"] == 1 and errors["bad_request"] == 2
    finally:
        prod.close()
        cons.close()
    assert bp.proc.poll() is None


def test_kill_9_with_spool_loses_nothing_and_returns_nothing_acked(broker, tmp_path):
    spool = tmp_path / "spool"
    bp = broker(groups_per_step=2, max_staleness=4, spool_dir=spool, fsync="never")
    prod = SyncProducer(bp.address, producer_id="w0", timeout_s=10)
    cons = SyncConsumer(bp.address, consumer_id="learner", timeout_s=20)
    try:
        for i in range(5):
            prod.push(make_groups([f"g{2 * i}", f"g{2 * i + 1}"], step=1, version=0))
        acked = cons.next_batch(1, wait_s=2)
        cons.ack(acked.lease_id)
        live = cons.next_batch(2, wait_s=2)  # leased, not acked when the broker dies
        bp.kill()
        bp2 = broker(address=bp.address, groups_per_step=2, max_staleness=4, spool_dir=spool, fsync="never")
        st = get_status(bp2.address)["status"]
        assert st["broker/queue_depth_groups"] == 6 and st["broker/leased_groups"] == 2
        assert not cons.ack(live.lease_id).duplicate  # the ack that races the crash is honoured
        assert cons.ack(acked.lease_id).duplicate
        seen = set(acked.batch.column("group_id").to_pylist()) | set(live.batch.column("group_id").to_pylist())
        for step in (3, 4, 5):
            lease = cons.next_batch(step, wait_s=2)
            gids = set(lease.batch.column("group_id").to_pylist())
            assert not gids & seen
            seen |= gids
            cons.ack(lease.lease_id)
        assert seen == {f"g{i}" for i in range(10)}
        assert cons.next_batch(6, wait_s=0.2) is None
    finally:
        prod.close()
        cons.close()
    bp2.stop()
    out = tmp_path / "all.parquet"
    subprocess.run(
        [sys.executable, "-m", "broker", "export", str(spool), "--out", str(out)],
        check=True,
        timeout=60,
        capture_output=True,
    )
    import pyarrow.parquet as pq

    t = pq.read_table(out)
    assert t.num_rows == 20 and set(t.column("status").to_pylist()) == {"acked"}


def test_backpressure_slows_producers_and_drops_nothing(broker):
    bp = broker(groups_per_step=1, max_staleness=1000, byte_budget_mb=0.25)
    batches = [make_groups([f"g{i}"], step=1, version=0, resp_len=1000, group_size=8) for i in range(12)]
    assert batches[0].nbytes > 60_000  # so 12 of them are > 3x the budget

    async def produce():
        prod = ProducerClient(bp.address, producer_id="w0", timeout_s=3)
        try:
            for b in batches:
                await prod.push(b)
        finally:
            await prod.close()

    with pytest.raises(BrokerError) as e:  # nobody consumes: the producer is held, then told why
        run(produce())
    assert e.value.code == P.ErrorCode.BUSY
    held = get_status(bp.address)["status"]["broker/produced_groups_total"]
    assert 1 <= held < 12

    async def both():
        cons = ConsumerClient(bp.address, consumer_id="learner", timeout_s=10)
        got = []

        async def consume():
            step = 1
            while len(got) < 12:
                lease = await cons.next_batch(step, wait_s=1)
                if lease is not None:
                    got.extend(lease.batch.column("group_id").to_pylist()[::8])
                    await cons.ack(lease.lease_id)
                    step += 1

        prod = ProducerClient(bp.address, producer_id="w0", timeout_s=20)
        await asyncio.gather(consume(), *(prod.push(b) for b in batches))
        await prod.close()
        await cons.close()
        return got

    got = run(both())
    assert sorted(got) == sorted(f"g{i}" for i in range(12))


def test_curve_keys_admit_known_clients_only(broker, tmp_path):
    keys = make_curve_keys(tmp_path / "keys")
    bp = broker(groups_per_step=1, curve_keys_dir=keys)
    assert ping(bp.address, timeout_s=5, curve_keys_dir=str(keys))
    assert not ping(bp.address, timeout_s=1)  # plain text client: no answer
    other = make_curve_keys(tmp_path / "stranger")  # a valid keypair the broker does not know
    (other / "server.key").unlink()
    (other / "server.key").write_bytes((keys / "server.key").read_bytes())
    assert not ping(bp.address, timeout_s=1, curve_keys_dir=str(other))
    prod = SyncProducer(bp.address, producer_id="w0", timeout_s=5, curve_keys_dir=str(keys))
    try:
        assert prod.push(make_groups(["a"], step=1, version=0)).groups == 1
    finally:
        prod.close()


def test_learner_source_and_lease_renewal(broker):
    from learner.broker_source import BrokerSource

    bp = broker(groups_per_step=1, max_staleness=2, lease_timeout_s=1.5)
    prod = SyncProducer(bp.address, producer_id="w0", timeout_s=5)
    src = BrokerSource(bp.address, consumer_id="learner", timeout_s=5, lease_timeout_s=1.5, poll_s=0.2)
    try:
        with pytest.raises(TimeoutError, match="no batch for learner step 1"):
            src.next_batch(1, timeout_s=0.5)
        prod.push(make_groups(["a", "b"], step=1, version=0))
        sb = src.next_batch(1, timeout_s=5)
        time.sleep(2.5)  # longer than the lease timeout: renewal keeps it
        src.report_version(1)
        src.ack(sb.lease_id)
        st = src.status()
        assert st["status"]["broker/redelivered_groups_total"] == 0 and st["status"]["broker/version"] == 1
        assert src.next_batch(2, timeout_s=5).batch.column("group_id").to_pylist()[0] == "b"
    finally:
        prod.close()
        src.close()


def test_client_timeout_names_the_broker():
    port = socket.socket()
    port.bind(("127.0.0.1", 0))
    addr = f"tcp://127.0.0.1:{port.getsockname()[1]}"
    port.close()
    cons = SyncConsumer(addr, consumer_id="x", timeout_s=0.5)
    try:
        with pytest.raises(BrokerTimeout, match=f"broker {addr}: no reply to StatusRequest"):
            cons.status()
    finally:
        cons.close()


def test_a_ctrl_c_at_the_terminal_reaches_the_starter_not_the_broker():
    """SIGINT to the starter's process group (a terminal's Ctrl-C) leaves the broker serving: the
    starter stops it when it is done with it (a launcher's clean stop still needs it)."""
    import os
    import signal

    from broker.client import ping

    code = (
        "import signal, sys; from broker.process import BrokerProcess; "
        "signal.signal(signal.SIGINT, signal.SIG_IGN); bp = BrokerProcess().start(); "
        "print(bp.address, bp.pid, flush=True); sys.stdin.read(); bp.stop()"
    )
    starter = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        address, pid = starter.stdout.readline().split()
        os.killpg(starter.pid, signal.SIGINT)
        time.sleep(1.0)
        assert ping(address, timeout_s=5.0), "the broker stopped on the starter's Ctrl-C"
        assert os.getpgid(int(pid)) == int(pid) != starter.pid
        starter.stdin.close()
        assert starter.wait(30) == 0
        with pytest.raises(ProcessLookupError):
            os.kill(int(pid), 0)
    finally:
        if starter.poll() is None:
            starter.kill()
            starter.wait(10)


def test_cli_rejects_bad_options_with_a_clear_message(tmp_path):
    def cli(*args):
        return subprocess.run([sys.executable, "-m", "broker", *args], capture_output=True, text=True, timeout=60)

    out = cli("--max-stalenes", "2")  # misspelt: an error, never a prefix guess
    assert out.returncode == 2 and "unrecognized arguments: --max-stalenes" in out.stderr
    out = cli("--max-staleness", "-1")
    assert out.returncode == 2 and "broker.max_staleness" in out.stderr and "greater than or equal to 0" in out.stderr
    out = cli("export", str(tmp_path), "--out", str(tmp_path / "x.parquet"))
    assert out.returncode == 2 and "is not a broker spool" in out.stderr


def test_tickets_come_back_with_push_replies_and_waiting_producers_go_first(broker):
    bp = broker(groups_per_step=1, max_staleness=3)  # 4 slots: steps 1..4

    async def go():
        prod = ProducerClient(bp.address, producer_id="w0", timeout_s=5)
        other = ProducerClient(bp.address, producer_id="w1", timeout_s=5)
        cons = ConsumerClient(bp.address, consumer_id="learner", timeout_s=5)
        try:
            [t1] = await prod.acquire_tickets(1, wait_s=0.0)
            reply = await prod.push(make_groups(["a"], step=t1.step, version=0), want_tickets=8)
            assert [t.step for t in reply.tickets] == [2, 3, 4]  # what was free, no more
            # all 4 slots taken: a producer waiting for 2 at once gets nothing until 2 are free
            t0 = time.monotonic()
            assert len(await other.acquire_tickets(4, wait_s=0.3, min_groups=2)) == 0
            assert time.monotonic() - t0 >= 0.25
            waiting = asyncio.ensure_future(other.acquire_tickets(4, wait_s=5.0, min_groups=2))
            lease = await cons.next_batch(1, wait_s=1.0)
            await cons.ack(lease.lease_id)  # one slot free: not enough for the waiter
            await asyncio.sleep(0.2)
            assert not waiting.done()
            for t in reply.tickets[:1]:  # a push frees none: its group takes its ticket's slot
                r = await prod.push(make_groups(["b"], step=t.step, version=0), want_tickets=8)
                assert r.tickets == []  # w1 waits in acquire: it goes first
            lease = await cons.next_batch(2, wait_s=1.0)
            await cons.ack(lease.lease_id)
            assert [t.step for t in await waiting] == [5, 6]  # two at once (w0 still holds steps 3 and 4)
        finally:
            for c in (prod, other, cons):
                await c.close()

    run(go())


def test_acks_ride_on_next_batch_and_an_ack_that_never_comes_lets_the_lease_expire(broker):
    bp = broker(groups_per_step=1, max_staleness=3, lease_timeout_s=1.0)
    prod = SyncProducer(bp.address, producer_id="w0", timeout_s=5)
    cons = SyncConsumer(bp.address, consumer_id="learner", timeout_s=5)
    try:
        for i, t in enumerate(prod.acquire_tickets(4, wait_s=0.0)):
            prod.push(make_groups([f"g{i}"], step=t.step, version=0))
        l1 = cons.next_batch(1, wait_s=1.0)
        assert cons.ack(l1.lease_id, defer=True) is None
        assert cons.status()["status"]["broker/acked_groups_total"] == 0  # not sent yet
        l2 = cons.next_batch(2, wait_s=1.0)  # carries the ack of l1
        st = cons.status()["status"]
        assert st["broker/acked_groups_total"] == 1 and st["broker/version"] == 1
        assert l2.batch.column("group_id")[0].as_py() == "g1"
        # l2's ack is deferred and the consumer "dies" before sending it: the lease expires
        cons.ack(l2.lease_id, defer=True)
        cons.close(flush_acks=False)
        cons = SyncConsumer(bp.address, consumer_id="learner-2", timeout_s=5)
        time.sleep(1.3)
        again = cons.next_batch(2, wait_s=1.0)  # g1 again, under a new lease; nothing lost
        assert again.lease_id != l2.lease_id and again.batch.column("group_id")[0].as_py() == "g1"
        # the old ack arriving now (piggybacked) is refused by name; later acks in the list are kept
        l3 = cons.next_batch(3, wait_s=1.0)
        cons.ack(l2.lease_id, defer=True)
        cons.ack(l3.lease_id, defer=True)
        with pytest.raises(BrokerError) as err:
            cons.next_batch(4, wait_s=1.0)
        assert err.value.code == "lease_expired" and err.value.lease_id == l2.lease_id
        cons.ack(again.lease_id, defer=True)
        l4 = cons.next_batch(4, wait_s=1.0)  # carries l3 (kept) and `again`
        cons.ack(l4.lease_id, defer=True)
        cons.close()  # flushes the deferred ack of l4
        st = get_status(bp.address)["status"]
        assert st["broker/acked_groups_total"] == 4 and st["broker/redelivered_groups_total"] == 1
        assert st["broker/queue_depth_groups"] == 0 and st["broker/leased_groups"] == 0
        assert l4.batch.column("group_id")[0].as_py() == "g3"
    finally:
        prod.close()
        cons.close()


def test_replies_to_one_peer_are_coalesced_and_all_matched(broker):
    bp = broker(groups_per_step=1, max_staleness=1)
    ctx, s = _raw(bp.address)
    try:
        s.send_multipart([P.encode(P.Ping(req=1))])
        s.send_multipart([P.encode(P.Ping(req=2))])
        s.send_multipart([P.encode(P.Ping(req=3))])
        seen, messages = [], 0
        while len(seen) < 3:
            assert s.poll(5000)
            frames = s.recv_multipart()
            messages += 1
            seen += [P.decode_reply(f).req for f in frames]
        assert sorted(seen) == [1, 2, 3] and messages <= 3
    finally:
        s.close(0)
        ctx.term()


def _replies(sock, want: int) -> tuple[dict, int]:
    """Read until ``want`` replies came (however the broker coalesced them): req -> (reply, payload)."""
    got, messages = {}, 0
    while len(got) < want:
        assert sock.poll(5000), f"only {len(got)} of {want} replies came"
        messages += 1
        for reply, payload in P.split_replies(sock.recv_multipart()):
            got[reply.req] = (reply, payload)
    return got, messages


def test_a_multi_is_answered_request_by_request_and_its_pushes_are_checked_together(broker):
    bp = broker(groups_per_step=1, max_staleness=3)
    ctx, s = _raw(bp.address)
    try:
        good = [P.batch_to_ipc(make_groups([g], step=1, version=0)).to_pybytes() for g in ("a", "b", "c")]
        wrong = P.batch_to_ipc(pa.RecordBatch.from_pydict({"traj_id": ["x"]})).to_pybytes()
        dup = P.batch_to_ipc(make_groups(["b"], step=1, version=0)).to_pybytes()  # b again, same rows
        units = [
            [P.encode(P.Push(req=1, producer_id="w")), good[0]],
            [P.encode(P.Push(req=2, producer_id="w")), wrong],
            [P.encode(P.Push(req=3, producer_id="w", want_tickets=1)), good[1]],
            [P.encode(P.Push(req=4, producer_id="w")), dup],
            [P.encode(P.Push(req=5, producer_id="w")), good[2]],
            [P.encode(P.Ping(req=6))],
            [P.encode(P.NextBatch(req=7, consumer_id="c", step=1, wait_s=1.0))],
            [P.encode(P.NextBatch(req=8, consumer_id="c", step=2, wait_s=1.0))],
        ]
        s.send_multipart([P.encode(P.Multi(req=99, frames=[len(u) for u in units]))] + [f for u in units for f in u])
        got, messages = _replies(s, 8)
        assert messages <= 2 and 99 not in got
        assert got[1][0].groups == 1 and got[3][0].groups == 1 and got[5][0].groups == 1
        assert got[2][0].code == P.ErrorCode.BAD_SCHEMA  # refused alone; its neighbours accepted
        assert got[4][0].duplicates == 1 and got[4][0].groups == 0
        assert len(got[3][0].tickets) == 1 and isinstance(got[6][0], P.OkReply)
        leased = []
        for req in (7, 8):  # leases with payload frames, in one message with the others
            reply, payload = got[req]
            assert isinstance(reply, P.LeaseReply) and reply.frames == len(payload) == 1
            leased += P.ipc_to_batches(payload[0])[0].column("group_id").unique().to_pylist()
        assert leased == ["a", "b"]
        # framing errors: counts that do not add up, and a multi inside a multi
        s.send_multipart([P.encode(P.Multi(req=10, frames=[1, 3])), P.encode(P.Ping(req=11)), good[0]])
        assert _replies(s, 1)[0][10][0].code == P.ErrorCode.BAD_FRAME
        inner = P.encode(P.Multi(req=12, frames=[1]))
        s.send_multipart([P.encode(P.Multi(req=13, frames=[1, 1])), inner, P.encode(P.Ping(req=14))])
        got, _ = _replies(s, 2)
        assert got[12][0].code == P.ErrorCode.BAD_REQUEST and isinstance(got[14][0], P.OkReply)
    finally:
        s.close(0)
        ctx.term()


def test_clients_coalesce_and_a_consumer_may_ask_several_steps_ahead(broker, tmp_path):
    bp = broker(groups_per_step=1, max_staleness=7, spool_dir=tmp_path, fsync="never")

    async def go():
        prod = ProducerClient(bp.address, producer_id="w0", timeout_s=10)
        cons = ConsumerClient(bp.address, consumer_id="learner", timeout_s=10)
        try:
            ahead = [asyncio.ensure_future(cons.next_batch(s, wait_s=5.0)) for s in range(1, 5)]
            await asyncio.sleep(0.2)  # all four wait in the broker: the version must only move up
            assert (await cons.status())["status"]["broker/version"] == 3
            tickets = await prod.acquire_tickets(8, wait_s=1.0)
            replies = await asyncio.gather(
                *(prod.push(make_groups([f"g{i}"], step=t.step, version=0)) for i, t in enumerate(tickets[:6]))
            )
            assert [r.groups for r in replies] == [1] * 6
            leases = []
            for fut in ahead:
                leases.append(await fut)
                await cons.ack(leases[-1].lease_id, defer=True)  # each rides on a later request
            more = [asyncio.ensure_future(cons.next_batch(s, wait_s=5.0)) for s in (5, 6)]
            leases += [await f for f in more]
            groups = [x.batch.column("group_id")[0].as_py() for x in leases]
            assert groups == [f"g{i}" for i in range(6)]  # oldest first, each once
            for x in leases[4:]:
                await cons.ack(x.lease_id, defer=True)
            await cons.close()  # sends what is deferred; no ack was sent twice
            st = get_status(bp.address)
            assert st["status"]["broker/acked_groups_total"] == 6 and st["status"]["broker/version"] == 6
            assert st["status"]["broker/duplicate_acks_total"] == 0 and not st["errors"]
        finally:
            await prod.close()
            await cons.close()

    run(go())
    from broker.spool import read_log

    versions = [r.step for r in read_log(tmp_path / "log.bin")[0] if r.kind == "version"]
    assert versions == sorted(versions) and versions[-1] == 6  # never back, while four requests waited


def test_broker_serves_over_a_unix_socket(broker, tmp_path):
    """``bench/broker.py --transport ipc`` runs the broker on an ipc:// address (raw PUSH/PULL
    too): the same requests, a whole group pushed alone handed on as the frame it came in."""
    bp = broker(address=f"ipc://{tmp_path}/broker.sock", groups_per_step=1, max_staleness=0)
    assert bp.address == f"ipc://{tmp_path}/broker.sock"

    async def flow():
        prod = ProducerClient(bp.address, producer_id="w0", timeout_s=10)
        cons = ConsumerClient(bp.address, consumer_id="learner", timeout_s=10)
        [t] = await prod.acquire_tickets(4, wait_s=1.0)
        sent = make_groups(["u"], step=t.step, version=0, group_size=3, resp_len=50)
        assert (await prod.push(sent)).groups == 1
        lease = await cons.next_batch(1, wait_s=2.0)
        await cons.ack(lease.lease_id)
        await prod.close()
        await cons.close()
        return sent, lease

    sent, lease = run(flow())
    assert lease.batch.equals(sent)


def test_a_burst_of_signals_stops_the_broker():
    """SIGTERMs and SIGINTs back to back (a parent's death signal and a shutdown's at once): the broker
    still stops, within its stop timeout. A handler that took a lock (threading.Event.set) could be
    interrupted inside it by the next signal, whose handler then waited on that lock forever: a broker
    left serving its port and spool after its driver was gone (core/signals.py)."""
    import os
    import signal

    from broker.process import BrokerProcess

    for _ in range(3):
        bp = BrokerProcess(die_with_parent=False).start()
        try:
            for i in range(400):
                os.kill(bp.pid, signal.SIGTERM if i % 2 else signal.SIGINT)
            bp.proc.wait(15)  # raises TimeoutExpired if it hangs
            assert bp.proc.returncode == 0, bp.proc.returncode
        finally:
            bp.kill()
