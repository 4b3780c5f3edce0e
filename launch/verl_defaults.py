"""verl 0.9's own defaults for the keys launch/verl.py maps: what a verl command means where it says nothing.

A translated command starts from these values for every key it omits, so fleetrl's recipe defaults
never stand in silently for verl's. Read from verl-project/verl at tag v0.9.0 (commit
483b8a009ba3a97563edee3a19887e4862b8094a), ``verl/trainer/config/_generated_ppo_trainer.yaml`` (the
flattened ``ppo_trainer.yaml`` with ``actor/dp_actor.yaml``, ``rollout/rollout.yaml`` and
``algorithm/rollout_correction.yaml``); the entry points' own config files add theirs on top
(:data:`ENTRY_DEFAULTS`). Only keys whose value reaches a fleetrl setting are listed; docs/verl.md
prints this table.
"""

from __future__ import annotations

from typing import Any

VERL_SOURCE = "verl-project/verl v0.9.0 (483b8a009ba3a97563edee3a19887e4862b8094a)"
A = "actor_rollout_ref."

# verl key -> verl 0.9's value (verl/trainer/config/_generated_ppo_trainer.yaml at VERL_SOURCE)
DEFAULTS: dict[str, Any] = {
    "data.max_prompt_length": 512,
    "data.max_response_length": 512,
    "data.train_batch_size": 1024,
    "data.shuffle": True,
    "data.filter_overlong_prompts": False,
    "data.truncation": "error",
    A + "model.enable_gradient_checkpointing": True,
    A + "model.lora_rank": 0,
    A + "actor.strategy": "fsdp",
    A + "actor.optim.lr": 1e-6,
    A + "actor.optim.weight_decay": 0.01,
    A + "actor.optim.betas": [0.9, 0.999],
    A + "actor.optim.clip_grad": 1.0,
    A + "actor.optim.lr_warmup_steps": -1,  # -1: lr_warmup_steps_ratio decides
    A + "actor.optim.lr_warmup_steps_ratio": 0.0,
    A + "actor.optim.lr_scheduler_type": "constant",
    A + "actor.optim.min_lr_ratio": 0.0,
    A + "actor.ppo_mini_batch_size": 256,  # prompts; verl multiplies by rollout.n
    A + "actor.ppo_epochs": 1,
    A + "actor.clip_ratio_low": 0.2,  # explicit 0.2 each: clip_ratio (0.2) is only their fallback when null
    A + "actor.clip_ratio_high": 0.2,
    A + "actor.clip_ratio_c": 3.0,
    A + "actor.loss_agg_mode": "token-mean",
    A + "actor.entropy_coeff": 0,
    A + "actor.policy_loss.loss_mode": "vanilla",
    A + "actor.use_kl_loss": False,
    A + "actor.kl_loss_coef": 0.001,
    A + "actor.kl_loss_type": "low_var_kl",
    A + "actor.fsdp_config.param_offload": False,
    A + "actor.fsdp_config.optimizer_offload": False,
    A + "ref.fsdp_config.param_offload": False,
    A + "rollout.n": 1,
    A + "rollout.temperature": 1.0,
    A + "rollout.top_p": 1,
    A + "rollout.top_k": -1,
    A + "rollout.tensor_model_parallel_size": 2,
    A + "rollout.gpu_memory_utilization": 0.5,
    A + "rollout.max_num_seqs": 256,
    A + "rollout.enforce_eager": False,
    A + "rollout.val_kwargs.temperature": 0,
    A + "rollout.val_kwargs.top_p": 1.0,
    A + "rollout.val_kwargs.top_k": -1,
    A + "rollout.val_kwargs.n": 1,
    A + "rollout.val_kwargs.do_sample": False,
    "algorithm.adv_estimator": "gae",
    "algorithm.norm_adv_by_std_in_grpo": True,
    "algorithm.use_kl_in_reward": False,
    "algorithm.filter_groups.enable": False,
    "algorithm.rollout_correction.rollout_is": None,
    "algorithm.rollout_correction.rollout_is_threshold": 2.0,
    "algorithm.rollout_correction.rollout_rs": None,
    "algorithm.rollout_correction.bypass_mode": False,
    "reward.reward_manager.name": "naive",
    "trainer.total_epochs": 30,
    "trainer.total_training_steps": None,
    "trainer.save_freq": -1,
    "trainer.test_freq": -1,
    "trainer.val_before_train": True,
    "trainer.resume_mode": "auto",
    "trainer.n_gpus_per_node": 8,
    "trainer.nnodes": 1,
}

# values verl reads only when a switch is on (use_kl_in_reward, filter_groups, overlong buffer): looked up
# through Ctx.get, not translated on their own
SWITCHED: dict[str, Any] = {
    "algorithm.kl_penalty": "kl",
    "algorithm.kl_ctrl.type": "fixed",
    "algorithm.kl_ctrl.kl_coef": 0.001,
    "algorithm.kl_ctrl.horizon": 10000,
    "algorithm.kl_ctrl.target_kl": 0.1,
    "algorithm.filter_groups.metric": None,
    "algorithm.filter_groups.max_num_gen_batches": 0,
    "algorithm.gamma": 1.0,
    "algorithm.lam": 1.0,
    A + "actor.clip_ratio": 0.2,
    A + "actor.loss_scale_factor": None,
    A + "actor.use_dynamic_bsz": False,
    A + "actor.ppo_max_token_len_per_gpu": 16384,
    "trainer.project_name": "verl_examples",
    "trainer.experiment_name": "gsm8k",
}

MAIN_PPO = "verl.trainer.main_ppo"
FULLY_ASYNC = "verl.experimental.fully_async_policy.fully_async_main"
ONE_STEP_OFF = "verl.experimental.one_step_off_policy.main_ppo"
DAPO = ("recipe.dapo.main_dapo", "recipe.dapo.dapo_transfer_queue.main_dapo")

# entry module -> what its own config file sets over ppo_trainer.yaml (same commit;
# verl/experimental/*/config/*_ppo_trainer.yaml; verl-recipe dapo/config/dapo_trainer.yaml)
ENTRY_DEFAULTS: dict[str, dict[str, Any]] = {
    MAIN_PPO: {},
    FULLY_ASYNC: {
        A + "rollout.n": 4,
        "data.gen_batch_size": 1,
        "async_training.staleness_threshold": 0.1,
        "async_training.trigger_parameter_sync_step": 4,
        "async_training.require_batches": 1,
        "async_training.partial_rollout": True,
        "rollout.nnodes": 1,
        "rollout.n_gpus_per_node": 8,
        "rollout.total_rollout_steps": 100,
        "algorithm.rollout_correction.bypass_mode": True,
    },
    ONE_STEP_OFF: {
        "rollout.nnodes": 1,
        "rollout.n_gpus_per_node": 8,
        "algorithm.rollout_correction.bypass_mode": True,
    },
    **{d: {"reward.reward_manager.name": "dapo"} for d in DAPO},
}


def defaults_for(entry: str) -> dict[str, Any]:
    """verl's defaults under ``entry`` (a module run with ``python -m``); an unknown entry gets main_ppo's."""
    return {**DEFAULTS, **ENTRY_DEFAULTS.get(entry, {})}
