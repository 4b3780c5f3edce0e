"""Run-config composition, dotted overrides, and the messages a user sees for bad input."""

import subprocess
import sys
from pathlib import Path

import pytest

from core.configbase import ConfigError
from launch.config import load_run_config, write_subconfigs
from learner.config import LearnerConfig


def test_recipe_and_overrides_compose():
    cfg = load_run_config("tiny", ["learner.optim.lr=1e-6", "broker.max_staleness=0", "rollout.sampling.n=4"])
    assert cfg.learner.optim.lr == 1e-6
    assert cfg.broker.max_staleness == 0
    assert cfg.rollout.sampling.n == 4
    # untouched values keep the recipe's
    assert cfg.learner.loss.correction == "decoupled"


def test_override_parses_yaml_values():
    cfg = load_run_config("tiny", ["data.test_files=[a.parquet, b.parquet]", "broker.spool_dir=/tmp/spool"])
    assert cfg.data.test_files == ["a.parquet", "b.parquet"]
    assert cfg.broker.spool_dir == "/tmp/spool"


def test_unknown_key_names_key_and_suggests():
    with pytest.raises(ConfigError) as e:
        load_run_config("tiny", ["broker.max_stalness=2"])
    msg = str(e.value)
    assert "broker.max_stalness" in msg
    assert "Did you mean 'max_staleness'" in msg
    assert "groups_per_step" in msg  # the allowed keys are listed


def test_unknown_section_suggests():
    with pytest.raises(ConfigError, match="unknown key 'lerner'.*Did you mean 'learner'"):
        load_run_config("tiny", ["lerner.optim.lr=1"])


def test_bad_value_names_key_value_and_range():
    with pytest.raises(ConfigError) as e:
        load_run_config("tiny", ["learner.optim.lr=-1"])
    assert "learner.optim.lr" in str(e.value) and "-1" in str(e.value) and "greater than 0" in str(e.value)


def test_bad_literal_lists_choices():
    with pytest.raises(ConfigError, match="rollout.engine.*'vlm'.*'vllm', 'sglang'"):
        load_run_config("tiny", ["rollout.engine=vlm"])


def test_correction_none_requires_synchronous():
    with pytest.raises(ConfigError, match="correction='none' is only legal with broker.max_staleness=0"):
        load_run_config("tiny", ["learner.loss.correction=none"])
    cfg = load_run_config("tiny", ["learner.loss.correction=none", "broker.max_staleness=0"])
    assert cfg.learner.loss.correction == "none"


def test_correction_is_required():
    with pytest.raises(Exception, match="correction"):
        LearnerConfig.model_validate({"engine": "fsdp", "loss": {}})


def test_unknown_recipe_suggests():
    with pytest.raises(ConfigError, match="unknown recipe 'tinny'. Did you mean 'tiny'"):
        load_run_config("tinny")


def test_malformed_override():
    with pytest.raises(ConfigError, match="expected dotted.key=value"):
        load_run_config("tiny", ["broker.max_staleness"])


def test_write_subconfigs_round_trip(tmp_path):
    cfg = load_run_config("tiny")
    paths = write_subconfigs(cfg, tmp_path)
    assert paths["broker"].exists() and paths["learner"].exists()
    import yaml

    from broker.config import BrokerConfig

    assert BrokerConfig.model_validate(yaml.safe_load(paths["broker"].read_text())) == cfg.broker


def test_config_modules_import_neither_torch_nor_vllm():
    # What keeps `--help` and config errors fast is what the config modules import; the
    # time itself is measured in bench, not asserted here (a loaded CI machine varies).
    code = (
        "import sys; import launch.config; "
        "bad = [m for m in ('torch', 'vllm', 'ray', 'transformers') if m in sys.modules]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_learner_temperature_follows_sampling_and_a_different_one_is_refused():
    assert load_run_config("tiny", ["rollout.sampling.temperature=0.7"]).learner.temperature == 0.7
    assert (
        load_run_config("tiny", ["rollout.sampling.temperature=0.7", "learner.temperature=0.7"]).learner.temperature
        == 0.7
    )
    with pytest.raises(ConfigError, match="learner.temperature=1.0 differs from rollout.sampling.temperature=0.7"):
        load_run_config("tiny", ["rollout.sampling.temperature=0.7", "learner.temperature=1.0"])


# ---- checks that catch what breaks a first run (issue 19) ------------------------------------------


def test_grpo_with_one_sample_per_prompt_is_refused():
    with pytest.raises(
        ConfigError,
        match=r"rollout.sampling.n=1: GRPO scores each sample against the others of its "
        r"group.*use n >= 2",
    ):
        load_run_config("tiny", ["rollout.sampling.n=1"])


def test_eval_needs_test_files_or_is_switched_off():
    with pytest.raises(
        ConfigError,
        match=r"data.test_files is empty but the run evaluates before and after training "
        r"\(run.eval_samples=200\): give data.test_files \(verl's data.val_files\) or set "
        r"run.eval_samples=0",
    ):
        load_run_config("tiny", ["data.test_files=[]"])
    cfg = load_run_config("tiny", ["data.test_files=[]", "run.eval_samples=0"])
    assert cfg.run.eval_samples == 0


def test_train_and_test_files_may_be_one_string():
    cfg = load_run_config("tiny", ["data.test_files=data/addition/test.parquet"])
    assert cfg.data.test_files == [str(Path(__file__).resolve().parents[3] / "data/addition/test.parquet")]


def test_on_truncated_mask_reaches_the_learner():
    assert load_run_config("tiny", ["reward.on_truncated=mask"]).learner.loss.mask_truncated
    assert not load_run_config("tiny", ["reward.on_truncated=penalize"]).learner.loss.mask_truncated
    with pytest.raises(ConfigError, match="learner.loss.mask_truncated=True disagrees with reward.on_truncated"):
        load_run_config("tiny", ["learner.loss.mask_truncated=true"])


def test_fsdp_offload_keys_and_megatron_refusal():
    cfg = load_run_config("tiny", ["learner.param_offload=true", "learner.optimizer_offload=true"])
    assert cfg.learner.param_offload and cfg.learner.optimizer_offload
    with pytest.raises(ConfigError, match="param_offload / optimizer_offload are FSDP's"):
        load_run_config("tiny", ["learner.engine=megatron", "learner.param_offload=true"])


def test_megatron_chunked_logprobs_need_tp1():
    tp2 = ["learner.engine=megatron", "learner.megatron.tensor_model_parallel_size=2"]
    assert (
        load_run_config("tiny", ["learner.engine=megatron", "learner.logprobs=chunked"]).learner.logprobs == "chunked"
    )
    assert load_run_config("tiny", tp2).learner.logprobs == "auto"  # auto: the full head with TP>1
    with pytest.raises(ConfigError, match="logprobs=chunked with learner.engine=megatron needs tensor_model_parallel"):
        load_run_config("tiny", [*tp2, "learner.logprobs=chunked"])


def test_a_hub_id_not_in_the_cache_fails_at_config_time_saying_what_to_do(tmp_path, monkeypatch):
    from launch.config import resolve_model_path

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))  # an empty cache: nothing to find, nothing downloaded
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(
        ConfigError,
        match=r"model.path 'Qwen/Qwen2-7B-Instruct' is not a local folder; as a Hugging "
        r"Face hub id it is not in the local HF cache either. Download it first \(`hf download "
        r"Qwen/Qwen2-7B-Instruct`",
    ):
        resolve_model_path("Qwen/Qwen2-7B-Instruct")
    with pytest.raises(ConfigError, match="has no config.json"):
        resolve_model_path(str(tmp_path))
    with pytest.raises(ConfigError, match="does not exist"):
        resolve_model_path("/no/such/model")
    # a cached snapshot (the hub's cache layout) resolves to its folder
    snap = tmp_path / "models--org--tiny" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    (tmp_path / "models--org--tiny" / "refs").mkdir()
    (tmp_path / "models--org--tiny" / "refs" / "main").write_text("abc123")
    assert resolve_model_path("org/tiny") == str(snap)


def test_reward_function_names():
    assert load_run_config("tiny", ["reward.function=default"]).reward.function == "default"
    assert load_run_config("tiny", ["reward.function=rewards/my_score.py:compute_score"]).reward.function
    with pytest.raises(ConfigError, match="neither a built-in"):
        load_run_config("tiny", ["reward.function=gsm9k"])


def test_training_sampling_the_learner_cannot_score_is_refused():
    with pytest.raises(ConfigError, match="temperature=0 samples greedily"):
        load_run_config("tiny", ["rollout.sampling.temperature=0"])
    with pytest.raises(ConfigError, match="top_p=0.9 truncates"):
        load_run_config("tiny", ["rollout.sampling.top_p=0.9"])


def test_kl_estimators_and_mini_batch_keys():
    with pytest.raises(ConfigError, match="zero expected gradient"):
        load_run_config("tiny", ["learner.loss.kl_estimator=k1"])
    with pytest.raises(ConfigError, match="kl_estimator must be one of"):
        load_run_config("tiny", ["learner.loss.kl_estimator=k4"])
    for name in ("k2", "mse", "k3", "low_var_kl"):
        assert load_run_config("tiny", [f"learner.loss.kl_estimator={name}"]).learner.loss.kl_estimator == name
    cfg = load_run_config("tiny", ["learner.ppo_mini_batch_size=8", "learner.ppo_epochs=2"])
    assert (cfg.learner.ppo_mini_batch_size, cfg.learner.ppo_epochs, cfg.learner.loss.clip_ratio_c) == (8, 2, 3.0)
    with pytest.raises(ConfigError, match="clip_ratio_c"):
        load_run_config("tiny", ["learner.loss.clip_ratio_c=1.0"])


def test_logprob_probe_tolerance_follows_the_engines_dtype():
    from learner.logprob_probe import BF16_TOLERANCE, FP32_TOLERANCE, resolve_tolerance

    cfg = load_run_config("tiny", [])
    assert cfg.learner.logprob_probe_tolerance == "auto"
    assert resolve_tolerance("auto", cfg.model.dtype) == FP32_TOLERANCE  # the tiny recipe serves float32
    assert resolve_tolerance("auto", load_run_config("gpu-tiny", []).model.dtype) == BF16_TOLERANCE
    assert resolve_tolerance(0.2, "bfloat16") == 0.2 and resolve_tolerance(None, "float32") is None
    assert load_run_config("tiny", ["learner.logprob_probe_tolerance=null"]).learner.logprob_probe_tolerance is None
    with pytest.raises(ConfigError, match="logprob_probe_tolerance"):
        load_run_config("tiny", ["learner.logprob_probe_tolerance=-1.0"])


def test_dapo_smollm2_is_the_smollm2_recipe_with_dapos_changes():
    grpo, dapo = load_run_config("smollm2").model_dump(), load_run_config("dapo-smollm2").model_dump()
    assert dapo["rollout"]["filter_groups"]["enable"] and dapo["reward"]["overlong_buffer"]["enable"]
    assert dapo["reward"]["overlong_buffer"]["len"] == 4
    assert (dapo["learner"]["loss"]["clip_low"], dapo["learner"]["loss"]["clip_high"]) == (0.2, 0.28)
    assert dapo["learner"]["loss"]["kl_coef"] == 0.0 and dapo["learner"]["loss"]["aggregation"] == "token"
    # everything else is the GRPO recipe's, so the two runs compare the algorithm only
    for section in ("model", "data", "broker"):
        assert dapo[section] == grpo[section], section
    for part in ("sampling", "servers", "max_model_len"):
        assert dapo["rollout"][part] == grpo["rollout"][part], part
    assert dapo["learner"]["optim"] == grpo["learner"]["optim"]
    assert dapo["run"] | {"run_dir": None} == grpo["run"] | {"run_dir": None}


def test_every_shipped_recipe_validates():
    """A recipe is a user's first command: each one under launch/recipes/ loads and validates as shipped. The
    exception is `verl`, the base of translated verl commands, whose data files come from the command line."""
    from launch.config import RECIPES_DIR

    names = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))
    assert len(names) >= 15 and "smollm2-lora" in names
    for name in names:
        if name == "verl":
            with pytest.raises(ConfigError, match="data.train_files"):
                load_run_config(name)
            continue
        cfg = load_run_config(name)
        assert cfg.learner.lora is None or name.endswith("-lora"), name
