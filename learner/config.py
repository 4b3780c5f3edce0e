"""Learner config: training engine, optimizer, loss and checkpointing."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from core.configbase import ConfigError, ConfigModel
from learner.lora_config import MEGATRON_REFUSED, LoraConfig

# KL estimator names (verl's aliases included) -> the estimator used; learner/kl.py explains each.
KL_ALIASES = {"k2": "k2", "mse": "k2", "k3": "k3", "low_var_kl": "k3"}
K1_REFUSED = ("kl_estimator 'k1' in the loss has zero expected gradient (E_pi[grad log pi] = 0), so the penalty "
              "would do nothing; use 'k2' (alias 'mse', gradient of KL(pi || ref)) or 'k3' (alias 'low_var_kl', "
              "gradient of KL(ref || pi))")


def resolve_kl_estimator(name: str) -> str:
    """The estimator behind a user-facing name; raises ValueError naming the choices."""
    if name == "k1":
        raise ValueError(K1_REFUSED)
    try:
        return KL_ALIASES[name]
    except KeyError:
        raise ValueError(f"kl_estimator must be one of {sorted(KL_ALIASES)}, got {name!r}") from None


class OptimConfig(ConfigModel):
    lr: float = Field(1e-5, gt=0, le=1.0)
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = Field(0.0, ge=0)
    eps: float = Field(1e-8, gt=0)
    warmup_steps: int = Field(0, ge=0)
    schedule: Literal["constant", "cosine", "linear"] = "constant"
    grad_clip: float = Field(1.0, gt=0)
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="floor of the cosine/linear decay, as a fraction of lr")


class LossConfig(ConfigModel):
    correction: Literal["none", "tis", "decoupled"] = Field(
        description="off-policy correction; required. 'none' is legal only with broker.max_staleness = 0"
    )
    advantage: Literal["mean", "mean_std"] = "mean_std"
    drop_uniform_groups: bool = Field(True, description="drop groups whose rewards are all equal (zero advantage)")
    clip_low: float = Field(0.2, gt=0, lt=1)
    clip_high: float = Field(0.28, gt=0)
    clip_ratio_c: float = Field(3.0, gt=1, description="dual-clip: for A < 0 the per-token loss is capped at "
                                "clip_ratio_c * |A| (bounds a token whose ratio exploded)")
    tis_cap: float = Field(2.0, ge=1.0, description="truncation of the behaviour importance weight")
    aggregation: Literal["token", "sequence"] = "token"
    kl_coef: float = Field(0.0, ge=0)
    kl_estimator: str = Field("k3", description="KL-to-reference term in the loss: 'k2' (alias 'mse'): gradient of "
                              "KL(pi || ref); 'k3' (alias 'low_var_kl'): value estimates KL(pi || ref), gradient is "
                              "that of KL(ref || pi). 'k1' is refused (zero expected gradient). See learner/kl.py")

    @field_validator("kl_estimator")
    @classmethod
    def _kl_estimator(cls, v: str) -> str:
        resolve_kl_estimator(v)
        return v
    mask_truncated: bool = Field(False, description="leave responses cut at max_tokens (finish reason 'length') out "
                                 "of the loss; set by reward.on_truncated=mask")


class MegatronConfig(ConfigModel):
    tensor_model_parallel_size: int = Field(1, ge=1)
    pipeline_model_parallel_size: int = Field(1, ge=1)
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = True

    def check_layout(self, learner_gpus: int, hf_config: dict) -> None:
        """Raise ConfigError, before any process starts, if the parallel layout cannot split
        ``learner_gpus`` GPUs or the model described by ``hf_config`` (its config.json)."""
        tp, pp = self.tensor_model_parallel_size, self.pipeline_model_parallel_size
        heads = hf_config["num_attention_heads"]
        kv_heads = hf_config.get("num_key_value_heads") or heads
        layers = hf_config["num_hidden_layers"]
        problems = []
        if learner_gpus < 1:
            problems.append("learner.engine=megatron needs GPUs, but --learner-gpus is 0")
        elif learner_gpus % (tp * pp):
            problems.append(f"learner.megatron.tensor_model_parallel_size x pipeline_model_parallel_size = "
                            f"{tp} x {pp} = {tp * pp} does not divide --learner-gpus {learner_gpus}")
        if heads % tp:
            problems.append(f"learner.megatron.tensor_model_parallel_size={tp} does not divide the model's "
                            f"{heads} attention heads")
        if kv_heads % tp:
            problems.append(f"learner.megatron.tensor_model_parallel_size={tp} does not divide the model's "
                            f"{kv_heads} key/value heads")
        if layers % pp:
            problems.append(f"learner.megatron.pipeline_model_parallel_size={pp} does not divide the model's "
                            f"{layers} layers")
        if self.sequence_parallel and tp == 1:
            problems.append("learner.megatron.sequence_parallel=true needs tensor_model_parallel_size > 1")
        if problems:
            raise ConfigError("invalid Megatron layout:\n  " + "\n  ".join(problems))


class LearnerConfig(ConfigModel):
    engine: Literal["fsdp", "megatron"] = "fsdp"
    cpu_processes: int = Field(1, ge=1, le=64, description="learner ranks (gloo) with --learner-gpus 0; "
                               "with GPUs the learner has one rank per GPU and this must stay 1")
    optim: OptimConfig = OptimConfig()
    loss: LossConfig
    micro_batch_tokens: int = Field(8192, ge=16, description="token budget of one packed micro-batch")
    activation_checkpointing: bool = False
    attn_implementation: Literal["auto", "varlen", "sdpa", "eager", "flash_attention_2"] = Field(
        "auto", description="auto: varlen on GPU (document-masked flash attention, learner/attention.py), sdpa on "
        "CPU; sdpa and eager keep packed sequences apart with a mask from position_ids")
    # FSDP fast paths (learner/fastpath.py); auto = on for GPU ranks, off on CPU
    logprobs: Literal["auto", "chunked", "full"] = Field(
        "auto", description="chunked: log-probs/entropy from the last hidden state in vocab chunks (no full logits)")
    logprob_chunk: int = Field(4096, ge=1, description="response tokens per chunk of the chunked log-prob path")
    fused_optimizer: Literal["auto", "on", "off"] = "auto"
    meta_init: Literal["auto", "on", "off"] = Field(
        "auto", description="build on the meta device and load each rank's shards from safetensors")
    compile_blocks: bool = Field(False, description="torch.compile each decoder layer's forward (FSDP); "
                                   "Megatron: each layer's MLP")
    temperature: float = Field(1.0, gt=0, description="sampling temperature the fleet used; must equal rollout.sampling.temperature")
    ppo_mini_batch_size: int | None = Field(
        None, ge=1, description="prompt groups per optimizer step; None: all groups of the step batch (one optimizer "
        "step). Smaller values give several optimizer steps per step batch, against proximal log-probs computed once "
        "before the first: the trust region that clip_low/clip_high and decoupled PPO act on")
    ppo_epochs: int = Field(1, ge=1, description="passes over the step batch's mini-batches")
    logprob_probe_tolerance: float | Literal["auto"] | None = Field(
        "auto", description="first step: the mean |learner - engine| log-prob (nats) over staleness-0 tokens above "
        "which the run fails (the learner does not score the distribution the fleet sampled). auto: 0.01 when the "
        "engines run model.dtype float32, else 0.1 (bf16 engines differ from the learner by ~0.05 on average); "
        "None: no check (synthetic behaviour log-probs, e.g. replayed test data)")

    @field_validator("logprob_probe_tolerance")
    @classmethod
    def _positive_tolerance(cls, v):
        if isinstance(v, float) and not v > 0:
            raise ValueError(f"logprob_probe_tolerance must be > 0, 'auto' or null, got {v}")
        return v
    recompute_proximal: bool = Field(
        False, description="tis: recompute the pre-step log-probs in a no-grad forward (decoupled always does); "
        "tis with it is decoupled's objective, without it a truncated-IS gradient with no trust region")
    checkpoint_every: int = Field(10, ge=0, description="steps between checkpoints (the launcher resumes from the "
                                  "newest when run again on the same run_dir); 0 disables")
    checkpoint_dir: str | None = Field(None, description="None: RUN_DIR/checkpoints")
    keep_checkpoints: int = Field(2, ge=1, description="complete checkpoints kept; older ones are deleted")
    resume: bool = Field(True, description="resume from the newest complete checkpoint in checkpoint_dir if any")
    export_every: int = Field(0, ge=0, description="steps between HF exports (RUN_DIR/export/latest); 0: only at the end")
    log_samples_every: int = Field(10, ge=0, description="steps between sample-generation tables (TensorBoard text, "
                                   "RUN_DIR/metrics/learner.jsonl, W&B); 0: none")
    export_dtype: Literal["float32", "bfloat16"] = Field("float32", description="dtype of HF exports (lossless by default)")
    reference_offload: bool = Field(True, description="keep the KL reference model on CPU")
    param_offload: bool = Field(False, description="FSDP on GPU: keep parameter shards (and with them gradients and "
                                "optimizer state) in CPU memory between uses (FSDP2 CPUOffloadPolicy); slower, "
                                "for models that do not fit; verl's fsdp_config.param_offload")
    optimizer_offload: bool = Field(False, description="FSDP on GPU: the optimizer state in CPU memory; FSDP2 keeps "
                                    "it with the parameter shards, so this offloads those too (as param_offload)")
    megatron: MegatronConfig = MegatronConfig()
    lora: LoraConfig | None = Field(None, description="train LoRA adapters on a frozen base (docs/lora.md); "
                                    "None: full fine-tuning")

    @model_validator(mode="after")
    def _lora_engine(self) -> LearnerConfig:
        if self.lora is not None and self.engine == "megatron":
            raise ValueError(MEGATRON_REFUSED)
        return self

    @model_validator(mode="after")
    def _tis_trust_region(self) -> LearnerConfig:
        several = self.ppo_epochs > 1 or self.ppo_mini_batch_size is not None
        if self.loss.correction == "tis" and several and not self.recompute_proximal:
            raise ValueError("learner.loss.correction=tis without learner.recompute_proximal has no trust region "
                             f"(ratio = 1 at every optimizer step), yet ppo_mini_batch_size={self.ppo_mini_batch_size} "
                             f"/ ppo_epochs={self.ppo_epochs} ask for several optimizer steps per batch: set "
                             "recompute_proximal=true (or use correction=decoupled), or make one optimizer step")
        return self

    @model_validator(mode="after")
    def _offload_engine(self) -> LearnerConfig:
        if self.engine == "megatron" and (self.param_offload or self.optimizer_offload):
            raise ValueError("learner.param_offload / optimizer_offload are FSDP's (CPUOffloadPolicy); with "
                             "learner.engine=megatron use tensor/pipeline parallelism and the distributed optimizer")
        if self.engine == "megatron" and self.logprobs == "chunked" and self.megatron.tensor_model_parallel_size > 1:
            raise ValueError("learner.logprobs=chunked with learner.engine=megatron needs tensor_model_parallel_size=1 "
                             "(the vocab-sharded head is not chunked); use logprobs=auto or full with TP>1")
        return self
