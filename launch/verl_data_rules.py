"""The verl rollout, data and reward keys' rules (rollout.*, data.*, reward*.*, custom_reward_function.*).

launch/verl_rules.py joins them into its tables with the trainer, fully-async, LoRA and critic rules; the
algorithm and actor rules are in launch/verl_policy_rules.py, the building blocks in launch/verl_rule_kit.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from launch.verl_defaults import FULLY_ASYNC
from launch.verl_policy_rules import _response_len
from launch.verl_rule_kit import (
    ARR,
    MOE,
    OTHER_ENGINE,
    Ctx,
    Refused,
    Rule,
    _above_one,
    _when_true,
    dump,
)


# -- rollout -----------------------------------------------------------------------------------
def _engine(v: Any, _: Ctx) -> list[str]:
    if v not in ("vllm", "sglang"):
        raise Refused(f"rollout.name {v!r} (fleetrl's engines are vLLM and SGLang)", OTHER_ENGINE)
    return [f"rollout.engine={v}"]


def _temperature(v: Any, _: Ctx) -> list[str]:
    return [f"rollout.sampling.temperature={dump(v)}"]  # the learner's follows it (launch/config.py)


def _top_k(v: Any, _: Ctx) -> list[str]:
    return [f"rollout.sampling.top_k={-1 if v in (0, -1) else int(v)}"]


def _val(dest: str) -> Rule:
    def rule(v: Any, _: Ctx) -> list[str]:
        if dest == "top_k" and v == 0:
            v = -1  # HF's 0 and vLLM's -1 both mean off
        return [f"rollout.eval_sampling.{dest}={dump(v)}"]

    return rule


def _engine_kwargs(key: str, v: Any, c: Ctx) -> list[str] | str:
    engine, _, name = key.removeprefix(ARR + "rollout.engine_kwargs.").partition(".")
    if engine not in c.engine_args:
        raise Refused(f"engine_kwargs for {engine!r} (fleetrl's engines are vLLM and SGLang)", OTHER_ENGINE)
    if engine == "vllm" and name == "enable_expert_parallel" and v:
        raise Refused("vLLM expert parallelism", MOE)
    if name in ("max_model_len", "context_length"):  # fleetrl passes the engine's length itself
        return [f"rollout.max_model_len={int(v)}"]
    top, _, sub = name.partition(".")
    if sub:  # a JSON-valued engine argument given key by key (compilation_config.cudagraph_mode=...)
        c.engine_args[engine].setdefault(top, {})[sub] = v
    else:
        c.engine_args[engine][top] = v
    return f"(added to rollout.{engine}_server_args; used when rollout.engine={engine})"


def engine_arg_overrides(c: Ctx) -> list[str]:
    """The collected engine_kwargs as server command-line arguments, one override per engine."""
    out = []
    for engine, kw in c.engine_args.items():
        args: list[str] = []
        for name, v in kw.items():
            flag = "--" + name.replace("_", "-")
            if isinstance(v, dict):
                args += [flag, json.dumps(v)]
            elif v is True:
                args.append(flag)
            elif v is False:
                continue  # the flag left out: the engine's default (off)
            else:
                args += [flag, str(v)]
        if args:
            out.append(f"rollout.{engine}_server_args={json.dumps(args)}")
    return out


def _n(v: Any, _: Ctx) -> list[str]:
    return [f"rollout.sampling.n={int(v)}"]


def _rollout_ep(v: Any, c: Ctx) -> str:
    return _above_one(MOE, "rollout expert_parallel_size")(v, c)


def _response_length(v: Any, c: Ctx) -> list[str]:
    return [f"rollout.sampling.max_tokens={int(v)}"]


def _max_response(v: Any, c: Ctx) -> list[str] | str:
    if c.get(ARR + "rollout.response_length"):
        return "(no setting: rollout.response_length wins)"
    return [f"rollout.sampling.max_tokens={int(v)}"]


def _max_model_len(v: Any, c: Ctx) -> list[str] | str:
    return "(no setting: null, prompt + response)" if v is None else [f"rollout.max_model_len={int(v)}"]


_multi_turn = _when_true(
    OTHER_ENGINE,
    "verl's multi-turn tool agent loop (tool_config_path, sandbox tools); fleetrl runs multi-turn "
    "episodes through rollout.env or rollout.proxy.agent",
    "single turn",
)


def _multi_turn_part(v: Any, c: Ctx) -> str:
    return (
        "(set with rollout.multi_turn.enable)"
        if c.get(ARR + "rollout.multi_turn.enable")
        else "(no setting: multi_turn.enable is false)"
    )


# -- data --------------------------------------------------------------------------------------
def _train_batch(v: Any, c: Ctx) -> list[str] | str:
    if c.entry == FULLY_ASYNC:
        return "(no setting: the fully-async trainer's step is async_training.require_batches x ppo_mini_batch_size)"
    if not isinstance(v, int) or v < 1:
        raise Refused(
            f"data.train_batch_size={v!r}: expected prompts per step >= 1 (0 is the fully-async "
            f"trainer's, {FULLY_ASYNC})"
        )
    return [f"broker.groups_per_step={v}"]


def _gen_batch(v: Any, c: Ctx) -> str:
    if c.entry == FULLY_ASYNC:
        return "(no setting: the fleet streams prompts one group at a time, as verl's gen_batch_size=1)"
    return "(no setting: the fleet generates continuously; dynamic sampling refills a step group by group)"


def _truncation(v: Any, _: Ctx) -> list[str]:
    if v not in ("error", "left", "right", "middle"):
        raise Refused(f"data.truncation {v!r}: verl has error, left, right and middle")
    return [f"data.truncation={v}"]


def _trust_remote_code(v: Any, c: Ctx) -> str:
    if not v:
        return "(no setting: transformers' own model classes)"
    path = Path(str(c.get(ARR + "model.path", ""))).expanduser()
    cfg = path / "config.json"
    if not cfg.is_file():
        raise Refused(
            f"trust_remote_code=True with model.path {str(path)!r}, not a local model folder: fleetrl runs no "
            "code fetched from the hub; download the folder and read its code first"
        )
    try:
        auto_map = json.loads(cfg.read_text()).get("auto_map")
    except (OSError, ValueError) as exc:
        raise Refused(f"trust_remote_code=True: cannot read {cfg}: {exc}") from None
    if auto_map:
        raise Refused(
            f"{cfg} maps its classes to the folder's own code (auto_map {sorted(auto_map)}); fleetrl's "
            "learner and converter build transformers' own classes",
            OTHER_ENGINE,
        )
    return "(no setting: the local folder's model is one of transformers' own classes; no remote code runs)"


def _chat_kwargs(key: str, v: Any, c: Ctx) -> list[str]:
    return [f"data.chat_template_kwargs.{key.rsplit('.', 1)[-1]}={dump(v)}"]


# -- rewards -----------------------------------------------------------------------------------
def _manager(v: Any, c: Ctx) -> list[str]:
    if v in ("naive", None):
        return ["reward.batched=false"]
    if v == "batch":
        return ["reward.batched=true"]
    if v == "prime":
        return ["reward.batched=false", "reward.mode=process"]
    if v == "dapo":
        return ["reward.batched=false"] + _overlong(c)
    raise Refused(
        f"reward manager {v!r}: fleetrl has naive, batch, prime (a process pool) and dapo (overlong "
        "shaping); an async reward function covers judges and sandboxes"
    )


OVERLONG_PREFIXES = (
    "reward.reward_kwargs.overlong_buffer_cfg.",
    "reward_model.reward_kwargs.overlong_buffer_cfg.",
    "reward_model.overlong_buffer.",
)


def _overlong_get(c: Ctx, leaf: str, default: Any) -> Any:
    for p in OVERLONG_PREFIXES:
        if p + leaf in c:
            return c[p + leaf]
    return default


def _overlong(c: Ctx) -> list[str]:
    if not _overlong_get(c, "enable", False):
        return []
    length = int(_overlong_get(c, "len", 0))
    if length < 1:
        raise Refused(f"overlong_buffer_cfg.len={length}: the buffer needs at least one token")
    return [
        "reward.overlong_buffer.enable=true",
        f"reward.overlong_buffer.len={length}",
        f"reward.overlong_buffer.penalty_factor={dump(_overlong_get(c, 'penalty_factor', 1.0))}",
        f"reward.overlong_buffer.log={dump(bool(_overlong_get(c, 'log', False)))}",
    ]


def _manager_name(c: Ctx) -> Any:
    return c.get("reward_model.reward_manager") or c.get("reward.reward_manager.name")


def _overlong_part(v: Any, c: Ctx) -> str:
    if _manager_name(c) != "dapo":
        return "(no setting: only verl's dapo reward manager reads it)"
    return "(set with the dapo reward manager: reward.overlong_buffer)"


def _max_resp_len(v: Any, c: Ctx) -> str:
    if _manager_name(c) == "dapo" and v is not None and int(v) != _response_len(c):
        raise Refused(
            f"max_resp_len={v} differs from the response length {_response_len(c)}: fleetrl measures the "
            "overlong buffer from rollout.sampling.max_tokens"
        )
    return "(no setting: fleetrl measures the overlong buffer from rollout.sampling.max_tokens)"


def _legacy_manager(v: Any, c: Ctx) -> str | list[str]:
    return _manager(v, c)


def _reward_fn(v: Any, c: Ctx) -> list[str] | str:
    for prefix in ("custom_reward_function.", "reward.custom_reward_function."):
        path = c.get(prefix + "path")
        if path:
            return [f"reward.function={path}:{c.get(prefix + 'name') or 'compute_score'}"]
    return "(no setting: no custom_reward_function.path)"


_reward_model = _when_true(
    OTHER_ENGINE,
    "verl's reward-model worker pool; fleetrl scores with reward.model (a judge or classifier server, --reward-gpus N)",
    "rule-based rewards",
)


def _reward_model_part(v: Any, c: Ctx) -> str:
    on = c.get("reward_model.enable") or c.get("reward.reward_model.enable")
    return "(set with reward_model.enable)" if on else "(no setting: reward_model.enable is false)"
