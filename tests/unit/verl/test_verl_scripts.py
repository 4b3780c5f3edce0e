"""verl's own example scripts through launch/verl.py: every one translates or is refused by capability,
verl's defaults stand for omitted keys, and the schedule follows the entry module.

The key=value lists in scripts.json come from verl v0.9.0's examples/grpo_trainer, examples/ppo_trainer,
verl/experimental/{fully_async_policy,one_step_off_policy}/shell and verl-recipe's dapo/ (regenerate:
tools/verl_script_keys.py, see its docstring); data and model paths are placeholders filled with this
repository's small files."""

from __future__ import annotations

import json
import math
import types
import typing
from pathlib import Path

import numpy as np
import pytest
import yaml
from pydantic import BaseModel

from core.configbase import ConfigError
from launch.config import RunConfig
from launch.verl import CAPABILITIES, Untranslatable, translate
from launch.verl_defaults import DEFAULTS
from rollout_fleet.data import truncate
from tools.verl_script_keys import local_command, outcomes

pytestmark = pytest.mark.timeout(120)

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
RECORDS = json.loads((HERE / "scripts.json").read_text())
SEED = (HERE / "run_qwen2-7b_gsm8k_grpo.sh").read_text().replace("$HOME/data/gsm8k", str(REPO / "data/word_problems"))
# Scripts that map with no refusal today (the table in docs/verl.md); a floor, so new capabilities only raise it
MAPPED_FLOOR = 46
# keys agreed for this wave (notes/keys.md) that other branches add to the config models
AGREED = (
    "learner.loss.advantage",
    "learner.loss.entropy_coeff",
    "learner.loss.policy_loss",
    "learner.loss.loss_scale_factor",
    "learner.loss.gamma",
    "learner.loss.lam",
    "learner.kl_reward.",
    "rollout.filter_groups.",
    "reward.overlong_buffer.",
    "learner.critic.",
)


def _overrides(m) -> dict[str, str]:
    return dict(o.split("=", 1) for o in m.overrides)


def _known(key: str) -> bool:
    """The dotted key exists in the run config's models (through optional sections and free dicts)."""
    model: typing.Any = RunConfig
    for part in key.split("."):
        if model is dict:
            return True
        if not (isinstance(model, type) and issubclass(model, BaseModel)) or part not in model.model_fields:
            return False
        ann = model.model_fields[part].annotation
        union = typing.get_origin(ann) in (typing.Union, types.UnionType)
        args = [a for a in typing.get_args(ann) if a is not type(None)] if union else [ann]
        model = next(
            (a for a in args if isinstance(a, type) and issubclass(a, BaseModel)), typing.get_origin(args[0]) or args[0]
        )
    return True


def test_records_are_one_per_script_with_source():
    assert len(RECORDS) == 109
    assert {r["repo"] for r in RECORDS} == {"verl-project/verl", "verl-project/verl-recipe"}
    assert all(len(r["commit"]) == 40 and r["path"].endswith(".sh") for r in RECORDS)
    with_call = [r for r in RECORDS if r["entry"]]
    assert len(with_call) == 107  # a moved-away stub and dapo's data download script run no trainer
    assert all("=" in w for r in with_call for w in r["keys"])


def test_every_script_translates_and_each_refusal_names_one_capability():
    results = outcomes(RECORDS)  # a traceback here fails the test
    mapped = 0
    for rec, caps in results:
        if caps is None:
            mapped += 1
            continue
        assert None not in caps, f"{rec['path']}: a refusal names no capability"
        assert caps <= set(CAPABILITIES), rec["path"]
    assert mapped >= MAPPED_FLOOR
    for rec, caps in results:  # each message names exactly one capability
        if caps is not None:
            with pytest.raises(Untranslatable) as err:
                translate(local_command(rec))
            for p in err.value.problems:
                assert str(err.value).count(f"[needs {p.capability}]") >= 1
                assert sum(f"[needs {c}]" in p.message for c in CAPABILITIES) == 1, p.message


def test_mapped_scripts_emit_only_known_or_agreed_keys():
    for rec, caps in outcomes(RECORDS):
        if caps is None:
            for o in translate(local_command(rec)).overrides:
                key = o.split("=", 1)[0]
                assert _known(key) or key.startswith(AGREED), f"{rec['path']}: {o}"


def test_seed_script_runs_with_verl_defaults():
    o = _overrides(translate(SEED))
    assert o["learner.loss.clip_high"] == "0.2" and o["learner.loss.clip_low"] == "0.2"  # not fleetrl's 0.28
    assert o["learner.optim.weight_decay"] == "0.01" and o["learner.optim.lr"] == "1e-6"
    assert o["rollout.sampling.max_tokens"] == "1024"  # the script's own
    # without the script's lr and response length, verl's defaults stand in, not fleetrl's 1e-5 and 256
    bare = translate(
        SEED.replace("actor_rollout_ref.actor.optim.lr=1e-6", "").replace("data.max_response_length=1024", "")
    )
    o = _overrides(bare)
    assert float(o["learner.optim.lr"]) == 1e-6 and o["rollout.sampling.max_tokens"] == "512"  # same literal
    assert o["learner.loss.clip_high"] == "0.2" and o["learner.optim.weight_decay"] == "0.01"
    assert o["rollout.max_model_len"] == "1024" and o["broker.max_staleness"] == "0"
    assert o["learner.loss.correction"] == "none" and o["learner.ppo_epochs"] == "1"
    assert o["rollout.eval_sampling.temperature"] == "0" and o["rollout.eval_sampling.do_sample"] == "false"
    assert ("data.max_response_length=512", "rollout.sampling.max_tokens=512") in bare.defaults


def test_an_omitted_estimator_is_verls_gae():
    assert DEFAULTS["algorithm.adv_estimator"] == "gae"
    o = _overrides(translate("actor_rollout_ref.rollout.n=1 trainer.critic_warmup=3 critic.optim.lr_warmup_steps=-1"))
    assert o["learner.loss.advantage"] == "gae" and o["learner.critic.model_path"] == "null"
    assert o["learner.loss.gamma"] == "1.0" and o["learner.loss.lam"] == "1.0"
    # verl trains the critic alone while critic_warmup > global step (counted from 1): steps 1 and 2
    assert o["learner.critic.warmup_steps"] == "2" and "learner.critic.optim.warmup_steps" not in o


def test_fully_async_keys_onto_the_broker():
    rec = next(r for r in RECORDS if r["path"].endswith("fully_async_policy/shell/dapo_7b_math_fsdp2_8_8.sh"))
    m = translate(local_command(rec))
    o = _overrides(m)
    # train_batch_size=0 (no ZeroDivisionError); one step = trigger 4 x require_batches 4 x mini 32 prompts
    assert o["broker.groups_per_step"] == str(4 * 4 * 32) and o["learner.ppo_mini_batch_size"] == "32"
    assert o["broker.max_staleness"] == "1"  # ceil(staleness_threshold 0.1)
    assert o["rollout.weight_update"] == "inflight"  # partial_rollout
    assert o["run.max_steps"] == str(51200 // 512)  # total_rollout_steps
    assert o["learner.loss.correction"] == "bypass"  # the fully-async entry's default bypass_mode=true
    assert o["rollout.eval_sampling.top_p"] == "0.7" and o["rollout.sampling.top_k"] == "-1"
    assert o["reward.overlong_buffer.len"] == "4096" and o["learner.loss.clip_ratio_c"] == "10.0"
    assert o["learner.optim.warmup_steps"] == "10" and o["data.truncation"] == "left"
    assert any("--rollout-gpus 8 --learner-gpus 8" in a for a in m.advice)
    assert any("share of samples" in d for d in m.differences)


def test_one_step_off_is_one_version_stale():
    rec = next(r for r in RECORDS if r["path"].endswith("one_step_off_policy/shell/grpo_3b_gsm8k_fsdp2_2_6.sh"))
    o = _overrides(translate(local_command(rec)))
    assert o["broker.max_staleness"] == "1" and o["learner.loss.correction"] == "bypass"  # the entry's bypass_mode


@pytest.mark.parametrize(
    ("args", "expect"),
    [
        ("algorithm.adv_estimator=rloo", {"learner.loss.advantage": "rloo"}),
        ("algorithm.adv_estimator=grpo algorithm.norm_adv_by_std_in_grpo=False", {"learner.loss.advantage": "mean"}),
        (
            "algorithm.adv_estimator=reinforce_plus_plus_baseline",
            {"learner.loss.advantage": "reinforce_plus_plus_baseline"},
        ),
        ("algorithm.adv_estimator=gpg", {"learner.loss.advantage": "gpg"}),
        (
            "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm actor_rollout_ref.actor.loss_scale_factor=1024",
            {"learner.loss.aggregation": "seq_mean_token_sum_norm", "learner.loss.loss_scale_factor": "1024"},
        ),
        ("actor_rollout_ref.actor.loss_agg_mode=token-sum", {"learner.loss.aggregation": "token_sum"}),
        ("actor_rollout_ref.actor.policy_loss.loss_mode=gspo", {"learner.loss.policy_loss": "gspo"}),
        ("actor_rollout_ref.actor.entropy_coeff=0.001", {"learner.loss.entropy_coeff": "0.001"}),
        (
            "algorithm.use_kl_in_reward=True algorithm.kl_penalty=low_var_kl algorithm.kl_ctrl.type=adaptive "
            "algorithm.kl_ctrl.kl_coef=0.002",
            {
                "learner.kl_reward.enable": "true",
                "learner.kl_reward.estimator": "k3",
                "learner.kl_reward.type": "adaptive",
                "learner.kl_reward.coef": "0.002",
            },
        ),
        (
            "algorithm.filter_groups.enable=True algorithm.filter_groups.metric=acc "
            "algorithm.filter_groups.max_num_gen_batches=10",
            {
                "rollout.filter_groups.enable": "true",
                "rollout.filter_groups.metric": "acc",
                "rollout.filter_groups.max_num_gen_batches": "10",
            },
        ),
        (
            "reward_model.reward_manager=dapo +reward_model.reward_kwargs.overlong_buffer_cfg.enable=True "
            "+reward_model.reward_kwargs.overlong_buffer_cfg.len=128 "
            "+reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=0.5",
            {
                "reward.overlong_buffer.enable": "true",
                "reward.overlong_buffer.len": "128",
                "reward.overlong_buffer.penalty_factor": "0.5",
            },
        ),
        ("reward.reward_manager.name=prime", {"reward.mode": "process", "reward.batched": "false"}),
        (
            "algorithm.rollout_correction.rollout_is=token algorithm.rollout_correction.rollout_is_threshold=3.0",
            {"learner.loss.correction": "decoupled", "learner.loss.tis_cap": "3.0"},
        ),
        ("algorithm.rollout_correction.bypass_mode=True", {"learner.loss.correction": "bypass"}),
        # verl's fully-async MIS scripts: bypass (the entry's default) with seq_mean_k1 rejection, per micro-batch
        (
            "algorithm.rollout_correction.bypass_mode=True algorithm.rollout_correction.rollout_is=null "
            "algorithm.rollout_correction.rollout_rs=seq_mean_k1 algorithm.rollout_correction.rollout_rs_threshold=0.999_1.001",
            {
                "learner.loss.correction": "bypass",
                "learner.rollout_correction.enable": "true",
                "learner.rollout_correction.is_level": "none",
            },
        ),
        (
            "algorithm.rollout_correction.bypass_mode=True algorithm.rollout_correction.loss_type=reinforce "
            "algorithm.rollout_correction.rollout_is=token algorithm.rollout_correction.rollout_is_threshold=3.0",
            {"learner.loss.correction": "tis", "learner.loss.tis_cap": "3.0"},
        ),
        # IcePop band and sequence IS with batch normalisation: learner.rollout_correction
        (
            "algorithm.rollout_correction.rollout_is=token algorithm.rollout_correction.rollout_is_threshold=0.5_4.0",
            {
                "learner.loss.correction": "decoupled",
                "learner.rollout_correction.enable": "true",
                "learner.rollout_correction.is_level": "token",
                "learner.rollout_correction.is_upper": "4.0",
                "learner.rollout_correction.is_lower": "0.5",
                "learner.rollout_correction.rejection": "[]",
            },
        ),
        (
            "algorithm.rollout_correction.rollout_is=sequence algorithm.rollout_correction.rollout_is_batch_normalize=true",
            {
                "learner.rollout_correction.is_level": "sequence",
                "learner.rollout_correction.is_batch_normalize": "true",
                "learner.rollout_correction.is_upper": "2.0",
            },
        ),
        # k2/k3 options take one upper bound each, comma-separated per option
        (
            "algorithm.rollout_correction.rollout_rs=token_k2,seq_max_k3 algorithm.rollout_correction.rollout_rs_threshold=0.5,2",
            {
                "learner.rollout_correction.rejection": "[{statistic: k2, level: token, lower: null, upper: 0.5, name: "
                "token_k2}, {statistic: k3, level: seq_max, lower: null, upper: 2.0, name: seq_max_k3}]",
                "learner.rollout_correction.is_level": "none",
            },
        ),
        (
            "actor_rollout_ref.actor.clip_ratio_c=10.0 actor_rollout_ref.rollout.top_k=0",
            {"learner.loss.clip_ratio_c": "10.0", "rollout.sampling.top_k": "-1"},
        ),
        (
            "actor_rollout_ref.rollout.val_kwargs.top_k=20 actor_rollout_ref.rollout.val_kwargs.n=4",
            {"rollout.eval_sampling.top_k": "20", "rollout.eval_sampling.n": "4"},
        ),
        (
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2 "
            "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=4 actor_rollout_ref.actor.strategy=megatron",
            {
                "learner.megatron.tensor_model_parallel_size": "2",
                "learner.megatron.pipeline_model_parallel_size": "4",
                "learner.engine": "megatron",
            },
        ),
        (
            "trainer.val_before_train=False data.truncation=middle",
            {"run.eval_before_train": "false", "data.truncation": "middle"},
        ),
        (
            "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.1 trainer.total_training_steps=50",
            {"learner.optim.warmup_steps": "5", "run.max_steps": "50"},
        ),
        (
            "data.apply_chat_template_kwargs.enable_thinking=False",
            {"data.chat_template_kwargs.enable_thinking": "false"},
        ),
        (
            "actor_rollout_ref.rollout.engine_kwargs.vllm.kv_cache_dtype=fp8",
            {"rollout.vllm_server_args": '["--kv-cache-dtype", "fp8"]'},
        ),
        ("actor_rollout_ref.rollout.engine_kwargs.vllm.max_model_len=4096", {"rollout.max_model_len": "4096"}),
        # verl's length control for benchmarks: decode past EOS up to the response length
        ("actor_rollout_ref.rollout.ignore_eos=True", {"rollout.sampling.ignore_eos": "true"}),
        ("actor_rollout_ref.rollout.ignore_eos=False", {"rollout.sampling.ignore_eos": "false"}),
        # verl 0.9 clips with clip_ratio_low/high (0.2 each); clip_ratio is their fallback only when they are null
        ("actor_rollout_ref.actor.clip_ratio=0.3", {"learner.loss.clip_low": "0.2", "learner.loss.clip_high": "0.2"}),
        (
            "actor_rollout_ref.actor.clip_ratio=0.3 actor_rollout_ref.actor.clip_ratio_high=null",
            {"learner.loss.clip_low": "0.2", "learner.loss.clip_high": "0.3"},
        ),
    ],
)
def test_family_mappings(args, expect):
    o = _overrides(translate("algorithm.adv_estimator=grpo " + args))
    for k, v in expect.items():
        assert o[k] == v, (k, o.get(k))


def test_rollout_correction_scripts_map_to_verls_rules():
    """verl's MIS/RIS scripts and verl-recipe's rollout_corr script: rules in verl's log space."""
    by_name = {r["path"].rsplit("/", 1)[-1]: r for r in RECORDS}
    o = _overrides(translate(local_command(by_name["dapo_7b_math_fsdp2_64_64_mis.sh"])))
    assert o["learner.loss.correction"] == "decoupled" and o["learner.rollout_correction.is_level"] == "token"
    # seq_mean_k1 with 0.99_1.001: verl keeps log 0.99 <= mean(-log r) <= log 1.001
    rule = yaml.safe_load(o["learner.rollout_correction.rejection"])[0]
    assert rule["statistic"] == "k1" and rule["level"] == "seq_mean"
    assert (rule["lower"], rule["upper"]) == pytest.approx((math.log(0.99), math.log(1.001)), abs=1e-12)
    o = _overrides(translate(local_command(by_name["dapo_7b_math_fsdp2_64_64_ris.sh"])))
    assert o["learner.rollout_correction.is_level"] == "none"  # rollout_is=null: weight 1, not tis_cap's
    o = _overrides(translate(local_command(by_name["run_dapo_qwen2.5_32b_rollout_corr.sh"])))
    rules = yaml.safe_load(o["learner.rollout_correction.rejection"])
    assert [(r["name"], r["statistic"], r["level"]) for r in rules] == [
        ("geometric", "log_ratio", "seq_mean"),
        ("veto", "log_ratio", "seq_min"),
    ]
    assert rules[0]["lower"] == pytest.approx(math.log(0.99)) and rules[1]["lower"] == pytest.approx(math.log(1e-4))
    assert o["learner.rollout_correction.is_batch_normalize"] == "true"


@pytest.mark.parametrize(
    ("arg", "capability"),
    [
        ("data.image_key=images", "vlm"),
        ("actor_rollout_ref.actor.megatron.expert_model_parallel_size=8", "moe_expert_parallel"),
        ("actor_rollout_ref.actor.megatron.context_parallel_size=2", "context_parallel"),
        ("actor_rollout_ref.model.lora.rank=32", "lora"),  # verl's nested (Megatron) LoRA section
        ("actor_rollout_ref.rollout.name=trtllm", "other_engine"),
        ("actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=2", "other_engine"),
        (
            "algorithm.rollout_correction.bypass_mode=True algorithm.rollout_correction.loss_type=reinforce "
            "algorithm.rollout_correction.rollout_rs=seq_mean_k1 algorithm.rollout_correction.rollout_rs_threshold=0.99_1.01",
            "rollout_correction",
        ),
        (
            "algorithm.rollout_correction.rollout_is=sequence actor_rollout_ref.actor.strategy=megatron",
            "rollout_correction",
        ),
    ],
)
def test_refusals_by_capability(arg, capability):
    with pytest.raises(Untranslatable) as err:
        translate(f"algorithm.adv_estimator=grpo {arg}")
    assert [p.capability for p in err.value.problems] == [capability]
    assert f"[needs {capability}]" in str(err.value)


@pytest.mark.parametrize(
    ("arg", "needle"),
    [
        ("algorithm.adv_estimator=remax", "remax needs a greedy baseline rollout"),
        ("actor_rollout_ref.actor.policy_loss.loss_mode=clip_cov", "clip_cov and kl_cov select tokens"),
        ("data.train_batch_size=0", "0 is the fully-async trainer's"),
        (
            "actor_rollout_ref.model.trust_remote_code=True actor_rollout_ref.model.path=Qwen/Qwen2-7B",
            "not a local model folder",
        ),
    ],
)
def test_bad_values_are_refused_with_the_reason(arg, needle):
    with pytest.raises(Untranslatable) as err:
        translate(f"algorithm.adv_estimator=grpo {arg}")
    assert needle in str(err.value) and err.value.problems[0].capability is None


def test_trust_remote_code_on_a_local_folder_of_transformers_classes():
    m = translate(
        f"algorithm.adv_estimator=grpo actor_rollout_ref.model.path={REPO / 'models/tiny-adder'} "
        "actor_rollout_ref.model.trust_remote_code=True"
    )
    assert any("no remote code runs" in v for k, v in m.notes if k.startswith(f"{'actor_rollout_ref'}.model.trust"))


def test_truncation_cuts_as_verl_does():
    ids = np.arange(10)
    assert truncate(ids, 4, "left").tolist() == [6, 7, 8, 9]
    assert truncate(ids, 4, "right").tolist() == [0, 1, 2, 3]
    assert truncate(ids, 5, "middle").tolist() == [0, 1, 7, 8, 9]  # 5 // 2 first, the rest from the end
    assert truncate(ids, 12, "left") is ids


def test_no_key_value_gives_a_traceback():
    """Every key the translator knows, with values of the wrong kind: a ConfigError naming the key, or a mapping."""
    from launch.verl_defaults import FULLY_ASYNC, SWITCHED
    from launch.verl_rules import PREFIX_RULES, RULES

    for key in [*RULES, *(p + "x" for p in PREFIX_RULES), *SWITCHED]:
        entry = FULLY_ASYNC if key.startswith(("async_training.", "rollout.")) else "verl.trainer.main_ppo"
        for value in ("abc", "null", "[1,2]", "0"):
            try:
                translate(["-m", entry, "algorithm.adv_estimator=grpo", f"{key}={value}"])
            except ConfigError as err:
                assert key in str(err) or "(schedule)" in str(err) or "verl command line" in str(err), (key, value)


# verl's examples/grpo_trainer/run_qwen2_5-3b_gsm8k_grpo_lora.sh (volcengine/verl 771e530; not in scripts.json,
# which holds v0.9.0's examples, where it has no LoRA keys left), with its data and model paths made local.
VERL_LORA_EXAMPLE = """algorithm.adv_estimator=grpo trainer.val_before_train=False
 data.train_files={data}/train.parquet data.val_files={data}/test.parquet data.train_batch_size=16
 data.max_prompt_length=512 data.max_response_length=1024 data.filter_overlong_prompts=True data.truncation='error'
 data.shuffle=False actor_rollout_ref.model.path={model} actor_rollout_ref.model.lora_rank=64
 actor_rollout_ref.model.lora_alpha=32 actor_rollout_ref.actor.optim.lr=3e-6 actor_rollout_ref.model.use_remove_padding=True
 actor_rollout_ref.actor.ppo_mini_batch_size=16 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=40
 actor_rollout_ref.actor.use_kl_loss=True actor_rollout_ref.actor.kl_loss_coef=0.001
 actor_rollout_ref.actor.kl_loss_type=low_var_kl actor_rollout_ref.actor.entropy_coeff=0
 actor_rollout_ref.model.enable_gradient_checkpointing=True actor_rollout_ref.actor.fsdp_config.param_offload=False
 actor_rollout_ref.actor.fsdp_config.optimizer_offload=False actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=40
 actor_rollout_ref.rollout.tensor_model_parallel_size=2 actor_rollout_ref.rollout.name=vllm
 actor_rollout_ref.rollout.gpu_memory_utilization=0.6 actor_rollout_ref.rollout.n=5
 actor_rollout_ref.rollout.load_format=safetensors actor_rollout_ref.rollout.layered_summon=True
 actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=40 actor_rollout_ref.ref.fsdp_config.param_offload=True
 algorithm.use_kl_in_reward=False trainer.critic_warmup=0 trainer.project_name=verl_grpo_example_gsm8k
 trainer.experiment_name=qwen2.5_3b_grpo_lora trainer.n_gpus_per_node=2 trainer.nnodes=1 trainer.save_freq=20
 trainer.test_freq=5 trainer.total_epochs=15 actor_rollout_ref.model.use_shm=True"""


def test_verl_lora_example_translates_onto_learner_lora(tmp_path):
    cmd = VERL_LORA_EXAMPLE.format(data=REPO / "data/word_problems", model=REPO / "models/tiny-adder")
    o = _overrides(translate(cmd.split()))
    assert (o["learner.lora.rank"], o["learner.lora.alpha"], o["learner.lora.target_modules"]) == (
        "64",
        "32",
        "all-linear",
    )
    assert not any(k.startswith("learner.lora.") for k in _overrides(translate(SEED)))
    o = _overrides(
        translate(
            SEED.replace(
                "lr=1e-6",
                "lr=1e-6 actor_rollout_ref.model.lora_rank=8 "
                "actor_rollout_ref.model.target_modules=[q_proj,v_proj] "
                "actor_rollout_ref.model.exclude_modules=o_proj "
                f"actor_rollout_ref.model.lora_adapter_path={tmp_path}",
            )
        )
    )
    assert o["learner.lora.target_modules"] == "[q_proj, v_proj]" and o["learner.lora.exclude_modules"] == "[o_proj]"
    assert o["learner.lora.alpha"] == "16" and o["learner.lora.adapter_path"] == str(tmp_path)  # verl's default alpha


def test_lora_no_longer_refused_in_the_corpus():
    for rec, caps in outcomes([r for r in RECORDS if any("lora" in k for k in r["keys"])]):
        assert caps is None or "lora" not in caps, rec["path"]


def test_ulysses_maps_onto_the_learners_sequence_parallel_size():
    from launch.verl import translate

    m = translate(
        "algorithm.adv_estimator=grpo actor_rollout_ref.actor.ulysses_sequence_parallel_size=4 "
        "actor_rollout_ref.ref.ulysses_sequence_parallel_size=4"
    )
    assert "learner.sequence_parallel_size=4" in m.overrides
    with pytest.raises(Untranslatable, match="actor's sequence-parallel group"):
        translate(
            "algorithm.adv_estimator=grpo actor_rollout_ref.actor.ulysses_sequence_parallel_size=4 "
            "actor_rollout_ref.ref.ulysses_sequence_parallel_size=2"
        )


def test_verls_ppo_trainer_scripts_give_a_critic_or_a_named_refusal():
    """examples/ppo_trainer: the FSDP script becomes a valid run config with a critic; the Megatron one (PP=2)
    is refused at validation, naming the Megatron critic's layout limit (learner/config.py)."""
    from launch.config import load_run_config

    seen = set()
    for rec in RECORDS:
        if "ppo_trainer" not in rec["path"]:
            continue
        m = translate(local_command(rec))
        seen.add(Path(rec["path"]).name)
        if "megatron" in rec["path"]:
            # PP=2 in verl's script: the Megatron critic has no pipeline stages (learner/megatron/critic.py)
            with pytest.raises(ConfigError, match="Megatron critic .* has no pipeline stages"):
                load_run_config("verl", list(m.overrides))
            continue
        cfg = load_run_config("verl", list(m.overrides))
        assert cfg.learner.loss.advantage == "gae" and cfg.learner.critic is not None
    assert "run_qwen3_8b_fsdp.sh" in seen
