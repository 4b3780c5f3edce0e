"""Every repository path the README and docs/ name exists, and the README stays a manual (under 500 lines).

A path is a backticked token whose first component is a top-level entry of the repository (``learner/loss.py``,
``bench/results/e2e_gpu/``); tokens with placeholders (``<run_dir>``, ``*``, ``...``, ``RUN_DIR``) or that
name run outputs (``runs/``) are not paths of the checkout.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
TOP = {p.name for p in REPO.iterdir() if not p.name.startswith(".")} - {"runs"}
PLACEHOLDER = re.compile(r"[<>*{}$~]|\.\.\.|RUN_DIR|\bD/|NAME|\bN\b|STEP|PATH")


def named_paths(text: str) -> set[str]:
    out = set()
    for token in re.findall(r"`([^`\n]+)`", text):
        for word in token.split():
            word = word.strip("'\",;:()[]")
            word = re.sub(r"(::|\[).*$", "", word)  # a pytest node id or parametrisation
            if "/" not in word or PLACEHOLDER.search(word) or word.startswith(("http", "/", "-")):
                continue
            if "=" in word:
                continue
            if word.split("/", 1)[0] not in TOP:
                continue
            word = word.rstrip(".")
            if word.count("/") == 1 and "." not in word:
                continue  # a metric name (`broker/queue_depth`), not a file
            out.add(word)
    return out


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(REPO)) for d in DOCS])
def test_every_named_path_exists(doc):
    def exists(p: str) -> bool:  # a path, or a module's attribute (`launch/verl_defaults.DEFAULTS`)
        return (REPO / p).exists() or (REPO / (p.rsplit(".", 1)[0] + ".py")).exists()

    missing = sorted(p for p in named_paths(doc.read_text()) if not exists(p))
    assert not missing, f"{doc.relative_to(REPO)} names paths that do not exist: {missing}"


def test_the_readme_is_a_manual():
    n = len((REPO / "README.md").read_text().splitlines())
    assert n < 500, f"README.md has {n} lines; move narratives and results under docs/"


def test_the_path_finder_finds_paths():
    found = named_paths(
        "see `learner/losses.py` and `bench/results/x/` but not `runs/tiny`, `<run_dir>/a` or the "
        "metric `learner/clip_frac`"
    )
    assert found == {"learner/losses.py", "bench/results/x/"}
