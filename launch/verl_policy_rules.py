"""verl's algorithm.* and actor/reference keys (advantage, KL, dynamic sampling, the policy loss, optimizer and
the learner's parallel layout) as fleetrl overrides, with the rollout-correction keys of
launch/verl_correction_rules.py; the rest of the rules (rollout, data, rewards, trainer, critic) are in
launch/verl_rules.py, which joins both tables."""

from __future__ import annotations

from typing import Any

from launch.verl_correction_rules import CORRECTION_RULES
from launch.verl_rule_kit import (
    ARR,
    CP,
    CRITIC,
    MOE,
    OTHER_ENGINE,
    Ctx,
    Refused,
    Rule,
    _above_one,
    _no_effect,
    _only,
    _set,
    _when_true,
    dump,
    num,
)


def _sp_size(v: Any, _: Ctx) -> list[str] | str:
    """Ulysses SP onto the FSDP learner's ``learner.sequence_parallel_size`` (learner/ulysses.py)."""
    if v in (None, "", 0, 1):
        return "(no setting: size 1)"
    return [f"learner.sequence_parallel_size={dump(v)}"]


def _ref_sp_size(v: Any, c: Ctx) -> str:
    actor = (
        c.get(ARR + "actor.ulysses_sequence_parallel_size")
        or c.get(ARR + "actor.fsdp_config.ulysses_sequence_parallel_size")
        or 1
    )
    if v not in (None, "", 0, 1) and v != actor:
        raise Refused(
            f"ref ulysses_sequence_parallel_size={v} differs from the actor's {actor}: fleetrl runs the "
            "reference model in the actor's sequence-parallel group"
        )
    return "(no setting: the reference model runs in the actor's sequence-parallel group)"


# -- algorithm ---------------------------------------------------------------------------------
ESTIMATORS = {
    "rloo": "rloo",
    "reinforce_plus_plus": "reinforce_plus_plus",
    "reinforce_plus_plus_baseline": "reinforce_plus_plus_baseline",
    "gpg": "gpg",
}


def critic_available() -> bool:
    """The critic lands with its own branch: until learner.critic exists, GAE is refused by capability."""
    from learner.config import LearnerConfig

    return "critic" in LearnerConfig.model_fields


def _adv(v: Any, c: Ctx) -> list[str] | str:
    if v == "grpo":
        return [f"learner.loss.advantage={'mean_std' if c.get('algorithm.norm_adv_by_std_in_grpo', True) else 'mean'}"]
    if v in ESTIMATORS:
        return [f"learner.loss.advantage={ESTIMATORS[v]}"]
    if v == "gae":
        if not critic_available():
            raise Refused("adv_estimator 'gae' needs a value model (critic) and GAE", CRITIC)
        # the critic section exists once it has a model: verl's critic.model.path, else the actor's (null)
        out = ["learner.loss.advantage=gae", f"learner.critic.model_path={dump(c.get('critic.model.path'))}"]
        for key, dest in (("algorithm.gamma", "learner.loss.gamma"), ("algorithm.lam", "learner.loss.lam")):
            out.append(f"{dest}={dump(c.get(key))}")
        return out
    raise Refused(
        f"adv_estimator {v!r}: fleetrl has grpo, rloo, reinforce_plus_plus, reinforce_plus_plus_baseline, "
        "gpg and gae (with the critic); remax needs a greedy baseline rollout per prompt, which the fleet "
        "does not generate"
    )


def _norm_std(v: Any, c: Ctx) -> str:
    return (
        "(set with algorithm.adv_estimator=grpo)"
        if c.get("algorithm.adv_estimator") == "grpo"
        else "(no setting: read only by adv_estimator=grpo)"
    )


def _gamma_lam(v: Any, c: Ctx) -> str:
    est = c.get("algorithm.adv_estimator")
    if est == "gae":
        return "(set with algorithm.adv_estimator=gae)"
    if est in ("reinforce_plus_plus", "reinforce_plus_plus_baseline") and v != 1.0:
        raise Refused(f"a discount gamma={v} for {est}: fleetrl's REINFORCE++ returns are undiscounted (gamma 1)")
    return f"(no setting: {est} does not discount)"


KL_PENALTY = {"kl": "k1", "k1": "k1", "mse": "k2", "k2": "k2", "low_var_kl": "k3", "k3": "k3", "abs": "abs"}


def _kl_in_reward(v: Any, c: Ctx) -> list[str] | str:
    if not v:
        return "(no setting: no KL in the reward, fleetrl's default)"
    pen = c.get("algorithm.kl_penalty")
    if pen not in KL_PENALTY:
        raise Refused(f"algorithm.kl_penalty {pen!r}: fleetrl has kl (k1), mse (k2), low_var_kl (k3) and abs")
    kind = c.get("algorithm.kl_ctrl.type")
    if kind not in ("fixed", "adaptive"):
        raise Refused(f"algorithm.kl_ctrl.type {kind!r}: fleetrl has 'fixed' and 'adaptive'")
    return [
        "learner.kl_reward.enable=true",
        f"learner.kl_reward.estimator={KL_PENALTY[pen]}",
        f"learner.kl_reward.type={kind}",
        f"learner.kl_reward.coef={dump(c.get('algorithm.kl_ctrl.kl_coef'))}",
        f"learner.kl_reward.target_kl={dump(c.get('algorithm.kl_ctrl.target_kl'))}",
        f"learner.kl_reward.horizon={dump(c.get('algorithm.kl_ctrl.horizon'))}",
    ]


def _kl_reward_part(v: Any, c: Ctx) -> str:
    return (
        "(set with algorithm.use_kl_in_reward)"
        if c.get("algorithm.use_kl_in_reward")
        else "(no setting: algorithm.use_kl_in_reward is false)"
    )


def _filter_groups(v: Any, c: Ctx) -> list[str] | str:
    if not v:
        return "(no setting: no dynamic sampling, fleetrl's default)"
    metric = c.get("algorithm.filter_groups.metric") or "acc"
    return [
        "rollout.filter_groups.enable=true",
        f"rollout.filter_groups.metric={dump(metric)}",
        f"rollout.filter_groups.max_num_gen_batches={max(0, int(c.get('algorithm.filter_groups.max_num_gen_batches') or 0))}",
    ]


def _filter_part(v: Any, c: Ctx) -> str:
    return (
        "(set with algorithm.filter_groups.enable)"
        if c.get("algorithm.filter_groups.enable")
        else "(no setting: algorithm.filter_groups.enable is false)"
    )


# -- actor -------------------------------------------------------------------------------------
def _kl_loss(v: Any, c: Ctx) -> list[str]:
    return [f"learner.loss.kl_coef={dump(c.get(ARR + 'actor.kl_loss_coef')) if v else '0.0'}"]


def _kl_coef(v: Any, c: Ctx) -> str:
    return (
        "(set with actor.use_kl_loss)"
        if c.get(ARR + "actor.use_kl_loss")
        else "(no setting: actor.use_kl_loss is false)"
    )


def _kl_type(v: Any, c: Ctx) -> list[str] | str:
    if not c.get(ARR + "actor.use_kl_loss"):
        return "(no setting: actor.use_kl_loss is false)"
    if v in ("kl", "k1"):
        raise Refused(
            "kl_loss_type 'kl' (k1) has zero expected gradient as a loss term; use 'low_var_kl' (k3) or 'mse' (k2)"
        )
    est = {"low_var_kl": "k3", "k3": "k3", "mse": "k2", "k2": "k2"}.get(v)
    if est is None:
        raise Refused(f"kl_loss_type {v!r}: fleetrl has 'low_var_kl' (k3) and 'mse' (k2)")
    return [f"learner.loss.kl_estimator={est}"]


AGG = {
    "token-mean": "token",
    "seq-mean-token-mean": "sequence",
    "token-sum": "token_sum",
    "seq-mean-token-sum": "seq_mean_token_sum",
    "seq-mean-token-sum-norm": "seq_mean_token_sum_norm",
}


def _agg(v: Any, _: Ctx) -> list[str]:
    if v not in AGG:
        raise Refused(f"loss_agg_mode {v!r}: verl's modes are {', '.join(AGG)}")
    return [f"learner.loss.aggregation={AGG[v]}"]


def _scale_factor(v: Any, _: Ctx) -> list[str] | str:
    return "(no setting: none, fleetrl's default)" if v is None else [f"learner.loss.loss_scale_factor={int(v)}"]


def _policy_loss(v: Any, _: Ctx) -> list[str] | str:
    if v == "vanilla":
        return "(no setting: the clipped PPO loss, fleetrl's default)"
    if v in ("gspo", "geo_mean"):
        return [f"learner.loss.policy_loss={v}"]
    raise Refused(
        f"policy_loss.loss_mode {v!r}: fleetrl has vanilla, gspo and geo_mean (clip_cov and kl_cov "
        "select tokens by their covariance, which is not built)"
    )


def _entropy(v: Any, _: Ctx) -> list[str] | str:
    if not v:
        return "(no setting: no entropy bonus, fleetrl's default)"
    return [f"learner.loss.entropy_coeff={dump(v)}"]


def _clip_side(dest: str) -> Rule:
    def rule(v: Any, c: Ctx) -> list[str]:
        # verl reads clip_ratio only where clip_ratio_low/high are null
        return [f"{dest}={dump(c.get(ARR + 'actor.clip_ratio') if v is None else v)}"]

    return rule


def _clip_ratio(v: Any, c: Ctx) -> str:
    return (
        "(no setting: verl 0.9 clips with clip_ratio_low/clip_ratio_high, 0.2 each by default; clip_ratio "
        "is their fallback only where they are null)"
    )


def _micro_seqs(v: Any, c: Ctx) -> list[str] | str:
    if v is None:
        return "(no setting: null)"
    if c.get(ARR + "actor.use_dynamic_bsz"):
        return "(no setting: use_dynamic_bsz takes ppo_max_token_len_per_gpu)"
    # fleetrl packs micro-batches by tokens: room for this many sequences of the longest length
    return [f"learner.micro_batch_tokens={int(v) * longest(c)}"]


def longest(c: Ctx) -> int:
    return num(c, "data.max_prompt_length", int, 1) + _response_len(c)


def _response_len(c: Ctx) -> int:
    if c.get(ARR + "rollout.response_length"):
        return num(c, ARR + "rollout.response_length", int, 1)
    return num(c, "data.max_response_length", int, 1)


def _token_budget(v: Any, c: Ctx) -> list[str] | str:
    if not c.get(ARR + "actor.use_dynamic_bsz"):
        return "(no setting: read only with use_dynamic_bsz=True)"
    return [f"learner.micro_batch_tokens={int(v)}"]


def _strategy(v: Any, _: Ctx) -> list[str]:
    if v in ("fsdp", "fsdp2"):
        return ["learner.engine=fsdp"]
    if v == "megatron":
        return ["learner.engine=megatron"]
    raise Refused(f"trainer strategy {v!r} (fleetrl's learner engines are FSDP2 and Megatron)", OTHER_ENGINE)


def _model_engine(v: Any, c: Ctx) -> list[str]:
    return _strategy({"fsdp": "fsdp", "megatron": "megatron"}.get(v, v), c)


def _ref_strategy(v: Any, c: Ctx) -> str:
    if v in ("fsdp", "fsdp2", "megatron"):
        return "(no setting: the reference runs in the learner's engine)"
    raise Refused(f"reference strategy {v!r} (fleetrl's learner engines are FSDP2 and Megatron)", OTHER_ENGINE)


def _megatron_size(dest: str) -> Rule:
    def rule(v: Any, c: Ctx) -> list[str] | str:
        if v is None:
            return "(no setting: null)"
        return [f"learner.megatron.{dest}={int(v)}"]

    return rule


def _vpp(v: Any, _: Ctx) -> list[str] | str:
    from learner.config import MegatronConfig

    if v in (None, 1):
        return "(no setting: no virtual pipeline stages)"
    if "virtual_pipeline_model_parallel_size" in MegatronConfig.model_fields:
        return [f"learner.megatron.virtual_pipeline_model_parallel_size={int(v)}"]
    raise Refused(
        f"virtual_pipeline_model_parallel_size={v}: learner.megatron has no virtual_pipeline_model_parallel_"
        "size (the interleaved pipeline schedule)",
        OTHER_ENGINE,
    )


def _dtype(v: Any, _: Ctx) -> str:
    if v in ("bfloat16", "bf16", "float32", "fp32"):
        return "(no setting: fleetrl trains in float32 master weights with bfloat16 compute where model.dtype says)"
    raise Refused(
        f"dtype {v!r}: fleetrl trains and serves in bfloat16 or float32 (float16 needs loss scaling)", OTHER_ENGINE
    )


def _recompute(v: Any, _: Ctx) -> list[str] | str:
    if v in (None, "", "null"):
        return "(no setting: no recomputation)"
    return ["learner.activation_checkpointing=true"]


def _override_transformer(key: str, v: Any, c: Ctx) -> list[str] | str:
    leaf = key.rsplit(".", 1)[-1]
    if leaf.startswith("moe_") or leaf == "router_replay":
        raise Refused(
            f"{leaf}: a setting of Megatron-Core's MoE layers (fleetrl's Megatron engine builds dense "
            "decoders; FSDP trains the HF MoE model without expert parallelism)",
            MOE,
        )
    if leaf == "context_parallel_size":
        return _above_one(CP, "Megatron context_parallel_size")(v, c)
    if leaf.startswith("recompute_"):
        return _recompute(v, c) if leaf == "recompute_granularity" else "(set with recompute_granularity)"
    if leaf.startswith("fp8"):
        raise Refused(f"{leaf}={v}: FP8 training", OTHER_ENGINE)
    if leaf.startswith("dsa_"):
        raise Refused(f"{leaf}: DeepSeek sparse attention (DSA) layers", OTHER_ENGINE)
    return "(no setting: a Megatron-Core kernel or layout choice; the numbers it computes are the same)"


def _schedule(v: Any, _: Ctx) -> list[str]:
    if v not in ("constant", "cosine", "linear"):
        raise Refused(f"lr schedule {v!r}: fleetrl has constant, cosine and linear")
    return [f"learner.optim.schedule={v}"]


ALGORITHM_RULES: dict[str, Rule] = {
    # algorithm
    "algorithm.adv_estimator": _adv,
    "algorithm.norm_adv_by_std_in_grpo": _norm_std,
    "algorithm.gamma": _gamma_lam,
    "algorithm.lam": _gamma_lam,
    "algorithm.use_kl_in_reward": _kl_in_reward,
    "algorithm.kl_penalty": _kl_reward_part,
    "algorithm.kl_ctrl.type": _kl_reward_part,
    "algorithm.kl_ctrl.kl_coef": _kl_reward_part,
    "algorithm.kl_ctrl.horizon": _kl_reward_part,
    "algorithm.kl_ctrl.target_kl": _kl_reward_part,
    "algorithm.filter_groups.enable": _filter_groups,
    "algorithm.filter_groups.metric": _filter_part,
    "algorithm.filter_groups.max_num_gen_batches": _filter_part,
    "algorithm.filter_groups.max_inflight_gen_batches": _no_effect("the fleet keeps generating until a step is full"),
    "algorithm.use_pf_ppo": _only(False, "off", "preference-feedback PPO reweighting is not in fleetrl"),
    **CORRECTION_RULES,
}


ACTOR_RULES: dict[str, Rule] = {
    # actor
    ARR + "actor.strategy": _strategy,
    ARR + "actor.fsdp_config.strategy": _strategy,
    "model_engine": _model_engine,
    ARR + "actor.optim.lr": _set("learner.optim.lr"),
    ARR + "actor.optim.lr_warmup_steps": lambda v, c: "(set with the schedule lines: learner.optim.warmup_steps)",
    ARR + "actor.optim.lr_warmup_steps_ratio": lambda v, c: "(set with the schedule lines: learner.optim.warmup_steps)",
    ARR + "actor.optim.weight_decay": _set("learner.optim.weight_decay"),
    ARR + "actor.optim.betas": lambda v, _: [f"learner.optim.betas=[{float(v[0])}, {float(v[1])}]"],
    ARR + "actor.optim.clip_grad": _set("learner.optim.grad_clip"),
    ARR + "actor.grad_clip": _set("learner.optim.grad_clip"),
    ARR + "actor.optim.warmup_style": lambda v, c: "(no setting: null)" if v is None else _schedule(v, c),
    ARR + "actor.optim.lr_scheduler_type": lambda v, c: _schedule(v, c),
    ARR + "actor.optim.lr_decay_style": lambda v, c: _schedule(v, c),
    ARR + "actor.optim.lr_decay_steps": _no_effect("fleetrl decays over run.max_steps"),
    ARR + "actor.optim.min_lr_ratio": lambda v, _: [f"learner.optim.min_lr_ratio={dump(v or 0.0)}"],
    ARR + "actor.optim.min_lr": lambda v, c: [
        f"learner.optim.min_lr_ratio={dump(float(v) / float(c.get(ARR + 'actor.optim.lr')))}"
    ],
    ARR + "actor.optim.num_cycles": _only(0.5, "a half cosine", "fleetrl's cosine is one half cycle (num_cycles 0.5)"),
    ARR + "actor.optim.optimizer": _only("AdamW", "AdamW", "fleetrl's optimizer is AdamW"),
    ARR + "actor.optim.optimizer_impl": _no_effect("torch's AdamW"),
    ARR + "actor.ppo_mini_batch_size": lambda v, _: [f"learner.ppo_mini_batch_size={int(v)}"],
    ARR + "actor.ppo_epochs": lambda v, _: [f"learner.ppo_epochs={int(v)}"],
    ARR + "actor.ppo_micro_batch_size": _micro_seqs,
    ARR + "actor.ppo_micro_batch_size_per_gpu": _micro_seqs,
    ARR + "actor.use_dynamic_bsz": _no_effect("fleetrl always packs micro-batches by tokens"),
    ARR + "actor.ppo_max_token_len_per_gpu": _token_budget,
    ARR + "actor.clip_ratio": _clip_ratio,
    ARR + "actor.clip_ratio_low": _clip_side("learner.loss.clip_low"),
    ARR + "actor.clip_ratio_high": _clip_side("learner.loss.clip_high"),
    ARR + "actor.clip_ratio_c": _set("learner.loss.clip_ratio_c"),
    ARR + "actor.use_kl_loss": _kl_loss,
    ARR + "actor.kl_loss_coef": _kl_coef,
    ARR + "actor.kl_loss_type": _kl_type,
    ARR + "actor.entropy_coeff": _entropy,
    ARR + "actor.loss_agg_mode": _agg,
    ARR + "actor.loss_scale_factor": _scale_factor,
    ARR + "actor.policy_loss.loss_mode": _policy_loss,
    ARR + "actor.fsdp_config.param_offload": _set("learner.param_offload"),
    ARR + "actor.fsdp_config.optimizer_offload": _set("learner.optimizer_offload"),
    ARR + "actor.fsdp_config.offload_policy": lambda v, _: ["learner.param_offload=true"] if v else "(no setting: off)",
    ARR + "actor.fsdp_config.model_dtype": _dtype,
    ARR + "actor.ulysses_sequence_parallel_size": _sp_size,
    ARR + "actor.fsdp_config.ulysses_sequence_parallel_size": _sp_size,
    ARR + "actor.megatron.tensor_model_parallel_size": _megatron_size("tensor_model_parallel_size"),
    ARR + "actor.megatron.pipeline_model_parallel_size": _megatron_size("pipeline_model_parallel_size"),
    ARR + "actor.megatron.virtual_pipeline_model_parallel_size": _vpp,
    ARR + "actor.megatron.context_parallel_size": _above_one(CP, "Megatron context_parallel_size"),
    ARR + "actor.megatron.expert_model_parallel_size": _above_one(MOE, "Megatron expert_model_parallel_size"),
    ARR + "actor.megatron.expert_tensor_parallel_size": _above_one(MOE, "Megatron expert_tensor_parallel_size"),
    ARR + "actor.megatron.sequence_parallel": _set("learner.megatron.sequence_parallel"),
    ARR + "actor.megatron.use_distributed_optimizer": _set("learner.megatron.use_distributed_optimizer"),
    ARR + "actor.megatron.param_offload": _no_effect("fleetrl's Megatron engine does not offload (memory only)"),
    ARR + "actor.megatron.optimizer_offload": _no_effect("fleetrl's Megatron engine does not offload (memory only)"),
    ARR + "actor.megatron.grad_offload": _no_effect("fleetrl's Megatron engine does not offload (memory only)"),
    ARR + "actor.megatron.dtype": _dtype,
    ARR + "actor.megatron.use_megatron_fsdp": _when_true(OTHER_ENGINE, "Megatron-FSDP"),
    ARR + "actor.megatron.router_replay.mode": _only("disabled", "off", "MoE router replay", MOE),
    ARR + "actor.megatron.use_mbridge": _no_effect("fleetrl converts HF weights itself (learner/megatron/convert.py)"),
    ARR + "actor.megatron.vanilla_mbridge": _no_effect("fleetrl converts HF weights itself"),
    ARR + "actor.megatron.use_dist_checkpointing": _no_effect(
        "fleetrl loads the HF folder and writes its own checkpoints"
    ),
    ARR + "actor.megatron.dist_checkpointing_path": _no_effect("fleetrl loads the HF folder"),
    ARR + "actor.megatron.use_remove_padding": _no_effect("fleetrl always packs sequences without padding"),
    # reference
    ARR + "ref.fsdp_config.param_offload": _set("learner.reference_offload"),
    ARR + "ref.strategy": _ref_strategy,
    ARR + "ref.ulysses_sequence_parallel_size": _ref_sp_size,
    ARR + "ref.fsdp_config.ulysses_sequence_parallel_size": _ref_sp_size,
    ARR + "ref.megatron.context_parallel_size": _above_one(CP, "Megatron context_parallel_size"),
    ARR + "ref.megatron.expert_model_parallel_size": _above_one(MOE, "Megatron expert_model_parallel_size"),
    ARR + "ref.megatron.expert_tensor_parallel_size": _above_one(MOE, "Megatron expert_tensor_parallel_size"),
    ARR + "ref.megatron.virtual_pipeline_model_parallel_size": _vpp,
    ARR + "ref.megatron.use_megatron_fsdp": _when_true(OTHER_ENGINE, "Megatron-FSDP"),
}
