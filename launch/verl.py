"""A verl command line's dotted keys as fleetrl overrides: each key maps, or is refused by name with why.

verl configures a run with Hydra keys (``algorithm.adv_estimator=grpo data.train_batch_size=1024
actor_rollout_ref.actor.optim.lr=1e-6 ...``). :func:`translate` turns them into fleetrl's dotted
overrides, applied on top of a recipe (``launch/recipes/verl.yaml`` by default)::

    python launch/cluster.py --verl 'algorithm.adv_estimator=grpo data.train_files=train.parquet ...'
    python launch/cluster.py verl 'algorithm.adv_estimator=grpo ...'    # print the mapping and the config

Every key of verl's GRPO example scripts is in :data:`RULES`. A rule either maps the value onto
fleetrl keys, accepts it because fleetrl behaves that way anyway (``use_remove_padding=True``:
fleetrl always packs without padding), or refuses it with the reason (a value fleetrl has no
equivalent for, e.g. ``entropy_coeff != 0``). An unknown key is refused too, with the nearest
known one. All problems are reported at once, before anything starts.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import yaml

from core.configbase import ConfigError, suggest

ARR = "actor_rollout_ref."


class Refused(Exception):
    """One key's value has no fleetrl equivalent; the message says why."""


@dataclass(slots=True)
class Mapping:
    """The outcome of a translation: overrides in order, and per verl key what became of it."""

    overrides: list[str] = field(default_factory=list)
    notes: list[tuple[str, str]] = field(default_factory=list)  # (verl key=value, fleetrl keys or why none)
    advice: list[str] = field(default_factory=list)  # things to pass on the command line instead


Rule = Callable[[Any, dict[str, Any]], list[str] | str]


def _set(*keys: str) -> Rule:
    return lambda v, _: [f"{k}={_dump(v)}" for k in keys]


def _only(expected: Any, why: str, refuse: str) -> Rule:
    """Accept one value (fleetrl always behaves so: ``why``), refuse others (``refuse``)."""
    def rule(v: Any, _: dict) -> str:
        if v == expected or (isinstance(expected, tuple) and v in expected):
            return f"(no setting: {why})"
        raise Refused(refuse)
    return rule


def _no_effect(why: str) -> Rule:
    return lambda v, _: f"(no setting: {why})"


def _dump(v: Any) -> str:
    return yaml.safe_dump(v, default_flow_style=True).strip().removesuffix("...").strip()


def _adv(v: Any, _: dict) -> str:
    if v != "grpo":
        raise Refused(f"fleetrl's advantages are GRPO's (group-relative); {v!r} (a critic, RLOO, ...) is not implemented")
    return "(no setting: fleetrl's advantage is GRPO's; divided by the group's std unless " \
           "algorithm.norm_adv_by_std_in_grpo=False)"


def _norm_std(v: Any, _: dict) -> list[str]:
    return [f"learner.loss.advantage={'mean_std' if v else 'mean'}"]


def _kl_loss(v: Any, all_: dict) -> list[str] | str:
    if not v:
        return ["learner.loss.kl_coef=0.0"]
    return [f"learner.loss.kl_coef={_dump(all_.get(ARR + 'actor.kl_loss_coef', 0.001))}"]


def _kl_coef(v: Any, all_: dict) -> list[str] | str:
    if not all_.get(ARR + "actor.use_kl_loss", False):
        return "(no setting: actor.use_kl_loss is false)"
    return [f"learner.loss.kl_coef={_dump(v)}"]


def _kl_type(v: Any, _: dict) -> list[str]:
    est = {"low_var_kl": "k3", "k3": "k3", "mse": "k2", "k2": "k2"}.get(v)
    if v in ("kl", "k1"):
        raise Refused("kl_loss_type 'kl' (k1) has zero expected gradient as a loss term; use 'low_var_kl' (k3) "
                      "or 'mse' (k2)")
    if est is None:
        raise Refused(f"kl_loss_type {v!r}: fleetrl has 'low_var_kl' (k3) and 'mse' (k2)")
    return [f"learner.loss.kl_estimator={est}"]


def _agg(v: Any, _: dict) -> list[str]:
    agg = {"token-mean": "token", "seq-mean-token-mean": "sequence"}.get(v)
    if agg is None:
        raise Refused(f"loss_agg_mode {v!r}: fleetrl has 'token-mean' and 'seq-mean-token-mean'")
    return [f"learner.loss.aggregation={agg}"]


def _clip(v: Any, _: dict) -> list[str]:
    return [f"learner.loss.clip_low={_dump(v)}", f"learner.loss.clip_high={_dump(v)}"]


def _micro_seqs(v: Any, all_: dict) -> list[str] | str:
    if all_.get(ARR + "actor.use_dynamic_bsz"):
        return "(no setting: use_dynamic_bsz takes ppo_max_token_len_per_gpu)"
    # fleetrl packs micro-batches by tokens: room for this many sequences of the longest length
    longest = int(all_.get("data.max_prompt_length", 512)) + int(all_.get("data.max_response_length", 512))
    return [f"learner.micro_batch_tokens={int(v) * longest}"]


def _token_budget(v: Any, all_: dict) -> list[str] | str:
    if not all_.get(ARR + "actor.use_dynamic_bsz"):
        return "(no setting: read only with use_dynamic_bsz=True)"
    return [f"learner.micro_batch_tokens={int(v)}"]


def _truncation(v: Any, _: dict) -> str:
    if v == "error":
        return "(no setting: fleetrl refuses an overlong prompt before the run starts, or skips it with " \
               "filter_overlong_prompts)"
    raise Refused(f"truncation {v!r}: fleetrl never cuts a prompt; data.filter_overlong_prompts=True skips them")


def _strategy(v: Any, _: dict) -> list[str]:
    if v in ("fsdp", "fsdp2"):
        return ["learner.engine=fsdp"]
    if v == "megatron":
        return ["learner.engine=megatron"]
    raise Refused(f"actor.strategy {v!r}: fleetrl's learner engines are 'fsdp' (FSDP2) and 'megatron'")


def _engine(v: Any, _: dict) -> list[str]:
    if v not in ("vllm", "sglang"):
        raise Refused(f"rollout.name {v!r}: fleetrl's engines are 'vllm' and 'sglang'")
    return [f"rollout.engine={v}"]


def _temperature(v: Any, _: dict) -> list[str]:
    return [f"rollout.sampling.temperature={_dump(v)}", f"learner.temperature={_dump(v)}"]


def _logger(v: Any, all_: dict) -> list[str] | str:
    names = [v] if isinstance(v, str) else list(v or [])
    bad = [n for n in names if n not in ("console", "wandb", "tensorboard")]
    if bad:
        raise Refused(f"trainer.logger {bad}: fleetrl logs to the console, TensorBoard and W&B")
    out = [f"run.tensorboard={'true' if 'tensorboard' in names else 'false'}"]
    if "wandb" in names:
        out.append(f"run.wandb.project={_dump(all_.get('trainer.project_name', 'fleetrl'))}")
        if "trainer.experiment_name" in all_:
            out.append(f"run.wandb.name={_dump(all_['trainer.experiment_name'])}")
    return out


def _wandb_part(v: Any, all_: dict) -> str:
    logger = all_.get("trainer.logger", [])
    on = "wandb" in ([logger] if isinstance(logger, str) else list(logger or []))
    return "(set with trainer.logger)" if on else "(no setting: trainer.logger has no wandb)"


def _epochs(v: Any, all_: dict) -> list[str] | str:
    if "trainer.total_training_steps" in all_ and all_["trainer.total_training_steps"] is not None:
        return "(no setting: trainer.total_training_steps wins, as in verl)"
    files = all_.get("data.train_files")
    if files is None:
        raise Refused("trainer.total_epochs needs data.train_files on the same command line (steps = epochs x "
                      "prompts // data.train_batch_size)")
    import pyarrow.parquet as pq

    files = [files] if isinstance(files, str) else list(files)
    try:
        rows = sum(pq.ParquetFile(f).metadata.num_rows for f in files)
    except Exception as exc:
        raise Refused(f"trainer.total_epochs: cannot count the prompts of {files}: {exc}") from None
    batch = int(all_.get("data.train_batch_size", 1024))
    # verl's sampler drops the last incomplete batch of an epoch
    steps = int(v) * (rows // batch)
    if steps < 1:
        raise Refused(f"trainer.total_epochs={v}: {rows} prompts make no full batch of {batch}")
    return [f"run.max_steps={steps}"]


def _resume(v: Any, _: dict) -> list[str]:
    if v not in ("auto", "disable"):
        raise Refused(f"trainer.resume_mode {v!r}: fleetrl resumes from the newest checkpoint ('auto') or not ('disable')")
    return [f"learner.resume={'true' if v == 'auto' else 'false'}"]


def _placement(v: Any, all_: dict) -> str:
    total = int(all_.get("trainer.n_gpus_per_node", 8)) * int(all_.get("trainer.nnodes", 1))
    return f"(on the command line: --rollout-gpus R --learner-gpus L, R + L = {total}; fleetrl gives each pool its own GPUs)"


def _reward_fn(v: Any, all_: dict) -> list[str] | str:
    path, name = all_.get("custom_reward_function.path"), all_.get("custom_reward_function.name", "compute_score")
    if not path:
        return "(no setting: no custom_reward_function.path)"
    return [f"reward.function={path}:{name}"]


def _manager(v: Any, _: dict) -> list[str]:
    if v == "naive":
        return ["reward.batched=false"]
    if v == "batch":
        return ["reward.batched=true"]
    raise Refused(f"reward_model.reward_manager {v!r}: fleetrl scores per sample ('naive') or per group ('batch'); "
                  "an async reward function covers judges and sandboxes")


RULES: dict[str, Rule] = {
    "algorithm.adv_estimator": _adv,
    "algorithm.norm_adv_by_std_in_grpo": _norm_std,
    "algorithm.use_kl_in_reward": _only(False, "fleetrl puts the KL in the loss (actor.use_kl_loss)",
                                        "KL in the reward is not implemented; use actor.use_kl_loss=True"),
    "data.train_files": _set("data.train_files"),
    "data.val_files": _set("data.test_files"),
    "data.train_batch_size": _set("broker.groups_per_step"),
    "data.val_batch_size": _no_effect("evaluation prompts go through the fleet as they fit"),
    "data.max_prompt_length": _set("data.max_prompt_tokens"),
    "data.max_response_length": _set("rollout.sampling.max_tokens"),
    "data.filter_overlong_prompts": _set("data.filter_overlong_prompts"),
    "data.truncation": _truncation,
    "data.shuffle": _set("data.shuffle"),
    "data.prompt_key": _only("prompt", "fleetrl reads the 'prompt' column", "fleetrl reads the prompt from 'prompt'"),
    "data.reward_fn_key": _only("data_source", "the reward routes by 'data_source'",
                                "fleetrl routes rewards by 'data_source'"),
    "data.return_raw_chat": _no_effect("fleetrl keeps the chat messages and applies the template itself"),
    ARR + "model.path": _set("model.path"),
    ARR + "model.use_remove_padding": _only(True, "fleetrl always packs sequences without padding",
                                            "fleetrl always packs sequences without padding"),
    ARR + "model.enable_gradient_checkpointing": _set("learner.activation_checkpointing"),
    ARR + "model.lora_rank": _only(0, "full fine-tuning", "LoRA is not implemented in fleetrl"),
    ARR + "model.trust_remote_code": _only(False, "fleetrl loads transformers' own model classes",
                                           "fleetrl does not run a model's remote code"),
    ARR + "actor.strategy": _strategy,
    ARR + "actor.optim.lr": _set("learner.optim.lr"),
    ARR + "actor.optim.lr_warmup_steps": lambda v, _: [f"learner.optim.warmup_steps={max(0, int(v))}"],
    ARR + "actor.optim.lr_warmup_steps_ratio": _only(0.0, "no warm-up", "give actor.optim.lr_warmup_steps instead"),
    ARR + "actor.optim.weight_decay": _set("learner.optim.weight_decay"),
    ARR + "actor.optim.warmup_style": lambda v, _: [f"learner.optim.schedule={_dump(v)}"],
    ARR + "actor.grad_clip": _set("learner.optim.grad_clip"),
    ARR + "actor.clip_ratio": _clip,
    ARR + "actor.clip_ratio_low": _set("learner.loss.clip_low"),
    ARR + "actor.clip_ratio_high": _set("learner.loss.clip_high"),
    ARR + "actor.ppo_mini_batch_size": _set("learner.ppo_mini_batch_size"),
    ARR + "actor.ppo_epochs": _set("learner.ppo_epochs"),
    ARR + "actor.ppo_micro_batch_size_per_gpu": _micro_seqs,
    ARR + "actor.use_dynamic_bsz": _no_effect("fleetrl always packs micro-batches by tokens"),
    ARR + "actor.ppo_max_token_len_per_gpu": _token_budget,
    ARR + "actor.use_kl_loss": _kl_loss,
    ARR + "actor.kl_loss_coef": _kl_coef,
    ARR + "actor.kl_loss_type": _kl_type,
    ARR + "actor.entropy_coeff": _only((0, 0.0), "no entropy bonus", "an entropy bonus is not implemented in fleetrl"),
    ARR + "actor.loss_agg_mode": _agg,
    ARR + "actor.fsdp_config.param_offload": _set("learner.param_offload"),
    ARR + "actor.fsdp_config.optimizer_offload": _set("learner.optimizer_offload"),
    ARR + "rollout.name": _engine,
    ARR + "rollout.mode": _no_effect("fleetrl's engines are always servers generating asynchronously"),
    ARR + "rollout.n": _set("rollout.sampling.n"),
    ARR + "rollout.temperature": _temperature,
    ARR + "rollout.top_p": _set("rollout.sampling.top_p"),
    ARR + "rollout.tensor_model_parallel_size": _set("rollout.tensor_parallel_size"),
    ARR + "rollout.gpu_memory_utilization": _set("rollout.gpu_memory_utilization"),
    ARR + "rollout.max_num_seqs": _set("rollout.max_num_seqs"),
    ARR + "rollout.enforce_eager": _set("rollout.enforce_eager"),
    ARR + "rollout.log_prob_micro_batch_size_per_gpu": _no_effect("the engine returns the behaviour log-probs; the "
                                                                  "learner's own pass packs by learner.micro_batch_tokens"),
    ARR + "rollout.free_cache_engine": _no_effect("fleetrl's engines keep their own GPUs"),
    ARR + "rollout.enable_chunked_prefill": _no_effect("the engine's default"),
    ARR + "rollout.load_format": _no_effect("engines load the model folder; weights arrive by weight sync"),
    ARR + "ref.log_prob_micro_batch_size_per_gpu": _no_effect("the reference pass packs by learner.micro_batch_tokens"),
    ARR + "ref.fsdp_config.param_offload": _set("learner.reference_offload"),
    "trainer.critic_warmup": _only(0, "there is no critic", "there is no critic to warm up"),
    "trainer.logger": _logger,
    "trainer.project_name": _wandb_part,
    "trainer.experiment_name": _wandb_part,
    "trainer.n_gpus_per_node": _placement,
    "trainer.nnodes": _placement,
    "trainer.save_freq": lambda v, _: [f"learner.checkpoint_every={max(0, int(v))}"],
    "trainer.test_freq": lambda v, _: [f"run.eval_every={max(0, int(v))}"],
    "trainer.total_epochs": _epochs,
    "trainer.total_training_steps": lambda v, _: [] if v is None else [f"run.max_steps={int(v)}"],
    "trainer.val_before_train": _only(True, "fleetrl evaluates before and after training",
                                      "set run.eval_samples=0 to run without evaluation"),
    "trainer.default_local_dir": _set("learner.checkpoint_dir"),
    "trainer.resume_mode": _resume,
    "custom_reward_function.path": _reward_fn,
    "custom_reward_function.name": lambda v, a: "(set with custom_reward_function.path)",
    "reward_model.enable": _only(False, "rule-based rewards", "a reward model is not implemented; an async reward "
                                 "function (reward.function) can call one"),
    "reward_model.reward_manager": _manager,
}


def parse(text_or_args: str | list[str]) -> dict[str, Any]:
    """``key=value`` words (one string, shell-quoted, or a list) into a dict; values parsed as YAML."""
    words = shlex.split(text_or_args) if isinstance(text_or_args, str) else list(text_or_args)
    out: dict[str, Any] = {}
    for w in words:
        # a pasted script: its interpreter words and line continuations are not keys
        if not w.strip() or w in ("\\", "python3", "python", "-m", "verl.trainer.main_ppo", "$@"):
            continue
        key, sep, raw = w.partition("=")
        if not sep or not key:
            raise ConfigError(f"verl argument {w!r} is not key=value")
        key = key.lstrip("+")  # Hydra's "append" marker
        try:
            out[key] = yaml.safe_load(raw) if raw else ""
        except yaml.YAMLError as exc:
            raise ConfigError(f"verl argument {w!r}: bad value: {exc}") from None
    return out


def translate(text_or_args: str | list[str]) -> Mapping:
    """fleetrl overrides for a verl command line; a :class:`ConfigError` lists every key refused."""
    keys = parse(text_or_args)
    out, problems = Mapping(), []
    for key, value in keys.items():
        rule = RULES.get(key)
        if rule is None:
            problems.append(f"verl key '{key}' is not known to fleetrl.{suggest(key, list(RULES))}")
            continue
        try:
            got = rule(value, keys)
        except Refused as why:
            problems.append(f"verl key '{key}={_dump(value)}' is refused: {why}")
            continue
        if isinstance(got, str):
            out.notes.append((f"{key}={_dump(value)}", got))
            if got.startswith("(on the command line"):
                out.advice.append(got)
        else:
            out.overrides.extend(got)
            out.notes.append((f"{key}={_dump(value)}", " ".join(got) or "(no setting needed)"))
    lengths = [keys.get("data.max_prompt_length"), keys.get("data.max_response_length")]
    if all(isinstance(x, int) for x in lengths):
        # verl sizes the engine for the longest prompt plus the longest response
        out.overrides.append(f"rollout.max_model_len={sum(lengths)}")
        out.notes.append(("data.max_prompt_length + data.max_response_length", f"rollout.max_model_len={sum(lengths)}"))
    if problems:
        raise ConfigError("verl command line not mapped:\n  " + "\n  ".join(problems))
    return out


def describe(m: Mapping) -> str:
    width = max((len(k) for k, _ in m.notes), default=0)
    lines = [f"{k.ljust(width)}  ->  {v}" for k, v in m.notes]
    return "\n".join(lines + [f"note: {a}" for a in dict.fromkeys(m.advice)])

