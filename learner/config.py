"""Learner config: training engine, optimizer, loss and checkpointing."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from core.configbase import ConfigError, ConfigModel
from learner.lora_config import MEGATRON_REFUSED, LoraConfig

# KL estimator names (verl's aliases included) -> the estimator used; learner/kl.py explains each.
KL_ALIASES = {"k2": "k2", "mse": "k2", "k3": "k3", "low_var_kl": "k3"}
K1_REFUSED = (
    "kl_estimator 'k1' in the loss has zero expected gradient (E_pi[grad log pi] = 0), so the penalty "
    "would do nothing; use 'k2' (alias 'mse', gradient of KL(pi || ref)) or 'k3' (alias 'low_var_kl', "
    "gradient of KL(ref || pi))"
)


def resolve_kl_estimator(name: str) -> str:
    """The estimator behind a user-facing name; raises ValueError naming the choices."""
    if name == "k1":
        raise ValueError(K1_REFUSED)
    try:
        return KL_ALIASES[name]
    except KeyError:
        raise ValueError(f"kl_estimator must be one of {sorted(KL_ALIASES)}, got {name!r}") from None


# advantage estimators whose uniform groups get an advantage of exactly 0 (a group baseline, nothing batch-wide)
GROUP_BASELINE_ADVANTAGES = ("mean", "mean_std", "rloo", "gpg")


def uniform_in_mean_blockers(
    *, advantage: str, entropy_coeff: float, kl_coef: float, kl_reward: bool, rollout_correction: bool
) -> list[str]:
    """Why a uniform group's tokens would not have a loss of exactly zero (so skipping them while counting them in
    the mean would change the gradient); empty where learner.loss.uniform_groups_in_mean is exact."""
    why = []
    if advantage not in GROUP_BASELINE_ADVANTAGES:
        why.append(f"advantage {advantage!r} gives a uniform group's tokens a non-zero advantage or none")
    if entropy_coeff > 0 or kl_coef > 0:
        why.append("an entropy or KL term in the loss has a gradient on a uniform group's tokens")
    if kl_reward:
        why.append("KL in the reward makes a uniform group's token rewards differ")
    if rollout_correction:
        why.append("rollout_correction's rejection and batch normalisation count the tokens they see")
    return why


class OptimConfig(ConfigModel):
    lr: float = Field(1e-5, gt=0, le=1.0, description="peak learning rate of AdamW")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas")
    weight_decay: float = Field(0.0, ge=0, description="AdamW decoupled weight decay")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon")
    warmup_steps: int = Field(0, ge=0, description="linear warm-up over this many step batches")
    schedule: Literal["constant", "cosine", "linear"] = Field(
        "constant", description="learning-rate schedule after warm-up, over run.max_steps step batches"
    )
    grad_clip: float = Field(1.0, gt=0, description="global gradient-norm clip")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="floor of the cosine/linear decay, as a fraction of lr")


class LossConfig(ConfigModel):
    correction: Literal["none", "tis", "decoupled", "bypass"] = Field(
        description="off-policy correction; required. 'none' is legal only with broker.max_staleness = 0; "
        "'bypass' (verl's rollout_correction.bypass_mode): the clipped ratio is taken against the sampler's "
        "log-probs, no proximal pass and no behaviour weight"
    )
    advantage: Literal[
        "mean", "mean_std", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gpg", "gae"
    ] = Field(
        "mean_std",
        description="advantage estimator (learner/advantages.py): mean_std / mean (verl grpo with / "
        "without norm_adv_by_std_in_grpo), rloo, reinforce_plus_plus, reinforce_plus_plus_baseline, gpg; gae: PPO "
        "with a learned value baseline (needs learner.critic; learner/gae.py)",
    )
    gamma: float = Field(1.0, ge=0, le=1, description="GAE discount per trained token (verl algorithm.gamma)")
    lam: float = Field(1.0, ge=0, le=1, description="GAE lambda (verl algorithm.lam)")
    drop_uniform_groups: bool = Field(True, description="drop groups whose rewards are all equal (zero advantage)")
    uniform_groups_in_mean: bool = Field(
        False,
        description="with drop_uniform_groups: the dropped groups' tokens and sequences still count in the loss's "
        "mean, as if trained at advantage 0, so the gradient is the one of training them (verl's without "
        "DAPO's filter) at none of their compute; group-baseline advantages only, no entropy or KL term, no "
        "rollout_correction (learner/batch.py)",
    )
    clip_low: float = Field(0.2, gt=0, lt=1, description="PPO clip below: the ratio is held at >= 1 - clip_low")
    clip_high: float = Field(0.28, gt=0, description="PPO clip above (DAPO's clip-higher): ratio <= 1 + clip_high")
    clip_ratio_c: float = Field(
        3.0,
        gt=1,
        description="dual-clip: for A < 0 the per-token loss is capped at "
        "clip_ratio_c * |A| (bounds a token whose ratio exploded)",
    )
    tis_cap: float = Field(2.0, ge=1.0, description="truncation of the behaviour importance weight")
    aggregation: Literal["token", "sequence", "token_sum", "seq_mean_token_sum", "seq_mean_token_sum_norm"] = Field(
        "token",
        description="verl's loss_agg_mode: token (token-mean), sequence (seq-mean-token-mean), token_sum, "
        "seq_mean_token_sum, seq_mean_token_sum_norm (Dr. GRPO: divided by loss_scale_factor); gspo and geo_mean "
        "always use sequence",
    )
    loss_scale_factor: int | None = Field(
        None,
        ge=1,
        description="the constant length seq_mean_token_sum_norm divides by (verl actor.loss_scale_factor); "
        "None: rollout.sampling.max_tokens (verl: the padded response length)",
    )
    policy_loss: Literal["vanilla", "gspo", "geo_mean"] = Field(
        "vanilla",
        description="verl actor.policy_loss.loss_mode: vanilla (token-level PPO clip), gspo (sequence-level "
        "ratio), geo_mean (GMPO, geometric mean of clipped token ratios); learner/losses.py surrogate",
    )
    entropy_coeff: float = Field(
        0.0,
        ge=0,
        description="entropy bonus: -entropy_coeff * entropy joins each token's "
        "loss (verl actor.entropy_coeff); FSDP only",
    )
    kl_coef: float = Field(0.0, ge=0, description="weight of the KL-to-reference loss term (0: no reference model)")
    kl_estimator: str = Field(
        "k3",
        description="KL-to-reference term in the loss: 'k2' (alias 'mse'): gradient of "
        "KL(pi || ref); 'k3' (alias 'low_var_kl'): value estimates KL(pi || ref), gradient is "
        "that of KL(ref || pi). 'k1' is refused (zero expected gradient). See learner/kl.py",
    )

    @field_validator("kl_estimator")
    @classmethod
    def _kl_estimator(cls, v: str) -> str:
        resolve_kl_estimator(v)
        return v

    mask_truncated: bool = Field(
        False,
        description="leave responses cut at max_tokens (finish reason 'length') out "
        "of the loss; set by reward.on_truncated=mask",
    )

    @model_validator(mode="after")
    def _algorithms(self) -> LossConfig:
        if self.aggregation == "seq_mean_token_sum_norm" and self.loss_scale_factor is None:
            raise ValueError(
                "learner.loss.aggregation='seq_mean_token_sum_norm' divides by a constant length: set "
                "learner.loss.loss_scale_factor (a run config fills it from rollout.sampling.max_tokens)"
            )
        return self

    @property
    def effective_aggregation(self) -> str:
        """gspo and geo_mean are sequence-level objectives: like verl they always average over sequences."""
        return "sequence" if self.policy_loss in ("gspo", "geo_mean") else self.aggregation


class KLRewardConfig(ConfigModel):
    """KL to the reference as a reward penalty (verl algorithm.use_kl_in_reward / kl_penalty / kl_ctrl.*):
    learner/kl_reward.py."""

    enable: bool = Field(False, description="subtract coef * KL(old || ref) per token from the reward")
    estimator: Literal["k1", "k2", "k3", "abs"] = Field(
        "k1", description="per-token estimate: k1 (verl kl), k2 (mse), k3 (low_var_kl), abs"
    )
    type: Literal["fixed", "adaptive"] = Field("fixed", description="fixed coef, or adapted toward target_kl")
    coef: float = Field(0.001, ge=0, description="the penalty's coefficient (adaptive: its start)")
    target_kl: float = Field(0.1, gt=0, description="adaptive: the KL per token it steers toward")
    horizon: int = Field(10000, ge=1, description="adaptive: samples over which the coefficient may change by 20%")


class RejectionRule(ConfigModel):
    """One rejection-sampling rule of learner.rollout_correction (learner/correction.py)."""

    statistic: Literal["log_ratio", "k1", "k2", "k3"] = Field(
        description="per token, with d = prox - behaviour log-prob: log_ratio d, k1 -d, k2 d^2/2, k3 exp(d)-1-d"
    )
    level: Literal["token", "seq_sum", "seq_mean", "seq_max", "seq_min"] = Field(
        description="token: each token alone; seq_*: the sequence's sum/mean/max/min decides for all its tokens"
    )
    lower: float | None = Field(None, description="keep where the statistic >= this (None: no lower bound)")
    upper: float | None = Field(None, description="keep where the statistic <= this (None: no upper bound)")
    name: str | None = Field(None, description="the metric's name (rollout_rs_<name>_masked_fraction)")

    @model_validator(mode="after")
    def _bounded(self) -> RejectionRule:
        if self.lower is None and self.upper is None:
            raise ValueError("a rejection rule needs lower, upper or both")
        if self.lower is not None and self.upper is not None and self.lower > self.upper:
            raise ValueError(f"rejection rule lower {self.lower} > upper {self.upper}")
        return self


class RolloutCorrectionConfig(ConfigModel):
    """verl's algorithm.rollout_correction beyond token TIS: learner/correction.py (with correction=decoupled)."""

    enable: bool = Field(
        False,
        description="IS weights and rejection measured on the pre-step policy against the "
        "sampler replace decoupled's min(exp(prox - behaviour), tis_cap) weight",
    )
    is_level: Literal["none", "token", "sequence"] = Field(
        "none", description="IS weight per token, or the product of a sequence's token ratios; none: weight 1"
    )
    is_upper: float = Field(2.0, gt=0, description="IS weights above are truncated to it (is_lower None) or zeroed")
    is_lower: float | None = Field(
        None,
        gt=0,
        description="IcePop: weights outside [is_lower, is_upper] are zeroed; None: truncation at is_upper only",
    )
    is_batch_normalize: bool = Field(False, description="divide the IS weights by their mean over the optimizer step")
    rejection: list[RejectionRule] = Field(
        [],
        description="tokens (or sequences) kept only where every rule holds; "
        "rejected tokens leave the loss and its denominator",
    )

    @model_validator(mode="after")
    def _band(self) -> RolloutCorrectionConfig:
        if self.is_lower is not None and self.is_lower > self.is_upper:
            raise ValueError(f"rollout_correction.is_lower {self.is_lower} > is_upper {self.is_upper}")
        return self


class MegatronConfig(ConfigModel):
    tensor_model_parallel_size: int = Field(1, ge=1, description="Megatron tensor parallelism (divides heads)")
    pipeline_model_parallel_size: int = Field(1, ge=1, description="Megatron pipeline stages (divides layers)")
    sequence_parallel: bool = Field(False, description="Megatron sequence parallelism (needs TP > 1)")
    use_distributed_optimizer: bool = Field(True, description="shard optimizer state over data-parallel ranks")
    context_parallel_size: int = Field(
        1,
        ge=1,
        description="Megatron context parallelism; only 1: megatron-core "
        "runs CP only in TransformerEngine's attention, which fleetrl's local layer "
        "spec does not use (docs/long_context.md). Use the FSDP engine's "
        "learner.sequence_parallel_size for long responses",
    )

    @field_validator("context_parallel_size")
    @classmethod
    def _no_context_parallel(cls, v: int) -> int:
        if v > 1:
            raise ValueError(
                f"learner.megatron.context_parallel_size={v} is not supported: megatron-core implements "
                "context parallelism only in TransformerEngine's attention (its local DotProductAttention "
                "asserts context_parallel_size == 1) and fleetrl builds Megatron with the local spec, "
                "without TransformerEngine; use learner.engine=fsdp with learner.sequence_parallel_size"
            )
        return v

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
            problems.append(
                f"learner.megatron.tensor_model_parallel_size x pipeline_model_parallel_size = "
                f"{tp} x {pp} = {tp * pp} does not divide --learner-gpus {learner_gpus}"
            )
        if heads % tp:
            problems.append(
                f"learner.megatron.tensor_model_parallel_size={tp} does not divide the model's {heads} attention heads"
            )
        if kv_heads % tp:
            problems.append(
                f"learner.megatron.tensor_model_parallel_size={tp} does not divide the model's "
                f"{kv_heads} key/value heads"
            )
        if layers % pp:
            problems.append(
                f"learner.megatron.pipeline_model_parallel_size={pp} does not divide the model's {layers} layers"
            )
        if self.sequence_parallel and tp == 1:
            problems.append("learner.megatron.sequence_parallel=true needs tensor_model_parallel_size > 1")
        if problems:
            raise ConfigError("invalid Megatron layout:\n  " + "\n  ".join(problems))


class CriticOptimConfig(OptimConfig):
    """The critic's AdamW and schedule: verl's critic defaults (weight decay 0.01)."""

    weight_decay: float = Field(
        0.01, ge=0, description="AdamW weight decay of the critic (verl critic.optim.weight_decay)"
    )


class CriticConfig(ConfigModel):
    """PPO's value model (learner/critic.py): verl's ``critic.*`` where the names exist."""

    model_path: str | None = Field(
        None,
        description="HF causal LM folder whose body the critic starts from (a "
        "fresh scalar head is added); None: the actor's model.path",
    )
    optim: CriticOptimConfig = Field(
        CriticOptimConfig(),
        description="the critic's own AdamW and LR schedule "
        "(verl critic.optim: lr 1e-5, weight_decay 0.01); its grad_clip is critic.grad_clip",
    )
    grad_clip: float = Field(1.0, gt=0, description="gradient-norm clip of the critic (verl critic.grad_clip)")
    cliprange_value: float = Field(
        0.5,
        gt=0,
        description="the value prediction moves at most this far from the "
        "values the advantages were computed with before its loss stops pulling",
    )
    aggregation: Literal["token", "sequence"] = Field(
        "token", description="value-loss aggregation (verl critic.loss_agg_mode: token-mean / seq-mean-token-mean)"
    )
    ppo_epochs: int | None = Field(
        None, ge=1, description="critic passes over the step batch's mini-batches; None: learner.ppo_epochs"
    )
    ppo_mini_batch_size: int | None = Field(
        None,
        ge=1,
        description="must be None or learner.ppo_mini_batch_size: the critic trains on the actor's mini-batches",
    )
    micro_batch_tokens: int | None = Field(
        None,
        ge=16,
        description="must be None or learner.micro_batch_tokens: "
        "values, advantages and returns attach to the actor's micro-batches",
    )
    warmup_steps: int = Field(
        0,
        ge=0,
        description="the first steps train the critic only (the policy is not "
        "updated and not published). verl's trainer.critic_warmup=k skips the actor while "
        "k > global step (steps 1..k-1), i.e. warmup_steps = k - 1",
    )
    param_offload: bool = Field(False, description="FSDP on GPU: the critic's shards in CPU memory between uses")
    optimizer_offload: bool = Field(
        False,
        description="FSDP on GPU: the critic's optimizer state in CPU memory "
        "(FSDP2 keeps it with the shards: same effect as param_offload)",
    )

    @model_validator(mode="after")
    def _one_clip(self) -> CriticConfig:
        # compared with the default, not by fields set: the launcher writes the whole config out for the ranks
        if self.optim.grad_clip not in (OptimConfig.model_fields["grad_clip"].default, self.grad_clip):
            raise ValueError(
                "set the critic's gradient clip with learner.critic.grad_clip (verl's name), not "
                "learner.critic.optim.grad_clip"
            )
        return self


class LearnerConfig(ConfigModel):
    engine: Literal["fsdp", "megatron"] = Field(
        "fsdp", description="training engine: PyTorch FSDP2 or Megatron-core (GPUs, megatron-core installed)"
    )
    cpu_processes: int = Field(
        1,
        ge=1,
        le=64,
        description="learner ranks (gloo) with --learner-gpus 0; "
        "with GPUs the learner has one rank per GPU and this must stay 1",
    )
    optim: OptimConfig = OptimConfig()
    loss: LossConfig
    micro_batch_tokens: int | Literal["auto"] = Field(
        "auto",
        description="token budget of one packed micro-batch. auto: 8192 on CPU; on GPU sized from the "
        "GPU's free memory and the model's shape (learner/fastpath.py micro_batch_budget), the resolved value is "
        "logged and reported in the run's summary",
    )
    activation_checkpointing: bool | Literal["auto"] = Field(
        "auto",
        description="recompute each decoder layer in the backward. auto: off on CPU; on GPU on only when "
        "the micro-batch budget without it would be too small to run efficiently (learner/fastpath.py)",
    )
    attn_implementation: Literal["auto", "varlen", "sdpa", "eager", "flash_attention_2"] = Field(
        "auto",
        description="auto: varlen on GPU (document-masked flash attention, learner/attention.py), sdpa on "
        "CPU; sdpa and eager keep packed sequences apart with a mask from position_ids",
    )
    # Fast paths (learner/fastpath.py resolve_fast_path); auto = on for GPU ranks, off on CPU. The plain engine of
    # before: logprobs=full attn_implementation=sdpa fused_optimizer=off meta_init=off compile_blocks=false
    # micro_batch_tokens=8192 activation_checkpointing=false
    logprobs: Literal["auto", "chunked", "full"] = Field(
        "auto", description="chunked: log-probs/entropy from the last hidden state in vocab chunks (no full logits)"
    )
    logprob_chunk: int = Field(4096, ge=1, description="response tokens per chunk of the chunked log-prob path")
    fused_optimizer: Literal["auto", "on", "off"] = Field(
        "auto", description="torch's fused AdamW kernel; auto: on for GPU ranks"
    )
    meta_init: Literal["auto", "on", "off"] = Field(
        "auto", description="build on the meta device and load each rank's shards from safetensors"
    )
    compile_blocks: bool | Literal["auto"] = Field(
        "auto",
        description="torch.compile each decoder layer's forward and the chunked head's per-chunk "
        "log-softmax (FSDP); Megatron: each layer's MLP. auto: on for GPU ranks, off on CPU",
    )
    temperature: float = Field(
        1.0,
        gt=0,
        description="the temperature the learner scores at; in a run config it is "
        "rollout.sampling.temperature's (set that one; a different value here is refused)",
    )
    ppo_mini_batch_size: int | None = Field(
        None,
        ge=1,
        description="prompt groups per optimizer step; None: all groups of the step batch (one optimizer "
        "step). Smaller values give several optimizer steps per step batch, against proximal log-probs computed once "
        "before the first: the trust region that clip_low/clip_high and decoupled PPO act on",
    )
    ppo_epochs: int = Field(1, ge=1, description="passes over the step batch's mini-batches")
    logprob_probe_tolerance: float | Literal["auto"] | None = Field(
        "auto",
        description="first step: the mean |learner - engine| log-prob (nats) over staleness-0 tokens above "
        "which the run fails (the learner does not score the distribution the fleet sampled). auto: 0.01 when the "
        "engines run model.dtype float32, else 0.1 (bf16 engines differ from the learner by ~0.05 on average); "
        "None: no check (synthetic behaviour log-probs, e.g. replayed test data)",
    )

    @field_validator("micro_batch_tokens")
    @classmethod
    def _budget(cls, v):
        if isinstance(v, int) and v < 16:
            raise ValueError(f"micro_batch_tokens must be 'auto' or at least 16 tokens, got {v}")
        return v

    @field_validator("logprob_probe_tolerance")
    @classmethod
    def _positive_tolerance(cls, v):
        if isinstance(v, float) and not v > 0:
            raise ValueError(f"logprob_probe_tolerance must be > 0, 'auto' or null, got {v}")
        return v

    recompute_proximal: bool = Field(
        False,
        description="tis: recompute the pre-step log-probs in a no-grad forward (decoupled always does); "
        "tis with it is decoupled's objective, without it a truncated-IS gradient with no trust region",
    )
    checkpoint_every: int = Field(
        10,
        ge=0,
        description="steps between checkpoints (the launcher resumes from the "
        "newest when run again on the same run_dir); 0 disables",
    )
    checkpoint_dir: str | None = Field(None, description="None: RUN_DIR/checkpoints")
    keep_checkpoints: int = Field(2, ge=1, description="complete checkpoints kept; older ones are deleted")
    resume: bool = Field(True, description="resume from the newest complete checkpoint in checkpoint_dir if any")
    export_every: int = Field(
        0, ge=0, description="steps between HF exports (RUN_DIR/export/latest); 0: only at the end"
    )
    log_samples_every: int = Field(
        10,
        ge=0,
        description="steps between sample-generation tables (TensorBoard text, "
        "RUN_DIR/metrics/learner.jsonl, W&B); 0: none",
    )
    export_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="dtype of HF exports (lossless by default)"
    )
    reference_offload: bool = Field(True, description="keep the KL reference model on CPU")
    param_offload: bool = Field(
        False,
        description="FSDP on GPU: keep parameter shards (and with them gradients and "
        "optimizer state) in CPU memory between uses (FSDP2 CPUOffloadPolicy); slower, "
        "for models that do not fit; verl's fsdp_config.param_offload",
    )
    optimizer_offload: bool = Field(
        False,
        description="FSDP on GPU: the optimizer state in CPU memory; FSDP2 keeps "
        "it with the parameter shards, so this offloads those too (as param_offload)",
    )
    megatron: MegatronConfig = MegatronConfig()
    lora: LoraConfig | None = Field(
        None, description="train LoRA adapters on a frozen base (docs/lora.md); None: full fine-tuning"
    )

    @model_validator(mode="after")
    def _lora_engine(self) -> LearnerConfig:
        if self.lora is not None and self.engine == "megatron":
            raise ValueError(MEGATRON_REFUSED)
        return self

    kl_reward: KLRewardConfig = Field(KLRewardConfig(), description="KL in the reward (verl use_kl_in_reward)")
    rollout_correction: RolloutCorrectionConfig = Field(
        RolloutCorrectionConfig(), description="verl's rollout_correction IS levels and rejection sampling"
    )
    sequence_parallel_size: int = Field(
        1,
        ge=1,
        description="FSDP: Ulysses sequence parallelism (verl's ulysses_sequence_parallel_size). Groups of "
        "this many consecutive learner ranks split each packed row between them (attention exchanges heads for "
        "sequence, learner/ulysses.py); the step batch is split over learner ranks / this many data replicas. Must "
        "divide the learner's ranks and the model's attention heads (key/value heads are repeated when it does not "
        "divide them). Layout and gradient scaling: docs/long_context.md",
    )
    critic: CriticConfig | None = Field(
        None,
        description="PPO's value model, trained beside the actor on the "
        "learner's devices; required by (and only used with) loss.advantage=gae",
    )

    def check_sequence_parallel(self, ranks: int, hf_config: dict | None) -> None:
        """Raise ConfigError if ``sequence_parallel_size`` cannot split ``ranks`` learner ranks or the model
        described by ``hf_config`` (its config.json; None: the ranks only)."""
        sp = self.sequence_parallel_size
        heads = hf_config["num_attention_heads"] if hf_config is not None else sp
        problems = []
        if ranks % sp:
            problems.append(
                f"learner.sequence_parallel_size={sp} does not divide the learner's {ranks} ranks "
                "(--learner-gpus, or learner.cpu_processes with --learner-gpus 0)"
            )
        if heads % sp:
            problems.append(f"learner.sequence_parallel_size={sp} does not divide the model's {heads} attention heads")
        if problems:
            raise ConfigError("invalid sequence-parallel layout:\n  " + "\n  ".join(problems))

    @model_validator(mode="after")
    def _sequence_parallel(self) -> LearnerConfig:
        if self.sequence_parallel_size > 1 and self.engine != "fsdp":
            raise ValueError(
                f"learner.sequence_parallel_size={self.sequence_parallel_size} is the FSDP engine's "
                "Ulysses sequence parallelism; learner.engine=megatron has no sequence split of that kind"
            )
        if self.sequence_parallel_size > 1 and self.attn_implementation in ("eager", "flash_attention_2"):
            raise ValueError(
                f"learner.sequence_parallel_size={self.sequence_parallel_size} wraps the varlen or sdpa "
                f"attention, not {self.attn_implementation!r}: use attn_implementation auto, varlen or sdpa"
            )
        return self

    @property
    def several_optimizer_steps(self) -> bool:
        """Whether a step batch may make more than one optimizer step (mini-batches or epochs)."""
        return self.ppo_epochs > 1 or self.ppo_mini_batch_size is not None

    @model_validator(mode="after")
    def _tis_trust_region(self) -> LearnerConfig:
        if self.loss.correction == "tis" and self.several_optimizer_steps and not self.recompute_proximal:
            raise ValueError(
                "learner.loss.correction=tis without learner.recompute_proximal has no trust region "
                f"(ratio = 1 at every optimizer step), yet ppo_mini_batch_size={self.ppo_mini_batch_size} "
                f"/ ppo_epochs={self.ppo_epochs} ask for several optimizer steps per batch: set "
                "recompute_proximal=true (or use correction=decoupled), or make one optimizer step"
            )
        return self

    @model_validator(mode="after")
    def _uniform_in_mean(self) -> LearnerConfig:
        """Counting a skipped group in the mean gives training's gradient only where its tokens' loss is exactly
        zero: advantage 0 (a group baseline, not whitened over the batch), and no other term in the loss."""
        lo = self.loss
        if not lo.uniform_groups_in_mean:
            return self
        why = [] if lo.drop_uniform_groups else ["drop_uniform_groups is false (nothing is skipped)"]
        why += uniform_in_mean_blockers(
            advantage=lo.advantage,
            entropy_coeff=lo.entropy_coeff,
            kl_coef=lo.kl_coef,
            kl_reward=self.kl_reward.enable,
            rollout_correction=self.rollout_correction.enable,
        )
        if why:
            raise ValueError(
                "learner.loss.uniform_groups_in_mean=true would not give the gradient of training those groups: "
                + "; ".join(why)
                + ". Set uniform_groups_in_mean=false, and drop_uniform_groups=false to train them"
            )
        return self

    @model_validator(mode="after")
    def _rollout_correction(self) -> LearnerConfig:
        rc = self.rollout_correction
        if not rc.enable:
            return self
        if self.loss.correction == "bypass":
            if rc.is_level != "none" or rc.is_batch_normalize:
                raise ValueError(
                    "learner.rollout_correction with correction=bypass takes rejection rules only: the "
                    "clipped ratio against the sampler is the correction (verl's bypass PPO-clip applies "
                    "no IS weight); set is_level=none"
                )
            if self.sequence_parallel_size > 1:
                raise ValueError(
                    "learner.rollout_correction's sequence rules need whole rows: use sequence_parallel_size=1"
                )
            return self
        if self.loss.correction != "decoupled":
            raise ValueError(
                "learner.rollout_correction measures the pre-step policy against the sampler and weights "
                f"the decoupled ratio: it needs learner.loss.correction=decoupled (or bypass for "
                f"rejection alone), got {self.loss.correction!r}"
            )
        if self.engine != "fsdp" or self.sequence_parallel_size > 1:
            raise ValueError(
                "learner.rollout_correction needs learner.engine=fsdp with sequence_parallel_size=1 (its "
                "sums are reduced over the data-parallel ranks and its sequence rules need whole rows)"
            )
        return self

    @model_validator(mode="after")
    def _critic(self) -> LearnerConfig:
        c = self.critic
        if self.loss.advantage == "gae" and c is None:
            raise ValueError(
                "learner.loss.advantage=gae needs a value model: set learner.critic (e.g. {} for a "
                "critic initialised from the actor's model)"
            )
        if c is None:
            return self
        if self.loss.advantage != "gae":
            raise ValueError(
                f"learner.critic is set but learner.loss.advantage={self.loss.advantage!r} never uses "
                "its values: use advantage=gae or remove learner.critic"
            )
        m = self.megatron
        if self.engine == "megatron" and m.pipeline_model_parallel_size > 1:
            raise ValueError(
                f"learner.critic with learner.engine=megatron needs pipeline_model_parallel_size=1 (got "
                f"{m.pipeline_model_parallel_size}): the Megatron critic (learner/megatron/critic.py) "
                "has no pipeline stages; use tensor and data parallelism, or engine=fsdp"
            )
        if self.engine == "megatron" and (c.param_offload or c.optimizer_offload):
            raise ValueError(
                "learner.critic.param_offload / optimizer_offload are FSDP's; with learner.engine=megatron "
                "the critic uses Megatron's (distributed) optimizer: leave them false"
            )
        if self.sequence_parallel_size > 1:
            raise ValueError(
                f"learner.critic with learner.sequence_parallel_size={self.sequence_parallel_size}: the "
                "critic's forward does not split rows across a sequence-parallel group yet; use "
                "sequence_parallel_size=1 for PPO with a critic"
            )
        if c.ppo_mini_batch_size is not None and c.ppo_mini_batch_size != self.ppo_mini_batch_size:
            raise ValueError(
                f"learner.critic.ppo_mini_batch_size={c.ppo_mini_batch_size} differs from "
                f"learner.ppo_mini_batch_size={self.ppo_mini_batch_size}: the critic trains on the "
                "actor's mini-batches; leave it unset"
            )
        if c.micro_batch_tokens is not None and c.micro_batch_tokens != self.micro_batch_tokens:
            raise ValueError(
                f"learner.critic.micro_batch_tokens={c.micro_batch_tokens} differs from "
                f"learner.micro_batch_tokens={self.micro_batch_tokens}: values, advantages and returns "
                "attach to the actor's packed micro-batches; leave it unset"
            )
        return self

    @model_validator(mode="after")
    def _offload_engine(self) -> LearnerConfig:
        if self.engine == "megatron" and (self.param_offload or self.optimizer_offload):
            raise ValueError(
                "learner.param_offload / optimizer_offload are FSDP's (CPUOffloadPolicy); with "
                "learner.engine=megatron use tensor/pipeline parallelism and the distributed optimizer"
            )
        if self.sequence_parallel_size > 1 and (self.loss.policy_loss != "vanilla" or self.kl_reward.enable):
            what = (
                "learner.kl_reward" if self.kl_reward.enable else f"learner.loss.policy_loss={self.loss.policy_loss!r}"
            )
            raise ValueError(
                f"{what} needs whole sequences on a rank, but learner.sequence_parallel_size="
                f"{self.sequence_parallel_size} splits each row's tokens over ranks; use vanilla / no "
                "kl_reward with sequence parallelism, or sequence_parallel_size=1"
            )
        if self.kl_reward.enable and self.engine == "megatron":
            raise ValueError(
                "learner.kl_reward needs learner.engine=fsdp (its per-row sums are reduced over the "
                "data-parallel ranks, which Megatron's tensor/pipeline groups would count twice)"
            )
        if self.kl_reward.enable and self.loss.mask_truncated:
            raise ValueError(
                "learner.kl_reward with reward.on_truncated=mask: masked samples get no log-probs, so "
                "their KL penalty (part of their group's baseline) is unknown; use on_truncated "
                "score or penalize"
            )
        if self.engine == "megatron" and self.loss.entropy_coeff > 0:
            raise ValueError(
                "learner.loss.entropy_coeff > 0 needs learner.engine=fsdp: the Megatron engine computes "
                "the entropy as a metric without gradient (a vocab-parallel entropy backward is not "
                "wired); use entropy_coeff=0 with Megatron"
            )
        if self.engine == "megatron" and self.logprobs == "chunked" and self.megatron.tensor_model_parallel_size > 1:
            raise ValueError(
                "learner.logprobs=chunked with learner.engine=megatron needs tensor_model_parallel_size=1 "
                "(the vocab-sharded head is not chunked); use logprobs=auto or full with TP>1"
            )
        return self
