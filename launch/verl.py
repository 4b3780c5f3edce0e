"""A verl command line's dotted keys as fleetrl overrides, with verl's own defaults for every key it omits.

verl configures a run with Hydra keys (``algorithm.adv_estimator=grpo data.train_batch_size=1024
actor_rollout_ref.actor.optim.lr=1e-6 ...``). :func:`translate` turns them into fleetrl's dotted
overrides, applied on top of a recipe (``launch/recipes/verl.yaml`` by default)::

    python launch/cluster.py --verl 'algorithm.adv_estimator=grpo data.train_files=train.parquet ...'
    python launch/cluster.py verl 'algorithm.adv_estimator=grpo ...'    # print the mapping and the config

The same command means the same run: every key the command omits takes verl 0.9's default
(launch/verl_defaults.py, per entry module: ``python -m verl.trainer.main_ppo``, the fully-async and
one-step-off trainers, verl-recipe's DAPO), so fleetrl's recipe defaults never stand in for verl's.
Each key is then mapped by its rule (launch/verl_rules.py): onto fleetrl keys, accepted because
fleetrl behaves that way anyway (with the reason), or refused. A refusal names the capability
fleetrl lacks (``vlm``, ``moe_expert_parallel``, ...) or says why the value is bad. An unknown key is
refused with the nearest known one. All problems are reported at once, before anything starts.

Then the schedule: verl's entry module fixes the staleness (main_ppo and DAPO are synchronous: 0;
one-step-off: 1; fully-async: ``ceil(async_training.staleness_threshold)``), which with
``algorithm.rollout_correction.*`` gives ``learner.loss.correction`` and ``learner.rollout_correction``
(launch/verl_correction_rules.py); the fully-async keys give the
broker's step; warm-up from ``lr_warmup_steps(_ratio)``; the engine length from prompt + response.
What still differs from verl is printed as a note (:func:`describe`).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from typing import Any

import yaml

from core.configbase import ConfigError, suggest
from launch.verl_data_rules import engine_arg_overrides
from launch.verl_defaults import FULLY_ASYNC, MAIN_PPO, defaults_for
from launch.verl_rules import (
    ARR,
    CAPABILITIES,
    PREFIX_RULES,
    RULES,
    Ctx,
    Refused,
    async_schedule,
    correction,
    dump,
    longest,
    num,
    placement_advice,
)
from learner.config import uniform_in_mean_blockers

__all__ = ["CAPABILITIES", "RULES", "Mapping", "Refused", "describe", "parse", "split_command", "translate"]

LAUNCH_WORDS = {"\\", "python3", "python", "-m", "$@", "--", "torchrun"}


@dataclass(slots=True)
class Mapping:
    """The outcome of a translation: overrides in order, and per verl key what became of it."""

    entry: str = MAIN_PPO
    overrides: list[str] = field(default_factory=list)
    notes: list[tuple[str, str]] = field(default_factory=list)  # (verl key=value, fleetrl keys or why none)
    defaults: list[tuple[str, str]] = field(default_factory=list)  # the same for verl defaults of omitted keys
    schedule: list[tuple[str, str]] = field(default_factory=list)  # derived from several keys
    advice: list[str] = field(default_factory=list)  # things to pass on the command line instead
    differences: list[str] = field(default_factory=list)  # what still differs from verl


@dataclass(slots=True)
class Problem:
    """One refused key: the message, and the capability it needs (None: a bad value or an unknown key)."""

    key: str
    message: str
    capability: str | None = None


class Untranslatable(ConfigError):
    """A verl command line with refused keys; ``problems`` lists each with its capability."""

    def __init__(self, problems: list[Problem]) -> None:
        super().__init__("verl command line not mapped:\n  " + "\n  ".join(p.message for p in problems))
        self.problems = problems


def split_command(text_or_args: str | list[str]) -> tuple[str, dict[str, Any]]:
    """(the entry module, the ``key=value`` words as a dict with YAML values) of a verl command line.

    A pasted script's interpreter words (``python3 -m verl.trainer.main_ppo``), line continuations and
    ``$@`` are not keys; without ``-m MODULE`` the entry is ``verl.trainer.main_ppo``."""
    words = shlex.split(text_or_args) if isinstance(text_or_args, str) else list(text_or_args)
    entry, out = MAIN_PPO, {}
    skip_next = False
    for i, w in enumerate(words):
        if skip_next:
            skip_next = False
            continue
        if w == "-m" and i + 1 < len(words):
            entry, skip_next = words[i + 1], True
            continue
        if not w.strip() or w in LAUNCH_WORDS:
            continue
        key, sep, raw = w.partition("=")
        if not sep or not key:
            raise ConfigError(f"verl argument {w!r} is not key=value")
        key = key.lstrip("+~")  # Hydra's append / delete markers
        try:
            out[key] = yaml.safe_load(raw) if raw else ""
        except yaml.YAMLError as exc:
            raise ConfigError(f"verl argument {w!r}: bad value: {exc}") from None
    return entry, out


def parse(text_or_args: str | list[str]) -> dict[str, Any]:
    """The ``key=value`` words of a verl command line (see :func:`split_command`)."""
    return split_command(text_or_args)[1]


def _rule_for(key: str):
    rule = RULES.get(key)
    if rule is not None:
        return lambda v, c: rule(v, c)
    prefixes = [p for p in PREFIX_RULES if key.startswith(p)]
    if prefixes:
        prule = PREFIX_RULES[max(prefixes, key=len)]
        return lambda v, c: prule(key, v, c)
    return None


def _apply(
    key: str, value: Any, ctx: Ctx, out: Mapping, notes: list, problems: list[Problem], default: bool = False
) -> None:
    rule = _rule_for(key)
    if rule is None:
        problems.append(Problem(key, f"verl key '{key}' is not known to fleetrl.{suggest(key, list(RULES))}"))
        return
    try:
        try:
            got = rule(value, ctx)
        except (TypeError, ValueError, ArithmeticError, KeyError, IndexError) as exc:
            # a value of the wrong kind (a list where a number belongs, ...): said, never a traceback
            raise Refused(f"value of the wrong kind ({type(exc).__name__}: {exc})") from None
    except Refused as why:
        if default and why.capability is None:
            # a default the command did not ask for and fleetrl cannot apply here: said, not fatal
            out.differences.append(f"verl's default {key}={dump(value)} is not applied: {why}")
            return
        problems.append(Problem(key, f"verl key '{key}={dump(value)}' is refused: {why}", why.capability))
        return
    if isinstance(got, str):
        notes.append((f"{key}={dump(value)}", got))
    else:
        out.overrides.extend(got)
        notes.append((f"{key}={dump(value)}", " ".join(got) or "(no setting needed)"))


def translate(text_or_args: str | list[str]) -> Mapping:
    """fleetrl overrides for a verl command line; :class:`Untranslatable` (a ConfigError) lists every key refused."""
    entry, given = split_command(text_or_args)
    defaults = defaults_for(entry)
    ctx = Ctx({**defaults, **given}, set(given), entry)
    out, problems = Mapping(entry=entry), []
    # verl's defaults first: the command's own keys come after them and win where both set a fleetrl key
    for key, value in defaults.items():
        if key not in given:
            _apply(key, value, ctx, out, out.defaults, problems, default=True)
    for key, value in given.items():
        _apply(key, value, ctx, out, out.notes, problems)
    if not problems:
        try:
            _schedule(ctx, out)
        except (TypeError, ValueError, ArithmeticError) as exc:
            problems.append(Problem("(schedule)", f"verl command line: a value of the wrong kind ({exc})"))
        except Refused as why:
            problems.append(Problem("(schedule)", f"verl command line: {why}", why.capability))
    if problems:
        raise Untranslatable(problems)
    out.differences += _differences(ctx)
    return out


def _schedule(ctx: Ctx, out: Mapping) -> None:
    """The settings that follow from several keys together."""

    def add(label: str, overrides: list[str], why: str = "") -> None:
        out.overrides.extend(overrides)
        out.schedule.append((label, " ".join(overrides) + (f"  ({why})" if why else "")))

    stale = ctx.stale()
    add(
        f"staleness of {ctx.entry}",
        [f"broker.max_staleness={stale}"],
        "verl's main_ppo generates each batch with the weights it trains"
        if stale == 0 and ctx.entry == MAIN_PPO
        else "",
    )
    overrides, why = correction(ctx)
    add("algorithm.rollout_correction", overrides, why)
    add("groups whose rewards are all equal", *uniform_groups(out.overrides))
    if ctx.entry == FULLY_ASYNC:
        add("async_training", *async_schedule(ctx))
    warm = num(ctx, ARR + "actor.optim.lr_warmup_steps", int)
    ratio = num(ctx, ARR + "actor.optim.lr_warmup_steps_ratio", float, 0.0)
    if warm > 0 or ratio <= 0:
        add("actor.optim.lr_warmup_steps", [f"learner.optim.warmup_steps={max(0, warm)}"])
    else:
        steps = _max_steps(out)
        if steps is None:
            raise Refused(
                "actor.optim.lr_warmup_steps_ratio needs the run's length (trainer.total_training_steps, or "
                "trainer.total_epochs with data.train_files)"
            )
        # verl: int(ratio * total_training_steps) warm-up steps when lr_warmup_steps <= 0
        add(
            "actor.optim.lr_warmup_steps_ratio",
            [f"learner.optim.warmup_steps={int(ratio * steps)}"],
            f"{ratio} x {steps} steps",
        )
    if not any(o.startswith("rollout.max_model_len=") for o in out.overrides):  # unless a key set it
        total = longest(ctx)
        # verl sizes the engine for the longest prompt plus the longest response
        add("data.max_prompt_length + data.max_response_length", [f"rollout.max_model_len={total}"])
    out.overrides.extend(engine_arg_overrides(ctx))
    out.advice.append(placement_advice(ctx))


def _max_steps(out: Mapping) -> int | None:
    steps = [o.split("=", 1)[1] for o in out.overrides if o.startswith("run.max_steps=")]
    return int(steps[-1]) if steps else None


def uniform_groups(overrides: list[str]) -> tuple[list[str], str]:
    """verl trains a group whose rewards are all equal (advantage 0) and counts its tokens in the loss's mean.
    Where those tokens' loss is exactly zero, fleetrl skips their compute and keeps them in the mean (the same
    gradient, learner.loss.uniform_groups_in_mean); elsewhere it trains them. Decided on the translated settings
    (the last override of a key wins, unset keys keep fleetrl's defaults)."""
    last = dict(o.split("=", 1) for o in overrides if "=" in o)

    def value(key: str, default: Any) -> Any:
        return yaml.safe_load(last[key]) if key in last else default

    blockers = uniform_in_mean_blockers(
        advantage=str(value("learner.loss.advantage", "mean_std")),
        entropy_coeff=float(value("learner.loss.entropy_coeff", 0) or 0),
        kl_coef=float(value("learner.loss.kl_coef", 0) or 0),
        kl_reward=value("learner.kl_reward.enable", False) is True,
        rollout_correction=value("learner.rollout_correction.enable", False) is True,
    )
    if not blockers:
        return (
            ["learner.loss.drop_uniform_groups=true", "learner.loss.uniform_groups_in_mean=true"],
            "verl trains them at advantage 0 and counts their tokens in the loss's mean; fleetrl skips their "
            "compute and keeps them in the mean: the same gradient",
        )
    return (
        ["learner.loss.drop_uniform_groups=false"],
        f"trained as verl does: skipping them would change the gradient ({'; '.join(blockers)})",
    )


def _differences(ctx: Ctx) -> list[str]:
    """What a fleetrl run of this command still does otherwise than verl."""
    out = []
    if ARR + "rollout.name" not in ctx.given:
        out.append("actor_rollout_ref.rollout.name is required by verl; the recipe's rollout.engine applies")
    if "trainer.logger" not in ctx.given:
        out.append(
            "verl logs to console and wandb by default; fleetrl's recipe logs to the console and TensorBoard "
            "(pass trainer.logger=[console,wandb] for W&B)"
        )
    if ctx.entry == MAIN_PPO:
        out.append(
            "verl's main_ppo is synchronous and so is this run (broker.max_staleness=0); for fleetrl's "
            "asynchronous schedule add broker.max_staleness=1 learner.loss.correction=decoupled after the "
            "verl keys (fleetrl overrides win)"
        )
    if ctx.entry == FULLY_ASYNC:
        out.append(
            "verl's staleness_threshold bounds the share of samples generated by the previous weights; "
            "fleetrl's broker.max_staleness bounds a sample's age in versions (any share may be that old)"
        )
    if ctx.get("trainer.max_actor_ckpt_to_keep") is None:
        out.append("verl keeps every checkpoint; fleetrl keeps learner.keep_checkpoints (2)")
    return out


def describe(m: Mapping) -> str:
    rows = [(k, v) for k, v in m.notes] + [(k, f"{v}  [verl default]") for k, v in m.defaults] + m.schedule
    width = max((len(k) for k, _ in rows), default=0)
    lines = [f"# entry: {m.entry}"] + [f"{k.ljust(width)}  ->  {v}" for k, v in rows]
    return "\n".join(lines + [f"note: {a}" for a in dict.fromkeys(m.advice)] + [f"note: {d}" for d in m.differences])
