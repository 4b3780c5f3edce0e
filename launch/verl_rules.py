"""What each verl key becomes in fleetrl: a rule per key (RULES) or per key family (PREFIX_RULES).

A rule takes the key's value and the context (every key's effective value: the command's, else
verl's default) and returns the fleetrl overrides it maps to, or a string that says why the key
needs none (``(no setting: ...)``), or raises :class:`Refused`. A refusal for something fleetrl
does not have names exactly one capability of :data:`CAPABILITIES`, so a user (and the corpus test
over verl's own scripts) can tell "not built yet" from "bad value".
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from launch.verl_defaults import FULLY_ASYNC, ONE_STEP_OFF, SWITCHED

ARR = "actor_rollout_ref."

# What a refusal may name as missing (docs/verl.md counts verl's scripts by it).
VLM = "vlm"
MOE = "moe_expert_parallel"
ULYSSES = "ulysses_sequence_parallel"
CP = "context_parallel"
CRITIC = "critic"
LORA = "lora"
OTHER_ENGINE = "other_engine"
ROLLOUT_CORRECTION = "rollout_correction"  # verl's sequence-level IS / rejection-sampling modes
CAPABILITIES = (VLM, MOE, ULYSSES, CP, CRITIC, LORA, OTHER_ENGINE, ROLLOUT_CORRECTION)


class Refused(Exception):
    """One key's value has no fleetrl equivalent; ``capability`` names what is missing (None: a bad value)."""

    def __init__(self, why: str, capability: str | None = None) -> None:
        if capability is not None and capability not in CAPABILITIES:
            raise ValueError(f"unknown capability {capability!r}; expected one of {CAPABILITIES}")
        super().__init__(f"[needs {capability}] {why}" if capability else why)
        self.capability = capability


class Ctx(dict):
    """Effective verl values (the command's over verl's defaults), the keys given, the entry module, and
    arguments collected for the engines' command lines."""

    def __init__(self, eff: dict[str, Any], given: set[str], entry: str) -> None:
        super().__init__(eff)
        self.given, self.entry = given, entry
        self.engine_args: dict[str, dict[str, Any]] = {"vllm": {}, "sglang": {}}

    def get(self, key: str, default: Any = None) -> Any:
        if key in self:
            return self[key]
        return SWITCHED.get(key, default)

    def stale(self) -> int:
        """The staleness bound in versions that the entry point (and its async keys) gives."""
        if self.entry == FULLY_ASYNC:
            return math.ceil(float(self.get("async_training.staleness_threshold", 0.1)))
        return 1 if self.entry == ONE_STEP_OFF else 0


Rule = Callable[[Any, Ctx], list[str] | str]


def dump(v: Any) -> str:
    return yaml.safe_dump(v, default_flow_style=True).strip().removesuffix("...").strip()


def num(c: Ctx, key: str, kind: type = int, minimum: float | None = None) -> Any:
    """``key``'s effective value as a number; a Refused that names the key otherwise."""
    v = c.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and v != int(v)):
        raise Refused(f"{key}={dump(v)}: expected {'an integer' if kind is int else 'a number'}")
    if minimum is not None and v < minimum:
        raise Refused(f"{key}={dump(v)}: expected at least {minimum}")
    return kind(v)


def _set(*keys: str) -> Rule:
    return lambda v, _: [f"{k}={dump(v)}" for k in keys]


def _no_effect(why: str) -> Rule:
    return lambda v, _: f"(no setting: {why})"


def _only(expected: Any, why: str, refuse: str, capability: str | None = None) -> Rule:
    """Accept ``expected`` (fleetrl always behaves so: ``why``); refuse any other value."""
    def rule(v: Any, _: Ctx) -> str:
        if v == expected or (isinstance(expected, tuple) and v in expected):
            return f"(no setting: {why})"
        raise Refused(refuse, capability)
    return rule


def _above_one(capability: str, what: str) -> Rule:
    """A parallel size: 1 (or unset) is what fleetrl does; more needs ``capability``."""
    def rule(v: Any, _: Ctx) -> str:
        if v in (None, "", 0, 1):
            return "(no setting: size 1)"
        raise Refused(f"{what} = {v}", capability)
    return rule


def _sp_size(v: Any, _: Ctx) -> list[str] | str:
    """Ulysses SP onto the FSDP learner's ``learner.sequence_parallel_size`` (learner/ulysses.py)."""
    if v in (None, "", 0, 1):
        return "(no setting: size 1)"
    return [f"learner.sequence_parallel_size={dump(v)}"]


def _ref_sp_size(v: Any, c: Ctx) -> str:
    actor = c.get(ARR + "actor.ulysses_sequence_parallel_size") or c.get(
        ARR + "actor.fsdp_config.ulysses_sequence_parallel_size") or 1
    if v not in (None, "", 0, 1) and v != actor:
        raise Refused(f"ref ulysses_sequence_parallel_size={v} differs from the actor's {actor}: fleetrl runs the "
                      "reference model in the actor's sequence-parallel group")
    return "(no setting: the reference model runs in the actor's sequence-parallel group)"


def _when_true(capability: str, what: str, why_off: str = "off") -> Rule:
    def rule(v: Any, _: Ctx) -> str:
        if not v:
            return f"(no setting: {why_off})"
        raise Refused(what, capability)
    return rule


def _refuse(capability: str, what: str) -> Rule:
    def rule(v: Any, _: Ctx) -> str:
        raise Refused(what, capability)
    return rule


# -- algorithm ---------------------------------------------------------------------------------
ESTIMATORS = {"rloo": "rloo", "reinforce_plus_plus": "reinforce_plus_plus",
              "reinforce_plus_plus_baseline": "reinforce_plus_plus_baseline", "gpg": "gpg"}


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
    raise Refused(f"adv_estimator {v!r}: fleetrl has grpo, rloo, reinforce_plus_plus, reinforce_plus_plus_baseline, "
                  "gpg and gae (with the critic); remax needs a greedy baseline rollout per prompt, which the fleet "
                  "does not generate")


def _norm_std(v: Any, c: Ctx) -> str:
    return "(set with algorithm.adv_estimator=grpo)" if c.get("algorithm.adv_estimator") == "grpo" \
        else "(no setting: read only by adv_estimator=grpo)"


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
    return ["learner.kl_reward.enable=true", f"learner.kl_reward.estimator={KL_PENALTY[pen]}",
            f"learner.kl_reward.type={kind}", f"learner.kl_reward.coef={dump(c.get('algorithm.kl_ctrl.kl_coef'))}",
            f"learner.kl_reward.target_kl={dump(c.get('algorithm.kl_ctrl.target_kl'))}",
            f"learner.kl_reward.horizon={dump(c.get('algorithm.kl_ctrl.horizon'))}"]


def _kl_reward_part(v: Any, c: Ctx) -> str:
    return "(set with algorithm.use_kl_in_reward)" if c.get("algorithm.use_kl_in_reward") \
        else "(no setting: algorithm.use_kl_in_reward is false)"


def _filter_groups(v: Any, c: Ctx) -> list[str] | str:
    if not v:
        return "(no setting: no dynamic sampling, fleetrl's default)"
    metric = c.get("algorithm.filter_groups.metric") or "acc"
    return ["rollout.filter_groups.enable=true", f"rollout.filter_groups.metric={dump(metric)}",
            f"rollout.filter_groups.max_num_gen_batches={max(0, int(c.get('algorithm.filter_groups.max_num_gen_batches') or 0))}"]


def _filter_part(v: Any, c: Ctx) -> str:
    return "(set with algorithm.filter_groups.enable)" if c.get("algorithm.filter_groups.enable") \
        else "(no setting: algorithm.filter_groups.enable is false)"


RC = "algorithm.rollout_correction."


def _threshold(c: Ctx) -> float:
    t = c.get(RC + "rollout_is_threshold", 2.0)
    try:
        return float(t)
    except (TypeError, ValueError):
        raise Refused(f"rollout_is_threshold {t!r} (IcePop's lower_upper band zeroes weights outside it; fleetrl "
                      "truncates above tis_cap only)", ROLLOUT_CORRECTION) from None


def correction(c: Ctx) -> tuple[list[str], str]:
    """learner.loss.correction (and tis_cap) for verl's rollout_correction under this entry's staleness."""
    is_, bypass, stale = c.get(RC + "rollout_is"), bool(c.get(RC + "bypass_mode")), c.stale()
    if is_ == "token":
        cap = _threshold(c)
        return ["learner.loss.correction=decoupled", f"learner.loss.tis_cap={dump(cap)}"], (
            "token-level truncated IS: ratio against the learner's pre-step log-probs, weighted by "
            f"min(prox/behaviour, {cap})" + (" (verl's bypass anchors the ratio at the sampler instead)" if bypass else ""))
    if stale == 0:
        return ["learner.loss.correction=none"], ("on-policy: ratio against the learner's pre-step log-probs, no "
                                                  "behaviour weight" + (" (verl's bypass anchors it at the sampler's)"
                                                                        if bypass else ""))
    return ["learner.loss.correction=decoupled"], (
        f"samples up to {stale} version(s) old: fleetrl requires a correction, so decoupled PPO (ratio against the "
        "pre-step log-probs, behaviour weight truncated at learner.loss.tis_cap)"
        + ("; verl's bypass anchors the ratio at the sampler with no weight" if bypass else ""))


def _rc_is(v: Any, c: Ctx) -> str:
    if v in (None, "token"):
        return "(set with the correction: see the schedule lines)"
    if v == "sequence":
        raise Refused("rollout_is=sequence: a sequence-level IS weight (product of token ratios)", ROLLOUT_CORRECTION)
    raise Refused(f"rollout_is {v!r}: verl has null, token and sequence")


def _rc_rs(v: Any, c: Ctx) -> str:
    if v in (None, ""):
        return "(no setting: no rejection sampling)"
    raise Refused(f"rollout_rs={v}: rejection sampling of tokens/sequences by their IS ratio", ROLLOUT_CORRECTION)


def _rc_part(v: Any, c: Ctx) -> str:
    return "(no setting: read only with rollout_rs)" if not c.get(RC + "rollout_rs") else "(set with rollout_rs)"


def _rc_threshold(v: Any, c: Ctx) -> str:
    if c.get(RC + "rollout_is") == "token":
        _threshold(c)
        return "(set with rollout_is=token: learner.loss.tis_cap)"
    return "(no setting: read only with rollout_is)"


def _rc_loss_type(v: Any, c: Ctx) -> str:
    if v == "ppo_clip" or not c.get(RC + "bypass_mode"):
        return "(no setting: the clipped PPO loss)"
    raise Refused(f"bypass loss_type {v!r}: REINFORCE with explicit IS weights and no clip", ROLLOUT_CORRECTION)


# -- actor -------------------------------------------------------------------------------------
def _kl_loss(v: Any, c: Ctx) -> list[str]:
    return [f"learner.loss.kl_coef={dump(c.get(ARR + 'actor.kl_loss_coef')) if v else '0.0'}"]


def _kl_coef(v: Any, c: Ctx) -> str:
    return "(set with actor.use_kl_loss)" if c.get(ARR + "actor.use_kl_loss") else "(no setting: actor.use_kl_loss is false)"


def _kl_type(v: Any, c: Ctx) -> list[str] | str:
    if not c.get(ARR + "actor.use_kl_loss"):
        return "(no setting: actor.use_kl_loss is false)"
    if v in ("kl", "k1"):
        raise Refused("kl_loss_type 'kl' (k1) has zero expected gradient as a loss term; use 'low_var_kl' (k3) "
                      "or 'mse' (k2)")
    est = {"low_var_kl": "k3", "k3": "k3", "mse": "k2", "k2": "k2"}.get(v)
    if est is None:
        raise Refused(f"kl_loss_type {v!r}: fleetrl has 'low_var_kl' (k3) and 'mse' (k2)")
    return [f"learner.loss.kl_estimator={est}"]


AGG = {"token-mean": "token", "seq-mean-token-mean": "sequence", "token-sum": "token_sum",
       "seq-mean-token-sum": "seq_mean_token_sum", "seq-mean-token-sum-norm": "seq_mean_token_sum_norm"}


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
    raise Refused(f"policy_loss.loss_mode {v!r}: fleetrl has vanilla, gspo and geo_mean (clip_cov and kl_cov "
                  "select tokens by their covariance, which is not built)")


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
    return "(no setting: verl 0.9 clips with clip_ratio_low/clip_ratio_high, 0.2 each by default; clip_ratio " \
           "is their fallback only where they are null)"


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
    raise Refused(f"virtual_pipeline_model_parallel_size={v}: learner.megatron has no virtual_pipeline_model_parallel_"
                  "size (the interleaved pipeline schedule)", OTHER_ENGINE)


def _dtype(v: Any, _: Ctx) -> str:
    if v in ("bfloat16", "bf16", "float32", "fp32"):
        return "(no setting: fleetrl trains in float32 master weights with bfloat16 compute where model.dtype says)"
    raise Refused(f"dtype {v!r}: fleetrl trains and serves in bfloat16 or float32 (float16 needs loss scaling)",
                  OTHER_ENGINE)


def _recompute(v: Any, _: Ctx) -> list[str] | str:
    if v in (None, "", "null"):
        return "(no setting: no recomputation)"
    return ["learner.activation_checkpointing=true"]


def _override_transformer(key: str, v: Any, c: Ctx) -> list[str] | str:
    leaf = key.rsplit(".", 1)[-1]
    if leaf.startswith("moe_") or leaf == "router_replay":
        raise Refused(f"{leaf}: a setting of Megatron-Core's MoE layers (fleetrl's Megatron engine builds dense "
                      "decoders; FSDP trains the HF MoE model without expert parallelism)", MOE)
    if leaf == "context_parallel_size":
        return _above_one(CP, "Megatron context_parallel_size")(v, c)
    if leaf.startswith("recompute_"):
        return _recompute(v, c) if leaf == "recompute_granularity" else "(set with recompute_granularity)"
    if leaf.startswith("fp8"):
        raise Refused(f"{leaf}={v}: FP8 training", OTHER_ENGINE)
    if leaf.startswith("dsa_"):
        raise Refused(f"{leaf}: DeepSeek sparse attention (DSA) layers", OTHER_ENGINE)
    return "(no setting: a Megatron-Core kernel or layout choice; the numbers it computes are the same)"


# -- rollout -----------------------------------------------------------------------------------
def _engine(v: Any, _: Ctx) -> list[str]:
    if v not in ("vllm", "sglang"):
        raise Refused(f"rollout.name {v!r} (fleetrl's engines are vLLM and SGLang)", OTHER_ENGINE)
    return [f"rollout.engine={v}"]


def _temperature(v: Any, _: Ctx) -> list[str]:
    return [f"rollout.sampling.temperature={dump(v)}", f"learner.temperature={dump(v)}"]


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


def _multi_turn(v: Any, _: Ctx) -> str:
    if not v:
        return "(no setting: single turn)"
    raise Refused("verl's multi-turn tool agent loop (tool_config_path, sandbox tools); fleetrl runs multi-turn "
                  "episodes through rollout.env or rollout.proxy.agent", OTHER_ENGINE)


def _multi_turn_part(v: Any, c: Ctx) -> str:
    return "(set with rollout.multi_turn.enable)" if c.get(ARR + "rollout.multi_turn.enable") \
        else "(no setting: multi_turn.enable is false)"


# -- data --------------------------------------------------------------------------------------
def _train_batch(v: Any, c: Ctx) -> list[str] | str:
    if c.entry == FULLY_ASYNC:
        return "(no setting: the fully-async trainer's step is async_training.require_batches x ppo_mini_batch_size)"
    if not isinstance(v, int) or v < 1:
        raise Refused(f"data.train_batch_size={v!r}: expected prompts per step >= 1 (0 is the fully-async "
                      f"trainer's, {FULLY_ASYNC})")
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
        raise Refused(f"trust_remote_code=True with model.path {str(path)!r}, not a local model folder: fleetrl runs no "
                      "code fetched from the hub; download the folder and read its code first")
    try:
        auto_map = json.loads(cfg.read_text()).get("auto_map")
    except (OSError, ValueError) as exc:
        raise Refused(f"trust_remote_code=True: cannot read {cfg}: {exc}") from None
    if auto_map:
        raise Refused(f"{cfg} maps its classes to the folder's own code (auto_map {sorted(auto_map)}); fleetrl's "
                      "learner and converter build transformers' own classes", OTHER_ENGINE)
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
    raise Refused(f"reward manager {v!r}: fleetrl has naive, batch, prime (a process pool) and dapo (overlong "
                  "shaping); an async reward function covers judges and sandboxes")


OVERLONG_PREFIXES = ("reward.reward_kwargs.overlong_buffer_cfg.", "reward_model.reward_kwargs.overlong_buffer_cfg.",
                     "reward_model.overlong_buffer.")


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
    return ["reward.overlong_buffer.enable=true", f"reward.overlong_buffer.len={length}",
            f"reward.overlong_buffer.penalty_factor={dump(_overlong_get(c, 'penalty_factor', 1.0))}",
            f"reward.overlong_buffer.log={dump(bool(_overlong_get(c, 'log', False)))}"]


def _manager_name(c: Ctx) -> Any:
    return c.get("reward_model.reward_manager") or c.get("reward.reward_manager.name")


def _overlong_part(v: Any, c: Ctx) -> str:
    if _manager_name(c) != "dapo":
        return "(no setting: only verl's dapo reward manager reads it)"
    return "(set with the dapo reward manager: reward.overlong_buffer)"


def _max_resp_len(v: Any, c: Ctx) -> str:
    if _manager_name(c) == "dapo" and v is not None and int(v) != _response_len(c):
        raise Refused(f"max_resp_len={v} differs from the response length {_response_len(c)}: fleetrl measures the "
                      "overlong buffer from rollout.sampling.max_tokens")
    return "(no setting: fleetrl measures the overlong buffer from rollout.sampling.max_tokens)"


def _legacy_manager(v: Any, c: Ctx) -> str | list[str]:
    return _manager(v, c)


def _reward_fn(v: Any, c: Ctx) -> list[str] | str:
    for prefix in ("custom_reward_function.", "reward.custom_reward_function."):
        path = c.get(prefix + "path")
        if path:
            return [f"reward.function={path}:{c.get(prefix + 'name') or 'compute_score'}"]
    return "(no setting: no custom_reward_function.path)"


def _reward_model(v: Any, _: Ctx) -> str:
    if not v:
        return "(no setting: rule-based rewards)"
    raise Refused("verl's reward-model worker pool; fleetrl scores with reward.model (a judge or classifier server, "
                  "--reward-gpus N)", OTHER_ENGINE)


def _reward_model_part(v: Any, c: Ctx) -> str:
    on = c.get("reward_model.enable") or c.get("reward.reward_model.enable")
    return "(set with reward_model.enable)" if on else "(no setting: reward_model.enable is false)"


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
        raise Refused("trainer.total_epochs needs data.train_files on the same command line (steps = epochs x "
                      "prompts // data.train_batch_size)")
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
        raise Refused(f"trainer.resume_mode {v!r}: fleetrl resumes from the newest checkpoint ('auto') or not ('disable')")
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
        rollout = (num(c, "rollout.n_gpus_per_node", int, 0) if "rollout.n_gpus_per_node" in c else 8) * \
            (num(c, "rollout.nnodes", int, 0) if "rollout.nnodes" in c else 1)
        return (f"(on the command line: --rollout-gpus {rollout} --learner-gpus {learner}; verl gives the rollout "
                "and the trainer their own GPUs, as fleetrl does)")
    return (f"(on the command line: --rollout-gpus R --learner-gpus L, R + L = {learner}; fleetrl gives each pool "
            f"its own GPUs; verl's hybrid engine shares them, which is --gpus {learner} (colocated mode))")


# -- fully async -------------------------------------------------------------------------------
def async_schedule(c: Ctx) -> tuple[list[str], str]:
    """The broker's step and staleness for verl's fully-async trainer."""
    mini = num(c, ARR + "actor.ppo_mini_batch_size", int, 1)
    req = num(c, "async_training.require_batches", int, 1)
    sync = num(c, "async_training.trigger_parameter_sync_step", int, 1)
    groups = mini * req * sync
    out = [f"broker.groups_per_step={groups}",
           f"rollout.weight_update={'inflight' if c.get('async_training.partial_rollout') else 'pause'}"]
    total = c.get("rollout.total_rollout_steps")
    if total is not None:
        out.append(f"run.max_steps={max(1, num(c, 'rollout.total_rollout_steps', int, 1) // groups)}")
    return out, (f"one fleetrl step = one verl parameter sync: trigger_parameter_sync_step {sync} x require_batches "
                 f"{req} x ppo_mini_batch_size {mini} = {groups} prompt groups, published once")


def _async_part(v: Any, c: Ctx) -> str:
    if c.entry != FULLY_ASYNC:
        return f"(no setting: read only by {FULLY_ASYNC})"
    return "(set with the fully-async schedule: see the schedule lines)"


def _staleness(v: Any, c: Ctx) -> str:
    if c.entry != FULLY_ASYNC:
        return f"(no setting: read only by {FULLY_ASYNC})"
    if not isinstance(v, (int, float)) or v < 0:
        raise Refused(f"async_training.staleness_threshold={v!r}: expected a fraction >= 0")
    return (f"(broker.max_staleness={math.ceil(v)}: verl bounds the share of samples from the previous version "
            f"({v}); fleetrl bounds their age in versions, any share)")


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
    out.append("learner.lora.target_modules=" + (
        "all-linear" if targets == "all-linear" else dump(_names(ARR + "model.target_modules", targets))))
    if get["exclude_modules"] not in (None, "", []):
        out.append("learner.lora.exclude_modules=" + dump(_names(ARR + "model.exclude_modules",
                                                                   get["exclude_modules"])))
    if get["lora_adapter_path"]:
        out.append(f"learner.lora.adapter_path={get['lora_adapter_path']}")
    return out


def _lora_part(v: Any, c: Ctx) -> str:
    return "(set with lora_rank)" if _lora_on(c) else "(no setting: read only with lora_rank > 0)"


RULES: dict[str, Rule] = {
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
    RC + "rollout_is": _rc_is,
    RC + "rollout_is_threshold": _rc_threshold,
    RC + "rollout_is_batch_normalize": _when_true(ROLLOUT_CORRECTION, "IS weights normalised to mean 1 per batch"),
    RC + "rollout_rs": _rc_rs,
    RC + "rollout_rs_threshold": _rc_part,
    RC + "rollout_rs_threshold_lower": _rc_part,
    RC + "rollout_token_veto_threshold": lambda v, c: _rc_part(v, c) if v is None else _refuse(
        ROLLOUT_CORRECTION, f"token veto: a sequence with any token ratio below {v} is rejected")(v, c),
    RC + "bypass_mode": lambda v, c: "(set with the correction: see the schedule lines)",
    RC + "loss_type": _rc_loss_type,
    # fully async / one-step-off
    "async_training.staleness_threshold": _staleness,
    "async_training.trigger_parameter_sync_step": _async_part,
    "async_training.require_batches": _async_part,
    "async_training.partial_rollout": _async_part,
    "async_training.use_trainer_do_validate": _no_effect("the fleet runs evaluations"),
    "async_training.use_dynamic_resource_scheduling": _no_effect(
        "fleetrl's pools keep their own GPUs (rollout.autoscale sizes the fleet; --gpus N shares them)"),
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
    "data.reward_fn_key": _only("data_source", "the reward routes by 'data_source'",
                                "fleetrl routes rewards by 'data_source'"),
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
    ARR + "model.use_remove_padding": _no_effect("fleetrl always packs sequences without padding; the numbers are the same"),
    ARR + "model.enable_gradient_checkpointing": _set("learner.activation_checkpointing"),
    ARR + "model.enable_activation_offload": _no_effect("a memory choice; fleetrl has activation checkpointing only"),
    ARR + "model.lora_rank": _lora_rank,
    ARR + "model.trust_remote_code": _trust_remote_code,
    ARR + "model.use_fused_kernels": _no_effect("a kernel choice; fleetrl's chunked log-prob path keeps no full logits"),
    ARR + "model.use_liger": _no_effect("a kernel choice"),
    ARR + "model.use_shm": _no_effect("the model loads from its folder (and, with LoRA, the adapters too)"),
    ARR + "model.external_lib": _refuse(OTHER_ENGINE, "a model class from an external library"),
    ARR + "model.mtp.enable": _when_true(OTHER_ENGINE, "multi-token-prediction (MTP) heads"),
    ARR + "hybrid_engine": _placement,
    ARR + "nccl_timeout": _no_effect("weight_sync has its own timeouts"),
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
    ARR + "actor.optim.min_lr": lambda v, c: [f"learner.optim.min_lr_ratio={dump(float(v) / float(c.get(ARR + 'actor.optim.lr')))}"],
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
    ARR + "actor.megatron.use_dist_checkpointing": _no_effect("fleetrl loads the HF folder and writes its own checkpoints"),
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
    ARR + "rollout.data_parallel_size": _no_effect("fleetrl runs one server per tensor_parallel_size GPUs and "
                                                   "balances groups over them"),
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
    ARR + "rollout.ignore_eos": _only(False, "generation stops at EOS", "ignore_eos=True: generation "
                                          "past the end-of-sequence token (fleetrl's sampling always stops there)",
                                          OTHER_ENGINE),
    ARR + "rollout.calculate_log_probs": _no_effect("the engines always return the behaviour log-probs"),
    ARR + "rollout.max_num_batched_tokens": _no_effect("a throughput setting of the engine (rollout.vllm_server_args)"),
    ARR + "rollout.log_prob_micro_batch_size": _no_effect("the engine returns the behaviour log-probs"),
    ARR + "rollout.log_prob_micro_batch_size_per_gpu": _no_effect(
        "the engine returns the behaviour log-probs; the learner's own pass packs by learner.micro_batch_tokens"),
    ARR + "rollout.log_prob_use_dynamic_bsz": _no_effect("the learner packs by tokens"),
    ARR + "rollout.log_prob_max_token_len_per_gpu": _no_effect("the learner packs by learner.micro_batch_tokens"),
    ARR + "rollout.free_cache_engine": _no_effect("fleetrl's engines keep their own GPUs"),
    ARR + "rollout.enable_sleep_mode": _no_effect("fleetrl's engines keep their own GPUs (colocated mode sleeps them)"),
    ARR + "rollout.multi_stage_wake_up": _no_effect("fleetrl's engines keep their own GPUs"),
    ARR + "rollout.enable_chunked_prefill": _no_effect("the engine's default"),
    ARR + "rollout.enable_prefix_caching": _no_effect("the engine's default; the cache is reset at every weight update"),
    ARR + "rollout.disable_log_stats": _no_effect("engine logging"),
    ARR + "rollout.load_format": _no_effect("engines load the model folder; weights arrive by weight sync"),
    ARR + "rollout.layered_summon": _no_effect("weights are gathered by fleetrl's publisher (with LoRA only the "
                                               "adapters are gathered)"),
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


def _schedule(v: Any, _: Ctx) -> list[str]:
    if v not in ("constant", "cosine", "linear"):
        raise Refused(f"lr schedule {v!r}: fleetrl has constant, cosine and linear")
    return [f"learner.optim.schedule={v}"]


CRITIC_KEYS = {  # verl critic.* -> learner.critic.* (keys.md); mapped only when the run has a critic (GAE)
    "critic.optim.lr": "optim.lr", "critic.optim.weight_decay": "optim.weight_decay",
    "critic.optim.lr_warmup_steps": "optim.warmup_steps", "critic.cliprange_value": "cliprange_value",
    "critic.ppo_epochs": "ppo_epochs", "critic.ppo_mini_batch_size": "ppo_mini_batch_size",
    "critic.grad_clip": "grad_clip", "critic.fsdp.param_offload": "param_offload",
    "critic.fsdp.optimizer_offload": "optimizer_offload", "trainer.critic_warmup": "warmup_steps",
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
    ARR + "rollout.checkpoint_engine.": lambda k, v, c: "(no setting: fleetrl's weight sync moves the weights "
                                                         "(weight_sync.*))",
    ARR + "rollout.prometheus.": lambda k, v, c: "(no setting: fleetrl's own Prometheus endpoints (run.prometheus))",
    ARR + "rollout.trace.": lambda k, v, c: "(no setting: tracing)",
    ARR + "model.override_config.": lambda k, v, c: (
        "(no setting: fleetrl serves and trains the model folder's config.json as it is; edit it there)"),
    ARR + "model.mtp.": lambda k, v, c: "(set with model.mtp.enable)",
    ARR + "model.lora.": lambda k, v, c: _only((0, None, False), "no LoRA", "LoRA adapters", LORA)(v, c)
    if k.endswith((".rank", ".adapter_path")) else "(no setting: read only with LoRA)",
    ARR + "model.lora_": lambda k, v, c: _lora_part(v, c),
    ARR + "model.target_modules": lambda k, v, c: _lora_part(v, c),
    ARR + "model.exclude_modules": lambda k, v, c: _lora_part(v, c),
    ARR + "actor.megatron.": _megatron_prefix,
    ARR + "ref.megatron.": _megatron_prefix,
    ARR + "actor.fsdp_config.": lambda k, v, c: "(no setting: an FSDP sharding, prefetch or compile choice; the "
                                                "numbers are the same)",
    ARR + "ref.fsdp_config.": lambda k, v, c: "(no setting: an FSDP choice of the reference)",
    ARR + "actor.optim.override_optimizer_config.": lambda k, v, c: (
        _refuse(OTHER_ENGINE, "FP8 optimizer states")(v, c) if "fp8" in k else
        "(no setting: a Megatron optimizer memory choice)"),
    ARR + "actor.checkpoint.": lambda k, v, c: "(no setting: fleetrl's checkpoints hold model, optimizer and data "
                                               "position)",
    ARR + "actor.engine.": lambda k, v, c: _refuse(OTHER_ENGINE, "a Megatron-Lite engine setting (actor.engine.*)")(v, c),
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
