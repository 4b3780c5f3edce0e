"""Publisher against in-process engines whose answer is a wrong checksum, on each ack path.

The engines are fakes of the engine *client* only: each runs a real :class:`WeightReceiver` on a thread of
its own, in a real gloo group with the publisher (loopback), so the broadcast, the loads and the group acks
are the real ones. What a fake can do wrong: answer its update RPC with a checksum other than the bytes it
got (``lie="rpc"``), or load corrupted bytes (``lie="bytes"``: a bit flipped in the received bucket before
its fingerprint, what a bad transfer would do). Either must drop that engine and only that engine:
- ``acks="rpc"``: the RPC answer is the ack; a wrong one fails the publish, blaming the engine;
- ``acks="group"``: corrupted bytes show in the gathered fingerprints and fail the publish; a wrong RPC
  answer after a correct group ack is caught by ``settle()`` (at the next publish).
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf

import pytest
import torch

from weight_sync.config import WeightSyncConfig
from weight_sync.endpoint import WeightEndpoint
from weight_sync.plan import build_plan
from weight_sync.publisher import Publisher, PublishError
from weight_sync.receiver import WeightReceiver

pytestmark = pytest.mark.timeout(120)


class FakeEngine(WeightEndpoint):
    supports_group_acks = True

    def __init__(self, engine_id: str, lie: str | None = None) -> None:
        self.engine_id, self.lie = engine_id, lie
        self.receiver = WeightReceiver(engine_id)
        self.pool = cf.ThreadPoolExecutor(1, thread_name_prefix=engine_id)
        self.tensors: dict[str, torch.Tensor] = {}
        self._version = 0

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    async def init_weight_transfer(self, group, plan) -> None:
        await self._run(self.receiver.join, group, plan, group.rank_offset, 30.0)

    def _load(self, pairs):
        for name, t in pairs:
            if self.lie == "bytes":
                t.view(-1).view(torch.uint8)[0] ^= 1
            self.tensors[name] = t.clone()

    async def update_weights(self, version: int, plan_id: str) -> str:
        checksum = await self._run(self.receiver.receive, version, plan_id, self._load)
        self._version = version
        return "0123456789abcdef-1" if self.lie == "rpc" else checksum

    async def generate(self, prompt_ids, params):
        raise NotImplementedError

    async def health(self) -> bool:
        return True

    async def pause(self, mode: str = "keep") -> None: ...

    async def resume(self) -> None: ...

    async def reset_prefix_cache(self) -> None: ...

    async def load_weights_from_path(self, path: str, version: int) -> None: ...

    @property
    def weight_version(self) -> int:
        return self._version

    async def close(self) -> None:
        self.receiver.leave()
        self.pool.shutdown(wait=False)


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(40, 30, generator=g), "b": torch.randn(700, generator=g), "c": torch.randn(9, generator=g)}


def _publisher(acks: str, engines):
    plan = build_plan([(k, list(v.shape), v.dtype) for k, v in _state(0).items()], bucket_bytes=3000)
    cfg = WeightSyncConfig(backend="gloo", acks=acks, timeout_s=20, bucket_mb=3000 / 2**20)
    return Publisher(cfg, plan, engines=engines)


@pytest.mark.parametrize("acks,lie", [("rpc", "rpc"), ("rpc", "bytes"), ("group", "bytes")])
def test_a_wrong_checksum_fails_the_publish_and_drops_only_that_engine(acks, lie):
    good, bad = FakeEngine("good"), FakeEngine("bad", lie=lie)
    pub = _publisher(acks, [good, bad])
    try:
        with pytest.raises(PublishError, match="checksum mismatch") as err:
            pub.publish(1, _state(1).items())
        assert err.value.blamed == ["bad"]
        assert list(pub.engines) == ["good"]
        report = pub.publish(2, _state(2).items())  # the group is rebuilt with the survivor
        assert report.engines == ["good"] and report.per_engine_checksums["good"] == report.checksum
        assert all(torch.equal(good.tensors[k], v) for k, v in _state(2).items())
    finally:
        pub.close()


def test_group_acks_a_wrong_rpc_answer_is_caught_at_settle():
    good, bad = FakeEngine("good"), FakeEngine("bad", lie="rpc")
    pub = _publisher("group", [good, bad])
    try:
        report = pub.publish(1, _state(1).items())  # the bytes were right: the group acks pass
        assert sorted(report.engines) == ["bad", "good"]
        failed = pub.settle()
        assert list(failed) == ["bad"] and "after its group ack" in failed["bad"]
        assert list(pub.engines) == ["good"]
        assert pub.publish(2, _state(2).items()).engines == ["good"]
    finally:
        pub.close()
