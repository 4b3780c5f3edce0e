"""How a run's judge graded what the policy sampled, step window by step window (addition runs).

Reads the run's spool (``python -m broker export``), decodes each sample, scores it by the rule
(the stripped answer against a+b of the prompt) and sets that beside the reward the judge gave it:
the rule's accuracy of the samples, the judge's AUC right vs wrong, and its mean reward on each.
A policy that learns from a judge raises the first; one that games it raises the judge's reward of
wrong answers while the accuracy falls.

    python bench/judge_in_run.py --run-dir runs/judge-tiny --json bench/results/judge_tiny_cpu/in_run.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from rollout_fleet.scorers import exact_match  # noqa: E402
from tools.pretrain_judge import auc  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run-dir", type=Path, required=True)
    ap.add_argument("--model", default=str(REPO / "models" / "tiny-adder"), help="the policy's tokenizer")
    ap.add_argument("--window", type=int, default=10, help="steps per row")
    ap.add_argument("--top", type=int, default=12, help="wrong answers the judge liked most, listed")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "spool.parquet"
        subprocess.run(
            [sys.executable, "-m", "broker", "export", str(args.run_dir / "spool"), "--out", str(out)],
            cwd=REPO,
            check=True,
            capture_output=True,
            timeout=300,
        )
        rows = pq.read_table(out, columns=["step", "prompt_ids", "response_ids", "reward", "status"]).to_pylist()
    tok = AutoTokenizer.from_pretrained(args.model)
    samples = []
    for r in rows:
        prompt = tok.decode(r["prompt_ids"], skip_special_tokens=True)
        answer = tok.decode(r["response_ids"], skip_special_tokens=True)
        a, b = prompt.rstrip("=").split("+")
        samples.append(
            {
                "step": r["step"],
                "right": bool(exact_match(answer, str(int(a) + int(b)))),
                "reward": r["reward"],
                "answer": answer,
                "prompt": prompt,
            }
        )
    table = []
    last = max(s["step"] for s in samples)
    for lo in range(0, last + 1, args.window):
        w = [s for s in samples if lo <= s["step"] < lo + args.window]
        if not w:
            continue
        pos = [s["reward"] for s in w if s["right"]]
        neg = [s["reward"] for s in w if not s["right"]]
        table.append(
            {
                "steps": [lo, min(last, lo + args.window - 1)],
                "samples": len(w),
                "rule_accuracy": round(len(pos) / len(w), 4),
                "judge_auc": round(auc(pos, neg), 4),
                "judge_reward_right": round(sum(pos) / max(1, len(pos)), 4),
                "judge_reward_wrong": round(sum(neg) / max(1, len(neg)), 4),
            }
        )
    tail = [s for s in samples if s["step"] >= last - args.window + 1 and not s["right"]]
    # highest reward first, the most frequent first among equal rewards
    liked = sorted(
        Counter((s["prompt"], s["answer"], round(s["reward"], 3)) for s in tail).items(),
        key=lambda x: (-x[0][2], -x[1]),
    )
    res = {
        "run_dir": str(args.run_dir),
        "samples": len(samples),
        "windows": table,
        "wrong_answers_the_judge_liked_most_last_window": [
            {"prompt": p, "answer": a, "reward": r, "times": n} for (p, a, r), n in liked[: args.top]
        ],
    }
    for t in table:
        print(
            f"steps {t['steps'][0]:>3}-{t['steps'][1]:<3} samples {t['samples']:>5}  rule accuracy "
            f"{t['rule_accuracy']:.3f}  judge AUC {t['judge_auc']:.3f}  judge reward right "
            f"{t['judge_reward_right']:.3f} wrong {t['judge_reward_wrong']:.3f}"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
