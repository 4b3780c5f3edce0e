"""How a publish is acknowledged: through the group (an all-gather of checksums) or by each engine's RPC answer.

Real processes and sockets: the publisher (rank 0, gloo) runs in this process,
and the receivers are standalone receiver processes (``python -m
weight_sync.receiver``). One of them is started with ``--corrupt-tensor``: it flips
a bit of one tensor of every publish as it lands, the way a bad transfer or load
would. Both ack paths must catch that receiver, drop it, and go on with the rest.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest
import torch
from health import wait_healthy  # tests/support (pyproject: pytest pythonpath)
from receiver_procs import start_receiver
from safetensors.torch import load_file

from core.http_client import EngineError, free_port
from weight_sync.config import WeightSyncConfig
from weight_sync.plan import build_plan
from weight_sync.publisher import Publisher, PublishError
from weight_sync.receiver_client import ReceiverClient

BAD_TENSOR = "layers.1.w"

pytestmark = pytest.mark.timeout(180)


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    state = {"embed": torch.randn(300, 64, generator=g)}
    for i in range(3):
        state[f"layers.{i}.w"] = torch.randn(64, 96, generator=g).to(torch.bfloat16)
        state[f"layers.{i}.b"] = torch.randn(96, generator=g)
    return state


@pytest.fixture(scope="module")
def receivers(tmp_path_factory):
    """url of the good receiver and of the one that corrupts ``BAD_TENSOR``."""
    tmp = tmp_path_factory.mktemp("acks")
    procs, urls = [], {}
    try:
        for eid, extra in (("good", []), ("bad", ["--corrupt-tensor", BAD_TENSOR])):
            proc, urls[eid] = start_receiver(eid, tmp, *extra)
            procs.append(proc)
        for proc, (eid, url) in zip(procs, urls.items(), strict=True):
            wait_healthy(url, proc, tmp / f"{eid}.log", f"receiver {eid}")
        yield urls, tmp
    finally:
        for p in procs:
            p.kill()
            p.wait(10)


def _publisher(urls: dict[str, str], acks: str, names: tuple[str, ...]) -> tuple[Publisher, dict]:
    state = _state(0)
    # 8 KiB buckets: several of them, so the acks follow a pipelined publish
    plan = build_plan([(n, list(t.shape), t.dtype) for n, t in state.items()], 8 << 10)
    assert len(plan.buckets) > 3
    clients = {n: ReceiverClient(n, urls[n], timeout_s=15) for n in names}
    # bucket_mb (16 KiB) sets how many small buckets the publisher sends as one group: here the last two
    pub = Publisher(
        WeightSyncConfig(backend="gloo", timeout_s=15, acks=acks, bucket_mb=16 / 1024),
        plan,
        engines=list(clients.values()),
    )
    return pub, clients


def _dump(pub: Publisher, client: ReceiverClient, path: Path) -> dict[str, torch.Tensor]:
    pub.call(client.dump(str(path)), 15, f"dump {client.engine_id}")
    return load_file(str(path))


def _assert_bit_identical(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, w in want.items():
        assert torch.equal(got[name].view(torch.uint8), w.view(torch.uint8)), name


@pytest.mark.parametrize("acks", ["group", "rpc"])
def test_both_ack_paths_publish_bit_identical_and_settle(receivers, tmp_path, acks):
    urls, _ = receivers
    pub, clients = _publisher(urls, acks, ("good",))
    try:
        for version in (1, 2):
            state = _state(version)
            report = pub.publish(version, iter(state.items()))
            assert pub.group_acks == (acks == "group")
            # the last two buckets fit in 16 KiB together: packed into one send slot and sent as one group
            assert pub._ring.groups[-1] == [len(pub.plan.buckets) - 2, len(pub.plan.buckets) - 1], pub._ring.groups
            assert len(pub._ring.groups) > 2
            assert report.per_engine_checksums == {"good": report.checksum}
            assert pub.settle() == {}, "the engine's RPC answer must agree with its ack"
            assert clients["good"].weight_version == version
            _assert_bit_identical(_dump(pub, clients["good"], tmp_path / f"v{version}.safetensors"), state)
    finally:
        pub.close()


@pytest.mark.parametrize("acks", ["group", "rpc"])
def test_corrupted_receiver_is_caught_dropped_and_the_rest_go_on(receivers, tmp_path, acks):
    urls, _ = receivers
    pub, clients = _publisher(urls, acks, ("good", "bad"))
    try:
        with pytest.raises(PublishError) as err:
            pub.publish(1, iter(_state(1).items()))
        assert err.value.blamed == ["bad"], str(err.value)
        assert "checksum mismatch" in str(err.value) and "engine bad" in str(err.value)
        if acks == "group":
            assert "group acks" in str(err.value)
        # The good receiver got the same bytes; the next publish goes to it alone, in a new epoch.
        state = _state(2)
        report = pub.publish(2, iter(state.items()))
        assert report.engines == ["good"] and report.epoch == 2
        assert pub.settle() == {}
        _assert_bit_identical(_dump(pub, clients["good"], tmp_path / "good_v2.safetensors"), state)
    finally:
        pub.close()


def test_group_acks_need_every_engine_to_support_them(receivers):
    urls, _ = receivers

    class RpcOnly(ReceiverClient):
        supports_group_acks = False

    state = _state(3)
    plan = build_plan([(n, list(t.shape), t.dtype) for n, t in state.items()], 8 << 10)
    pub = Publisher(
        WeightSyncConfig(backend="gloo", timeout_s=15), plan, engines=[RpcOnly("good", urls["good"], timeout_s=15)]
    )
    try:
        report = pub.publish(1, iter(state.items()))
        assert not pub.group_acks, "an engine without group acks makes the epoch ack by RPC"
        assert report.per_engine_checksums == {"good": report.checksum}
    finally:
        pub.close()


def test_send_update_to_a_dead_receiver_fails_its_future_naming_it():
    """The request written from the publishing thread: a receiver that is gone fails the returned future (the
    publisher then blames that engine), it does not raise in the publisher's thread."""
    client = ReceiverClient("gone", f"http://127.0.0.1:{free_port()}", timeout_s=2)
    fut = client.send_update(3, "some-plan")
    with pytest.raises(EngineError, match=r"engine gone: sending /update_weights\(v3\) failed"):
        fut.result(5)
    asyncio.run(client.close())


def test_an_unanswered_send_update_ends_when_the_client_closes():
    """A receiver that takes the request and never answers: the answer's reader waits (bounded by the
    connection's timeout) until the client closes, which wakes it with an error rather than leaving a thread
    blocked until the timeout."""
    import socket

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    try:
        client = ReceiverClient("mute", f"http://127.0.0.1:{srv.getsockname()[1]}", timeout_s=30)
        fut = client.send_update(1, "some-plan")
        conn, _ = srv.accept()
        time.sleep(0.2)
        assert not fut.done(), "nothing answered yet"
        t0 = time.monotonic()
        asyncio.run(client.close())
        with pytest.raises(EngineError, match=r"engine mute: /update_weights\(v1\) failed"):
            fut.result(5)
        assert time.monotonic() - t0 < 5
        conn.close()
    finally:
        srv.close()


@pytest.mark.parametrize("acks", ["group", "rpc"])
def test_a_frozen_receiver_fails_the_publish_at_the_timeout_naming_it(receivers, tmp_path, acks):
    """A receiver that hangs (SIGSTOP: alive, its sockets open, answering nothing) after joining: the publish
    waits at most its step timeout, names the frozen engine (it fails its health probe, the good one passes),
    and the next publish goes to the good receiver alone in a new epoch. Nothing waits without a limit."""
    import signal

    urls, _ = receivers
    frozen, url = start_receiver("frozen", tmp_path)
    try:
        wait_healthy(url, frozen, tmp_path / "frozen.log", "receiver frozen")
        state = _state(4)
        plan = build_plan([(n, list(t.shape), t.dtype) for n, t in state.items()], 8 << 10)
        good, stuck = ReceiverClient("good", urls["good"], timeout_s=15), ReceiverClient("frozen", url, timeout_s=15)
        pub = Publisher(WeightSyncConfig(backend="gloo", timeout_s=3, acks=acks), plan, engines=[good, stuck])
        try:
            pub.rebuild()  # both join; then one of them stops answering anything
            os.kill(frozen.pid, signal.SIGSTOP)
            t0 = time.monotonic()
            with pytest.raises(PublishError) as err:
                pub.publish(1, iter(state.items()))
            took = time.monotonic() - t0
            assert err.value.blamed == ["frozen"], str(err.value)
            assert "engine frozen" in str(err.value) and "health probe" in str(err.value), str(err.value)
            assert took < 30, f"the publish took {took:.1f}s with a 3 s step timeout"
            report = pub.publish(2, iter(state.items()))
            assert report.engines == ["good"] and report.epoch == 2
            assert pub.settle() == {}
            _assert_bit_identical(_dump(pub, good, tmp_path / "good_v2.safetensors"), state)
        finally:
            pub.close()
    finally:
        frozen.kill()  # SIGKILL ends a stopped process too
        frozen.wait(10)
