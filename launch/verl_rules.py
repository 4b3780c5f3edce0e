"""What each verl key becomes in fleetrl: a rule per key (RULES) or per key family (PREFIX_RULES).

The algorithm.* and actor/reference rules are in launch/verl_policy_rules.py, the rollout, data and reward rules
in launch/verl_data_rules.py and the building blocks in launch/verl_rule_kit.py; this module holds the trainer,
fully-async, LoRA and critic rules and joins the tables. A rule takes the key's value and the context (every
key's effective value: the command's, else verl's default) and returns the fleetrl overrides it maps to, or a string that says why the key
needs none (``(no setting: ...)``), or raises :class:`Refused`. A refusal for something fleetrl
does not have names exactly one capability of :data:`CAPABILITIES`, so a user (and the corpus test
over verl's own scripts) can tell "not built yet" from "bad value".
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from launch.verl_correction_rules import correction
from launch.verl_data_rules import (
    _chat_kwargs,
    _engine,
    _engine_kwargs,
    _gen_batch,
    _legacy_manager,
    _manager,
    _max_model_len,
    _max_resp_len,
    _max_response,
    _multi_turn,
    _multi_turn_part,
    _n,
    _overlong_part,
    _response_length,
    _reward_fn,
    _reward_model,
    _reward_model_part,
    _rollout_ep,
    _temperature,
    _top_k,
    _train_batch,
    _truncation,
    _trust_remote_code,
    _val,
)
from launch.verl_defaults import FULLY_ASYNC, ONE_STEP_OFF
from launch.verl_policy_rules import (
    ACTOR_RULES,
    ALGORITHM_RULES,
    _agg,
    _dtype,
    _kl_reward_part,
    _override_transformer,
    critic_available,
    longest,
)
from launch.verl_rule_kit import (
    ARR,
    CAPABILITIES,
    CP,
    CRITIC,
    LORA,
    MOE,
    OTHER_ENGINE,
    ROLLOUT_CORRECTION,
    ULYSSES,
    VLM,
    Ctx,
    Refused,
    Rule,
    _above_one,
    _no_effect,
    _only,
    _refuse,
    _set,
    _when_true,
    dump,
    num,
)

__all__ = [
    "ARR",
    "CAPABILITIES",
    "CP",
    "CRITIC",
    "LORA",
    "MOE",
    "OTHER_ENGINE",
    "PREFIX_RULES",
    "ROLLOUT_CORRECTION",
    "RULES",
    "ULYSSES",
    "VLM",
    "Ctx",
    "Refused",
    "correction",
    "dump",
    "longest",
    "num",
]


# -- trainer -----------------------------------------------------------------------------------
def _logger(v: Any, c: Ctx) -> list[str]:
    if isinstance(v, str) and v.startswith("["):  # a quoted list reaches Hydra as a string
        v = yaml.safe_load(v)
    names = [v] if isinstance(v, str) else list(v or [])
    bad = [n for n in names if n not in ("console", "wandb", "tensorboard")]
    if bad:
        raise Refused(f"trainer.logger {bad}: fleetrl logs to the console, TensorBoard and W&B")
    out = [f"run.tensorboard={'true' if 'tensorboard' in names else 'false'}"]
    if "wandb" in names:
        out.append(f"run.wandb.project={dump(c.get('trainer.project_name'))}")
        if "trainer.experiment_name" in c.given:
            out.append(f"run.wandb.name={dump(c['trainer.experiment_name'])}")
    return out


def _wandb_part(v: Any, c: Ctx) -> str:
    logger = c.get("trainer.logger", [])
    if isinstance(logger, str) and logger.startswith("["):
        logger = yaml.safe_load(logger)
    on = "wandb" in ([logger] if isinstance(logger, str) else list(logger or []))
    return "(set with trainer.logger)" if on else "(no setting: trainer.logger has no wandb)"


def count_rows(files: Any) -> int:
    import pyarrow.parquet as pq

    if not isinstance(files, (str, list)):
        raise Refused(f"data.train_files={dump(files)}: expected a path or a list of paths")
    files = [files] if isinstance(files, str) else list(files)
    try:
        return sum(pq.ParquetFile(str(Path(f).expanduser())).metadata.num_rows for f in files)
    except Exception as exc:
        raise Refused(f"cannot count the prompts of {files}: {exc}") from None


def _epochs(v: Any, c: Ctx) -> list[str] | str:
    if c.entry == FULLY_ASYNC:
        return "(no setting: rollout.total_rollout_steps bounds a fully-async run)"
    if c.get("trainer.total_training_steps") is not None:
        return "(no setting: trainer.total_training_steps wins, as in verl)"
    files = c.get("data.train_files")
    if files is None:
        raise Refused(
            "trainer.total_epochs needs data.train_files on the same command line (steps = epochs x "
            "prompts // data.train_batch_size)"
        )
    batch = c.get("data.train_batch_size")
    if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
        return "(no setting: data.train_batch_size is refused above)"
    rows = count_rows(files)
    # verl's sampler drops the last incomplete batch of an epoch
    steps = int(v) * (rows // batch)
    if steps < 1:
        raise Refused(f"trainer.total_epochs={v}: {rows} prompts make no full batch of {batch}")
    return [f"run.max_steps={steps}"]


def _total_steps(v: Any, c: Ctx) -> list[str] | str:
    if v is None:
        return "(no setting: null, trainer.total_epochs decides)"
    if c.entry == FULLY_ASYNC:
        return "(no setting: rollout.total_rollout_steps bounds a fully-async run)"
    return [f"run.max_steps={int(v)}"]


def _resume(v: Any, _: Ctx) -> list[str]:
    if v not in ("auto", "disable"):
        raise Refused(
            f"trainer.resume_mode {v!r}: fleetrl resumes from the newest checkpoint ('auto') or not ('disable')"
        )
    return [f"learner.resume={'true' if v == 'auto' else 'false'}"]


def _val_before(v: Any, _: Ctx) -> list[str]:
    return [f"run.eval_before_train={'true' if v else 'false'}"]


def _keep(v: Any, _: Ctx) -> list[str] | str:
    if v is None:
        return "(no setting: verl keeps every checkpoint; fleetrl keeps learner.keep_checkpoints)"
    return [f"learner.keep_checkpoints={max(1, int(v))}"]


def _placement(v: Any, c: Ctx) -> str:
    return "(on the command line: see the placement note)"


def placement_advice(c: Ctx) -> str:
    learner = num(c, "trainer.n_gpus_per_node", int, 0) * num(c, "trainer.nnodes", int, 0)
    if c.entry in (FULLY_ASYNC, ONE_STEP_OFF) or c.get(ARR + "hybrid_engine") is False:
        rollout = (num(c, "rollout.n_gpus_per_node", int, 0) if "rollout.n_gpus_per_node" in c else 8) * (
            num(c, "rollout.nnodes", int, 0) if "rollout.nnodes" in c else 1
        )
        return (
            f"(on the command line: --rollout-gpus {rollout} --learner-gpus {learner}; verl gives the rollout "
            "and the trainer their own GPUs, as fleetrl does)"
        )
    return (
        f"(on the command line: --rollout-gpus R --learner-gpus L, R + L = {learner}; fleetrl gives each pool "
        f"its own GPUs; verl's hybrid engine shares them, which is --gpus {learner} (colocated mode))"
    )


# -- fully async -------------------------------------------------------------------------------
def async_schedule(c: Ctx) -> tuple[list[str], str]:
    """The broker's step and staleness for verl's fully-async trainer."""
    mini = num(c, ARR + "actor.ppo_mini_batch_size", int, 1)
    req = num(c, "async_training.require_batches", int, 1)
    sync = num(c, "async_training.trigger_parameter_sync_step", int, 1)
    groups = mini * req * sync
    out = [
        f"broker.groups_per_step={groups}",
        f"rollout.weight_update={'inflight' if c.get('async_training.partial_rollout') else 'pause'}",
    ]
    total = c.get("rollout.total_rollout_steps")
    if total is not None:
        out.append(f"run.max_steps={max(1, num(c, 'rollout.total_rollout_steps', int, 1) // groups)}")
    return out, (
        f"one fleetrl step = one verl parameter sync: trigger_parameter_sync_step {sync} x require_batches "
        f"{req} x ppo_mini_batch_size {mini} = {groups} prompt groups, published once"
    )


def _async_part(v: Any, c: Ctx) -> str:
    if c.entry != FULLY_ASYNC:
        return f"(no setting: read only by {FULLY_ASYNC})"
    return "(set with the fully-async schedule: see the schedule lines)"


def _staleness(v: Any, c: Ctx) -> str:
    if c.entry != FULLY_ASYNC:
        return f"(no setting: read only by {FULLY_ASYNC})"
    if not isinstance(v, (int, float)) or v < 0:
        raise Refused(f"async_training.staleness_threshold={v!r}: expected a fraction >= 0")
    return (
        f"(broker.max_staleness={math.ceil(v)}: verl bounds the share of samples from the previous version "
        f"({v}); fleetrl bounds their age in versions, any share)"
    )


def _no_verl(what: str) -> Rule:
    return _no_effect(f"verl 0.9 does not read {what}")


# -- LoRA (learner.lora; docs/lora.md) ----------------------------------------------------------
LORA_KEYS = {"lora_alpha": 16, "target_modules": "all-linear", "exclude_modules": None, "lora_adapter_path": None}


def _lora_on(c: Ctx) -> bool:
    return num(c, ARR + "model.lora_rank", minimum=0) > 0


def _names(key: str, v: Any) -> list[str]:
    if isinstance(v, str):
        return [v]
    if isinstance(v, (list, tuple)) and v and all(isinstance(x, str) for x in v):
        return list(v)
    raise Refused(f"{key}={dump(v)}: expected a module name or a list of module names")


def _lora_rank(v: Any, c: Ctx) -> list[str] | str:
    """lora_rank > 0 creates the learner.lora section from verl's LoRA keys (their verl defaults if unset)."""
    if not _lora_on(c):
        return "(no setting: full fine-tuning)"
    get = {k: c.get(ARR + "model." + k, d) for k, d in LORA_KEYS.items()}
    out = [f"learner.lora.rank={int(v)}", f"learner.lora.alpha={dump(get['lora_alpha'])}"]
    targets = get["target_modules"]
    out.append(
        "learner.lora.target_modules="
        + ("all-linear" if targets == "all-linear" else dump(_names(ARR + "model.target_modules", targets)))
    )
    if get["exclude_modules"] not in (None, "", []):
        out.append(
            "learner.lora.exclude_modules=" + dump(_names(ARR + "model.exclude_modules", get["exclude_modules"]))
        )
    if get["lora_adapter_path"]:
        out.append(f"learner.lora.adapter_path={get['lora_adapter_path']}")
    return out


def _lora_part(v: Any, c: Ctx) -> str:
    return "(set with lora_rank)" if _lora_on(c) else "(no setting: read only with lora_rank > 0)"


RULES: dict[str, Rule] = {
    **ALGORITHM_RULES,
    # fully async / one-step-off
    "async_training.staleness_threshold": _staleness,
    "async_training.trigger_parameter_sync_step": _async_part,
    "async_training.require_batches": _async_part,
    "async_training.partial_rollout": _async_part,
    "async_training.use_trainer_do_validate": _no_effect("the fleet runs evaluations"),
    "async_training.use_dynamic_resource_scheduling": _no_effect(
        "fleetrl's pools keep their own GPUs (rollout.autoscale sizes the fleet; --gpus N shares them)"
    ),
    "async_training.dynamic_schedule_policy": _no_effect("read only with use_dynamic_resource_scheduling"),
    "async_training.dynamic_schedule_deactivate_ratio": _no_effect("read only with use_dynamic_resource_scheduling"),
    "async_training.dynamic_schedule_enable_rebalance": _no_effect("read only with use_dynamic_resource_scheduling"),
    "async_training.concurrent_samples_per_replica": _no_effect("rollout.max_inflight_groups bounds it per server"),
    "rollout.nnodes": _placement,
    "rollout.n_gpus_per_node": _placement,
    "rollout.total_rollout_steps": _async_part,
    # data
    "data.train_files": _set("data.train_files"),
    "data.val_files": _set("data.test_files"),
    "data.train_batch_size": _train_batch,
    "data.gen_batch_size": _gen_batch,
    "data.val_batch_size": _no_effect("evaluation prompts go through the fleet as they fit"),
    "data.max_prompt_length": _set("data.max_prompt_tokens"),
    "data.max_response_length": _max_response,
    "data.filter_overlong_prompts": _set("data.filter_overlong_prompts"),
    "data.filter_overlong_prompts_workers": _no_effect("prompts are measured once at load"),
    "data.truncation": _truncation,
    "data.shuffle": _set("data.shuffle"),
    "data.seed": _no_effect("the shuffle is seeded by run.seed"),
    "data.dataloader_num_workers": _no_effect("prompts are tokenized once at load"),
    "data.prompt_key": _only("prompt", "fleetrl reads the 'prompt' column", "fleetrl reads the prompt from 'prompt'"),
    "data.reward_fn_key": _only(
        "data_source", "the reward routes by 'data_source'", "fleetrl routes rewards by 'data_source'"
    ),
    "data.return_raw_chat": _no_effect("fleetrl keeps the chat messages and applies the template itself"),
    "data.trust_remote_code": _trust_remote_code,
    "data.tokenizer": _no_effect("the tokenizer is the model folder's"),
    "data.use_shm": _no_effect("the model loads from its folder"),
    "data.image_key": _refuse(VLM, "image inputs (data.image_key)"),
    "data.video_key": _refuse(VLM, "video inputs (data.video_key)"),
    "data.audio_key": _refuse(VLM, "audio inputs (data.audio_key)"),
    "data.image_patch_size": _refuse(VLM, "image inputs (data.image_patch_size)"),
    "data.custom_cls.path": _refuse(OTHER_ENGINE, "a custom verl dataset class (data.custom_cls)"),
    "data.custom_cls.name": _refuse(OTHER_ENGINE, "a custom verl dataset class (data.custom_cls)"),
    "data.continuous_token.enable": _when_true(OTHER_ENGINE, "verl's continuous-token encoding (DeepSeek-V4)"),
    "data.continuous_token.model_family": _no_effect("read only with data.continuous_token.enable"),
    "data.min_response_length": _no_verl("data.min_response_length"),
    # model
    ARR + "model.path": _set("model.path"),
    ARR + "model.tokenizer_path": _no_effect("the tokenizer is the model folder's"),
    ARR + "model.use_remove_padding": _no_effect(
        "fleetrl always packs sequences without padding; the numbers are the same"
    ),
    ARR + "model.enable_gradient_checkpointing": _set("learner.activation_checkpointing"),
    ARR + "model.enable_activation_offload": _no_effect("a memory choice; fleetrl has activation checkpointing only"),
    ARR + "model.lora_rank": _lora_rank,
    ARR + "model.trust_remote_code": _trust_remote_code,
    ARR + "model.use_fused_kernels": _no_effect(
        "a kernel choice; fleetrl's chunked log-prob path keeps no full logits"
    ),
    ARR + "model.use_liger": _no_effect("a kernel choice"),
    ARR + "model.use_shm": _no_effect("the model loads from its folder (and, with LoRA, the adapters too)"),
    ARR + "model.external_lib": _refuse(OTHER_ENGINE, "a model class from an external library"),
    ARR + "model.mtp.enable": _when_true(OTHER_ENGINE, "multi-token-prediction (MTP) heads"),
    ARR + "hybrid_engine": _placement,
    ARR + "nccl_timeout": _no_effect("weight_sync has its own timeouts"),
    **ACTOR_RULES,
    # rollout
    ARR + "rollout.name": _engine,
    ARR + "rollout.mode": _no_effect("fleetrl's engines are always servers generating asynchronously"),
    ARR + "rollout.n": _n,
    ARR + "rollout.temperature": _temperature,
    ARR + "rollout.top_p": _set("rollout.sampling.top_p"),
    ARR + "rollout.top_k": _top_k,
    ARR + "rollout.do_sample": _only(True, "training samples", "training needs sampling (do_sample=True)"),
    ARR + "rollout.val_kwargs.temperature": _val("temperature"),
    ARR + "rollout.val_kwargs.top_p": _val("top_p"),
    ARR + "rollout.val_kwargs.top_k": _val("top_k"),
    ARR + "rollout.val_kwargs.n": _val("n"),
    ARR + "rollout.val_kwargs.do_sample": _val("do_sample"),
    ARR + "rollout.tensor_model_parallel_size": _set("rollout.tensor_parallel_size"),
    ARR + "rollout.data_parallel_size": _no_effect(
        "fleetrl runs one server per tensor_parallel_size GPUs and balances groups over them"
    ),
    ARR + "rollout.expert_parallel_size": _rollout_ep,
    ARR + "rollout.moe_tensor_parallel_size": _above_one(MOE, "rollout moe_tensor_parallel_size"),
    ARR + "rollout.gpu_memory_utilization": _set("rollout.gpu_memory_utilization"),
    ARR + "rollout.standalone_gpu_memory_utilization": _set("rollout.gpu_memory_utilization"),
    ARR + "rollout.max_num_seqs": _set("rollout.max_num_seqs"),
    ARR + "rollout.enforce_eager": _set("rollout.enforce_eager"),
    ARR + "rollout.max_model_len": _max_model_len,
    ARR + "rollout.prompt_length": _no_effect("data.max_prompt_length bounds the prompt"),
    ARR + "rollout.response_length": _response_length,
    ARR + "rollout.single_turn_response_length": _no_verl("rollout.single_turn_response_length"),
    ARR + "rollout.dtype": _dtype,
    ARR + "rollout.ignore_eos": _set("rollout.sampling.ignore_eos"),
    ARR + "rollout.calculate_log_probs": _no_effect("the engines always return the behaviour log-probs"),
    ARR + "rollout.max_num_batched_tokens": _no_effect("a throughput setting of the engine (rollout.vllm_server_args)"),
    ARR + "rollout.log_prob_micro_batch_size": _no_effect("the engine returns the behaviour log-probs"),
    ARR + "rollout.log_prob_micro_batch_size_per_gpu": _no_effect(
        "the engine returns the behaviour log-probs; the learner's own pass packs by learner.micro_batch_tokens"
    ),
    ARR + "rollout.log_prob_use_dynamic_bsz": _no_effect("the learner packs by tokens"),
    ARR + "rollout.log_prob_max_token_len_per_gpu": _no_effect("the learner packs by learner.micro_batch_tokens"),
    ARR + "rollout.free_cache_engine": _no_effect("fleetrl's engines keep their own GPUs"),
    ARR + "rollout.enable_sleep_mode": _no_effect("fleetrl's engines keep their own GPUs (colocated mode sleeps them)"),
    ARR + "rollout.multi_stage_wake_up": _no_effect("fleetrl's engines keep their own GPUs"),
    ARR + "rollout.enable_chunked_prefill": _no_effect("the engine's default"),
    ARR + "rollout.enable_prefix_caching": _no_effect(
        "the engine's default; the cache is reset at every weight update"
    ),
    ARR + "rollout.disable_log_stats": _no_effect("engine logging"),
    ARR + "rollout.load_format": _no_effect("engines load the model folder; weights arrive by weight sync"),
    ARR + "rollout.layered_summon": _no_effect(
        "weights are gathered by fleetrl's publisher (with LoRA only the adapters are gathered)"
    ),
    ARR + "rollout.agent.num_workers": _no_effect("reward.workers and the fleet's workers scale with the servers"),
    ARR + "rollout.enable_rollout_routing_replay": _when_true(MOE, "MoE routing replay"),
    ARR + "rollout.multi_turn.enable": _multi_turn,
    ARR + "rollout.over_sample_rate": _only(0, "off", "over-sampling with early cut of the slowest requests"),
    # reward
    "reward_model.reward_manager": _legacy_manager,
    "reward.reward_manager.name": _manager,
    "reward.reward_manager.source": _only("register", "verl's registered managers", "a custom reward manager module"),
    "reward_model.enable": _reward_model,
    "reward.reward_model.enable": _reward_model,
    "reward.num_workers": lambda v, _: [f"reward.workers={max(1, int(v))}"],
    "reward_model.reward_kwargs.max_resp_len": _max_resp_len,
    "reward.reward_kwargs.max_resp_len": _max_resp_len,
    "custom_reward_function.path": _reward_fn,
    "custom_reward_function.name": lambda v, c: "(set with custom_reward_function.path)",
    "reward.custom_reward_function.path": _reward_fn,
    "reward.custom_reward_function.name": lambda v, c: "(set with custom_reward_function.path)",
    # trainer
    "trainer.critic_warmup": lambda v, c: _critic_key("trainer.critic_warmup", v, c),
    "trainer.logger": _logger,
    "trainer.project_name": _wandb_part,
    "trainer.experiment_name": _wandb_part,
    "trainer.n_gpus_per_node": _placement,
    "trainer.nnodes": _placement,
    "trainer.save_freq": lambda v, _: [f"learner.checkpoint_every={max(0, int(v))}"],
    "trainer.test_freq": lambda v, _: [f"run.eval_every={max(0, int(v))}"],
    "trainer.total_epochs": _epochs,
    "trainer.total_training_steps": _total_steps,
    "trainer.val_before_train": _val_before,
    "trainer.val_only": _only(False, "training", "val_only: evaluate without training is not a fleetrl run mode"),
    "trainer.default_local_dir": _set("learner.checkpoint_dir"),
    "trainer.resume_mode": _resume,
    "trainer.resume_from_path": _no_effect("fleetrl resumes from the newest checkpoint in learner.checkpoint_dir"),
    "trainer.max_actor_ckpt_to_keep": _keep,
    "trainer.balance_batch": _no_effect("fleetrl packs micro-batches by tokens, which balances them"),
    "trainer.log_val_generations": _no_effect("fleetrl logs sample tables every learner.log_samples_every steps"),
    "trainer.device": _only("cuda", "CUDA GPUs", "Ascend NPUs (trainer.device=npu)", OTHER_ENGINE),
    "trainer.use_legacy_worker_impl": _no_effect("verl's worker implementation choice"),
    "hydra.searchpath": _no_effect("Hydra's config search path"),
    "actor@actor_rollout_ref.actor": _refuse(OTHER_ENGINE, "a verl actor config group from another trainer backend"),
}


CRITIC_KEYS = {  # verl critic.* -> learner.critic.* (keys.md); mapped only when the run has a critic (GAE)
    "critic.optim.lr": "optim.lr",
    "critic.optim.weight_decay": "optim.weight_decay",
    "critic.optim.lr_warmup_steps": "optim.warmup_steps",
    "critic.cliprange_value": "cliprange_value",
    "critic.ppo_epochs": "ppo_epochs",
    "critic.ppo_mini_batch_size": "ppo_mini_batch_size",
    "critic.grad_clip": "grad_clip",
    "critic.fsdp.param_offload": "param_offload",
    "critic.fsdp.optimizer_offload": "optimizer_offload",
    "trainer.critic_warmup": "warmup_steps",
}


def _critic_key(key: str, v: Any, c: Ctx) -> list[str] | str:
    if c.get("algorithm.adv_estimator") != "gae" or c.get("critic.enable") is False:
        return f"(no setting: the run has no critic (adv_estimator={c.get('algorithm.adv_estimator')}))"
    if not critic_available():
        raise Refused(f"{key}: a value model (critic)", CRITIC)
    if key == "critic.model.path":
        return "(set with algorithm.adv_estimator=gae: learner.critic.model_path)"
    if key == "trainer.critic_warmup":  # verl skips the actor while critic_warmup > global step (from 1): k - 1 steps
        return [f"learner.critic.warmup_steps={max(0, int(v) - 1)}"]
    if key == "critic.optim.lr_warmup_steps" and int(v) < 0:
        return "(no setting: -1 leaves the critic's warm-up to lr_warmup_steps_ratio)"
    if key == "critic.loss_agg_mode":
        return [f"learner.critic.aggregation={_agg(v, c)[0].split('=', 1)[1]}"]
    if key in CRITIC_KEYS:
        return [f"learner.critic.{CRITIC_KEYS[key]}={dump(v)}"]
    return "(no setting: a memory or kernel choice of the critic)"


def _megatron_prefix(key: str, v: Any, c: Ctx) -> list[str] | str:
    if ".override_transformer_config." in key:
        return _override_transformer(key, v, c)
    if ".ref.megatron." in key:
        return "(no setting: the reference runs in the learner's layout)"
    return "(no setting: a Megatron-Core memory, kernel or checkpoint choice)"


# key prefix -> rule(key, value, ctx); the longest matching prefix wins, after RULES
PREFIX_RULES: dict[str, Callable[[str, Any, Ctx], list[str] | str]] = {
    "critic.": _critic_key,
    "trainer.critic_warmup": _critic_key,
    "data.apply_chat_template_kwargs.": _chat_kwargs,
    ARR + "rollout.engine_kwargs.": _engine_kwargs,
    ARR + "rollout.multi_turn.": lambda k, v, c: _multi_turn_part(v, c),
    ARR + "rollout.checkpoint_engine.": lambda k, v, c: (
        "(no setting: fleetrl's weight sync moves the weights (weight_sync.*))"
    ),
    ARR + "rollout.prometheus.": lambda k, v, c: "(no setting: fleetrl's own Prometheus endpoints (run.prometheus))",
    ARR + "rollout.trace.": lambda k, v, c: "(no setting: tracing)",
    ARR + "model.override_config.": lambda k, v, c: (
        "(no setting: fleetrl serves and trains the model folder's config.json as it is; edit it there)"
    ),
    ARR + "model.mtp.": lambda k, v, c: "(set with model.mtp.enable)",
    ARR + "model.lora.": lambda k, v, c: (
        _only((0, None, False), "no LoRA", "LoRA adapters", LORA)(v, c)
        if k.endswith((".rank", ".adapter_path"))
        else "(no setting: read only with LoRA)"
    ),
    ARR + "model.lora_": lambda k, v, c: _lora_part(v, c),
    ARR + "model.target_modules": lambda k, v, c: _lora_part(v, c),
    ARR + "model.exclude_modules": lambda k, v, c: _lora_part(v, c),
    ARR + "actor.megatron.": _megatron_prefix,
    ARR + "ref.megatron.": _megatron_prefix,
    ARR + "actor.fsdp_config.": lambda k, v, c: (
        "(no setting: an FSDP sharding, prefetch or compile choice; the numbers are the same)"
    ),
    ARR + "ref.fsdp_config.": lambda k, v, c: "(no setting: an FSDP choice of the reference)",
    ARR + "actor.optim.override_optimizer_config.": lambda k, v, c: (
        _refuse(OTHER_ENGINE, "FP8 optimizer states")(v, c)
        if "fp8" in k
        else "(no setting: a Megatron optimizer memory choice)"
    ),
    ARR + "actor.checkpoint.": lambda k, v, c: (
        "(no setting: fleetrl's checkpoints hold model, optimizer and data position)"
    ),
    ARR + "actor.engine.": lambda k, v, c: _refuse(OTHER_ENGINE, "a Megatron-Lite engine setting (actor.engine.*)")(
        v, c
    ),
    ARR + "actor.veomni.": lambda k, v, c: _refuse(OTHER_ENGINE, "the VeOmni trainer backend")(v, c),
    ARR + "ref.veomni.": lambda k, v, c: _refuse(OTHER_ENGINE, "the VeOmni trainer backend")(v, c),
    ARR + "actor.entropy_": lambda k, v, c: "(no setting: fleetrl's chunked log-prob path computes entropy in chunks)",
    ARR + "ref.entropy_": lambda k, v, c: "(no setting: fleetrl's chunked log-prob path)",
    ARR + "actor.use_torch_compile": lambda k, v, c: "(no setting: learner.compile_blocks)",
    ARR + "ref.use_torch_compile": lambda k, v, c: "(no setting: a compile choice)",
    ARR + "ref.log_prob_": lambda k, v, c: "(no setting: the reference pass packs by learner.micro_batch_tokens)",
    ARR + "actor.pad_to_length": lambda k, v, c: "(no setting: fleetrl packs without padding)",
    ARR + "actor.policy_loss.": lambda k, v, c: "(no setting: read only by clip_cov/kl_cov/other loss modes)",
    ARR + "actor.shuffle": lambda k, v, c: "(no setting: mini-batches keep the step batch's order)",
    ARR + "actor.data_loader_seed": lambda k, v, c: "(no setting: read only with actor.shuffle)",
    ARR + "actor.use_rollout_log_probs": lambda k, v, c: "(set with the correction: see the schedule lines)",
    "algorithm.kl_ctrl.": lambda k, v, c: _kl_reward_part(v, c),
    "algorithm.pf_ppo.": lambda k, v, c: "(no setting: read only with algorithm.use_pf_ppo)",
    "reward.reward_kwargs.overlong_buffer_cfg.": lambda k, v, c: _overlong_part(v, c),
    "reward_model.reward_kwargs.overlong_buffer_cfg.": lambda k, v, c: _overlong_part(v, c),
    "reward_model.overlong_buffer.": lambda k, v, c: _overlong_part(v, c),
    "reward.reward_model.": lambda k, v, c: _reward_model_part(v, c),
    "reward_model.": lambda k, v, c: _reward_model_part(v, c),
    "trainer.worker_env.": lambda k, v, c: "(no setting: environment of verl's workers)",
}
