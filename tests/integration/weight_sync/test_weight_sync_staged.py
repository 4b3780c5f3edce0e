"""Staged publishes (``weight_sync.staging``) on CPU: a publisher over gloo into standalone receiver processes.

A staged receiver posts its receives into standing buffers at ``begin_update`` and
loads them only at ``commit_update``; these tests check that the bytes still arrive
bit-identical, that the buffers are reused across publishes without mixing versions,
and that a receiver that dies between the two phases fails the publish fast, named,
while the survivor takes the next publish.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
import torch
from health import wait_healthy  # tests/integration
from receiver_procs import start_receiver
from safetensors.torch import load_file

from weight_sync.config import WeightSyncConfig
from weight_sync.plan import build_plan
from weight_sync.publisher import Publisher, PublishError
from weight_sync.receiver_client import ReceiverClient

pytestmark = pytest.mark.timeout(180)


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.w": torch.randn(256, 512, generator=g).to(torch.bfloat16) for i in range(6)} | {
        "norm.weight": torch.randn(512, generator=g),
        "head.bias": torch.randn(300, generator=g),
    }


@pytest.fixture(scope="module")
def receivers(tmp_path_factory):  # shared; the kill test, last in this file, ends s1
    tmp_path = tmp_path_factory.mktemp("staged")
    procs, urls = {}, {}
    for eid in ("s0", "s1"):
        procs[eid], urls[eid] = start_receiver(eid, tmp_path)
    for eid, url in urls.items():
        wait_healthy(url, procs[eid], tmp_path / f"{eid}.log", f"receiver {eid}")
    yield procs, urls
    for p in procs.values():
        if p.poll() is None:
            p.kill()
            p.wait(10)


def _dump(pub: Publisher, eid: str, path: Path) -> dict[str, torch.Tensor]:
    client = pub.engines[eid]
    pub.call(client.dump(str(path)), 30, f"dump {eid}")
    return load_file(str(path))


def _identical(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for k, w in want.items():
        assert torch.equal(got[k].view(torch.uint8), w.view(torch.uint8)), f"{k} differs from the publisher's"


def test_staged_publish_bit_identical_and_buffers_reused(receivers, tmp_path):
    _, urls = receivers
    s1, s2 = _state(1), _state(2)
    plan = build_plan([(k, v.shape, v.dtype) for k, v in s1.items()], bucket_bytes=300 * 1024)
    assert len(plan.buckets) > 3, "several buckets, so several staged receives are posted at once"
    pub = Publisher(
        WeightSyncConfig(backend="gloo", staging=True, timeout_s=20),
        plan,
        engines=[ReceiverClient(eid, url, timeout_s=20) for eid, url in urls.items()],
    )
    try:
        r1 = pub.publish(1, s1.items())
        for eid in urls:
            _identical(_dump(pub, eid, tmp_path / f"{eid}_v1.safetensors"), s1)
        r2 = pub.publish(2, s2.items())
        for eid in urls:
            _identical(_dump(pub, eid, tmp_path / f"{eid}_v2.safetensors"), s2)
    finally:
        pub.close()
    assert r1.per_engine_checksums == {eid: r1.checksum for eid in urls}
    assert r2.per_engine_checksums == {eid: r2.checksum for eid in urls} and r2.checksum != r1.checksum


def test_receiver_killed_between_stage_and_commit_is_named_and_survivor_continues(receivers, tmp_path):
    procs, urls = receivers
    s1, s2 = _state(3), _state(4)
    plan = build_plan([(k, v.shape, v.dtype) for k, v in s1.items()], bucket_bytes=300 * 1024)
    pub = Publisher(
        WeightSyncConfig(backend="gloo", staging=True, timeout_s=20),
        plan,
        engines=[ReceiverClient(eid, url, timeout_s=20) for eid, url in urls.items()],
    )

    def killing(state):  # s1 dies once its receives are posted, before any byte is sent
        time.sleep(0.5)
        procs["s1"].send_signal(signal.SIGKILL)
        procs["s1"].wait(10)
        yield from state.items()

    try:
        pub.publish(1, s1.items())
        t0 = time.perf_counter()
        with pytest.raises(PublishError) as err:
            pub.publish(2, killing(s2))
        failed_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        r3 = pub.publish(3, s2.items())
        recover_s = time.perf_counter() - t0
        got = _dump(pub, "s0", tmp_path / "s0_v3.safetensors")
    finally:
        pub.close()
    assert err.value.blamed == ["s1"], str(err.value)
    assert "s1" in str(err.value)
    assert failed_s < 15, f"the failure took {failed_s:.1f}s; it must not wait out the 20 s step timeout"
    # s0 left its receives of v2 posted in the dead group; rejoining must not wait for them to time out
    assert recover_s < 10, f"the next publish took {recover_s:.1f}s"
    assert r3.engines == ["s0"] and r3.epoch == 2
    _identical(got, s2)
