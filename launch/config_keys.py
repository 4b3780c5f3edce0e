"""Every config key a run takes, read off the config models: ``launch/cluster.py config --keys [SECTION]``.

The list is made from the pydantic models themselves (``RunConfig`` and the sections it nests), so it
cannot drift from what the loader accepts. ``docs/configuration.md`` is this list as Markdown, written by
``python launch/cluster.py config --keys --markdown > docs/configuration.md`` and checked in CI
(tests/unit/launch/test_config_keys.py)::

    python launch/cluster.py config --keys learner.loss
    learner.loss.correction  Literal['none', 'tis', 'decoupled', 'bypass']  (required)  off-policy correction; ...
"""

from __future__ import annotations

import argparse
import types
import typing
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from core.configbase import ConfigError, suggest


@dataclass(frozen=True, slots=True)
class Key:
    name: str  # dotted
    type: str
    default: str  # "(required)" when the key has none
    description: str


def _type_name(annotation: Any) -> str:
    text = str(annotation) if not isinstance(annotation, type) else annotation.__name__
    return text.replace("typing.", "").replace("NoneType", "None")


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The config classes a field holds: itself, or the members of ``X | None`` / ``list[X]``."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    out = []
    if typing.get_origin(annotation) in (typing.Union, types.UnionType, list):
        for arg in typing.get_args(annotation):
            out += _models_in(arg)
    return out


def _default(field) -> str:
    if field.is_required():
        return "(required)"
    value = field.default_factory() if field.default_factory is not None else field.default
    if isinstance(value, BaseModel):
        return "(section)"
    return repr(value)


def iter_keys(model: type[BaseModel], prefix: str = "") -> list[Key]:
    """Every leaf key under ``model`` (sections recurse; a section that may be None is listed too)."""
    keys: list[Key] = []
    for name, field in model.model_fields.items():
        dotted = f"{prefix}{name}"
        nested = _models_in(field.annotation)
        desc = " ".join((field.description or "").split())
        if nested:
            if not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
                # an optional or repeated section: the key itself takes a value
                keys.append(
                    Key(
                        dotted,
                        _type_name(field.annotation),
                        _default(field),
                        desc or (nested[0].__doc__ or "").strip().split("\n")[0],
                    )
                )
            for sub in nested:
                keys += iter_keys(sub, dotted + ".")
            continue
        keys.append(Key(dotted, _type_name(field.annotation), _default(field), desc))
    return keys


def all_keys() -> list[Key]:
    from launch.config import RunConfig

    seen, out = set(), []
    for k in iter_keys(RunConfig):
        if k.name not in seen:
            seen.add(k.name)
            out.append(k)
    return out


def select(keys: list[Key], section: str | None) -> list[Key]:
    if not section:
        return keys
    chosen = [k for k in keys if k.name == section or k.name.startswith(section + ".")]
    if not chosen:
        sections = sorted({k.name.rsplit(".", 1)[0] for k in keys if "." in k.name})
        raise ConfigError(
            f"no config section or key {section!r}.{suggest(section, sections)} Sections: "
            + ", ".join(s for s in sections if s.count(".") == 0)
        )
    return chosen


def markdown(keys: list[Key]) -> str:
    lines = [
        "# Configuration keys",
        "",
        "Every key a run takes, generated from the config models by",
        "`python launch/cluster.py config --keys --markdown > docs/configuration.md` (a test checks it is",
        "current). Set a key in a recipe (`launch/recipes/*.yaml`) or on the command line as",
        "`dotted.key=value`.",
        "",
    ]
    section = None
    for k in keys:
        top = k.name.split(".", 1)[0]
        if top != section:
            section = top
            lines += ["", f"## `{top}`", "", "| key | type | default | description |", "|---|---|---|---|"]
        cell = k.description.replace("|", "\\|")
        lines.append(f"| `{k.name}` | `{k.type.replace('|', '/')}` | `{k.default.replace('|', '/')}` | {cell} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="launch/cluster.py config",
        description="List every config key with its type, default and description, read from the config models.",
    )
    p.add_argument(
        "--keys",
        nargs="?",
        const="",
        default=None,
        metavar="SECTION",
        help="list the keys (of one section, e.g. learner.loss)",
    )
    p.add_argument("--markdown", action="store_true", help="as the Markdown table of docs/configuration.md")
    args = p.parse_args(argv)
    if args.keys is None:
        p.print_help()
        return 2
    try:
        keys = select(all_keys(), args.keys)
    except ConfigError as exc:
        print(f"error: {exc}")
        return 2
    if args.markdown:
        print(markdown(keys), end="")
        return 0
    width = max(len(k.name) for k in keys)
    for k in keys:
        print(f"{k.name:<{width}}  {k.type}  default {k.default}\n{'':<{width}}  {k.description or '(undescribed)'}")
    return 0
