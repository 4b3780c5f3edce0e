"""The key=value arguments of verl's example scripts, one JSON record per script (test data for launch/verl.py).

Each script is run by bash in a sandbox: an empty ``PATH`` (no external program can start), an empty
environment but ``HOME``, a scratch working directory, ``set -e``/``-u`` switched off, and shell
functions standing in for ``python``/``python3``/``ray``/``torchrun`` that write their arguments to a
file. So every variable resolves exactly as bash resolves it with the script's own defaults
(``${VAR:-default}``, ``$((...))``, arrays, ``if`` blocks), and nothing but the argument list is kept.
Data and model paths are replaced by placeholders (``{train_files}``, ``{val_files}``, ``{model_path}``)
that a test fills with local files. Scripts are read from bare git repositories (the ``fetch`` tool's
mirrors) at a given commit, never written out::

    python tools/verl_script_keys.py --out tests/unit/verl/scripts.json \\
        --repo verl-project/verl=/work/.mirror/verl-project+verl/repo@v0.9.0 \\
        --repo verl-project/verl-recipe=/work/.mirror/verl-project+verl-recipe/repo@HEAD

The folders read per repository are ``FOLDERS``. The same tool prints docs/verl.md's tables: verl's
defaults (``--defaults``) and, per capability, the scripts whose translation refuses it with the data
and model paths made local (``--table tests/unit/verl/scripts.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

FOLDERS = {
    "verl-project/verl": [
        "examples/grpo_trainer",
        "examples/ppo_trainer",
        "verl/experimental/fully_async_policy/shell",
        "verl/experimental/one_step_off_policy/shell",
    ],
    "verl-project/verl-recipe": ["dapo"],
}
LAUNCHERS = ("python", "python3", "ray", "torchrun")
# keys whose value is a data or model location: replaced so the record runs against local files
PLACEHOLDERS = {
    "data.train_files": "{train_files}",
    "data.val_files": "{val_files}",
    "actor_rollout_ref.model.path": "{model_path}",
    "actor_rollout_ref.model.tokenizer_path": "{model_path}",
    "critic.model.path": "{model_path}",
    "critic.model.tokenizer_path": "{model_path}",
    "data.tokenizer": "{model_path}",
}

PRELUDE = r"""
__capture() { local a; for a in "$@"; do printf '%s\0' "$a"; done >> "$__OUT"; printf '\1\0' >> "$__OUT"; }
python() { __capture python "$@"; }
python3() { __capture python3 "$@"; }
ray() { __capture ray "$@"; }
torchrun() { __capture torchrun "$@"; }
command_not_found_handle() { return 0; }
"""


def git(gitdir: str, *args: str) -> str:
    return subprocess.run(["git", f"--git-dir={gitdir}", *args], check=True, capture_output=True, text=True).stdout


def invocations(script: str, timeout_s: float = 30.0) -> list[list[str]]:
    """Every launcher call the script makes, as argument lists, with the shell's own expansion."""
    # set -e / -u would stop at the first stubbed-out command or unset variable; -x only adds noise
    lines = [":" if ln.strip().startswith("set -") else ln for ln in script.splitlines()]
    with tempfile.TemporaryDirectory(prefix="verl-keys-") as tmp:
        out = Path(tmp) / "calls"
        out.touch()
        empty = Path(tmp) / "bin"
        empty.mkdir()
        env = {"HOME": "/home/user", "PATH": str(empty), "__OUT": str(out)}
        # a variable the script demands (${NAME:?message}) and gives no default for: a placeholder
        env.update({name: f"/placeholder/{name}" for name in re.findall(r"\$\{(\w+):?\?", script)})
        try:
            subprocess.run(
                ["/bin/bash", "--noprofile", "--norc", "-s"],
                input=PRELUDE + "\n".join(lines) + "\n",
                cwd=tmp,
                env=env,
                capture_output=True,
                text=True,
                timeout=timeout_s,
            )
        except subprocess.TimeoutExpired:
            print(f"warning: a script ran past {timeout_s} s; keeping the calls it made", file=sys.stderr)
        # the scratch directory is the script's $PWD: a fixed name keeps the records reproducible
        text = out.read_bytes().decode(errors="replace").replace(os.path.realpath(tmp), "/cwd")
        raw = text.split("\0")
    calls, cur = [], []
    for w in raw:
        if w == "\1":
            calls.append(cur)
            cur = []
        elif w or cur:
            cur.append(w)
    return calls


def verl_call(calls: list[list[str]]) -> tuple[str | None, list[str]]:
    """The first call that runs a verl or recipe trainer module: (module, its key=value words)."""
    for call in calls:
        if "-m" not in call:
            continue
        i = call.index("-m")
        module = call[i + 1] if i + 1 < len(call) else ""
        if module.startswith(("verl.", "recipe.")):
            return module, [w for w in call[i + 2 :] if "=" in w and not w.startswith("-")]
    return None, []


def localize(words: list[str]) -> list[str]:
    out = []
    for w in words:
        key, _, _ = w.partition("=")
        ph = PLACEHOLDERS.get(key.lstrip("+"))
        out.append(f"{key}={ph}" if ph else w)
    return out


def records(repo: str, gitdir: str, ref: str) -> list[dict]:
    commit = git(gitdir, "rev-parse", f"{ref}^{{commit}}").strip()
    names = git(gitdir, "ls-tree", "-r", "--name-only", commit).splitlines()
    out = []
    for folder in FOLDERS[repo]:
        for path in sorted(n for n in names if n.startswith(folder + "/") and n.endswith(".sh")):
            module, words = verl_call(invocations(git(gitdir, "show", f"{commit}:{path}")))
            out.append({"repo": repo, "path": path, "commit": commit, "entry": module, "keys": localize(words)})
    return out


REPO_ROOT = Path(__file__).resolve().parent.parent
LOCAL = {
    "{train_files}": "data/word_problems/train.parquet",
    "{val_files}": "data/word_problems/test.parquet",
    "{model_path}": "models/tiny-adder",
}


def local_command(rec: dict, root: Path = REPO_ROOT) -> list[str]:
    """A record's command line with its placeholders replaced by the repository's own small files."""
    words = ["-m", rec["entry"]]
    for w in rec["keys"]:
        for ph, rel in LOCAL.items():
            w = w.replace(ph, str(root / rel))
        words.append(w)
    return words


def outcomes(recs: list[dict]) -> list[tuple[dict, set[str | None] | None]]:
    """Per record with a trainer call: None if it maps, else the capabilities its refusals name."""
    from launch.verl import Untranslatable, translate

    out = []
    for rec in recs:
        if not rec["entry"]:
            continue
        try:
            translate(local_command(rec))
            out.append((rec, None))
        except Untranslatable as exc:
            out.append((rec, {p.capability for p in exc.problems}))
    return out


def table(recs: list[dict]) -> str:
    """Markdown: how many scripts map, and the scripts refused per capability."""
    res = outcomes(recs)
    mapped = [r["path"] for r, caps in res if caps is None]
    by: dict[str, list[str]] = {}
    for rec, caps in res:
        for c in sorted(caps or [], key=str):
            by.setdefault(str(c), []).append(Path(rec["path"]).name)
    lines = [
        f"{len(mapped)} of {len(res)} scripts with a trainer call map with no refusal "
        f"({len(recs) - len(res)} more have no trainer call).",
        "",
        "| capability | scripts | which |",
        "|---|---|---|",
    ]
    lines += [f"| {c} | {len(v)} | {', '.join(v)} |" for c, v in sorted(by.items(), key=lambda kv: -len(kv[1]))]
    return "\n".join(lines + ["", "Mapped: " + ", ".join(Path(m).name for m in mapped)])


def defaults_table() -> str:
    from launch.verl_defaults import DEFAULTS, ENTRY_DEFAULTS, VERL_SOURCE

    lines = [f"verl's defaults ({VERL_SOURCE}):", "", "| verl key | verl 0.9 default |", "|---|---|"]
    lines += [f"| `{k}` | `{json.dumps(v)}` |" for k, v in DEFAULTS.items()]
    for entry, extra in ENTRY_DEFAULTS.items():
        if extra:
            lines += [
                "",
                f"`python -m {entry}` sets on top: " + ", ".join(f"`{k}={json.dumps(v)}`" for k, v in extra.items()),
            ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--repo",
        action="append",
        default=[],
        metavar="OWNER/NAME=GITDIR@REF",
        help="a bare repository and the commit or tag to read",
    )
    p.add_argument("--out", help="the JSON file written (a list of records)")
    p.add_argument(
        "--table", metavar="JSON", help="print the markdown table of refusals by capability of these records"
    )
    p.add_argument("--defaults", action="store_true", help="print the markdown table of verl's defaults")
    args = p.parse_args(argv)
    if args.table or args.defaults:
        if args.defaults:
            print(defaults_table())
        if args.table:
            print(table(json.loads(Path(args.table).read_text())))
        return 0
    if not args.repo or not args.out:
        p.error("give --repo (one or more) and --out, or --table / --defaults")
    recs = []
    for spec in args.repo:
        repo, _, rest = spec.partition("=")
        gitdir, _, ref = rest.rpartition("@")
        if repo not in FOLDERS or not gitdir:
            p.error(f"--repo {spec!r}: expected one of {sorted(FOLDERS)} as OWNER/NAME=GITDIR@REF")
        recs += records(repo, os.path.expanduser(gitdir), ref or "HEAD")
    # one record per line: a re-extraction diffs script by script
    Path(args.out).write_text("[\n" + ",\n".join(json.dumps(r) for r in recs) + "\n]\n")
    print(
        f"{len(recs)} scripts, {sum(1 for r in recs if r['entry'])} with a trainer call -> {args.out}", file=sys.stderr
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
