"""PPO's value model (the critic) on the Megatron engine, beside the Megatron actor (learner/critic.py is FSDP's).

The critic is a Megatron-core ``GPTModel`` of the critic checkpoint's family (``learner.critic.model_path``,
default the actor's ``model.path``; Llama / Qwen2 / Qwen3 / Mistral as the engine converts them) whose
body (embedding, decoder layers, final norm) is loaded from the HF weights and whose vocabulary output
layer is replaced by a fresh scalar head (:class:`ValueHead`, ``hidden -> 1`` with a bias, weights
N(0, initializer_range), bias 0, as transformers initialises ``AutoModelForTokenClassification``'s
``score``), the same model verl's critic and the FSDP critic build. Values are fp32: the head casts the
(bf16 on GPU) final hidden state and its weights up before its matmul, as the actor's fp32 output layer.

It reuses the actor's parallel state and packing: the same micro-batches, the engine's inputs (varlen
segments on GPU, the block-diagonal mask on CPU), its own DDP wrapper, Megatron optimizer (AdamW with the
critic's lr, betas, eps, weight decay and ``critic.grad_clip``), LR schedule, and a Megatron distributed
checkpoint in ``checkpoints/step_N/critic/``. The values are read through GPTModel's ``output_processor``
hook (the hidden states of the response positions only), so no vocabulary-sized tensor is ever built.

GAE, whitening and the value loss are the FSDP critic's (:class:`learner.critic.Critic`'s ``prepare``,
``train`` and ``_weights``): only the model, its forward and its optimizer step differ.

Layout: the actor's tensor parallelism (and sequence parallelism) and data parallelism; pipeline parallel
size 1, refused otherwise by the config (with PP > 1 the values would exist on the last stage only and the
metrics would have to be broadcast along the pipeline, which is not built). The head is replicated on the
tensor-parallel ranks, which all see the whole final hidden state (gathered over the sequence under
sequence parallelism) and so compute the same values; whitening moments and metrics are reduced over the
data-parallel group, where each token is held once.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch
import torch.distributed as dist

from learner.batch import MicroBatch, StepPlan
from learner.checkpoint import PART_SCHEDULER
from learner.config import LearnerConfig
from learner.critic import Critic
from learner.engine import lr_lambda
from learner.gae import value_loss
from learner.losses import combine_metrics
from learner.megatron import convert as cv
from learner.megatron.checkpoint import adam_steps, load_model_and_optimizer, save_model_and_optimizer
from learner.megatron.engine import (
    _torch_optimizers,
    import_megatron,
    layer_spec,
    main_grads_finite,
    rope_theta,
    transformer_config,
)
from learner.megatron.weights import HFWeights, copy_hf_into

logger = logging.getLogger(__name__)


class ValueHead(torch.nn.Module):
    """``hidden -> 1`` in fp32 whatever the parameters' dtype (Float16Module makes them bf16 on GPU)."""

    def __init__(self, hidden: int, init_std: float, seed: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(1, hidden))
        self.bias = torch.nn.Parameter(torch.zeros(1))
        with torch.random.fork_rng(devices=[]):  # the same head on every rank, the global RNG untouched
            torch.manual_seed(seed)
            torch.nn.init.normal_(self.weight, std=init_std)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """[n, H] hidden states -> [n] fp32 values."""
        return torch.nn.functional.linear(h.float(), self.weight.float(), self.bias.float())[:, 0]


class MegatronCritic(Critic):
    """One rank's replica of the Megatron value model, its optimizer and schedule. Every method is collective."""

    def __init__(self, cfg: LearnerConfig, actor_model_path: str, *, total_steps: int, seed: int = 0, engine) -> None:
        """``engine``: the actor's :class:`learner.megatron.engine.MegatronEngine` on this rank."""
        import_megatron()
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.models.gpt import GPTModel
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.transformer.module import Float16Module

        if cfg.critic is None:
            raise ValueError("MegatronCritic needs learner.critic")
        from megatron.core import parallel_state as ps
        from megatron.core import tensor_parallel

        if engine.pp != 1:
            raise ValueError(f"the Megatron critic needs pipeline_model_parallel_size=1, got {engine.pp}")
        self.cfg, self.c, self.engine = cfg, cfg.critic, engine
        self.model_path = self.c.model_path or actor_model_path
        self.rank, self.world_size, self.device = engine.rank, engine.world_size, engine.device
        on_gpu = self.device.type == "cuda"
        hf_cfg = json.loads((Path(self.model_path) / "config.json").read_text())
        tp, self.sp = engine.tp, engine.mcfg.sequence_parallel
        self.shape = cv.ModelShape.from_hf(hf_cfg, tp=tp)
        self.shape.check_tp(tp)
        self.reduce_group = ps.get_data_parallel_group()
        self.tcfg = transformer_config(
            hf_cfg, self.shape, engine.mcfg, bf16=on_gpu, recompute=engine.settings.activation_checkpointing
        )
        gpt = GPTModel(
            config=self.tcfg,
            transformer_layer_spec=layer_spec(self.sp, self.shape.num_layers, engine.varlen, self.shape.qk_norm),
            vocab_size=self.shape.padded_vocab,
            max_sequence_length=int(hf_cfg.get("max_position_embeddings", 4096)),
            pre_process=True,
            post_process=True,
            parallel_output=True,
            share_embeddings_and_output_weights=False,
            position_embedding_type="rope",
            rotary_base=rope_theta(hf_cfg),
        )
        gpt.output_layer = None  # the vocabulary head is never used: values come through output_processor
        with HFWeights(self.model_path) as hf:
            copy_hf_into(gpt, hf, self.shape, tp=tp, tp_rank=engine.tp_rank, layer_offset=0)
        gpt.value_head = ValueHead(self.shape.hidden, float(hf_cfg.get("initializer_range", 0.02)), seed)
        for p in gpt.value_head.parameters():  # replicated over TP: counted once by the gradient-norm clip
            tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(p)
        gpt.to(self.device)
        self.gpt = gpt  # unwrapped: parameter names without the wrappers' prefixes
        model = Float16Module(self.tcfg, gpt) if on_gpu else gpt
        mc = engine.mcfg
        ddp_cfg = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=mc.use_distributed_optimizer
        )
        self.model = DistributedDataParallel(config=self.tcfg, ddp_config=ddp_cfg, module=model)
        self.tcfg.finalize_model_grads_func = finalize_model_grads
        o = self.c.optim
        ocfg = OptimizerConfig(
            optimizer="adam",
            lr=o.lr,
            min_lr=o.lr * o.min_lr_ratio,
            weight_decay=o.weight_decay,
            adam_beta1=o.betas[0],
            adam_beta2=o.betas[1],
            adam_eps=o.eps,
            clip_grad=self.c.grad_clip,
            bf16=on_gpu,
            params_dtype=torch.bfloat16 if on_gpu else torch.float32,
            use_distributed_optimizer=mc.use_distributed_optimizer,
        )
        self.optimizer = get_megatron_optimizer(ocfg, [self.model])
        if on_gpu and engine.fused_optimizer:
            for inner in _torch_optimizers(self.optimizer):
                for g in inner.param_groups:
                    g.update(fused=True, foreach=False)
        self.lr_fn = lr_lambda(o.schedule, o.warmup_steps, total_steps, o.min_lr_ratio)
        self.steps_taken = 0
        self.epochs = self.c.ppo_epochs or cfg.ppo_epochs
        self._checkpointing = True  # recompute, when on, is built into the transformer config above
        logger.info(
            "Megatron critic: rank %d/%d on %s, %d parameters, from %s",
            self.rank,
            self.world_size,
            self.device,
            sum(p.numel() for p in gpt.parameters()),
            self.model_path,
        )

    # ---- values ------------------------------------------------------------------------------
    def _head(self, *, hidden_states: torch.Tensor, context: MicroBatch, **_unused) -> torch.Tensor:
        """GPTModel's output processor: [S, 1, H] final hidden state -> [n] fp32 values at the response positions.
        Under sequence parallelism each TP rank holds a slice of S: gathered first (every TP rank computes the
        same loss from the whole sequence, so the backward only splits the gradient: no reduction)."""
        if self.sp:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden_states = gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=False)
        return self.gpt.value_head(hidden_states[context.target_index, 0])

    def values(self, mb: MicroBatch, *, grad: bool = False) -> torch.Tensor:
        ids, pos, mask = self.engine._inputs(mb, self.engine._row_length([mb]))
        with torch.set_grad_enabled(grad):
            out = self.model(
                input_ids=ids,
                position_ids=pos,
                attention_mask=mask,
                output_processor=self._head,
                output_processor_context=mb,
            )
            return out.float()

    def loss_of(self, v: torch.Tensor, mb: MicroBatch, plan: StepPlan) -> tuple[torch.Tensor, dict]:
        """The value loss of one micro-batch (weights sum to one over the optimizer step, every rank)."""
        return value_loss(v, mb.values, mb.returns, self._weights(mb, plan), self.c.cliprange_value)

    # ---- training ------------------------------------------------------------------------------
    def train_step(self, plan: StepPlan, *, step_scheduler: bool = True) -> dict[str, float]:
        """One optimizer step of the value loss through Megatron's schedule; metrics reduced over ranks."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        if any(mb.returns is None for mb in plan.micro_batches):
            raise RuntimeError("MegatronCritic.train_step needs prepare(plans) first (values and returns)")
        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        mbs = plan.micro_batches
        parts: list[dict] = []
        # Megatron divides each micro-batch loss by their number and DDP averages over ranks; the weights
        # already sum to one over the step: multiply both back (as the actor engine does)
        scale = float(len(mbs) * self.engine.data_world_size)

        length = self.engine._row_length(mbs)

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            ids, pos, mask = self.engine._inputs(mb, length)
            out = model(
                input_ids=ids,
                position_ids=pos,
                attention_mask=mask,
                output_processor=self._head,
                output_processor_context=mb,
            )

            def loss_func(v):
                loss, m = self.loss_of(v.float(), mb, plan)
                parts.append(m)
                return loss * scale, {}

            return out, loss_func

        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(mbs),
            model=[self.model],
            num_microbatches=len(mbs),
            seq_length=length or max(mb.n_tokens for mb in mbs),
            micro_batch_size=1,
            forward_only=False,
        )
        lr = self.c.optim.lr * self.lr_fn(self.steps_taken)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        finite = main_grads_finite(self.model, self.device)
        grad_norm = float("nan")
        if finite and plan.stats.get("samples_trained", 1.0) > 0:
            ok, norm, _ = self.optimizer.step()
            grad_norm = float(norm) if norm is not None else float("nan")
        elif not finite:
            logger.error("critic: non-finite gradients: optimizer step skipped")
        else:
            grad_norm = 0.0
        if step_scheduler:
            self.steps_taken += 1
        m = combine_metrics(parts)
        names = sorted(m)
        t = torch.stack([m[k].detach().float().reshape(()) for k in names]).to(self.device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.reduce_group)
        out = {k: float(x) for k, x in zip(names, t.tolist(), strict=True)}
        out.update(grad_norm=grad_norm, lr=lr)
        return out

    # ---- checkpoints -----------------------------------------------------------------------------
    def model_sharded_state_dict(self) -> dict:
        """The body and value head as Megatron's sharded tensors. GPTModel's own method marks
        ``output_layer.weight`` whenever ``post_process`` is set, and the critic has dropped that head (its
        values come through ``output_processor``), so the flag is lowered for the call: the final norm
        belongs to the decoder, which keeps its own ``post_process``."""
        self.gpt.post_process = False
        try:
            return self.gpt.sharded_state_dict()
        finally:
            self.gpt.post_process = True

    def save(self, path: Path) -> None:
        """Collective: the critic's model and optimizer shards (Megatron's distributed checkpoint) and its
        schedule position, in ``path`` (written before the actor's ``meta.json`` marks the folder complete)."""
        path = Path(path)
        t0 = time.perf_counter()
        if self.rank == 0:
            (path / "mcore").mkdir(parents=True, exist_ok=True)
        dist.barrier()
        save_model_and_optimizer(self.model_sharded_state_dict(), self.optimizer, path / "mcore")
        if self.rank == 0:
            part = {"steps_taken": self.steps_taken, "adam_steps": adam_steps(self.optimizer)}
            (path / PART_SCHEDULER).write_text(json.dumps(part))
        dist.barrier()
        logger.info("Megatron critic saved in %s (%.1f s)", path, time.perf_counter() - t0)

    def load(self, path: Path) -> None:
        path = Path(path)
        if not (path / PART_SCHEDULER).exists():
            raise FileNotFoundError(
                f"{path} holds no saved critic (no {PART_SCHEDULER}): the checkpoint was written without learner.critic"
            )
        part = json.loads((path / PART_SCHEDULER).read_text())
        load_model_and_optimizer(
            self.gpt, self.model_sharded_state_dict(), self.optimizer, path / "mcore", part.get("adam_steps")
        )
        self.steps_taken = int(part["steps_taken"])
        logger.info("Megatron critic loaded: %s", path)
