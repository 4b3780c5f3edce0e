"""The built-in reward functions, and the default scorer that routes by ``data_source`` as verl does.

Every function here has fleetrl's signature ``fn(response_text, ground_truth, **extra) -> float``
(``extra`` holds ``data_source`` and ``extra_info``); a verl ``compute_score(data_source,
solution_str, ground_truth, extra_info)`` works unchanged beside them (see
:mod:`rollout_fleet.rewards`).

- ``exact_match``: the stripped response equals the stripped ground truth (the addition task);
- ``gsm8k``: GSM8K's rule, as verl scores it: the number after the last ``####`` equals the
  ground truth (``method="strict"``); ``gsm8k_flexible``: that number, or else the response's
  last number (verl's ``flexible`` method);
- ``math``: the final answer checked with HF ``math-verify`` (``"72"``, ``"\\frac{1}{2}"``, or a
  solution ending ``"#### 72"``);
- ``default``: picks one of those by the row's ``data_source`` (:data:`ROUTES`); a data source it
  does not know is an error naming it (:func:`check_sources` finds that before a run starts).
"""

from __future__ import annotations

import re
import threading
from typing import Any


def exact_match(response_text: str, ground_truth: str, **extra: Any) -> float:
    """1.0 when the response, stripped of surrounding whitespace, equals the ground truth."""
    return 1.0 if response_text.strip() == str(ground_truth).strip() else 0.0


_HASH_ANSWER = re.compile(r"####[ \t]*([^\n]*)")
_NUMBER = re.compile(r"-?[0-9][0-9,]*(?:\.[0-9]+)?")


def final_answer(text: str) -> str:
    """The line after the last ``####`` (GSM8K's answer marker), or the whole text.

    Only that line: a model that keeps writing after its answer must not have the
    rest read as the answer.
    """
    if "####" in text:
        m = _HASH_ANSWER.search(text[text.rindex("####") :])
        if m:
            return m.group(1).strip().replace(",", "")
    return text


def _norm_number(s: str) -> str:
    s = s.replace(",", "").rstrip(".")
    if re.fullmatch(r"-?\d+\.0+", s):
        s = s.split(".")[0]
    return s


def gsm8k_answer(response_text: str, method: str = "strict") -> str | None:
    """The answer a GSM8K scorer reads: the first number after the last ``####``; with
    ``flexible`` and no marker, the last number of the response."""
    if "####" in response_text:
        m = _NUMBER.search(final_answer(response_text))
        return _norm_number(m.group(0)) if m else None
    if method == "flexible":
        nums = _NUMBER.findall(response_text)
        return _norm_number(nums[-1]) if nums else None
    return None


def gsm8k(response_text: str, ground_truth: str, *, method: str = "strict", **extra: Any) -> float:
    """1.0 when the GSM8K answer of the response equals the ground truth's (``"72"`` or ``"... #### 72"``)."""
    if method not in ("strict", "flexible"):
        raise ValueError(f"gsm8k method must be 'strict' or 'flexible', got {method!r}")
    truth = gsm8k_answer(str(ground_truth), "flexible")
    if truth is None:
        raise ValueError(f"ground truth {ground_truth!r} holds no number")
    return 1.0 if gsm8k_answer(response_text, method) == truth else 0.0


def gsm8k_flexible(response_text: str, ground_truth: str, **extra: Any) -> float:
    return gsm8k(response_text, ground_truth, method="flexible")


def math_answer(response_text: str, ground_truth: str, **extra: Any) -> float:
    """1.0 when math-verify finds the response's final answer equal to the ground truth's."""
    from math_verify import parse, verify

    # math-verify's own timeouts use SIGALRM, which only works in the main thread (reward.mode
    # 'process'); elsewhere the pool's per-call timeout bounds the work instead.
    limit = 5 if threading.current_thread() is threading.main_thread() else None
    gold = parse(final_answer(str(ground_truth)), parsing_timeout=limit)
    if not gold:
        raise ValueError(f"ground truth {ground_truth!r} has no parsable answer")
    pred = parse(final_answer(response_text), parsing_timeout=limit)
    return 1.0 if pred and verify(gold, pred, timeout_seconds=limit) else 0.0


#: data_source -> built-in scorer name, as verl's default_compute_score routes them
ROUTES: dict[str, str] = {
    "addition": "exact_match",
    "openai/gsm8k": "gsm8k",
    "gsm8k": "gsm8k",
    "fleetrl/word_problems": "gsm8k_flexible",
    "lighteval/MATH": "math",
    "DigitalLearningGmbH/MATH-lighteval": "math",
    "HuggingFaceH4/MATH-500": "math",
    "math": "math",
    "math_dapo": "math",
    "aime24": "math",
    "aime25": "math",
}
_MATH_PREFIXES = ("numina_", "math_", "aime")


def route(data_source: str) -> str | None:
    """The built-in scorer for ``data_source`` (None if there is none)."""
    if data_source in ROUTES:
        return ROUTES[data_source]
    if data_source.startswith(_MATH_PREFIXES):
        return "math"
    return None


def check_sources(sources: set[str]) -> None:
    """Raise ValueError naming every data source the default scorer cannot score."""
    unknown = sorted(s for s in sources if route(s) is None)
    if unknown:
        raise ValueError(
            f"reward.function 'default' has no scorer for data_source {', '.join(map(repr, unknown))}; "
            f"it knows {', '.join(sorted(ROUTES))} (and names starting {', '.join(_MATH_PREFIXES)}). "
            "Set reward.function to a built-in ('exact_match', 'gsm8k', 'gsm8k_flexible', 'math') "
            "or to your own 'package.module:function' (a verl compute_score works unchanged)"
        )


def default(response_text: str, ground_truth: str, *, data_source: str = "", **extra: Any) -> float:
    name = route(data_source)
    if name is None:
        check_sources({data_source})
    return SCORERS[name](response_text, ground_truth, **extra)


SCORERS = {"exact_match": exact_match, "gsm8k": gsm8k, "gsm8k_flexible": gsm8k_flexible, "math": math_answer}
