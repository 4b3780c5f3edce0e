"""NCCL publish from the learner on GPU 0 to a receiver process on GPU 1: bit-identical, every version.

The publisher is fleetrl's :class:`weight_sync.publisher.Publisher` in this process
(learner rank 0, GPU 0); the receiver is fleetrl's
:class:`weight_sync.receiver.WeightReceiver` in a spawned process on GPU 1, driven by
the publisher's RPCs (bench/weight_sync.py's pipe engine). On a machine with CUDA
this test is never skipped: fewer than 2 GPUs is a failure.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    # Imported by module name (bench is a namespace package at the repo root) so that the
    # spawned receiver process can import its entry point too (spawn passes sys.path on).
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return importlib.import_module("bench.weight_sync")


@pytest.fixture(scope="module")
def receiver():
    if torch.cuda.device_count() < 2:
        pytest.fail(f"the NCCL weight-sync test needs 2 GPUs, found {torch.cuda.device_count()}")
    bench = _bench()
    with bench.receiver_process("cuda:1") as (parent, _):
        yield bench, parent


def _state(bench) -> dict[str, torch.Tensor]:
    # The 0.5B shape in bf16, plus an fp32 tensor: plans may mix dtypes within a bucket.
    state = bench.random_model("0.5B", "cuda:0", seed=1)
    state["extra.fp32_scale"] = torch.randn(1000, 3, device="cuda:0", dtype=torch.float32)
    return state


@pytest.mark.parametrize("acks", ["group", "rpc"])
def test_nccl_publish_gpu0_to_gpu1_bit_identical(receiver, tmp_path, acks):
    from safetensors.torch import load_file

    from weight_sync.config import WeightSyncConfig
    from weight_sync.plan import build_plan
    from weight_sync.publisher import Publisher

    bench, conn = receiver
    torch.cuda.set_device(0)
    engine = bench.PipeEngine(f"gpu1-rx-{acks}", conn)
    state = _state(bench)
    plan = build_plan([(n, list(t.shape), t.dtype) for n, t in state.items()], 128 << 20)
    assert len(plan.buckets) > 3, "several buckets, so the overlap of gather and broadcast is exercised"
    pub = Publisher(
        WeightSyncConfig(backend="nccl", nccl_impl="torch", bucket_mb=128, timeout_s=120, acks=acks),
        plan,
        rank=0,
        engines=[engine],
        device="cuda:0",
    )
    try:
        for version in (1, 2):
            if version == 2:  # a training step changed every tensor: nothing stale may survive
                with torch.no_grad():
                    for t in state.values():
                        t.mul_(-1.5).add_(0.001)
            report = pub.publish(version, iter(state.items()))
            assert report is not None and report.engines == [engine.engine_id]
            assert pub.group_acks == (acks == "group")
            assert report.bytes == sum(t.numel() * t.element_size() for t in state.values())
            assert report.per_engine_checksums[engine.engine_id] == report.checksum
            assert pub.settle() == {}  # the engine's RPC answer, checked against its group ack
            assert engine.weight_version == version
            path = tmp_path / f"v{version}.safetensors"
            engine.call("dump", str(path))
            got = load_file(str(path))
            assert sorted(got) == sorted(state)
            for name, want in state.items():
                g = got[name]
                assert g.dtype == want.dtype and list(g.shape) == list(want.shape), name
                # bitwise, not allclose: views as integers so NaN/-0.0 cannot hide a difference
                assert torch.equal(
                    g.view(torch.int16 if g.element_size() == 2 else torch.int32),
                    want.cpu().view(torch.int16 if want.element_size() == 2 else torch.int32),
                ), name
    finally:
        pub.close()
