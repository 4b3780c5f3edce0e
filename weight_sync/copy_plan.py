"""Replaying an engine's weight load as plain copies, for staged publishes.

A staged publish lands in standing buffers whose addresses never change, and the
engine's parameters do not move between updates. So the copies a model's
``load_weights`` makes from those buffers into its parameters (splitting HF
tensors into fused ones, sharding for tensor parallelism) are the same every time:
record them once, then replay them as ``dst.copy_(src)`` with none of the
per-tensor Python of the model's loader, which costs far more than the copies
themselves (bench/engine_update.py measures both; bench/results/engine_update_copy_plan.json).

Safety: a bucket is replayed only if, while recording, every write its load made
into a parameter was a ``copy_`` from a view of the staging buffer, or a fill with a
constant (vocabulary padding rows). A loader that
transforms a tensor first (a dtype cast, a transpose made contiguous), writes a
parameter any other way, or copies into anything but a parameter, keeps that
bucket on the model's own loader for good. The whole plan is dropped when any
parameter's storage moves (a reload from disk, a sleep/wake) or the staging
buffers change (a new plan).

Example::

    loader = CopyPlanLoader(model, model.load_weights)
    receiver.commit(version, loader.load)     # first commit records, later ones replay
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch.overrides import TorchFunctionMode

log = logging.getLogger(__name__)

Pairs = list[tuple[str, torch.Tensor]]


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


_INPLACE_DUNDERS = {
    "__setitem__",
    "__iadd__",
    "__isub__",
    "__imul__",
    "__itruediv__",
    "__ifloordiv__",
    "__imod__",
    "__ipow__",
    "__iand__",
    "__ior__",
    "__ixor__",
    "__ilshift__",
    "__irshift__",
}


def _writes(name: str) -> bool:
    """Whether a torch function of this name writes its first argument (``add_``, ``x[i] = ...``, ``+=``)."""
    return (name.endswith("_") and not name.startswith("_")) or name in _INPLACE_DUNDERS


class _Recorder(TorchFunctionMode):
    """Collects the copies a load makes, and notes any write it cannot replay."""

    def __init__(self, params: set[int], sources: set[int]) -> None:
        super().__init__()
        self.params, self.sources = params, sources
        self.ops: list[tuple] = []  # ("copy", dst, src) and ("fill", dst, value), in the order they ran
        self.unsafe: str = ""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        target = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if func is torch.Tensor.copy_ and target is not None:
            src = args[1] if len(args) > 1 else kwargs.get("src")
            if _storage(target) not in self.params:
                self.unsafe = self.unsafe or f"a copy into a tensor that is not a parameter {tuple(target.shape)}"
            elif not isinstance(src, torch.Tensor) or _storage(src) not in self.sources:
                self.unsafe = self.unsafe or "a parameter written from a transformed tensor, not a view of the bytes"
            else:
                self.ops.append(("copy", target, src))
        elif target is not None and _writes(name) and _storage(target) in self.params:
            value = args[1] if name == "fill_" and len(args) > 1 else 0 if name == "zero_" else None
            if isinstance(value, (int, float, bool)):  # padding rows set to a constant: the same every load
                self.ops.append(("fill", target, value))
            else:
                self.unsafe = self.unsafe or f"a parameter written by {name}"
        return func(*args, **kwargs)

    def steps(self) -> list[tuple]:
        """The ops as replay steps: runs of copies become one ``("copies", dsts, srcs)`` each."""
        out: list[tuple] = []
        for op in self.ops:
            if op[0] == "copy" and out and out[-1][0] == "copies":
                out[-1][1].append(op[1])
                out[-1][2].append(op[2])
            elif op[0] == "copy":
                out.append(("copies", [op[1]], [op[2]]))
            else:
                out.append(op)
        return out


class CopyPlanLoader:
    """``load(pairs)`` for :meth:`weight_sync.receiver.WeightReceiver.commit`: records, then replays."""

    def __init__(self, model: torch.nn.Module, load_weights: Callable[[Pairs], object]) -> None:
        self.model, self.load_weights = model, load_weights
        # (first name, bucket address) -> the recorded steps (Recorder.steps), or None (the model's loader)
        self._plans: dict[tuple[str, int], list[tuple] | None] = {}
        self._layout: tuple[int, ...] = ()
        self._checked_left = 0  # buckets of the current commit left to load under its one layout check
        self.replayed = self.recorded = self.fallbacks = 0  # buckets, for tests and logs

    def _param_layout(self) -> tuple[int, ...]:
        return tuple(p.data_ptr() for p in self.model.parameters())

    def start_commit(self, buckets: int) -> None:
        """Check the parameters' layout once for the next ``buckets`` loads (walking the model's modules
        costs about as much host time as replaying a bucket); without it every load checks."""
        self._check_layout()
        self._checked_left = buckets

    def _check_layout(self) -> None:
        layout = self._param_layout()
        if layout != self._layout:  # parameters moved (or first use): nothing recorded holds
            self._plans.clear()
            self._layout = layout

    def load(self, pairs: Pairs) -> None:
        if not pairs:
            return
        if self._checked_left > 0:
            self._checked_left -= 1
        else:
            self._check_layout()
        key = (pairs[0][0], _storage(pairs[0][1]))
        if key not in self._plans and any(k[0] == key[0] for k in self._plans):
            self._plans.clear()  # new staging buffers: drop the copies (and the old buffers they hold)
        if key in self._plans:
            plan = self._plans[key]
            if plan is None:
                self.fallbacks += 1
                self.load_weights(pairs)
            else:
                for step in plan:
                    if step[0] == "copies":
                        torch._foreach_copy_(step[1], step[2])  # one call for a run of copies
                    else:
                        step[1].fill_(step[2])
                self.replayed += 1
            return
        params = {_storage(p) for p in self.model.parameters()}
        with _Recorder(params, {_storage(t) for _, t in pairs}) as rec:
            self.load_weights(pairs)
        if rec.unsafe:
            log.info("bucket of %s stays on the model's loader: %s", pairs[0][0], rec.unsafe)
            self._plans[key] = None
            self.fallbacks += 1
        else:
            self._plans[key] = rec.steps()
            self.recorded += 1
