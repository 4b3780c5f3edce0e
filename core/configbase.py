"""The base of every component config, the sections every process shares (the model, the run's
seed, length and directory), and the error a user sees for a bad key or value.

Each component owns a small config next to the class it configures; all of them
derive from :class:`ConfigModel` (pydantic, ``extra="forbid"``), so a misspelt key
or a value out of range is an error at construction.  :func:`explain` turns
pydantic's error list into one message that names the dotted key, the bad value,
what was expected, and the nearest allowed name.

This module imports neither torch nor vLLM: config errors come back in well
under a second.
"""

from __future__ import annotations

import difflib
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class ConfigModel(BaseModel):
    """Strict, immutable config: unknown keys and wrong types are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


class ModelConfig(ConfigModel):
    """The policy model: the fleet serves it and the learner trains it."""

    path: str = Field(description="HF model folder (config.json, model.safetensors, tokenizer.json)")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="the engines' weights dtype (auto: the folder's torch_dtype); float32 engines make the log-prob probe's tolerance 0.01 nats, bf16 0.1",
    )


class RunKeys(ConfigModel):
    """The keys of the run section every process reads (the launcher's ``RunSection`` adds its own)."""

    seed: int = Field(0, description="seeds the data order, the engines' sampling and the learner's init")
    max_steps: int = Field(20, ge=0, description="learner steps (policy versions) of the run")
    run_dir: str = Field(
        "runs/latest",
        description="logs, metrics, checkpoints, spool and keys of the run; "
        "running again on the same directory resumes",
    )


class ConfigError(ValueError):
    """A bad key or value in a recipe or an override; the message says which and why."""


def _model_at(model: type[BaseModel], path: tuple[Any, ...]) -> type[BaseModel] | None:
    """The config class that owns the key at ``path`` (``None`` past a leaf)."""
    current: type[BaseModel] | None = model
    for part in path:
        if current is None or not isinstance(part, str) or part not in current.model_fields:
            return None
        annotation = current.model_fields[part].annotation
        current = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
    return current


def suggest(name: str, allowed: list[str]) -> str:
    close = difflib.get_close_matches(name, allowed, n=1, cutoff=0.5)
    return f" Did you mean '{close[0]}'?" if close else ""


def explain(err: ValidationError, model: type[BaseModel], prefix: str = "") -> ConfigError:
    """One readable message for every problem pydantic found."""
    lines = []
    for e in err.errors():
        loc = tuple(e["loc"])
        key = prefix + ".".join(str(p) for p in loc)
        if e["type"] == "extra_forbidden":
            owner = _model_at(model, loc[:-1])
            allowed = sorted(owner.model_fields) if owner else []
            lines.append(
                f"unknown key '{key}'.{suggest(str(loc[-1]), allowed)} Allowed keys here: {', '.join(allowed)}"
            )
        elif not loc:  # a check across sections (model_validator): its message names the keys
            lines.append(e["msg"].removeprefix("Value error, "))
        else:
            value = e.get("input")
            lines.append(f"bad value for '{key}': {value!r} ({e['msg']})")
    return ConfigError("invalid config:\n  " + "\n  ".join(lines))


def build(model: type[BaseModel], data: dict[str, Any], prefix: str = "") -> Any:
    """Construct ``model`` from plain data, raising :class:`ConfigError` on any problem."""
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise explain(err, model, prefix) from None
