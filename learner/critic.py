"""PPO's value model (the critic) on the learner's ranks, beside the FSDP2 actor.

The critic is the actor's model family with a fresh scalar head: a transformers
``AutoModelForTokenClassification`` with one label loaded from a causal LM folder
(``learner.critic.model_path``, default the actor's ``model.path``), so the body's
weights are the checkpoint's and the head ``score`` is newly initialised, as verl builds
its critic. It is sharded like the actor (each decoder layer an FSDP unit; on GPU bf16
compute in the layers, fp32 in the root that holds the head, so values are fp32), has its
own AdamW, LR schedule and gradient clip, and is checkpointed inside the actor's
checkpoint folder (``critic/``, written before the actor's ``meta.json`` marks the folder
complete).

Per step batch, every rank, on the actor's micro-batches (learner/batch.py)::

    prepare(plans):  values V of every trained token with the *current* critic (no grad)
                     -> GAE per sequence (learner/gae.py) -> advantages whitened over the
                     whole step batch (one all-reduce of count/sum/sumsq) -> mb.advantages,
                     mb.values (old values), mb.returns (targets)
    [the actor trains on mb.advantages, unless the step is a critic warm-up step]
    train(plans):    critic.ppo_epochs passes over the mini-batches, the clipped value loss

Values are never computed by the rollout engines: a sample generated several policy
versions ago gets the values of the critic as it is when the sample is trained on.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from learner import checkpoint as ckpt
from learner.batch import MicroBatch, StepPlan
from learner.config import LearnerConfig
from learner.engine import disable_dropout, lr_lambda
from learner.fastpath import forward_kwargs
from learner.gae import (
    explained_variance,
    gae,
    global_moments,
    mean_var,
    moments,
    token_rewards,
    value_loss,
    whiten,
)
from learner.losses import aggregation_weights, combine_metrics
from learner.minibatch import combine_steps, epoch_orders

logger = logging.getLogger(__name__)


def load_value_model(path: str, attn_implementation: str) -> torch.nn.Module:
    """A causal LM folder as a token-level value model: the LM body plus a fresh one-output ``score`` head."""
    from transformers import AutoConfig, AutoModelForTokenClassification

    if not (Path(path) / "config.json").exists():
        raise FileNotFoundError(f"critic model folder {path!r} has no config.json (expected a Hugging Face folder)")
    config = AutoConfig.from_pretrained(path, num_labels=1)
    config.classifier_dropout = 0.0  # (verl sets it too) the head's dropout would make values noisy
    model = AutoModelForTokenClassification.from_pretrained(
        path, config=config, dtype=torch.float32, attn_implementation=attn_implementation
    )
    disable_dropout(model)  # the value pass and the training pass must score alike
    return model


class Critic:
    """One rank's share of the value model, its optimizer and schedule. Every method is collective."""

    def __init__(self, cfg: LearnerConfig, actor_model_path: str, *, total_steps: int, seed: int = 0, engine) -> None:
        """``engine``: the actor's FSDP engine on this rank; the critic runs with its resolved settings
        (attention implementation, fused AdamW) and follows its activation checkpointing."""
        if cfg.critic is None:
            raise ValueError("Critic needs learner.critic")
        if not dist.is_initialized():
            raise RuntimeError("Critic needs torch.distributed initialised (gloo on CPU, nccl on GPU)")
        from learner.fsdp import _decoder_blocks, _shard

        self.cfg, self.c = cfg, cfg.critic
        self.model_path = self.c.model_path or actor_model_path
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        on_gpu = dist.get_backend() == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
        self.engine = engine
        self.settings = engine.settings
        # The same head on every rank (each shards its own full copy): a fixed seed, without touching the
        # global RNG stream the actor's run depends on.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = load_value_model(self.model_path, engine.attn_impl)
        self._checkpointing = False
        self.offload = on_gpu and (self.c.param_offload or self.c.optimizer_offload)
        if not self.offload:
            model.to(self.device)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if on_gpu else None
        if not _decoder_blocks(model):
            raise ValueError(f"{type(model).__name__} declares no _no_split_modules; cannot shard the critic")
        _shard(model, init_device_mesh(self.device.type, (self.world_size,)), mp, offload=self.offload)
        self.model = model
        o = self.c.optim
        self.optimizer = torch.optim.AdamW(
            model.parameters(),
            lr=o.lr,
            betas=o.betas,
            eps=o.eps,
            weight_decay=o.weight_decay,
            **({"fused": True} if self.settings.fused_optimizer else {}),
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(o.schedule, o.warmup_steps, total_steps, o.min_lr_ratio)
        )
        self.epochs = self.c.ppo_epochs or cfg.ppo_epochs
        logger.info(
            "critic: rank %d/%d on %s, %d parameters, from %s",
            self.rank,
            self.world_size,
            self.device,
            sum(p.numel() for p in model.parameters()),
            self.model_path,
        )

    # the group whose ranks hold disjoint rows of the step batch (FSDP: every rank; Megatron: data parallel)
    reduce_group = None

    @property
    def warmup_steps(self) -> int:
        return self.c.warmup_steps

    # ---- values ------------------------------------------------------------------------------
    def values(self, mb: MicroBatch, *, grad: bool = False) -> torch.Tensor:
        """[n] fp32 values at the positions that predict the micro-batch's trained tokens (the state before each)."""
        mb.to(self.device)
        with torch.set_grad_enabled(grad):
            out = self.model(
                input_ids=mb.input_ids,
                position_ids=mb.position_ids,
                use_cache=False,
                **forward_kwargs(self.settings, mb),
            )
            return out.logits[0, mb.target_index, 0].float()

    def prepare(
        self, plans: list[StepPlan], gamma: float, lam: float, penalties: dict[int, torch.Tensor] | None = None
    ) -> dict[str, float]:
        """Values, GAE advantages (whitened over the step batch) and returns on every micro-batch of ``plans``.

        ``penalties``: KL in the reward (learner/kl_reward.py ``gae_penalties``): per micro-batch (``id(mb)``) the
        [n] per-token ``beta * kl_t`` subtracted from the token rewards before GAE (verl's apply_kl_penalty)."""
        t0 = time.perf_counter()
        if not self._checkpointing and self.engine.settings.activation_checkpointing:
            # the actor decides it at its first step (learner.activation_checkpointing=auto sizes it then)
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            self._checkpointing = True
        self.model.eval()
        raw: list[tuple[MicroBatch, torch.Tensor]] = []
        parts = []
        for plan in plans:
            for mb in plan.micro_batches:
                v = self.values(mb)  # an empty micro-batch runs too: the forward is a collective
                if not mb.rows:
                    mb.values, mb.returns = torch.zeros_like(v), torch.zeros_like(v)
                    continue
                v_cpu = v.cpu()
                if penalties is not None and id(mb) not in penalties:
                    raise RuntimeError("KL in the reward: no token penalties for a micro-batch of the step")
                r = token_rewards(mb.rewards, mb.seq_lens, None if penalties is None else penalties[id(mb)])
                adv, ret = gae(r, v_cpu, mb.seq_lens, gamma, lam)
                mb.values, mb.returns = v, ret.to(self.device)
                raw.append((mb, adv))
                parts.append(torch.stack([moments(adv), moments(ret), moments(ret - v_cpu), moments(v_cpu)]))
        tot = global_moments(parts or [torch.zeros(4, 3, dtype=torch.float64)], self.device, self.reduce_group)
        n_tok = float(tot[0, 0])
        out = {"critic/prepare_seconds": 0.0}
        if n_tok >= 2:
            for mb, adv in raw:
                mb.advantages = whiten(adv, tot[0]).to(self.device)
            out.update(
                {
                    "critic/advantages_mean": mean_var(tot[0])[0],
                    "critic/returns_mean": mean_var(tot[1])[0],
                    "critic/values_mean": mean_var(tot[3])[0],
                    "critic/vf_explained_var": explained_variance(tot[1], tot[2]),
                }
            )
        else:  # nothing (or one token) to train on: zero advantages, the optimizer steps are skipped anyway
            logger.warning("critic: %d trained token(s) in the step batch; advantages left at 0", int(n_tok))
        out["critic/prepare_seconds"] = time.perf_counter() - t0
        return out

    # ---- training ------------------------------------------------------------------------------
    def _weights(self, mb: MicroBatch, plan: StepPlan) -> torch.Tensor:
        if not mb.rows:
            return torch.zeros_like(mb.values)
        if self.c.aggregation == "token" and self.cfg.loss.aggregation == "token":
            return mb.weights.to(self.device)
        return aggregation_weights(
            mb.seq_lens, self.c.aggregation, int(plan.stats["response_tokens"]), int(plan.stats["samples_trained"])
        ).to(self.device)

    def train_step(self, plan: StepPlan, *, step_scheduler: bool = True) -> dict[str, float]:
        """One optimizer step of the value loss over the plan's micro-batches; metrics reduced over ranks."""
        if any(mb.returns is None for mb in plan.micro_batches):
            raise RuntimeError("Critic.train_step needs Critic.prepare(plans) first (values and returns)")
        self.model.train()
        parts = []
        for mb in plan.micro_batches:
            v = self.values(mb, grad=True)
            loss, m = value_loss(v, mb.values, mb.returns, self._weights(mb, plan), self.c.cliprange_value)
            (loss * self.world_size).backward()  # FSDP averages gradients over ranks; the weights already sum to 1
            parts.append(m)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.c.grad_clip)
        if isinstance(grad_norm, DTensor):
            grad_norm = grad_norm.full_tensor()
        finite = bool(torch.isfinite(grad_norm))
        if finite and plan.stats.get("samples_trained", 1.0) > 0:
            self.optimizer.step()
        elif not finite:
            logger.error("critic: non-finite gradient norm (%s): optimizer step skipped", float(grad_norm))
        self.optimizer.zero_grad(set_to_none=True)
        lr = self.scheduler.get_last_lr()[0]
        if step_scheduler:
            self.scheduler.step()
        m = combine_metrics(parts)
        names = sorted(m)
        t = torch.stack([m[k].detach().float().reshape(()) for k in names]).to(self.device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        out = {k: float(x) for k, x in zip(names, t.tolist(), strict=True)}
        out.update(grad_norm=float(grad_norm), lr=lr)
        return out

    def train(self, plans: list[StepPlan], step: int) -> dict[str, float]:
        """``ppo_epochs`` passes over the step batch's mini-batches; the schedule steps once per step batch."""
        t0 = time.perf_counter()
        orders = epoch_orders(len(plans), self.epochs, step)
        n_opt = sum(len(o) for o in orders)
        parts = []
        for order in orders:
            for k in order:
                parts.append(self.train_step(plans[k], step_scheduler=len(parts) == n_opt - 1))
        m = {f"critic/{k}": v for k, v in combine_steps(parts).items()}
        m["critic/train_seconds"] = time.perf_counter() - t0
        return m

    # ---- checkpoints -----------------------------------------------------------------------------
    def save(self, path: Path) -> None:
        ckpt.save_part(Path(path), self.model, self.optimizer, self.scheduler, self.rank)

    def load(self, path: Path) -> None:
        ckpt.load_part(Path(path), self.model, self.optimizer, self.scheduler)
