"""Weight-sync plan, packing, checksums and timeouts (fast, CPU)."""

from __future__ import annotations

import time

import pytest
import torch

from weight_sync.messages import GroupInfo
from weight_sync.plan import (
    bucket_fingerprint,
    build_plan,
    combine_fingerprints,
    pack_bucket,
    packed_buffer_bytes,
    plan_from_dict,
    plan_to_dict,
    unpack_bucket,
)


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(100, 16, generator=g).to(torch.bfloat16),
        "layers.0.w": torch.randn(64, 64, generator=g),
        "layers.0.b": torch.randn(64, generator=g),
        "layers.1.w": torch.randn(64, 64, generator=g),
        "layers.1.b": torch.randn(64, generator=g).to(torch.float16),
        "norm.weight": torch.randn(16, generator=g),
        "lm_head.weight": torch.randn(100, 16, generator=g),
    }


def test_buckets_equal_vllm_packed_chunks_byte_for_byte():
    """Our buckets are exactly the chunks vLLM's packed NCCL format cuts (so one publisher feeds both)."""
    from vllm.distributed.weight_transfer.packed_tensor import pack_tensors

    sd = _state()
    plan = build_plan([(k, v.shape, v.dtype) for k, v in sd.items()], bucket_bytes=8_000)
    assert len(plan.buckets) >= 3
    limit = packed_buffer_bytes(plan)
    it = iter(sd.items())
    for b, idx in enumerate(plan.buckets):
        chunk = pack_tensors(it, lambda item: item[1], limit)
        assert chunk.names == [plan.names[i] for i in idx], f"bucket {b}"
        assert torch.equal(chunk.packed_tensor, pack_bucket([sd[plan.names[i]] for i in idx]))
    assert pack_tensors(it, lambda item: item[1], limit) is None


def test_pack_unpack_round_trip_is_bit_identical_and_checksum_sees_one_bit():
    sd = _state()
    plan = build_plan([(k, v.shape, v.dtype) for k, v in sd.items()], bucket_bytes=10_000)
    crcs = []
    for b, idx in enumerate(plan.buckets):
        buf = pack_bucket([sd[plan.names[i]] for i in idx])
        assert buf.numel() == plan.bucket_bytes()[b]
        crcs.append(bucket_fingerprint(buf))
        for name, t in unpack_bucket(buf.clone(), plan, b):
            assert t.dtype == sd[name].dtype and torch.equal(t.view(torch.uint8), sd[name].view(torch.uint8))
    flipped = pack_bucket([sd[plan.names[i]] for i in plan.buckets[0]])
    flipped[5] ^= 1
    assert not torch.equal(bucket_fingerprint(flipped), crcs[0])
    assert combine_fingerprints(crcs) != combine_fingerprints([bucket_fingerprint(flipped), *crcs[1:]])
    # moving bytes to another 4 KiB row (changing none) is seen too
    buf = torch.randint(0, 256, (3 * 4096 + 100,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    swapped = buf.clone()
    swapped[0:8], swapped[4096:4104] = buf[4096:4104].clone(), buf[0:8].clone()
    assert not torch.equal(swapped, buf)
    assert not torch.equal(bucket_fingerprint(swapped), bucket_fingerprint(buf))


def test_plan_id_is_stable_and_wire_round_trip_validates():
    meta = [(k, v.shape, v.dtype) for k, v in _state().items()]
    a, b = build_plan(meta, 10_000), build_plan(meta, 10_000)
    assert a.plan_id == b.plan_id and build_plan(meta, 20_000).plan_id != a.plan_id
    assert plan_from_dict(plan_to_dict(a)) == a
    bad = plan_to_dict(a)
    bad["buckets"] = bad["buckets"][1:]
    with pytest.raises(ValueError, match="exactly once"):
        plan_from_dict(bad)
    with pytest.raises(TypeError, match="complex64"):
        build_plan([("x", [2], torch.complex64)], 10)
    with pytest.raises(ValueError, match="duplicate"):
        build_plan([("x", [2], torch.float32), ("x", [2], torch.float32)], 10)


def test_receiver_join_times_out_naming_engine_and_epoch():
    """A publisher that never comes: the join fails within its limit, naming who and where; no hang."""
    from weight_sync.group import host_store
    from weight_sync.receiver import WeightReceiver

    store = host_store("127.0.0.1", 0, 5)
    plan = build_plan([("w", [4], torch.float32)], 1024)
    group = GroupInfo(
        master_addr="127.0.0.1", master_port=store.port, rank_offset=1, world_size=2, backend="gloo", group_epoch=7
    )
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"engine r9: joining weight-sync epoch 7 as rank 1"):
        WeightReceiver("r9").join(group, plan, 1, timeout_s=2)
    assert time.monotonic() - t0 < 15


def test_vllm_weight_version_spans_become_segments():
    from engines.vllm.generation import _segments

    seg = _segments([{"version": "3", "start": 0, "end": 5}, {"version": "4", "start": 5, "end": 9}], 0)
    assert (seg.starts, seg.versions) == ([0, 5], [3, 4])
    seg = _segments(None, 2)
    assert (seg.starts, seg.versions) == ([0], [2])
    seg = _segments([{"version": "default", "start": 0, "end": 2}, {"version": "1", "start": 2, "end": 3}], 0)
    assert (seg.starts, seg.versions) == ([0, 2], [0, 1])


def test_vllm_version_check_accepts_installed_build():
    from packaging.version import Version

    from engines.vllm.server import SUPPORTED, check_vllm_version

    assert SUPPORTED[0] <= Version(check_vllm_version()) < SUPPORTED[1]


def test_tail_pieces_shrink_towards_the_end_and_leave_the_other_cuts():
    from weight_sync.plan import TAIL_FACTOR, nbytes

    meta = [(f"t{i}", [n], torch.uint8) for i, n in enumerate([300, 300, 300, 120, 90, 60, 30, 20, 10, 5])]
    plain = build_plan(meta, 400)
    assert plain.buckets == [[0, 1], [2, 3], [4, 5, 6, 7, 8, 9]]  # the packed rule: cut after crossing 400
    cut = build_plan(meta, 400, tail_bytes=16)
    # the last bucket (90 60 30 20 10 5) is cut from the end: 10 + 5 <= 16 (the 20 would cross), then
    # 30 + 20 <= 64 (the 60 would cross), and what is left (90 + 60 = 150 <= 256) stays whole
    assert cut.buckets == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    sizes = [sum(nbytes(cut.shapes[i], cut.dtypes[i]) for i in b) for b in cut.buckets]
    assert sizes[-1] <= 16 and sizes[-2] <= 16 * TAIL_FACTOR
    assert cut.plan_id != plain.plan_id  # another byte layout, another id
    # the packed rule no longer describes the plan: vLLM's built-in backend must not get it
    with pytest.raises(ValueError, match="packed rule"):
        packed_buffer_bytes(cut)
    # a last tensor larger than the limit: nothing to cut
    assert build_plan(meta, 400, tail_bytes=4).buckets == plain.buckets
    # a last bucket no larger than the limit stays whole (a small model is not cut into pieces)
    assert build_plan(meta, 400, tail_bytes=1000).buckets == plain.buckets
    # a one-tensor last bucket cannot be cut either
    assert build_plan(meta[:4], 400, tail_bytes=16).buckets == build_plan(meta[:4], 400).buckets


def test_tail_bytes_only_where_fleetrl_receivers_take_the_plan():
    from weight_sync.config import WeightSyncConfig

    assert WeightSyncConfig(nccl_impl="torch", tail_bucket_mb=16).tail_bytes(nccl=True) == 16 << 20
    assert WeightSyncConfig(nccl_impl="vllm", tail_bucket_mb=16).tail_bytes(nccl=True) == 0
    assert WeightSyncConfig(nccl_impl="sglang", tail_bucket_mb=16).tail_bytes(nccl=True) == 0
    assert WeightSyncConfig(nccl_impl="vllm", tail_bucket_mb=16).tail_bytes(nccl=False) == 16 << 20  # gloo
    assert WeightSyncConfig(nccl_impl="torch").tail_bytes(nccl=True) == 64 << 20  # the default
    assert WeightSyncConfig(nccl_impl="torch", tail_bucket_mb=0).tail_bytes(nccl=True) == 0  # off


@pytest.mark.parametrize("size", [4096 * 3 + 100, 4096 * 2, 100, 4096 + 1])
def test_fingerprint_sees_a_flip_at_every_edge_of_a_bucket(size):
    """First byte, last byte, a byte of the ragged tail (under 4 KiB) and of the last whole 4 KiB row: each
    flip, and a swap of the last whole row with the tail, changes the fingerprint."""
    buf = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(size))
    ref = bucket_fingerprint(buf)
    whole = size - size % 4096
    where = {"first": 0, "last": size - 1}
    if size % 4096:
        where["tail"] = whole + (size - whole) // 2
    if whole:
        where["last_whole_row_first"] = whole - 4096
        where["last_whole_row_end"] = whole - 1
    for name, i in where.items():
        flipped = buf.clone()
        flipped[i] ^= 0x10
        assert not torch.equal(bucket_fingerprint(flipped), ref), f"{name} byte {i} of {size}"
    if whole and size % 4096:
        swapped = buf.clone()
        n = size - whole
        swapped[whole - 4096 : whole - 4096 + n], swapped[whole:] = (
            buf[whole:].clone(),
            buf[whole - 4096 : whole - 4096 + n].clone(),
        )
        assert not torch.equal(swapped, buf) and not torch.equal(bucket_fingerprint(swapped), ref)


def test_fingerprint_covers_every_bucket_of_a_plan():
    sd = _state()
    plan = build_plan([(k, v.shape, v.dtype) for k, v in sd.items()], bucket_bytes=6_000)
    bufs = [pack_bucket([sd[plan.names[i]] for i in idx]) for idx in plan.buckets]
    assert len(bufs) >= 3 and any(b.numel() % 4096 for b in bufs)
    ref = combine_fingerprints([bucket_fingerprint(b) for b in bufs])
    for k, b in enumerate(bufs):
        for i in {0, b.numel() - 1, b.numel() - b.numel() % 4096 - 1 if b.numel() >= 4096 else 0}:
            changed = [x.clone() for x in bufs]
            changed[k][i] ^= 1
            assert combine_fingerprints([bucket_fingerprint(x) for x in changed]) != ref, f"bucket {k} byte {i}"
