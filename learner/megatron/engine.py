"""The Megatron-core training engine: tensor, pipeline and data parallel GPTModel for Llama/Qwen2 models.

Layout: ``learner.megatron.tensor_model_parallel_size`` x ``pipeline_model_parallel_size`` GPUs per model
replica, data parallel over the rest (``parallel_state.initialize_model_parallel``). The model is
``GPTModel`` with the local (no Transformer Engine) layer spec, built from the HF config.json, bf16 on GPU
(``Float16Module``; fp32 main weights and Adam state in Megatron's (distributed) optimizer).

Same losses as FSDP: the loss of a micro-batch is ``learner.losses.policy_loss`` on the log-probs of its
response tokens. Log-probs with TP: the output layer's logits are vocab-sharded [T, Vp/tp]; we select the
response positions first ([n, Vp/tp]), all-gather them over TP (autograd-aware, backward = split) and
drop the vocab padding, then reuse ``learner.engine.logprobs_from_selected``. We chose the gather over
``tensor_parallel.vocab_parallel_cross_entropy`` because the entropy metric needs the whole distribution,
the padded vocab rows must be excluded, and only n response rows (not T) are gathered.

Chunked log-probs (``learner.logprobs``: ``chunked``, or ``auto`` on GPU; TP=1 only): the model never
produces logits. ``GPTModel.forward``'s ``output_processor`` hook receives the final hidden state (after
the final norm) on the last stage in place of the output layer call; we select the response rows and hand
them, with the output layer's (or the tied embedding's) weight, to ``learner.logprobs.chunked_logprobs``,
which builds at most ``learner.logprob_chunk`` rows of fp32 logits at a time (forward and backward). The
logits are the same fp32 function as ``fp32_output_layer``'s upcast head, computed from the bf16 operands
on tensor cores with fp32 accumulation (an fp32 matmul would run on the GPU's fp32 units, at a fraction of
the speed: on one H200 the upcast head halved the step's throughput). The hook returns [n, 2] (log-prob, entropy) as the model output, which the schedule hands to
``loss_func``; earlier pipeline stages return hidden states before the hook as before. With TP>1 the head is
vocab-sharded and ``auto`` keeps the full path (``chunked`` is refused by the config).

Optimizer: without Transformer Engine or apex, Megatron's Adam is torch's AdamW in its foreach mode;
``learner.fused_optimizer`` (auto: on GPU) sets its parameter groups to the fused kernel. ``compile_blocks``
(auto: on GPU) compiles each layer's MLP (the attention stays eager: the varlen metadata is module state).
``attn_implementation`` auto is varlen on GPU with PP=1 and no sequence parallelism; the micro-batch budget
and recompute (``micro_batch_tokens``/``activation_checkpointing`` auto) come from learner/fastpath.py.

Packing: one packed row per micro-batch, sequences kept apart by a block-diagonal causal mask built
from the restarting ``position_ids``. Megatron applies RoPE by absolute row position, which is exact
for packing because RoPE attention scores depend only on the distance between positions.

Loss scaling: Megatron's schedule divides each micro-batch loss by the number of micro-batches and its
DDP averages gradients over the data-parallel ranks; our losses are already normalised by the step's
global token count, so the loss handed to Megatron is multiplied by both to get the plain sum.

KL (``learner.loss.kl_coef > 0``): a frozen reference GPTModel of the same layout, built from the same HF
weights, gives ``ref_logp`` in ``prepare_logprobs`` through the same schedule (forward only, no grad);
``learner.reference_offload`` keeps its weights on the CPU between steps.

Limits: PP > 1 pads micro-batches to one length per step (p2p shapes);
weight decay skips biases and norms (Megatron's rule; FSDP decays all). Checkpoints: Megatron's
``dist_checkpointing`` (model + optimizer) under ``mcore/``, plus fleetrl's ``meta.json``/RNG files.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from learner.batch import MicroBatch, StepPlan
from learner.config import LearnerConfig
from learner.engine import TrainingEngine, logprobs_from_selected, lr_lambda
from learner.fastpath import DeviceProps, resolve_fast_path
from learner.fastpath import ModelShape as FastShape
from learner.losses import MAX_SUFFIX, LossSettings, combine_metrics, needs_proximal, policy_loss
from learner.megatron import convert as cv
from learner.megatron.weights import HFWeights, copy_hf_into, iter_hf_tensors, write_hf_export

logger = logging.getLogger(__name__)

INSTALL_HINT = "learner.engine=megatron needs megatron-core (Python >= 3.12): pip install fleetrl[megatron]"


def import_megatron():
    try:
        import megatron.core  # noqa: F401
    except ImportError as e:
        raise RuntimeError(f"{INSTALL_HINT} ({e})") from e
    import megatron.core as mc

    return mc


def fp32_output_layer(layer: torch.nn.Module) -> None:
    """Make the output layer compute in fp32: the bf16 hidden state and the (bf16) weight are cast up, so the
    logits, their TP gather and the log-softmax after them are fp32, as FSDP's fp32 root gives (a bf16 output
    layer rounds each logit to 2^-9 relative, ~1e-2 nats of log-prob noise against the engine). Gradients flow
    through the casts into the parameter as before (gradient accumulation fusion is off). A tied output layer
    is given the embedding weight by GPTModel; that weight is cast the same way."""
    forward = layer.forward

    def fp32_forward(input_, weight=None, runtime_gather_output=None):
        w = layer.weight if weight is None else weight
        return forward(input_.float(), weight=w.float(), runtime_gather_output=runtime_gather_output)

    layer.forward = fp32_forward


def transformer_config(hf: dict, shape: cv.ModelShape, mcfg, *, bf16: bool, recompute: bool = False):
    from megatron.core.transformer.transformer_config import TransformerConfig

    # Fusions off: they need apex / TE kernels, which the target environment does not have.
    return TransformerConfig(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden,
        num_attention_heads=shape.heads,
        num_query_groups=shape.kv_heads,
        kv_channels=shape.head_dim,
        ffn_hidden_size=shape.ffn,
        normalization="RMSNorm",
        layernorm_epsilon=hf.get("rms_norm_eps", 1e-6),
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=shape.qkv_bias,
        qk_layernorm=shape.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=mcfg.tensor_model_parallel_size,
        pipeline_model_parallel_size=mcfg.pipeline_model_parallel_size,
        sequence_parallel=mcfg.sequence_parallel,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        pipeline_dtype=torch.bfloat16 if bf16 else torch.float32,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        recompute_granularity="full" if recompute else None,
        recompute_method="uniform" if recompute else None,
        recompute_num_layers=1 if recompute else None,
        use_cpu_initialization=True,
        perform_initialization=False,
    )


def main_grads_finite(model, device) -> bool:
    """Whether every rank's DDP gradients (``main_grad``) are finite: one MAX all-reduce of a flag."""
    bad = torch.zeros(1, device=device)
    for p in model.parameters():
        g = getattr(p, "main_grad", None)
        if g is not None and not torch.isfinite(g).all():
            bad.fill_(1)
            break
    dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return not bool(bad)


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """torch RMSNorm usable with sequence parallelism (Megatron's local spec refuses SP without apex/TE).

    Under SP each TP rank normalises its own slice of the sequence, so the weight's gradient is partial
    on every rank; the ``sequence_parallel`` attribute makes ``finalize_model_grads`` sum it over TP.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused) -> None:
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = bool(config.sequence_parallel)


def layer_spec(sequence_parallel: bool, layers_here: int, varlen: bool = False, qk_norm: bool = False):
    """Megatron's local (no Transformer Engine) GPT layer spec; with SP, its norms replaced by ours; with
    ``varlen``, its core attention replaced by document-masked flash attention (learner/megatron/varlen.py)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=qk_norm)
    if varlen:
        from learner.megatron.varlen import core_attention_class

        spec.submodules.self_attention.submodules.core_attention = core_attention_class()
    if not sequence_parallel:
        return spec
    spec.submodules.input_layernorm = SequenceParallelRMSNorm
    spec.submodules.pre_mlp_layernorm = SequenceParallelRMSNorm
    return TransformerBlockSubmodules(layer_specs=[spec] * layers_here, layer_norm=SequenceParallelRMSNorm)


def rope_theta(hf: dict) -> float:
    rp = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if rp.get("rope_type", "default") not in ("default", None):
        raise ValueError(f"Megatron engine supports plain RoPE only, got rope_type {rp.get('rope_type')!r}")
    return float(rp.get("rope_theta") or hf.get("rope_theta") or 10000.0)


def packed_attention_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """[1, 1, T, T] bool, True where attention is NOT allowed: other sequences of the row, or the future."""
    pos = position_ids.view(-1)
    seg = torch.cumsum((pos == 0).to(torch.int32), 0)
    idx = torch.arange(pos.numel(), device=pos.device)
    allowed = (seg[:, None] == seg[None, :]) & (idx[None, :] <= idx[:, None])
    return (~allowed).view(1, 1, pos.numel(), pos.numel())


def pad_row(mb: MicroBatch, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids/position_ids padded to ``length`` with one extra sequence (never a target)."""
    n = mb.input_ids.shape[1]
    if n == length:
        return mb.input_ids, mb.position_ids
    extra = length - n
    ids = torch.cat([mb.input_ids, mb.input_ids.new_zeros((1, extra))], dim=1)
    pos = torch.cat([mb.position_ids, torch.arange(extra, device=mb.position_ids.device).view(1, -1)], dim=1)
    return ids, pos


def _torch_optimizers(opt) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside Megatron's (chained, distributed or fp32) optimizer wrapper."""
    parts = getattr(opt, "chained_optimizers", None) or [opt]
    return [p.optimizer for p in parts if isinstance(getattr(p, "optimizer", None), torch.optim.Optimizer)]


class MegatronEngine(TrainingEngine):
    def __init__(self, cfg: LearnerConfig, model_path: str, total_steps: int, seed: int = 0) -> None:
        import_megatron()
        from megatron.core import parallel_state as ps
        from megatron.core import tensor_parallel
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.transformer.module import Float16Module

        if not dist.is_initialized():
            raise RuntimeError("MegatronEngine needs torch.distributed initialised (nccl on GPU)")
        self.cfg, self.mcfg, self.model_path = cfg, cfg.megatron, model_path
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.loss = LossSettings.from_config(cfg.loss, cfg.rollout_correction)
        on_gpu = dist.get_backend() == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
        self.hf_config = json.loads((Path(model_path) / "config.json").read_text())
        mc = self.mcfg
        mc.check_layout(self.world_size, self.hf_config)
        tp, pp = mc.tensor_model_parallel_size, mc.pipeline_model_parallel_size
        if not ps.model_parallel_is_initialized():
            ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        self.tp, self.pp = tp, pp
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        self._dp_rank, self._dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        torch.manual_seed(seed)
        if on_gpu:
            tensor_parallel.model_parallel_cuda_manual_seed(seed)

        # Chunked log-probs (module docstring): auto = on GPU with TP=1; chunked with TP>1 is a config error.
        if cfg.logprobs == "chunked" and tp > 1:
            raise ValueError("learner.logprobs=chunked needs tensor_model_parallel_size=1 on the Megatron engine")
        # Every auto (varlen attention: GPU, PP=1, no SP; chunked head; fused AdamW; compiled MLPs; micro-batch
        # budget and recompute) decided once: learner/fastpath.py
        self.settings = resolve_fast_path(
            cfg, self._device_props(on_gpu), FastShape.from_hf(self.hf_config) if on_gpu else None, self.world_size
        )
        if self.rank == 0:
            logger.info("%s", self.settings.describe())
        self.varlen = self.settings.varlen
        self.chunked = self.settings.chunked_logprobs
        self.shape = cv.ModelShape.from_hf(self.hf_config, tp=tp)
        self.shape.check_tp(tp)
        self.tcfg = transformer_config(
            self.hf_config, self.shape, mc, bf16=on_gpu, recompute=self.settings.activation_checkpointing
        )
        per_stage = self.shape.num_layers // pp
        self.layers = list(range(self.pp_rank * per_stage, (self.pp_rank + 1) * per_stage))
        self.pre, self.post = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
        model = self._build_gpt()
        self.gpt = model  # unwrapped: parameter names without the wrappers' prefixes
        model.to(self.device)
        if on_gpu:
            model = Float16Module(self.tcfg, model)
        # KL reference: a second GPTModel of the same TP/PP layout from the same HF weights, frozen, run
        # through the same schedule and log-prob code (forward only). No DDP wrapper, no optimizer. With
        # reference_offload its weights live in pinned CPU memory and are copied in for each prepare
        # (like FSDP's CPUOffloadPolicy); being frozen, nothing is copied back.
        self.ref: torch.nn.Module | None = None
        self.ref_offload = on_gpu and cfg.reference_offload
        self._ref_cpu: list[torch.Tensor] = []
        if cfg.loss.kl_coef > 0:
            ref = self._build_gpt()
            ref.requires_grad_(False)
            if on_gpu:
                ref = Float16Module(self.tcfg, ref)  # the policy's bf16 compute path: equal weights, equal log-probs
            self.ref = ref.eval().to("cpu" if self.ref_offload else self.device)
            if self.ref_offload:
                self._ref_cpu = [p.data.pin_memory() for p in self.ref.parameters()]
                self._reference_on_gpu(False)
        ddp_cfg = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=mc.use_distributed_optimizer
        )
        self.model = DistributedDataParallel(config=self.tcfg, ddp_config=ddp_cfg, module=model)
        self.tcfg.finalize_model_grads_func = finalize_model_grads
        o = cfg.optim
        ocfg = OptimizerConfig(
            optimizer="adam",
            lr=o.lr,
            min_lr=o.lr * o.min_lr_ratio,
            weight_decay=o.weight_decay,
            adam_beta1=o.betas[0],
            adam_beta2=o.betas[1],
            adam_eps=o.eps,
            clip_grad=o.grad_clip,
            bf16=on_gpu,
            params_dtype=torch.bfloat16 if on_gpu else torch.float32,
            use_distributed_optimizer=mc.use_distributed_optimizer,
        )
        self.optimizer = get_megatron_optimizer(ocfg, [self.model])
        # Without Transformer Engine/apex Megatron's Adam is torch.optim.AdamW in its default (foreach) mode;
        # learner.fused_optimizer (auto: on GPU) switches its groups to the fused CUDA kernel, as FSDP does.
        self.fused_optimizer = on_gpu and self.settings.fused_optimizer
        if self.fused_optimizer:
            for inner in _torch_optimizers(self.optimizer):
                for g in inner.param_groups:
                    g.update(fused=True, foreach=False)
        # learner.compile_blocks: torch.compile of each layer's MLP (fc1, SwiGLU, fc2: shapes only, no packing
        # state; the attention, whose varlen metadata is module state, stays eager). dynamic=True: one graph for
        # every micro-batch's token count (learner.fastpath.compile_blocks says why).
        if self.settings.compile_blocks and on_gpu:
            from torch import _dynamo

            _dynamo.config.cache_size_limit = max(_dynamo.config.cache_size_limit, 8 * len(self.layers))
            for layer in self.gpt.decoder.layers:
                layer.mlp.forward = torch.compile(layer.mlp.forward, dynamic=True)
        self.lr_fn = lr_lambda(o.schedule, o.warmup_steps, total_steps, o.min_lr_ratio)
        self.steps_taken = 0
        n_local = sum(p.numel() for p in self.gpt.parameters())
        logger.info(
            "Megatron engine: rank %d/%d tp %d/%d pp %d/%d dp %d/%d on %s, %d local parameters, chunked "
            "log-probs %s, fused AdamW %s, model %s",
            self.rank,
            self.world_size,
            self.tp_rank,
            tp,
            self.pp_rank,
            pp,
            self.data_rank,
            self.data_world_size,
            self.device,
            n_local,
            self.chunked,
            self.fused_optimizer,
            model_path,
        )

    def _device_props(self, on_gpu: bool) -> DeviceProps:
        """This rank's device; on GPU the least free memory of any rank (all plan the same micro-batches)."""
        props = DeviceProps.probe(self.device)
        if on_gpu and self.world_size > 1:
            free = torch.tensor([props.free_bytes], dtype=torch.int64, device=self.device)
            dist.all_reduce(free, op=dist.ReduceOp.MIN)
            props = dataclasses.replace(props, free_bytes=int(free))
        return props

    def _reference_on_gpu(self, on: bool) -> None:
        """Offloaded reference: point its parameters at GPU copies of the pinned CPU weights, or back."""
        for p, cpu in zip(self.ref.parameters(), self._ref_cpu, strict=True):
            p.data = cpu.to(self.device, non_blocking=True) if on else cpu

    def _build_gpt(self) -> torch.nn.Module:
        """This rank's stage of the GPTModel (layers ``self.layers``, embedding on the first stage, final norm
        and output layer on the last), its parameters overwritten with their shards of the HF weights."""
        from megatron.core.models.gpt import GPTModel

        model = GPTModel(
            config=self.tcfg,
            transformer_layer_spec=layer_spec(
                self.mcfg.sequence_parallel, len(self.layers), self.varlen, self.shape.qk_norm
            ),
            vocab_size=self.shape.padded_vocab,
            max_sequence_length=int(self.hf_config.get("max_position_embeddings", 4096)),
            pre_process=self.pre,
            post_process=self.post,
            parallel_output=True,
            share_embeddings_and_output_weights=self.shape.tied,
            position_embedding_type="rope",
            rotary_base=rope_theta(self.hf_config),
        )
        with HFWeights(self.model_path) as hf:
            copy_hf_into(model, hf, self.shape, tp=self.tp, tp_rank=self.tp_rank, layer_offset=self.layers[0])
        if self.post:
            fp32_output_layer(model.output_layer)
        return model

    @property
    def data_rank(self) -> int:
        return self._dp_rank

    @property
    def data_world_size(self) -> int:
        return self._dp_size

    # ---- forward ---------------------------------------------------------------------------
    def _row_length(self, mbs: list[MicroBatch]) -> int | None:
        """None: each micro-batch keeps its length; else one padded length (PP p2p needs fixed shapes)."""
        longest = max(mb.n_tokens for mb in mbs)
        if self.pp > 1:
            t = torch.tensor([longest], device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            longest = int(t)
        elif not self.mcfg.sequence_parallel:
            return None
        return -(-longest // self.tp) * self.tp  # sequence parallel splits the sequence over TP

    def _inputs(self, mb: MicroBatch, length: int | None):
        mb.to(self.device)
        if self.varlen:
            from learner.megatron.varlen import set_segments

            set_segments(mb.cu_seqlens, mb.max_seqlen)  # set by plan_step; no [T, T] mask is built
            return mb.input_ids, mb.position_ids, None
        if length is None:
            ids, pos = mb.input_ids, mb.position_ids
        else:
            ids, pos = pad_row(mb, -(-max(length, mb.n_tokens) // self.tp) * self.tp)
        return ids, pos, packed_attention_mask(pos)

    def _head_kwargs(self, mb: MicroBatch) -> dict[str, Any]:
        """GPTModel.forward kwargs: the chunked head as its output processor, or none (full logits)."""
        if not self.chunked:
            return {}
        return {"output_processor": self._chunked_head, "output_processor_context": mb}

    def _chunked_head(
        self,
        *,
        hidden_states: torch.Tensor,
        output_layer: torch.nn.Module,
        output_weight: torch.Tensor | None,
        context: MicroBatch,
        **_unused,
    ) -> torch.Tensor:
        """GPTModel's output processor (last stage): [S, 1, H] final hidden state -> [n, 2] (log-prob, entropy)."""
        from learner.logprobs import chunked_logprobs

        mb = context
        w = output_layer.weight if output_weight is None else output_weight  # tied: the embedding weight
        h = hidden_states[mb.target_index, 0]  # [n, H] response positions only
        # fp32 logits from the bf16 operands (tensor cores, fp32 accumulation: learner/logprobs.py), the same
        # function as fp32_output_layer's upcast head; the vocab padding rows dropped
        logp, ent = chunked_logprobs(
            h,
            w[: self.shape.vocab],
            mb.targets,
            self.cfg.temperature,
            self.cfg.logprob_chunk,
            fused=self.settings.fused_head,
        )
        return torch.stack([logp, ent.detach()], dim=-1)

    def _logprobs(self, logits: torch.Tensor, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        if self.chunked:  # the model's output is already [n, 2] from _chunked_head
            return logits[:, 0], logits[:, 1]
        sel = logits[0, mb.target_index]  # [n, Vp/tp]
        if self.tp > 1:
            sel = gather_from_tensor_model_parallel_region(sel)
        return logprobs_from_selected(sel[:, : self.shape.vocab], mb.targets, self.cfg.temperature)

    def forward_logprobs(self, mb: MicroBatch, *, grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        if self.pp > 1:
            raise NotImplementedError("forward_logprobs of one micro-batch needs PP=1; use prepare_logprobs")
        ids, pos, mask = self._inputs(mb, self._row_length([mb]))
        with torch.set_grad_enabled(grad):
            logits = self.model(input_ids=ids, position_ids=pos, attention_mask=mask, **self._head_kwargs(mb))
            return self._logprobs(logits, mb)

    def _run(
        self, mbs: list[MicroBatch], loss_of, forward_only: bool, model: torch.nn.Module | None = None
    ) -> list[dict[str, torch.Tensor]]:
        """Megatron's forward/backward schedule over the micro-batches; ``loss_of(logp, ent, mb)`` on the last stage.

        ``model``: the policy (default) or the frozen KL reference (forward only)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        length = self._row_length(mbs)
        parts: list[dict[str, torch.Tensor]] = []
        scale = float(len(mbs) * self.data_world_size)

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            ids, pos, mask = self._inputs(mb, length)
            out = model(input_ids=ids, position_ids=pos, attention_mask=mask, **self._head_kwargs(mb))

            def loss_func(logits):
                logp, ent = self._logprobs(logits, mb)
                loss, m = loss_of(logp, ent, mb)
                parts.append(m)
                return loss * scale, {}

            return out, loss_func

        seq = length or max(mb.n_tokens for mb in mbs)
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(mbs),
            model=[self.model if model is None else model],
            num_microbatches=len(mbs),
            seq_length=seq,
            micro_batch_size=1,
            forward_only=forward_only,
        )
        return parts

    def needs_proximal(self) -> bool:
        return needs_proximal(self.loss.correction, self.cfg.recompute_proximal, self.cfg.several_optimizer_steps)

    def prepare_logprobs(self, plan: StepPlan) -> None:
        if self.needs_proximal():
            self.model.eval()

            def keep(logp, ent, mb):
                mb.prox_logp = logp.detach()
                return logp.sum() * 0.0, {}

            with torch.no_grad():
                self._run(plan.micro_batches, keep, forward_only=True)
        if self.ref is not None:

            def keep_ref(logp, ent, mb):
                mb.ref_logp = logp.detach()
                return logp.sum() * 0.0, {}

            if self.ref_offload:
                self._reference_on_gpu(True)
            try:
                with torch.no_grad():
                    self._run(plan.micro_batches, keep_ref, forward_only=True, model=self.ref)
            finally:
                if self.ref_offload:
                    self._reference_on_gpu(False)

    # ---- step ------------------------------------------------------------------------------
    def train_step(self, plan: StepPlan, *, step_scheduler: bool = True) -> dict[str, float]:
        t0 = time.perf_counter()
        if self.needs_proximal() and self.post and any(mb.prox_logp is None for mb in plan.micro_batches):
            raise RuntimeError(f"correction={self.loss.correction!r} needs prepare_logprobs(plan) before train_step")
        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

        def loss_of(logp, ent, mb):
            return policy_loss(
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
            )

        parts = self._run(plan.micro_batches, loss_of, forward_only=False)
        lr = self.cfg.optim.lr * self.lr_fn(self.steps_taken)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        finite = main_grads_finite(self.model, self.device)
        empty = plan.stats.get("samples_trained", 1.0) == 0
        grad_norm = float("nan")
        if finite and not empty:
            ok, norm, _ = self.optimizer.step()
            grad_norm = float(norm) if norm is not None else float("nan")
            finite = bool(ok)
        elif not finite:
            logger.error("non-finite gradients: optimizer step skipped")
        else:
            grad_norm = 0.0
        if step_scheduler:  # the LR schedule counts step batches (policy versions), not optimizer steps
            self.steps_taken += 1
        metrics = self._reduce(combine_metrics(parts) if parts else {})
        metrics.update(
            grad_norm=grad_norm, lr=lr, step_skipped=float(not finite or empty), step_seconds=time.perf_counter() - t0
        )
        return metrics

    def _reduce(self, m: dict[str, torch.Tensor]) -> dict[str, float]:
        """Sum (max) over data-parallel replicas on the last stage; every TP rank there holds the same values."""
        from megatron.core import parallel_state as ps

        out: dict[str, float] = {}
        keys = sorted(m)
        for names, op in (
            ([k for k in keys if not k.endswith(MAX_SUFFIX)], dist.ReduceOp.SUM),
            ([k for k in keys if k.endswith(MAX_SUFFIX)], dist.ReduceOp.MAX),
        ):
            if names:
                t = torch.stack([m[k].detach().float().reshape(()) for k in names]).to(self.device)
                dist.all_reduce(t, op=op, group=ps.get_data_parallel_group())
                out.update(zip(names, t.tolist(), strict=True))
        if self.pp > 1:  # only the last stage evaluated the loss
            box = [out]
            dist.broadcast_object_list(
                box, src=ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group()
            )
            out = box[0]
        return out

    # ---- weights out -----------------------------------------------------------------------
    def param_plan(self, dtype: torch.dtype | None = None) -> list[tuple[str, list[int], torch.dtype]]:
        own = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        return [(n, s, dtype or own) for m in cv.megatron_names(self.shape) for n, s in cv.hf_shape_of(m, self.shape)]

    def full_tensors(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        # Gathered one Megatron parameter at a time (all-gather over TP, then p2p to global rank 0 for
        # layers of later pipeline stages), so the publisher can broadcast a bucket while the next is built.
        yield from iter_hf_tensors(self, dtype)

    # ---- checkpoints -------------------------------------------------------------------------
    def save_checkpoint(self, path: Path, extra: dict[str, Any]) -> None:
        from learner.megatron.checkpoint import save

        save(self, Path(path), extra)

    def load_checkpoint(self, path: Path) -> dict[str, Any]:
        from learner.megatron.checkpoint import load

        return load(self, Path(path))

    def export_hf(self, path: Path, dtype: torch.dtype | None = None) -> None:
        write_hf_export(self, Path(path), dtype)
