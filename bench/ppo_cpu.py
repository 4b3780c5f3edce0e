"""CPU learning runs of PPO with a critic (the ``ppo`` recipe) against GRPO (issue 35).

Equal sample budget: 128 samples a step for 60 steps in every case. PPO n=4 (32 prompts x 4), PPO n=1
(128 prompts x 1) and GRPO n=4 (the ``tiny`` recipe at 32 prompts x 4). Each case is one
``launch/cluster.py`` run (vLLM CPU server, FSDP learner); run them one at a time (they use both cores).
``--collect`` reads the summaries and the learner's metrics (RUN_DIR/metrics/learner.jsonl) and writes
one JSON: eval accuracy before/after, wall time, mean reward of the first and last 10 steps and, for
PPO, the critic's explained variance over the first and last 10 steps.

    python bench/ppo_cpu.py --out-dir /tmp/ppo                       # every case (about 4 min each)
    python bench/ppo_cpu.py --out-dir /tmp/ppo --collect --json bench/results/ppo_cpu/summary.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# name -> (recipe, overrides)
CASES = {
    f"{name}_s{seed}": (recipe, [*over, f"run.seed={seed}"])
    for seed in (0, 1)
    for name, recipe, over in (
        ("ppo_n4", "ppo", ["rollout.sampling.n=4", "broker.groups_per_step=32"]),
        ("ppo_n1", "ppo", ["rollout.sampling.n=1", "broker.groups_per_step=128"]),
        ("grpo_n4", "tiny", ["rollout.sampling.n=4", "broker.groups_per_step=32"]),
    )
}


def run(out: Path, names: list[str]) -> None:
    for name in names:
        recipe, over = CASES[name]
        cmd = [
            sys.executable,
            "launch/cluster.py",
            "--rollout-gpus",
            "0",
            "--learner-gpus",
            "0",
            "--recipe",
            recipe,
            "--no-live",
            "--summary",
            str(out / f"{name}.json"),
            f"run.run_dir={out / ('rd_' + name)}",
            *over,
        ]
        print(" ".join(cmd), flush=True)
        with open(out / f"{name}.log", "w") as log:
            subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, check=False)


def _mean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x == x]
    return round(sum(xs) / len(xs), 4) if xs else None


def collect(out: Path) -> dict:
    results = {}
    for name, (recipe, over) in CASES.items():
        summary_path = out / f"{name}.json"
        if not summary_path.exists():
            continue
        s = json.loads(summary_path.read_text())
        rows = []
        jsonl = out / f"rd_{name}" / "metrics" / "learner.jsonl"
        if jsonl.exists():
            by_step = {}
            for line in jsonl.read_text().splitlines():
                r = json.loads(line)
                if "metrics" in r:
                    by_step[r["step"]] = r["metrics"]  # a redone step replaces the earlier record
            rows = [by_step[k] for k in sorted(by_step)]
        reward = [r.get("rollout/reward_mean", float("nan")) for r in rows]
        ev = [r["critic/vf_explained_var"] for r in rows if "critic/vf_explained_var" in r]
        results[name] = {
            "recipe": recipe,
            "overrides": over,
            "steps": s.get("steps"),
            "eval_accuracy_before": s.get("eval_accuracy_before"),
            "eval_accuracy_after": s.get("eval_accuracy_after"),
            "wall_s": s.get("wall_s"),
            "reward_first10_mean": _mean(reward[:10]),
            "reward_last10_mean": _mean(reward[-10:]),
            "explained_var_first10_mean": _mean(ev[:10]) if ev else None,
            "explained_var_last10_mean": _mean(ev[-10:]) if ev else None,
            "max_staleness_seen": s.get("max_staleness_seen"),
            "reward_per_step": [round(x, 4) for x in reward],
            "explained_var_per_step": [round(x, 4) for x in ev],
        }
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", type=Path, required=True)
    ap.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    ap.add_argument("--collect", action="store_true", help="summarise finished runs instead of running")
    ap.add_argument("--json", type=Path, help="with --collect: write the summary here")
    args = ap.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    if not args.collect:
        run(args.out_dir, args.cases)
        return
    res = collect(args.out_dir)
    text = json.dumps(res, indent=1)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
