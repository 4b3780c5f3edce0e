"""The training-engine interface the loop drives, and helpers every backend shares.

A backend (FSDP2 in learner/fsdp.py, Megatron-core in learner/megatron/) owns the model, optimizer and LR
schedule on each learner rank. All methods are collective: every rank calls
them in the same order with its own part of the step (see learner/batch.py).

Example::

    engine = FSDPEngine(cfg, model_path="models/tiny-adder", total_steps=100)
    plan = plan_step(batch, rank=engine.rank, world_size=engine.world_size, ...)
    engine.prepare_logprobs(plan)           # proximal / reference log-probs, no grad
    metrics = engine.train_step(plan)       # one optimizer step; metrics are global
    # several optimizer steps per step batch: learner/minibatch.py and Learner.step
    for bucket in engine.iter_full_params(256 << 20):
        ...                                 # [(name, full tensor)], on every rank
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from learner.batch import MicroBatch, StepPlan
from learner.fastpath import ResolvedSettings


class TrainingEngine(ABC):
    """One learner rank's share of the model, optimizer and schedule."""

    rank: int
    world_size: int
    device: torch.device
    settings: ResolvedSettings  # every "auto" of the learner config, decided (learner/fastpath.py)

    @property
    def micro_batch_tokens(self) -> int:
        """The token budget of one packed micro-batch, as resolved for this device (a collective the first
        time when it is still pending: every rank plans its micro-batches at the same point)."""
        if self.settings.pending:
            self.settle_settings()
        return self.settings.micro_batch_tokens

    def settle_settings(self) -> None:
        """Decide what ``settings`` left pending (learner/fastpath.py); engines that defer sizing override it."""
        raise NotImplementedError(f"{type(self).__name__} left its settings pending but cannot settle them")

    # The step batch is split over data-parallel replicas: every rank for FSDP; for Megatron the ranks of
    # one TP x PP replica share a split (they must run the same micro-batches).
    @property
    def data_rank(self) -> int:
        return self.rank

    @property
    def data_world_size(self) -> int:
        return self.world_size

    @abstractmethod
    def forward_logprobs(self, mb: MicroBatch, *, grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-response-token log-probs and entropies ([n] each) of one packed micro-batch."""

    @abstractmethod
    def prepare_logprobs(self, plan: StepPlan) -> None:
        """Fill ``prox_logp`` (when the correction needs the pre-step policy) and ``ref_logp`` (KL) with no grad."""

    @abstractmethod
    def train_step(self, plan: StepPlan, *, step_scheduler: bool = True) -> dict[str, float]:
        """Accumulate gradients over the plan's micro-batches, clip, step the optimizer (one optimizer step),
        and the LR schedule when ``step_scheduler`` (the last optimizer step of a step batch).

        Returns step metrics reduced over all ranks (identical on every rank).
        """

    @abstractmethod
    def full_tensors(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, full tensor) one by one in :meth:`param_plan` order; floating tensors cast to ``dtype``.

        Collective: every rank must drain the iterator in lockstep (each tensor is
        gathered from the shards); the tensors are only meaningful on rank 0.
        This is what ``weight_sync.publisher.Publisher.publish(version, tensors)`` takes.
        """

    def iter_full_params(
        self, bucket_bytes: int, dtype: torch.dtype | None = None
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """:meth:`full_tensors` grouped into buckets, cut after the tensor that crosses ``bucket_bytes``
        (weight_sync/plan.py's rule, so buckets match a plan built with the same size)."""
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        for name, t in self.full_tensors(dtype):
            bucket.append((name, t))
            size += t.numel() * t.element_size()
            if size > bucket_bytes:
                yield bucket
                bucket, size = [], 0
        if bucket:
            yield bucket

    @abstractmethod
    def param_plan(self, dtype: torch.dtype | None = None) -> list[tuple[str, list[int], torch.dtype]]:
        """(name, full shape, dtype) of every tensor :meth:`full_tensors` yields, in order (no communication)."""

    @abstractmethod
    def save_checkpoint(self, path: Path, extra: dict[str, Any]) -> None:
        """Sharded save of model, optimizer, schedule and RNG plus JSON-able ``extra`` (version, data position)."""

    @abstractmethod
    def load_checkpoint(self, path: Path) -> dict[str, Any]:
        """Restore what :meth:`save_checkpoint` wrote; returns its ``extra``."""

    @abstractmethod
    def export_hf(self, path: Path, dtype: torch.dtype | None = None) -> None:
        """Write a Hugging Face folder (config, safetensors, tokenizer) loadable by AutoModelForCausalLM."""


def disable_dropout(model: torch.nn.Module) -> int:
    """Set every dropout probability of a transformers model to 0; returns how many were not 0.

    The proximal pass runs without grad and the training pass with it: with dropout > 0 their
    log-probs would differ by noise, so the PPO ratio would not be 1 where it should be. HF attention
    modules copy ``config.attention_dropout`` into a float attribute at construction, so those are
    zeroed besides ``nn.Dropout`` modules and the config (for anything built later).
    """
    changed = 0
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout) and m.p > 0:
            m.p, changed = 0.0, changed + 1
        for attr in ("attention_dropout", "dropout"):
            v = m.__dict__.get(attr)
            if isinstance(v, float) and v > 0:
                setattr(m, attr, 0.0)
                changed += 1
    config = getattr(model, "config", None)  # optional: plain nn.Modules have none
    if config is not None:
        for k, v in list(vars(config).items()):
            if "dropout" in k and isinstance(v, float) and v > 0:
                setattr(config, k, 0.0)
    return changed


def lr_lambda(schedule: str, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.0):
    """LR multiplier as a function of the number of optimizer steps already taken.

    Linear warm-up from 1/warmup to 1 over ``warmup_steps``, then ``constant``,
    ``cosine`` or ``linear`` decay to ``min_lr_ratio`` at ``total_steps``.
    """
    if schedule not in ("constant", "cosine", "linear"):
        raise ValueError(f"schedule must be constant, cosine or linear, got {schedule!r}")

    def f(step: int) -> float:
        if warmup_steps > 0 and step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        shape = 0.5 * (1 + math.cos(math.pi * progress)) if schedule == "cosine" else 1 - progress
        return min_lr_ratio + (1 - min_lr_ratio) * shape

    return f


def logprobs_from_logits(
    logits: torch.Tensor, mb: MicroBatch, temperature: float, entropy_grad: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Select the response positions first (the full-vocab softmax of prompt tokens is never built)."""
    return logprobs_from_selected(logits[0, mb.target_index], mb.targets, temperature, entropy_grad)


def logprobs_from_selected(
    sel: torch.Tensor, targets: torch.Tensor, temperature: float, entropy_grad: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of ``targets`` and entropies from the [n, vocab] logits of the response positions
    (shared by every backend, so FSDP and Megatron compute them identically). The entropy carries a
    gradient only with ``entropy_grad`` (an entropy bonus in the loss)."""
    sel = sel.float()
    if temperature != 1.0:
        sel = sel / temperature
    logp_all = torch.log_softmax(sel, dim=-1)
    logp = logp_all.gather(-1, targets.view(-1, 1)).squeeze(-1)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def packed_forward(
    model: torch.nn.Module, mb: MicroBatch, temperature: float = 1.0, entropy_grad: bool = False, **forward_kwargs
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropies of one packed row through a transformers causal LM.

    ``use_cache=False`` matters: transformers only derives the block-diagonal mask
    from restarting ``position_ids`` when there is no KV cache (tested against
    unpacked forwards in tests/unit/test_learner_packing.py). ``forward_kwargs`` go to the model (varlen
    attention's segments, learner/attention.py).
    """
    out = model(input_ids=mb.input_ids, position_ids=mb.position_ids, use_cache=False, **forward_kwargs)
    return logprobs_from_logits(out.logits, mb, temperature, entropy_grad)
