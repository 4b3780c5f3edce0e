"""verl's ``algorithm.rollout_correction.*`` onto fleetrl's corrections (learner/losses.py, learner/correction.py).

* ``bypass_mode=true`` (verl's default in its one-step-off and fully-async entries): the ratio is anchored at the
  sampler's log-probs, ``learner.loss.correction=bypass`` (``loss_type=ppo_clip``: no IS weight; verl computes
  ``rollout_is`` weights there for metrics only); ``rollout_rs`` rules are measured per micro-batch against the
  policy being trained, as verl's. ``loss_type=reinforce`` with token TIS is ``tis`` without the proximal pass
  (the same gradient: ``w * A * grad log pi``); reinforce with other weights or rejection is refused.
* decoupled (``bypass_mode=false``): ``rollout_is=token`` with one threshold T alone is
  ``correction=decoupled tis_cap=T``; sequence IS, IcePop bands (``"lo_hi"``), batch normalisation, ``rollout_rs``
  rules and the older ``geometric`` / veto keys turn on ``learner.rollout_correction`` (FSDP only).
* no keys: on-policy ``none``; samples older than the learner: ``decoupled`` (fleetrl requires a correction).
"""

from __future__ import annotations

import math
from typing import Any

import yaml

from launch.verl_rule_kit import ARR, ROLLOUT_CORRECTION, Ctx, Refused, Rule, dump

RC = "algorithm.rollout_correction."
SECTION = "learner.rollout_correction"


def _flow(v: Any) -> str:
    """One line of flow YAML, however long (the rule list must stay one override word)."""
    return yaml.safe_dump(v, default_flow_style=True, width=1 << 30, sort_keys=False).strip()


def _positive(x: Any, what: str) -> float:
    try:
        v = float(x)
    except (TypeError, ValueError):
        raise Refused(f"{what} {x!r}: expected a positive number") from None
    if not v > 0:
        raise Refused(f"{what} {x!r}: expected a positive number")
    return v


def is_band(c: Ctx) -> tuple[float, float | None]:
    """(upper, lower) of rollout_is_threshold: a float truncates (TIS), ``"lo_hi"`` is IcePop's band."""
    t = c.get(RC + "rollout_is_threshold", 2.0)
    if isinstance(t, str) and "_" in t:
        lo, _, hi = t.partition("_")
        lower, upper = _positive(lo, "rollout_is_threshold lower"), _positive(hi, "rollout_is_threshold upper")
        if lower > upper:
            raise Refused(f"rollout_is_threshold {t!r}: lower above upper")
        return upper, lower
    return _positive(t, "rollout_is_threshold"), None


def _options(c: Ctx) -> list[str]:
    rs = c.get(RC + "rollout_rs")
    if rs in (None, "", "null"):
        return []
    return list(dict.fromkeys(o.strip() for o in str(rs).split(",") if o.strip()))


def rejection_rules(c: Ctx) -> list[dict[str, Any]]:
    """learner.rollout_correction.rejection for rollout_rs (+ rollout_rs_threshold[_lower]) and the token veto."""
    from learner.correction import verl_rule_bounds

    opts, rules = _options(c), []
    spec = c.get(RC + "rollout_rs_threshold")
    if opts:
        if spec is None:
            raise Refused(f"rollout_rs={','.join(opts)} needs rollout_rs_threshold (verl refuses it too)")
        specs = [s.strip() for s in str(spec).split(",") if s.strip()]
        if len(specs) not in (1, len(opts)):
            raise Refused(f"rollout_rs_threshold {spec!r}: one threshold, or one per rollout_rs option ({len(opts)})")
        specs = specs * len(opts) if len(specs) == 1 else specs
        legacy_lower = c.get(RC + "rollout_rs_threshold_lower")
        for opt, s in zip(opts, specs, strict=True):
            lo, _, hi = s.rpartition("_") if "_" in s else ("", "", s)
            upper = _positive(hi, f"rollout_rs_threshold for {opt}")
            lower = _positive(lo, f"rollout_rs_threshold lower for {opt}") if lo else None
            if opt in ("token", "sequence", "geometric") and legacy_lower is not None:
                lower = _positive(legacy_lower, "rollout_rs_threshold_lower")
            try:
                stat, level, lo_b, up_b = verl_rule_bounds(opt, lower, upper)
            except ValueError as exc:
                raise Refused(str(exc)) from None
            rules.append({"statistic": stat, "level": level, "lower": lo_b, "upper": up_b, "name": opt})
    veto = c.get(RC + "rollout_token_veto_threshold")
    if veto is not None:
        rules.append(
            {
                "statistic": "log_ratio",
                "level": "seq_min",
                "lower": math.log(_positive(veto, "rollout_token_veto_threshold")),
                "upper": None,
                "name": "veto",
            }
        )
    return rules


def _megatron(c: Ctx) -> bool:
    return "megatron" in (
        c.get(ARR + "actor.strategy"),
        c.get(ARR + "actor.fsdp_config.strategy"),
        c.get("model_engine"),
    )


def correction(c: Ctx) -> tuple[list[str], str]:
    """learner.loss.correction (and tis_cap or learner.rollout_correction) for this command's keys and entry."""
    is_, bypass, stale = c.get(RC + "rollout_is"), bool(c.get(RC + "bypass_mode")), c.stale()
    if is_ not in (None, "token", "sequence"):
        raise Refused(f"rollout_is {is_!r}: verl has null, token and sequence")
    rules = rejection_rules(c)
    normalize = bool(c.get(RC + "rollout_is_batch_normalize"))
    upper, lower = is_band(c) if is_ else (2.0, None)
    if bypass:
        loss_type = c.get(RC + "loss_type") or "ppo_clip"
        if loss_type == "ppo_clip":
            out = ["learner.loss.correction=bypass"]
            if rules:
                out += [f"{SECTION}.enable=true", f"{SECTION}.is_level=none", f"{SECTION}.rejection={_flow(rules)}"]
            return out, (
                "verl's bypass: the clipped ratio against the sampler's log-probs, no proximal pass, no IS weight"
                + (" (verl computes the rollout_is weights for metrics only)" if is_ else "")
                + (
                    f"; rejection by {', '.join(r['name'] for r in rules)} per micro-batch on the policy being trained"
                    if rules
                    else ""
                )
            )
        if loss_type != "reinforce":
            raise Refused(f"rollout_correction.loss_type {loss_type!r}: verl has ppo_clip and reinforce")
        if is_ == "token" and lower is None and not normalize and not rules:
            return [
                "learner.loss.correction=tis",
                "learner.recompute_proximal=false",
                f"learner.loss.tis_cap={dump(upper)}",
            ], (f"bypass REINFORCE with token TIS: gradient min(pi/mu, {upper}) * A * grad log pi, no clip")
        raise Refused(
            "bypass loss_type=reinforce with "
            + (
                "rejection sampling"
                if rules
                else "no IS weight"
                if not is_
                else f"{is_}-level, {'IcePop' if lower else 'batch-normalised' if normalize else 'truncated'} "
                "IS weights"
            )
            + " measured per micro-batch on the policy being trained",
            ROLLOUT_CORRECTION,
        )
    if is_ == "token" and lower is None and not normalize and not rules:
        return ["learner.loss.correction=decoupled", f"learner.loss.tis_cap={dump(upper)}"], (
            f"token-level truncated IS: ratio against the learner's pre-step log-probs, weighted by "
            f"min(prox/behaviour, {upper})"
        )
    if is_ or rules:
        if _megatron(c):
            raise Refused(
                "sequence-level, IcePop or batch-normalised IS weights and rejection sampling on the "
                "Megatron engine (learner.rollout_correction is FSDP's)",
                ROLLOUT_CORRECTION,
            )
        out = [
            "learner.loss.correction=decoupled",
            f"{SECTION}.enable=true",
            f"{SECTION}.is_level={is_ or 'none'}",
            f"{SECTION}.is_upper={dump(upper)}",
            f"{SECTION}.is_lower={dump(lower)}",
            f"{SECTION}.is_batch_normalize={dump(normalize)}",
            f"{SECTION}.rejection={_flow(rules)}",
        ]
        what = (
            [
                f"{is_}-level IS weights "
                + (f"in [{lower}, {upper}] (IcePop)" if lower else f"truncated at {upper}")
                + (", normalised to mean 1 per optimizer step" if normalize else "")
            ]
            if is_
            else ["no IS weight"]
        )
        what += [f"rejection by {', '.join(r['name'] for r in rules)}"] if rules else []
        return out, "decoupled PPO on the pre-step policy with " + "; ".join(what)
    if stale == 0:
        return ["learner.loss.correction=none"], "on-policy: ratio against the learner's pre-step log-probs"
    return ["learner.loss.correction=decoupled"], (
        f"samples up to {stale} version(s) old: fleetrl requires a correction, so decoupled PPO (ratio against the "
        "pre-step log-probs, behaviour weight truncated at learner.loss.tis_cap)"
    )


def _part(v: Any, c: Ctx) -> str:
    return "(set with the correction: see the schedule lines)"


def _rs_part(v: Any, c: Ctx) -> str:
    return "(set with rollout_rs: see the schedule lines)" if _options(c) else "(no setting: read only with rollout_rs)"


def _is_part(v: Any, c: Ctx) -> str:
    if c.get(RC + "rollout_is"):
        is_band(c)  # a bad value is refused on its own key
        return "(set with rollout_is: see the schedule lines)"
    return "(no setting: read only with rollout_is)"


def _veto(v: Any, c: Ctx) -> str:
    if v is None:
        return "(no setting: no veto)"
    _positive(v, "rollout_token_veto_threshold")
    return "(set with the correction: a sequence with a token ratio below it is rejected)"


CORRECTION_RULES: dict[str, Rule] = {
    RC + "rollout_is": _part,
    RC + "rollout_is_threshold": _is_part,
    RC + "rollout_is_batch_normalize": lambda v, c: _is_part(v, c) if v else "(no setting: off)",
    RC + "rollout_rs": _part,
    RC + "rollout_rs_threshold": _rs_part,
    RC + "rollout_rs_threshold_lower": _rs_part,
    RC + "rollout_token_veto_threshold": _veto,
    RC + "bypass_mode": _part,
    RC + "loss_type": lambda v, c: (
        _part(v, c) if c.get(RC + "bypass_mode") else "(no setting: read only in bypass mode)"
    ),
}
