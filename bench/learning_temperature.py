"""CPU learning runs of the tiny recipe at sampling temperature 0.7 against 1.0 (issue 26).

Each case is one ``launch/cluster.py --recipe tiny`` run (vLLM CPU server, FSDP learner, 60 steps);
run them one at a time (they use both cores). ``--collect`` reads the runs' summaries and learner
logs and writes one JSON: eval accuracy before/after, the mean reward of the last 10 steps, the
learner's clip fraction and the first-step log-prob probe.

    python bench/learning_temperature.py --out-dir /tmp/lt            # run every case (about 4 min each)
    python bench/learning_temperature.py --out-dir /tmp/lt --collect --json bench/results/learning_temperature.json
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# name -> overrides of the tiny recipe
CASES = {
    "t10_dec_s0": ["rollout.sampling.temperature=1.0", "learner.temperature=1.0", "run.seed=0"],
    "t07_dec_s0": ["rollout.sampling.temperature=0.7", "learner.temperature=0.7", "run.seed=0"],
    "t07_dec_mb8_s0": [
        "rollout.sampling.temperature=0.7",
        "learner.temperature=0.7",
        "run.seed=0",
        "learner.ppo_mini_batch_size=8",
    ],
    "t07_tis_mb8_s0": [
        "rollout.sampling.temperature=0.7",
        "learner.temperature=0.7",
        "run.seed=0",
        "learner.ppo_mini_batch_size=8",
        "learner.loss.correction=tis",
    ],
    "t10_dec_s1": ["rollout.sampling.temperature=1.0", "learner.temperature=1.0", "run.seed=1"],
    "t07_dec_s1": ["rollout.sampling.temperature=0.7", "learner.temperature=0.7", "run.seed=1"],
}

STEP_LINE = re.compile(r"step (\d+): loss (\S+) reward (\S+) clip (\S+) mismatch_kl (\S+)")
PROBE_LINE = re.compile(r"log-prob probe: mean \|learner - engine\| (\S+) nats \(max (\S+)\) over (\d+)")


def run(out: Path, names: list[str]) -> None:
    for name in names:
        cmd = [
            sys.executable,
            "launch/cluster.py",
            "--rollout-gpus",
            "0",
            "--learner-gpus",
            "0",
            "--recipe",
            "tiny",
            "--no-live",
            "--summary",
            str(out / f"{name}.json"),
            f"run.run_dir={out / ('rd_' + name)}",
            *CASES[name],
        ]
        print(" ".join(cmd), flush=True)
        with open(out / f"{name}.log", "w") as log:
            subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, check=False)


def collect(out: Path) -> dict:
    results = {}
    for name, overrides in CASES.items():
        summary_path = out / f"{name}.json"
        if not summary_path.exists():
            continue
        s = json.loads(summary_path.read_text())
        learner_log = out / f"rd_{name}" / "logs" / "learner.log"
        text = learner_log.read_text(errors="replace") if learner_log.exists() else ""
        clips = [float(m.group(4)) for m in STEP_LINE.finditer(text)]
        probe = PROBE_LINE.search(text)
        rewards = [r for r in s.get("reward_per_step", []) if r is not None]
        results[name] = {
            "overrides": overrides,
            "eval_accuracy_before": s.get("eval_accuracy_before"),
            "eval_accuracy_after": s.get("eval_accuracy_after"),
            "reward_first10_mean": round(sum(rewards[:10]) / max(1, len(rewards[:10])), 4),
            "reward_last10_mean": round(sum(rewards[-10:]) / max(1, len(rewards[-10:])), 4),
            "clip_frac_mean": round(sum(clips) / len(clips), 4) if clips else None,
            "logprob_probe_mean_abs": float(probe.group(1)) if probe else None,
            "logprob_probe_max_abs": float(probe.group(2)) if probe else None,
            "steps": s.get("steps"),
            "wall_s": s.get("wall_s"),
            "error": s.get("error"),
        }
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", type=Path, required=True)
    ap.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    ap.add_argument("--collect", action="store_true", help="only read finished runs")
    ap.add_argument("--json", type=Path, help="where --collect writes its JSON")
    args = ap.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    if not args.collect:
        run(args.out_dir, args.cases)
    res = collect(args.out_dir)
    for name, r in res.items():
        print(
            f"{name:16s} eval {r['eval_accuracy_before']} -> {r['eval_accuracy_after']}  reward first10 "
            f"{r['reward_first10_mean']} last10 {r['reward_last10_mean']}  clip {r['clip_frac_mean']}  "
            f"probe {r['logprob_probe_mean_abs']}"
        )
    if args.json:
        args.json.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
