"""``launch/cluster.py report --run-dir D``: PNG plots and a markdown summary from a run's own files.

Reads only what the run wrote (a finished, a running or a resumed run alike)::

    metrics/learner.jsonl   the learner's per-step records (learner/metrics_sink.py); for a resumed
                            run each step's last record counts (the redone steps replace the dead run's)
    metrics/driver.jsonl    the driver's once-a-second records (launch/observe.py): throughput,
                            idle fractions, evaluations
    summary.json            evaluation before and after (if the run finished)

and writes ``D/report/``: ``reward.png`` (reward and eval accuracy against step), ``reward_time.png``
(the same against wall time), ``staleness.png`` (the staleness histogram of every step),
``throughput.png`` (tokens/s), ``idle.png`` (fleet and learner idle), ``publish.png`` (publish and
engine-held seconds per step) and ``report.md``.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from launch.plot import Chart, heatmap
from learner.metrics_sink import effective_rows

PLOTS = ("reward.png", "reward_time.png", "staleness.png", "throughput.png", "idle.png", "publish.png")


def _driver_rows(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics" / "driver.jsonl"
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # cut by kill -9
            continue
        if "event" in row and rows:
            rows[-1]["_last"] = True  # the next row starts another launch: no line across the gap
        elif "step" in row:
            rows.append(row)
    return rows


def _evals(drows: list[dict[str, Any]], summary: dict[str, Any]) -> list[tuple[int, float, float]]:
    """(step, wall time, accuracy) of every evaluation the driver saw, plus before and after."""
    out, last = [], None
    for r in drows:
        acc = r.get("eval_accuracy")
        if acc is not None and acc != last:
            out.append((r["step"], r["time"], acc))
        last = acc
    t0 = drows[0]["time"] if drows else 0.0
    if summary.get("eval_accuracy_before") is not None:
        out.insert(0, (0, t0, summary["eval_accuracy_before"]))
    after = summary.get("eval_accuracy_after")
    if after is not None and not (out and out[-1][0] == summary["steps"] and out[-1][2] == after):
        out.append((summary["steps"], drows[-1]["time"] if drows else t0, summary["eval_accuracy_after"]))
    return out


def build_report(run_dir: str | Path) -> list[Path]:
    """Write the plots and ``report.md`` under ``run_dir/report``; returns their paths."""
    run_dir = Path(run_dir)
    rows = effective_rows(run_dir)
    if not rows:
        raise SystemExit(
            f"error: {run_dir / 'metrics' / 'learner.jsonl'} has no step records: "
            "is this a fleetrl run directory, and has its learner finished a step?"
        )
    drows = _driver_rows(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    out = run_dir / "report"
    steps = list(rows)
    m = [rows[s]["metrics"] for s in steps]
    t_start = min([rows[s]["wall_time"] for s in steps] + [r["time"] for r in drows])
    wall = [rows[s]["wall_time"] - t_start for s in steps]
    restarts = _restarts(run_dir)
    learner_gaps = {i for i, s in enumerate(steps) if s in restarts}
    driver_gaps = {i + 1 for i, r in enumerate(drows) if r.get("_last")}
    evals = _evals(drows, summary)

    c = Chart("reward and eval accuracy", x_label="learner step", y_label="reward / accuracy")
    c.line("train reward (mean)", steps, [x["rollout/reward_mean"] for x in m])
    c.line("eval accuracy", [e[0] for e in evals], [e[2] for e in evals], points=True)
    paths = [c.save(out / "reward.png")]
    c = Chart("reward and eval accuracy over time", x_label="wall time (s)", y_label="reward / accuracy")
    c.line("train reward (mean)", wall, [x["rollout/reward_mean"] for x in m], breaks=learner_gaps)
    c.line("eval accuracy", [e[1] - t_start for e in evals], [e[2] for e in evals], points=True)
    paths.append(c.save(out / "reward_time.png"))
    paths.append(
        heatmap(
            out / "staleness.png",
            "staleness of the samples of each step",
            {s: {int(k): v for k, v in rows[s]["staleness_hist"].items()} for s in steps},
            x_label="learner step",
            y_label="versions",
        )
    )
    dw = [r["time"] - t_start for r in drows]
    c = Chart("rollout throughput", x_label="wall time (s)", y_label="tokens / s")
    c.line("generated tokens/s", dw, [r.get("tokens_per_s") for r in drows], breaks=driver_gaps)
    paths.append(c.save(out / "throughput.png"))
    c = Chart("idle fractions", x_label="wall time (s)", y_label="share of wall time")
    c.line("fleet idle", dw, [r.get("fleet_idle_fraction") for r in drows], breaks=driver_gaps)
    c.line("learner idle (waiting for data)", dw, [r.get("learner_idle_fraction") for r in drows], breaks=driver_gaps)
    paths.append(c.save(out / "idle.png"))
    c = Chart("weight publish per step", x_label="learner step", y_label="seconds")
    c.line("publish", steps, [x["learner/time_publish_seconds"] for x in m])
    c.line("engines held", steps, [x["learner/publish_engine_held_seconds"] for x in m])
    c.line("wait for data", steps, [x["learner/time_wait_data_seconds"] for x in m])
    c.line("train", steps, [x["learner/time_train_seconds"] for x in m])
    paths.append(c.save(out / "publish.png"))
    paths.append(_markdown(run_dir, out / "report.md", rows, drows, evals, summary))
    return paths


def _restarts(run_dir: Path) -> set[int]:
    """The first step of every learner process after the first (a resumed run starts there)."""
    path = run_dir / "metrics" / "learner.jsonl"
    starts = [json.loads(x)["step"] for x in path.read_text().splitlines() if '"event"' in x]
    return set(starts[1:])


def _mean(xs: list[float]) -> float:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return sum(xs) / len(xs) if xs else float("nan")


def _markdown(run_dir: Path, path: Path, rows, drows, evals, summary) -> Path:
    steps = list(rows)
    m = [rows[s]["metrics"] for s in steps]
    hist: dict[int, int] = {}
    for s in steps:
        for k, v in rows[s]["staleness_hist"].items():
            hist[int(k)] = hist.get(int(k), 0) + v
    starts = sum(1 for x in (run_dir / "metrics" / "learner.jsonl").read_text().splitlines() if '"event"' in x)
    first, last = m[:5], m[-5:]
    lines = [
        f"# Run report: {run_dir.name}",
        "",
        f"- steps: {steps[0]}..{steps[-1]} ({len(steps)} recorded; learner processes started: {starts})",
        f"- reward (mean of first / last 5 steps): {_mean([x['rollout/reward_mean'] for x in first]):.3f} -> "
        f"{_mean([x['rollout/reward_mean'] for x in last]):.3f}",
        "- eval accuracy: " + (", ".join(f"step {s}: {a:.3f}" for s, _, a in evals) or "none"),
        f"- staleness (versions: samples): {dict(sorted(hist.items()))}",
        f"- mean seconds per step: wait {_mean([x['learner/time_wait_data_seconds'] for x in m]):.2f}, "
        f"train {_mean([x['learner/time_train_seconds'] for x in m]):.2f}, "
        f"publish {_mean([x['learner/time_publish_seconds'] for x in m]):.2f} "
        f"(engines held {_mean([x['learner/publish_engine_held_seconds'] for x in m]):.2f})",
        f"- response length (tokens, mean): {_mean([x['rollout/response_length_mean_tokens'] for x in m]):.1f}; "
        f"truncated: {_mean([x['rollout/truncated_fraction'] for x in m]):.3f}",
        f"- tokens/s (driver, mean): {_mean([r.get('tokens_per_s') for r in drows]):.0f}; fleet idle at end: "
        f"{drows[-1].get('fleet_idle_fraction') if drows else '-'}; learner idle at end: "
        f"{drows[-1].get('learner_idle_fraction') if drows else '-'}",
        f"- groups lost (summary): {summary.get('groups_lost', '-')}",
        "",
    ]
    lines += [f"![{p}]({p})" for p in PLOTS]
    path.write_text("\n".join(lines) + "\n")
    return path


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="launch/cluster.py report", description="PNG plots and a markdown summary of a run, from its own files"
    )
    p.add_argument("--run-dir", required=True)
    args = p.parse_args(argv)
    if not Path(args.run_dir).is_dir():
        print(f"error: --run-dir {args.run_dir} is not a directory", flush=True)
        return 2
    for path in build_report(args.run_dir):
        print(path)
    return 0
