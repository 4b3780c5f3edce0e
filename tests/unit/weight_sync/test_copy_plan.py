"""CopyPlanLoader: a model's weight load recorded once as copies from the staging buffers, then replayed.

The model below loads like vLLM's fused layers: q/k/v and gate/up land in slices of one fused
parameter through narrow + copy_. A replay must leave the parameters exactly as the model's own
loader would, for new bytes in the same buffers; loaders that transform a tensor first, or write a
parameter some other way, must stay on the model's loader.
"""

from __future__ import annotations

import pytest
import torch

from weight_sync.copy_plan import CopyPlanLoader
from weight_sync.plan import build_plan, pack_bucket, unpack_bucket

pytestmark = pytest.mark.timeout(60)


class Fused(torch.nn.Module):
    def __init__(self, transform: str = "") -> None:
        super().__init__()
        self.qkv = torch.nn.Parameter(torch.zeros(12, 8))
        self.gate_up = torch.nn.Parameter(torch.zeros(10, 8))
        self.norm = torch.nn.Parameter(torch.zeros(8))
        self.transform = transform
        self.calls = 0

    @torch.no_grad()
    def load_weights(self, pairs):
        self.calls += 1
        slots = {
            "q": (self.qkv, 0, 4),
            "k": (self.qkv, 4, 4),
            "v": (self.qkv, 8, 4),
            "gate": (self.gate_up, 0, 5),
            "up": (self.gate_up, 5, 5),
        }
        for name, t in pairs:
            if name == "norm":
                if self.transform == "pad":  # like a vocabulary embedding: padding rows set to 0
                    self.norm.data[6:].fill_(0.0)
                    self.norm.data[:6].copy_(t[:6])
                    continue
                self.norm.data.copy_(t)
                if self.transform == "scale":
                    self.norm.data.mul_(1.0)  # a write the plan cannot replay
                continue
            param, start, n = slots[name]
            if self.transform == "cast":
                t = (t * 1).contiguous()  # a new tensor, not a view of the bytes
            param.data.narrow(0, start, n).copy_(t)


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"q": (4, 8), "k": (4, 8), "v": (4, 8), "gate": (5, 8), "up": (5, 8), "norm": (8,)}
    return {k: torch.randn(s, generator=g) for k, s in shapes.items()}


def _buckets(state):
    plan = build_plan([(k, v.shape, v.dtype) for k, v in state.items()], bucket_bytes=400)
    assert len(plan.buckets) > 1
    bufs = [torch.empty(n, dtype=torch.uint8) for n in plan.bucket_bytes()]  # standing staging buffers
    return plan, bufs


def _receive(plan, bufs, state):  # what a broadcast does: new bytes in the same buffers
    for b, idx in enumerate(plan.buckets):
        bufs[b].copy_(pack_bucket([state[plan.names[i]] for i in idx]))


def _commit(loader, plan, bufs):
    for b in range(len(bufs)):
        loader.load(unpack_bucket(bufs[b], plan, b))


def _expected(state):
    ref = Fused()
    ref.load_weights(list(state.items()))
    return ref


def test_second_commit_replays_copies_and_matches_the_models_loader():
    model = Fused()
    s1, s2 = _state(1), _state(2)
    plan, bufs = _buckets(s1)
    loader = CopyPlanLoader(model, model.load_weights)
    _receive(plan, bufs, s1)
    _commit(loader, plan, bufs)
    calls = model.calls
    assert loader.recorded == len(bufs) and loader.replayed == 0
    _receive(plan, bufs, s2)
    _commit(loader, plan, bufs)
    assert model.calls == calls, "the replay went through the model's loader"
    assert loader.replayed == len(bufs)
    want = _expected(s2)
    for name in ("qkv", "gate_up", "norm"):
        assert torch.equal(getattr(model, name), getattr(want, name)), name


def test_constant_fills_are_replayed_in_order():
    model = Fused("pad")
    s1, s2 = _state(8), _state(9)
    plan, bufs = _buckets(s1)
    loader = CopyPlanLoader(model, model.load_weights)
    for s in (s1, s2):
        _receive(plan, bufs, s)
        model.norm.data.fill_(7.0)  # the replay must write the padding again, not keep whatever was there
        _commit(loader, plan, bufs)
    assert loader.replayed == len(bufs) and loader.fallbacks == 0
    assert torch.equal(model.norm[:6], s2["norm"][:6]) and torch.equal(model.norm[6:], torch.zeros(2))


@pytest.mark.parametrize("transform", ["cast", "scale"])
def test_loads_that_cannot_be_replayed_stay_on_the_models_loader(transform):
    model = Fused(transform)
    s1, s2 = _state(3), _state(4)
    plan, bufs = _buckets(s1)
    loader = CopyPlanLoader(model, model.load_weights)
    for s in (s1, s2):
        _receive(plan, bufs, s)
        _commit(loader, plan, bufs)
    assert loader.fallbacks >= 2 and loader.fallbacks + loader.replayed + loader.recorded == 2 * len(bufs)
    want = _expected(s2)
    for name in ("qkv", "gate_up", "norm"):
        assert torch.equal(getattr(model, name), getattr(want, name)), name


def test_moved_parameters_or_new_buffers_are_recorded_again():
    model = Fused()
    s1, s2, s3 = _state(5), _state(6), _state(7)
    plan, bufs = _buckets(s1)
    loader = CopyPlanLoader(model, model.load_weights)
    _receive(plan, bufs, s1)
    _commit(loader, plan, bufs)
    model.qkv = torch.nn.Parameter(torch.zeros(12, 8))  # a reload from disk made new storage
    _receive(plan, bufs, s2)
    _commit(loader, plan, bufs)
    assert loader.recorded == 2 * len(bufs) and loader.replayed == 0
    assert torch.equal(model.qkv, _expected(s2).qkv)
    plan, bufs = _buckets(s1)  # new staging buffers
    _receive(plan, bufs, s3)
    _commit(loader, plan, bufs)
    assert loader.recorded == 3 * len(bufs)
    assert torch.equal(model.gate_up, _expected(s3).gate_up)


def test_one_layout_check_per_commit_still_sees_moved_parameters():
    model = Fused()
    s1, s2 = _state(10), _state(11)
    plan, bufs = _buckets(s1)
    loader = CopyPlanLoader(model, model.load_weights)
    for s in (s1, s2):
        _receive(plan, bufs, s)
        loader.start_commit(len(bufs))
        _commit(loader, plan, bufs)
    assert loader.replayed == len(bufs)
    model.qkv = torch.nn.Parameter(torch.zeros(12, 8))  # moved between commits: the next check sees it
    _receive(plan, bufs, s1)
    loader.start_commit(len(bufs))
    _commit(loader, plan, bufs)
    assert loader.recorded == 2 * len(bufs) and torch.equal(model.qkv, _expected(s1).qkv)
