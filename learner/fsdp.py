"""The FSDP2 training engine (``torch.distributed.fsdp.fully_shard``) for transformers causal LMs.

Each decoder layer (the model's ``_no_split_modules``) is its own FSDP unit and the
root holds embeddings, final norm and head. On GPU parameters are stored in fp32;
the decoder layers compute in bf16 (``MixedPrecisionPolicy``, gradients reduced in
fp32). The logits and the log-softmax of the log-probs are always fp32 (a bf16-rounded
logit adds about 1e-2 nats of noise per token against the engine): with the chunked head
(the GPU default) the root computes in bf16 as the inference engines do and the head's
matmul turns bf16 operands into fp32 logits (learner/logprobs.py); with the full-logits
head the root computes in fp32. On CPU everything is fp32. Which applies is decided once,
with every other ``auto``, by learner/fastpath.py ``resolve_fast_path``.
Dropout is forced to 0 (:func:`learner.engine.disable_dropout`). The same code runs over gloo (CPU) and NCCL (GPU): the
process group must be initialised before construction.

Loss normalisation: every micro-batch's loss is already divided by the step's
global token (or sequence) count (learner/losses.py), so the sum over ranks is
the global mean; FSDP's reduce-scatter averages over ranks, hence the backward
of ``loss * world_size``. One and two ranks give the same gradient up to the
order of the fp32 sums.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.profiler import record_function

from learner import attention, ulysses
from learner import checkpoint as ckpt
from learner import lora as lora_mod
from learner.batch import MicroBatch, StepPlan
from learner.config import LearnerConfig
from learner.engine import TrainingEngine, disable_dropout, lr_lambda, packed_forward
from learner.fastpath import (
    DeviceProps,
    ModelShape,
    ResolvedSettings,
    compile_blocks,
    forward_kwargs,
    resolve_fast_path,
)
from learner.loading import load_shards, meta_model
from learner.logprobs import head_logprobs
from learner.losses import MAX_SUFFIX, LossSettings, combine_metrics, needs_proximal, policy_loss

logger = logging.getLogger(__name__)


def transformers_version() -> str:
    import transformers

    return transformers.__version__


def _load_model(path: str, attn_implementation: str) -> torch.nn.Module:
    import transformers.masking_utils as mu
    from transformers import AutoModelForCausalLM

    # Packed rows rely on transformers deriving the block-diagonal mask from restarting position_ids.
    if not hasattr(mu, "find_packed_sequence_indices"):
        raise RuntimeError(f"transformers {transformers_version()} cannot keep packed sequences apart; need >= 4.56")
    p = Path(path)
    if not (p / "config.json").exists():
        raise FileNotFoundError(f"model folder {path!r} has no config.json (expected a Hugging Face model folder)")
    # fp32 master weights; bf16 compute comes from the mixed-precision policy on GPU.
    model = AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32, attn_implementation=attn_implementation)
    if disable_dropout(model):
        logger.warning("%s had dropout > 0: set to 0 (the proximal and training passes must score alike)", path)
    return model


def _decoder_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    block_names = set(getattr(model, "_no_split_modules", None) or [])
    return [m for m in model.modules() if type(m).__name__ in block_names]


def _shard(
    model: torch.nn.Module,
    mesh,
    mp: MixedPrecisionPolicy | None,
    offload: bool,
    root_dtype: torch.dtype = torch.float32,
) -> None:
    kw: dict[str, Any] = {"mesh": mesh}
    if mp is not None:
        kw["mp_policy"] = mp
    if offload:
        kw["offload_policy"] = CPUOffloadPolicy()
    blocks = _decoder_blocks(model)
    if not blocks:
        raise ValueError(
            f"{type(model).__name__} declares no _no_split_modules; cannot find its decoder layers to shard"
        )
    # bf16 adapters beside fp32 base weights: FSDP2 wants one original dtype per unit, so each adapter is its own
    for m in model.modules():
        if isinstance(m, lora_mod.LoraLinear) and m.lora_A.weight.dtype != m.weight.dtype:
            fully_shard(m.lora_A, **kw)
            fully_shard(m.lora_B, **kw)
    for m in blocks:
        fully_shard(m, **kw)
    if mp is not None:  # the root (embeddings, final norm, output layer): fp32 for the full-logits head
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=root_dtype, reduce_dtype=torch.float32)
    fully_shard(model, **kw)


class FSDPEngine(TrainingEngine):
    def __init__(self, cfg: LearnerConfig, model_path: str, total_steps: int, seed: int = 0) -> None:
        if not dist.is_initialized():
            raise RuntimeError("FSDPEngine needs torch.distributed initialised (gloo on CPU, nccl on GPU)")
        self.cfg = cfg
        self.model_path = model_path
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.loss = LossSettings.from_config(cfg.loss, cfg.rollout_correction)
        backend = dist.get_backend()
        if backend == "nccl":
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")
        torch.manual_seed(seed)
        self.seed = seed
        on_gpu = self.device.type == "cuda"
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if on_gpu else None
        mesh = init_device_mesh(self.device.type, (self.world_size,))

        # FSDP2 keeps a parameter's gradient and optimizer state with its shard, so offloading either
        # (verl's param_offload / optimizer_offload) is one CPUOffloadPolicy: shards in pinned CPU
        # memory, copied to the GPU per unit for forward and backward, AdamW stepping on the CPU.
        self.offload = on_gpu and (cfg.param_offload or cfg.optimizer_offload)
        self.shape = ModelShape.from_folder(model_path) if on_gpu else None  # sizes micro_batch_tokens=auto
        # The budget (and checkpointing) wait for the first step: memory is known then (settle_settings)
        self.settings = fast = resolve_fast_path(cfg, self._device_props(), self.shape, self.world_size, size_now=False)
        if self.rank == 0:
            logger.info("%s", fast.describe())
        self.attn_impl = attention.register() if fast.varlen else fast.attn_implementation
        self.root_dtype = torch.bfloat16 if fast.root_dtype == "bfloat16" else torch.float32
        # Ulysses SP (learner/ulysses.py): models load with its attention, which wraps the resolved one.
        self.sp = ulysses.setup_engine(cfg, model_path, fast) if cfg.sequence_parallel_size > 1 else None
        if self.sp is not None:
            self.attn_impl = ulysses.register()
        model = self._build(model_path, fast, mesh, mp, offload=self.offload, train=True)
        self.model = model

        self.ref_model = None
        # with LoRA the reference is the base: the same model with its adapters off (prepare_logprobs)
        if (cfg.loss.kl_coef > 0 or cfg.kl_reward.enable) and cfg.lora is None:
            # With CPUOffloadPolicy the shards live on CPU and are copied to the GPU for each forward.
            self.ref_model = self._build(
                model_path, fast, mesh, mp, offload=on_gpu and cfg.reference_offload, train=False
            )

        o = cfg.optim
        # With LoRA only the adapters require grad: the optimizer (and its state) covers them alone.
        self.optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad],
            lr=o.lr,
            betas=o.betas,
            eps=o.eps,
            weight_decay=o.weight_decay,
            **({"fused": True} if fast.fused_optimizer else {}),
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(o.schedule, o.warmup_steps, total_steps, o.min_lr_ratio)
        )
        n_params = sum(p.numel() for p in model.parameters())
        n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
        logger.info(
            "FSDP2 engine: rank %d/%d on %s, %d parameters (%d trained), model %s",
            self.rank,
            self.world_size,
            self.device,
            n_params,
            n_train,
            model_path,
        )

    def settle_settings(self) -> None:
        """Size the micro-batches (and choose checkpointing) from the memory free now, counting what this
        rank already holds as free (the estimate includes the model's state): at the first step, after a
        colocated engine has gone to sleep."""
        self.settings = resolve_fast_path(self.cfg, self._device_props(held=True), self.shape, self.world_size)
        if self.settings.activation_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if self.rank == 0:
            logger.info("%s", self.settings.describe())

    def _device_props(self, held: bool = False) -> DeviceProps:
        """This rank's device; on GPU the least free memory of any rank (every rank must plan the same
        micro-batches: each forward and backward is a collective). ``held``: this process's cached GPU
        memory counts as free."""
        props = DeviceProps.probe(self.device)
        if props.is_gpu and held:
            props = dataclasses.replace(props, free_bytes=props.free_bytes + torch.cuda.memory_reserved(self.device))
        if props.is_gpu and self.world_size > 1:
            free = torch.tensor([props.free_bytes], dtype=torch.int64, device=self.device)
            dist.all_reduce(free, op=dist.ReduceOp.MIN)
            props = dataclasses.replace(props, free_bytes=int(free))
        return props

    def _build(
        self, model_path: str, fast: ResolvedSettings, mesh, mp, *, offload: bool, train: bool
    ) -> torch.nn.Module:
        if fast.meta_init:
            model = meta_model(model_path, self.attn_impl)
            if disable_dropout(model):
                logger.warning(
                    "%s had dropout > 0: set to 0 (the proximal and training passes must score alike)", model_path
                )
        else:
            model = _load_model(model_path, self.attn_impl)
        if not train:
            model.eval().requires_grad_(False)
        lora = self.cfg.lora if train else None
        if lora is not None:
            lora_mod.inject(model, lora)  # before sharding, so the adapters are sharded with their layers
        if train and fast.activation_checkpointing:
            # HF's own checkpointing keeps parameter names unchanged (a checkpoint wrapper would add a prefix).
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if fast.compile_blocks:
            compile_blocks(_decoder_blocks(model))
        if not fast.meta_init and not offload:
            model.to(self.device)  # plain load: on CPU, moved whole, then sharded (each rank keeps its shard)
        _shard(model, mesh, mp, offload=offload, root_dtype=self.root_dtype)
        if fast.meta_init:
            load_shards(
                model,
                model_path,
                torch.device("cpu") if offload else self.device,
                skip=lora_mod.is_adapter_name if lora is not None else None,
            )
        if lora is not None:
            lora_mod.init_adapters(model, self.seed)
            if lora.adapter_path:
                lora_mod.load_adapter(lora.adapter_path, model, lora)
        return model

    # ---- forward ---------------------------------------------------------------------------
    @property
    def data_rank(self) -> int:  # the ranks of one SP group plan the same micro-batches
        return self.sp.dp_rank if self.sp is not None else self.rank

    @property
    def data_world_size(self) -> int:
        return self.sp.dp_size if self.sp is not None else self.world_size

    def _forward(self, model: torch.nn.Module, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        if self.sp is not None:  # this rank's slice of the row (in place, once); the loss then reads its tokens
            kw = self.sp.forward_kwargs(self.sp.shard(mb))
        else:
            kw = forward_kwargs(self.settings, mb)
        # the entropy bonus needs the entropy's gradient; otherwise it stays a metric (no extra backward work)
        ent_grad = self.loss.entropy_coeff > 0 and torch.is_grad_enabled() and model is self.model
        if self.settings.chunked_logprobs:
            # bf16 operands on GPU (the weights the engines serve), fp32 logits: learner/logprobs.py
            cd = torch.bfloat16 if self.device.type == "cuda" else None
            return head_logprobs(
                model,
                mb,
                self.cfg.temperature,
                self.settings.logprob_chunk,
                cd,
                fused=self.settings.fused_head,
                entropy_grad=ent_grad,
                **kw,
            )
        return packed_forward(model, mb, self.cfg.temperature, entropy_grad=ent_grad, **kw)

    def forward_logprobs(self, mb: MicroBatch, *, grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        mb.to(self.device)
        with torch.set_grad_enabled(grad):
            return self._forward(self.model, mb)

    def needs_proximal(self) -> bool:
        # kl_reward's penalty is measured on the pre-step policy (verl's old_log_prob)
        return (
            needs_proximal(self.loss.correction, self.cfg.recompute_proximal, self.cfg.several_optimizer_steps)
            or self.cfg.kl_reward.enable
        )

    def prepare_logprobs(self, plan: StepPlan) -> None:
        if self.needs_proximal():
            self.model.eval()
            for mb in plan.micro_batches:
                mb.prox_logp, _ = self.forward_logprobs(mb, grad=False)
        if self.ref_model is not None:
            for mb in plan.micro_batches:
                mb.to(self.device)
                with torch.no_grad():
                    mb.ref_logp, _ = self._forward(self.ref_model, mb)
        elif self.cfg.lora is not None and (self.cfg.loss.kl_coef > 0 or self.cfg.kl_reward.enable):
            for mb in plan.micro_batches:
                mb.to(self.device)
                with torch.no_grad(), lora_mod.adapters_off(self.model):
                    mb.ref_logp, _ = self._forward(self.model, mb)

    # ---- step ------------------------------------------------------------------------------
    def train_step(self, plan: StepPlan, *, step_scheduler: bool = True) -> dict[str, float]:
        t0 = time.perf_counter()
        if self.needs_proximal() and any(mb.prox_logp is None for mb in plan.micro_batches):
            raise RuntimeError(f"correction={self.loss.correction!r} needs prepare_logprobs(plan) before train_step")
        self.model.train()
        parts = []
        # record_function ranges name the phases in a torch.profiler trace (bench/learner.py --profile); free otherwise.
        for mb in plan.micro_batches:
            with record_function("fleetrl.forward"):
                logp, ent = self.forward_logprobs(mb, grad=True)
                loss, m = policy_loss(
                    logp,
                    mb.behaviour_logp,
                    mb.advantages,
                    mb.weights,
                    self.loss,
                    prox_logp=mb.prox_logp,
                    ref_logp=mb.ref_logp,
                    entropy=ent,
                    fresh=mb.fresh,
                    seq_lens=mb.seq_lens,
                    loss_scale=mb.loss_scale,
                    is_weights=mb.is_weights,
                )
            with record_function("fleetrl.backward"):
                (loss * self.world_size).backward()
            parts.append(m)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optim.grad_clip)
        if isinstance(grad_norm, DTensor):
            grad_norm = grad_norm.full_tensor()
        finite = bool(torch.isfinite(grad_norm))
        # Nothing to learn from (every group uniform): AdamW would still move weights through momentum and
        # decay, so the step is skipped; the version still advances because the data was consumed.
        empty = plan.stats.get("samples_trained", 1.0) == 0
        if finite and not empty:
            self.optimizer.step()
        elif not finite:
            logger.error("non-finite gradient norm (%s): optimizer step skipped", float(grad_norm))
        self.optimizer.zero_grad(set_to_none=True)
        lr = self.scheduler.get_last_lr()[0]
        if step_scheduler:  # the LR schedule counts step batches (policy versions), not optimizer steps
            self.scheduler.step()
        metrics = self._reduce(combine_metrics(parts))
        metrics.update(
            grad_norm=float(grad_norm),
            lr=lr,
            step_skipped=float(not finite or empty),
            step_seconds=time.perf_counter() - t0,
        )
        return metrics

    def _reduce(self, m: dict[str, torch.Tensor]) -> dict[str, float]:
        keys = sorted(m)
        sums = [k for k in keys if not k.endswith(MAX_SUFFIX)]
        maxes = [k for k in keys if k.endswith(MAX_SUFFIX)]
        out: dict[str, float] = {}
        for names, op in ((sums, dist.ReduceOp.SUM), (maxes, dist.ReduceOp.MAX)):
            if not names:
                continue
            t = torch.stack([m[k].detach().float().reshape(()) for k in names]).to(self.device)
            dist.all_reduce(t, op=op)
            out.update({k: float(v) for k, v in zip(names, t.tolist(), strict=True)})
        return out

    # ---- weights out -----------------------------------------------------------------------
    def param_plan(self, dtype: torch.dtype | None = None) -> list[tuple[str, list[int], torch.dtype]]:
        return [
            (n, list(t.shape), dtype if dtype is not None and t.is_floating_point() else t.dtype)
            for n, t in self.model.state_dict().items()
            if not lora_mod.is_adapter_name(n)
        ]

    def full_tensors(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        # One all-gather per tensor, issued only when the consumer asks for it, so a publisher can
        # broadcast one bucket while the next is being gathered. With LoRA the full weights are the
        # merged ones (W + scale * B A): a full-weight publish still serves the current policy.
        merged = {n + ".weight": m for n, m in self.model.named_modules() if isinstance(m, lora_mod.LoraLinear)}
        for name, t in self.model.state_dict().items():
            if lora_mod.is_adapter_name(name):
                continue
            if isinstance(t, DTensor) and self.offload:  # an offloaded shard: gather on the GPU
                t = t.to(self.device)
            full = (t.full_tensor() if isinstance(t, DTensor) else t).detach()
            if name in merged:
                full = lora_mod.merged_weight(merged[name], full)
            if dtype is not None and full.is_floating_point():
                full = full.to(dtype)
            yield name, full

    # ---- checkpoints -------------------------------------------------------------------------
    def save_checkpoint(self, path: Path, extra: dict[str, Any]) -> None:
        ckpt.save(
            Path(path),
            self.model,
            self.optimizer,
            self.scheduler,
            extra,
            self.rank,
            self.world_size,
            trained_only=self.cfg.lora is not None,
        )

    def load_checkpoint(self, path: Path) -> dict[str, Any]:
        return ckpt.load(
            Path(path),
            self.model,
            self.optimizer,
            self.scheduler,
            self.rank,
            self.world_size,
            trained_only=self.cfg.lora is not None,
        )

    def export_hf(self, path: Path, dtype: torch.dtype | None = None) -> None:
        """With LoRA: the merged model (what every HF consumer and a late-joining engine loads) and, in its
        ``adapter/`` subfolder, the peft adapter alone."""
        scales = {n: m.lora_scale for n, m in self.model.named_modules() if isinstance(m, lora_mod.LoraLinear)}
        ckpt.export_hf(
            Path(path),
            self.model,
            self.model_path,
            self.rank,
            dtype,
            transform=(lambda sd: lora_mod.merge_state_dict(sd, scales)) if scales else None,
        )
        if scales:
            self.export_adapter(Path(path) / "adapter", dtype)

    def export_adapter(self, path: Path, dtype: torch.dtype | None = None) -> int:
        """Collective: write the peft adapter folder (rank 0); returns its tensor bytes on rank 0."""
        if self.cfg.lora is None:
            raise RuntimeError("export_adapter needs learner.lora (this learner fine-tunes the whole model)")
        return lora_mod.save_adapter(
            path, self.model, self.cfg.lora, base_model_path=self.model_path, rank=self.rank, dtype=dtype
        )
