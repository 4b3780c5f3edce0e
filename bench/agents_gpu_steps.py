"""Per step of a tool-use run: reward, turns, tool responses, and tool calls in the decoded samples.

    python bench/agents_gpu_steps.py RUN/metrics/learner.jsonl --json per_step.json

From each step's metrics (every episode of the batch): ``rollout/reward_mean``, ``rollout/turns_mean``
and ``rollout/observation_fraction`` (episodes that got at least one tool response). From the decoded
samples (``learner.log_samples_every``: the first episode of the first few groups): tool calls per
episode, the fraction of episodes with a call, and the fraction of calls that parse and whose tool
answer is not an error (valid calls).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from rollout_fleet.envs.tools import ToolCallError, parse_tool_calls  # noqa: E402

_BLOCK = re.compile(r"<tool_call>.*?</tool_call>", re.S)
_RESP = re.compile(r"<tool_response>\s*(.*?)\s*</tool_response>", re.S)


def sample_calls(response: str) -> tuple[int, int]:
    """(tool calls, valid calls) of one decoded episode: a valid call parses and its answer is no error."""
    blocks = _BLOCK.findall(response)
    answers = _RESP.findall(response)
    valid = 0
    for i, b in enumerate(blocks):
        try:
            ok = bool(parse_tool_calls(b))
        except ToolCallError:
            ok = False
        if ok and i < len(answers) and not answers[i].startswith("error"):
            valid += 1
    return len(blocks), valid


def per_step(rows: list[dict]) -> list[dict]:
    out = []
    for r in rows:
        if "metrics" not in r:
            continue
        m = r["metrics"]
        row = {
            "step": r["step"],
            "reward": m.get("rollout/reward_mean"),
            "turns": m.get("rollout/turns_mean"),
            "tool_response_fraction": m.get("rollout/observation_fraction"),
            "response_tokens": m.get("rollout/response_length_mean_tokens"),
            "step_s": m.get("learner/total_step_seconds"),
        }
        samples = r.get("samples") or []
        if samples:
            calls = [sample_calls(s["response"]) for s in samples]
            n_calls = sum(c for c, _ in calls)
            row.update(
                samples=len(samples),
                sample_call_fraction=sum(c > 0 for c, _ in calls) / len(samples),
                sample_calls=n_calls,
                sample_valid_call_fraction=(sum(v for _, v in calls) / n_calls) if n_calls else None,
            )
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("jsonl", type=Path)
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    if not a.jsonl.exists():
        print(f"no {a.jsonl}")
        return 1
    rows = [json.loads(x) for x in a.jsonl.read_text().splitlines() if x.strip()]
    steps = per_step(rows)
    for s in steps:
        print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in s.items()))
    if steps:
        k = max(1, len(steps) // 4)
        first, last = steps[:k], steps[-k:]

        def mean(xs, key):
            v = [x[key] for x in xs if x.get(key) is not None]
            return sum(v) / len(v) if v else None

        summary = {
            key: [mean(first, key), mean(last, key)]
            for key in (
                "reward",
                "turns",
                "tool_response_fraction",
                "sample_call_fraction",
                "sample_valid_call_fraction",
            )
        }
        print(f"first {k} steps -> last {k} steps:", json.dumps(summary))
    else:
        summary = {}
    if a.json:
        a.json.write_text(json.dumps({"steps": steps, "first_last_quarter": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
