"""verl's PPO example with a critic, ``examples/ppo_trainer/run_qwen2-7b_seq_balance.sh`` (issue 35's "done
means"), translates with no refusal once its model and data paths are local, and gives a valid run config.

The script is not in scripts.json (verl v0.9.0 dropped it); its key=value arguments below are the ones it
passes to ``verl.trainer.main_ppo`` at verl-project/verl 709c8dfb, with its model (Qwen/Qwen2-7B-Instruct)
and its gsm8k + math parquet paths replaced by placeholders that ``local_command`` fills with this
repository's small files (tools/verl_script_keys.py)."""

from __future__ import annotations

import pytest

from launch.verl import translate
from tools.verl_script_keys import local_command

pytestmark = pytest.mark.timeout(120)

SEQ_BALANCE = {
    "entry": "verl.trainer.main_ppo",
    "path": "examples/ppo_trainer/run_qwen2-7b_seq_balance.sh",
    "keys": [
        "algorithm.adv_estimator=gae",
        "data.train_files=['{train_files}', '{train_files}']",
        "data.val_files=['{val_files}', '{val_files}']",
        "data.return_raw_chat=True",
        "data.train_batch_size=4096",
        "data.max_prompt_length=4096",
        "data.max_response_length=4096",
        "data.filter_overlong_prompts=True",
        "data.truncation=error",
        "actor_rollout_ref.model.path={model_path}",
        "actor_rollout_ref.actor.optim.lr=1e-6",
        "actor_rollout_ref.model.use_remove_padding=True",
        "actor_rollout_ref.model.enable_gradient_checkpointing=True",
        "actor_rollout_ref.actor.ppo_mini_batch_size=512",
        "actor_rollout_ref.actor.use_dynamic_bsz=True",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=24000",
        "actor_rollout_ref.actor.fsdp_config.param_offload=False",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False",
        "actor_rollout_ref.actor.use_kl_loss=False",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.multi_turn.format=hermes",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.5",
        "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=24000",
        "critic.optim.lr=1e-5",
        "critic.model.use_remove_padding=True",
        "critic.model.path={model_path}",
        "critic.model.enable_gradient_checkpointing=True",
        "critic.ppo_max_token_len_per_gpu=98304",
        "critic.model.fsdp_config.param_offload=False",
        "critic.model.fsdp_config.optimizer_offload=False",
        "algorithm.use_kl_in_reward=False",
        "trainer.critic_warmup=0",
        'trainer.logger=["console","wandb"]',
        "trainer.project_name=verl_example_gsm8k",
        "trainer.experiment_name=qwen2-7b_function_rm_bsz8k_p4k_r4k_seq_packing",
        "trainer.n_gpus_per_node=8",
        "trainer.val_before_train=False",
        "trainer.nnodes=1",
        "trainer.save_freq=20",
        "trainer.test_freq=5",
        "trainer.total_epochs=15",
    ],
}


def test_seq_balance_ppo_script_translates_with_a_critic_and_no_refusal():
    from launch.config import load_run_config
    from tools.verl_script_keys import LOCAL, REPO_ROOT

    m = translate(local_command(SEQ_BALANCE))  # raises Untranslatable, naming each refused key, on a refusal
    # every key of the script is accounted for: mapped, or no setting with its reason
    assert [k.split("=", 1)[0] for k, _ in m.notes] == [k.split("=", 1)[0] for k in SEQ_BALANCE["keys"]]
    notes = {k.split("=", 1)[0]: v for k, v in m.notes}
    # the critic's memory knobs have no setting of their own: it trains on the actor's micro-batches
    assert notes["critic.ppo_max_token_len_per_gpu"].startswith("(no setting")
    cfg = load_run_config("verl", list(m.overrides))
    model = str(REPO_ROOT / LOCAL["{model_path}"])
    assert cfg.learner.loss.advantage == "gae" and (cfg.learner.loss.gamma, cfg.learner.loss.lam) == (1.0, 1.0)
    c = cfg.learner.critic
    assert c is not None and c.model_path == model and cfg.model.path == model
    assert (c.optim.lr, c.warmup_steps, c.param_offload, c.optimizer_offload) == (1e-5, 0, False, False)
    assert cfg.rollout.sampling.n == 1  # verl's default rollout.n: one sample per prompt, legal with GAE
    assert not cfg.learner.kl_reward.enable and cfg.learner.loss.kl_coef == 0.0
    assert cfg.learner.micro_batch_tokens == 24000 and cfg.learner.ppo_mini_batch_size == 512
    assert [str(p) for p in cfg.data.train_files] == [str(REPO_ROOT / LOCAL["{train_files}"])] * 2
