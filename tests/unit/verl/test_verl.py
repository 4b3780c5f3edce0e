"""verl command lines (launch/verl.py): the GRPO example script mapped key by key, refusals named with
their reason, epochs from the data, and --verl through the launcher's config resolution. verl's own
scripts, defaults and key families: tests/unit/verl/test_verl_scripts.py."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import pytest

from core.configbase import ConfigError
from launch.cluster import resolve_config
from launch.verl import parse, translate

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[3]
# verl's examples/grpo_trainer GRPO script on GSM8K (Qwen2-7B-Instruct), as users run it
SEED = (REPO / "tests/unit/verl/run_qwen2-7b_gsm8k_grpo.sh").read_text()
DATA = REPO / "data/word_problems"
# issue 26's keys (prompt groups per optimizer step, passes over the step batch)
MINI_BATCH_KEYS = {"learner.ppo_mini_batch_size", "learner.ppo_epochs"}


def _seed(**swap: str) -> str:
    text = SEED.replace("$HOME/data/gsm8k", str(DATA))
    for k, v in swap.items():
        text = text.replace(k, v)
    return text


def _resolve(text: str, tmp_path):
    """The launcher's run config for a verl command line alone (one rollout and one learner GPU)."""
    args = argparse.Namespace(
        overrides=[],
        recipe=None,
        verl=text,
        rollout_gpus=1,
        learner_gpus=1,
        simulate=False,
        max_steps=None,
        run_dir=str(tmp_path),
    )
    return resolve_config(args)


def test_every_key_of_the_seed_script_maps():
    keys = parse(_seed())
    assert len(keys) == 37
    m = translate(_seed())
    assert [k.split("=")[0] for k, _ in m.notes] == list(keys)  # each key, in order, accounted for
    o = dict(x.split("=", 1) for x in m.overrides)
    assert o["broker.groups_per_step"] == "1024"  # data.train_batch_size: prompts per step
    assert o["rollout.sampling.n"] == "5" and o["rollout.engine"] == "vllm"
    assert o["rollout.sampling.max_tokens"] == "1024" and o["data.max_prompt_tokens"] == "512"
    assert o["rollout.max_model_len"] == "1536"  # prompt + response, as verl sizes its engine
    assert o["learner.optim.lr"] == "1e-6" and o["learner.loss.kl_coef"] == "0.001"
    assert o["learner.loss.kl_estimator"] == "k3"  # low_var_kl
    assert o["learner.ppo_mini_batch_size"] == "256"
    assert o["learner.micro_batch_tokens"] == str(40 * 1536)  # 40 sequences of the longest length
    assert o["learner.param_offload"] == "false" and o["learner.optimizer_offload"] == "false"
    assert o["learner.reference_offload"] == "true" and o["learner.activation_checkpointing"] == "true"
    assert o["rollout.tensor_parallel_size"] == "2" and o["rollout.gpu_memory_utilization"] == "0.6"
    assert o["run.eval_every"] == "5" and o["learner.checkpoint_every"] == "20"
    assert o["run.wandb.project"] == "verl_grpo_example_gsm8k" and o["run.wandb.name"] == "qwen2_7b_function_rm"
    assert o["data.test_files"] == str(DATA / "test.parquet")  # val_files as a string
    assert o["model.path"] == "Qwen/Qwen2-7B-Instruct"
    # 15 epochs of 4000 prompts in batches of 1024 (verl drops the incomplete last batch): 15 x 3
    assert o["run.max_steps"] == "45"
    assert any("--rollout-gpus R --learner-gpus L, R + L = 8" in a for a in m.advice)


def test_seed_script_resolves_to_a_config(tmp_path):
    """The whole mapping through the launcher; the hub id is swapped for a local model (no download)."""
    text = _seed(**{"Qwen/Qwen2-7B-Instruct": str(REPO / "models/tiny-adder")})
    assert {o.split("=")[0] for o in translate(text).overrides} >= MINI_BATCH_KEYS
    cfg = _resolve(text, tmp_path)
    assert cfg.broker.groups_per_step == 1024 and cfg.rollout.sampling.n == 5
    assert cfg.rollout.max_model_len == 1536 and cfg.learner.loss.kl_coef == 0.001
    assert cfg.data.test_files == [str(DATA / "test.parquet")] and cfg.run.max_steps == 45
    # verl's main_ppo is synchronous with no rollout correction: staleness 0, correction none (was the
    # recipe's asynchronous decoupled schedule before the translation took verl's schedule)
    assert cfg.learner.loss.correction == "none" and cfg.broker.max_staleness == 0
    assert cfg.learner.optim.weight_decay == 0.01 and cfg.learner.loss.clip_high == 0.2  # verl's defaults


def test_rollout_correction_keys_resolve_to_a_learner_config(tmp_path):
    """verl-recipe's rollout_corr keys (sequence IS, batch-normalised, geometric rejection, the veto) through the
    launcher: learner.rollout_correction validates and carries verl's bounds in log space."""
    rc = (
        "algorithm.rollout_correction.rollout_is=sequence algorithm.rollout_correction.rollout_is_batch_normalize=true "
        "algorithm.rollout_correction.rollout_rs=geometric algorithm.rollout_correction.rollout_rs_threshold=1.01 "
        "algorithm.rollout_correction.rollout_rs_threshold_lower=0.99 "
        "algorithm.rollout_correction.rollout_token_veto_threshold=1e-4"
    )
    text = _seed(**{"Qwen/Qwen2-7B-Instruct": str(REPO / "models/tiny-adder")}) + " " + rc
    lc = _resolve(text, tmp_path).learner
    assert lc.loss.correction == "decoupled" and lc.rollout_correction.enable
    assert lc.rollout_correction.is_level == "sequence" and lc.rollout_correction.is_batch_normalize
    geo, veto = lc.rollout_correction.rejection
    assert (geo.statistic, geo.level) == ("log_ratio", "seq_mean")
    assert (geo.lower, geo.upper) == pytest.approx((math.log(0.99), math.log(1.01)), abs=1e-12)
    assert (veto.level, veto.upper) == ("seq_min", None) and veto.lower == pytest.approx(math.log(1e-4))


@pytest.mark.parametrize(
    "swap, skipped",
    [
        ({}, False),  # the seed's KL loss has a gradient on a uniform group's tokens: they are trained
        ({"use_kl_loss=True": "use_kl_loss=False"}, True),  # zero loss on them: skipped, counted in the mean
        ({"use_kl_loss=True": "use_kl_loss=False", "entropy_coeff=0": "entropy_coeff=0.001"}, False),
        (
            {
                "use_kl_loss=True": "use_kl_loss=False",
                "adv_estimator=grpo": "adv_estimator=reinforce_plus_plus_baseline",
            },
            False,
        ),
    ],
)
def test_a_verl_run_gets_the_gradient_verl_takes_from_uniform_groups(tmp_path, swap, skipped):
    """verl's GRPO puts every group in the loss's mean, uniform ones (advantage 0) too. fleetrl skips their compute
    and keeps them in the mean where their loss is exactly zero (the same gradient), trains them elsewhere; the
    mapping says which and why, and the launcher's config accepts it."""
    text = _seed(**{"Qwen/Qwen2-7B-Instruct": str(REPO / "models/tiny-adder"), **swap})
    m = translate(text)
    (why,) = [w for label, w in m.schedule if "all equal" in label]
    loss = _resolve(text, tmp_path).learner.loss
    assert (loss.drop_uniform_groups, loss.uniform_groups_in_mean) == ((True, True) if skipped else (False, False))
    assert ("the same gradient" in why) is skipped and ("would change the gradient" in why) is (not skipped)


# entropy_coeff, data.truncation, use_kl_in_reward and the other estimators map now (test_verl_scripts.py)
@pytest.mark.parametrize(
    ("arg", "needle"),
    [
        ("data.truncation=sideways", "verl has error, left, right and middle"),
        ("actor_rollout_ref.model.lora.rank=32", "[needs lora] LoRA adapters"),  # verl's nested (Megatron) section
        (
            "actor_rollout_ref.actor.use_kl_loss=True actor_rollout_ref.actor.kl_loss_type=kl",
            "'kl' (k1) has zero expected gradient",
        ),
        (
            "actor_rollout_ref.actor.use_kl_loss=True actor_rollout_ref.actor.kl_loss_type=full",
            "fleetrl has 'low_var_kl' (k3) and 'mse' (k2)",
        ),
        ("actor_rollout_ref.rollout.name=hf", "[needs other_engine] rollout.name 'hf'"),
        ("reward_model.enable=True", "[needs other_engine] verl's reward-model worker pool"),
        (
            "actor_rollout_ref.actor.ppo_mini_batchsize=8",
            "not known to fleetrl. Did you mean 'actor_rollout_ref.actor.ppo_mini_batch_size'?",
        ),
    ],
)
def test_refused_keys_are_named_with_the_reason(arg, needle):
    with pytest.raises(ConfigError) as err:
        translate(f"algorithm.adv_estimator=grpo {arg}")
    assert needle in str(err.value)


def test_every_problem_is_reported_at_once():
    with pytest.raises(ConfigError) as err:
        translate(
            "algorithm.adv_estimator=grpo actor_rollout_ref.model.lora.rank=8 data.truncation=sideways trainer.nosuch=1"
        )
    msg = str(err.value)
    assert "lora.rank" in msg and "truncation" in msg and "trainer.nosuch" in msg


def test_small_mappings():
    o = translate(
        "algorithm.adv_estimator=grpo algorithm.norm_adv_by_std_in_grpo=False actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean "
        "actor_rollout_ref.rollout.temperature=0.7 +trainer.total_training_steps=7 "
        "trainer.total_epochs=3 data.train_files=[a.parquet] custom_reward_function.path=my/score.py "
        "reward_model.reward_manager=batch actor_rollout_ref.actor.use_dynamic_bsz=True "
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384 trainer.resume_mode=disable"
    ).overrides
    assert "learner.loss.advantage=mean" in o and "learner.loss.aggregation=sequence" in o
    assert "rollout.sampling.temperature=0.7" in o and not any(x.startswith("learner.temperature") for x in o)
    assert "run.max_steps=7" in o  # total_training_steps wins over epochs, as in verl
    assert "reward.function=my/score.py:compute_score" in o and "reward.batched=true" in o
    assert "learner.micro_batch_tokens=16384" in o and "learner.resume=false" in o


def test_verl_subcommand_prints_the_mapping_and_config(capsys):
    from launch.cluster import main

    rc = main(
        [
            "verl",
            f"algorithm.adv_estimator=grpo data.train_files={DATA / 'train.parquet'} data.val_files={DATA / 'test.parquet'} "
            f"actor_rollout_ref.model.path={REPO / 'models/tiny-adder'} actor_rollout_ref.rollout.n=4",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert "actor_rollout_ref.rollout.n=4" in out and "rollout.sampling.n=4" in out
    assert "# fleetrl config" in out and "groups_per_step" in out


def test_verl_subcommand_refusal_exits_2(capsys):
    from launch.cluster import main

    assert main(["verl", "algorithm.adv_estimator=remax"]) == 2
    assert "'algorithm.adv_estimator=remax' is refused" in capsys.readouterr().err
