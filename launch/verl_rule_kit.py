"""The building blocks of the verl translator's rules (launch/verl_rules.py, launch/verl_policy_rules.py).

A rule takes the key's value and the context (every key's effective value: the command's, else
verl's default) and returns the fleetrl overrides it maps to, or a string that says why the key
needs none (``(no setting: ...)``), or raises :class:`Refused`. A refusal for something fleetrl
does not have names exactly one capability of :data:`CAPABILITIES`, so a user (and the corpus test
over verl's own scripts) can tell "not built yet" from "bad value".
"""

from __future__ import annotations

import math
from collections.abc import Callable
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
