"""The autoscaler in SIMULATED runs at full size (32 + 32 and 256 servers + 32 learner GPUs), and real CPU runs.

Each case is one ``launch/cluster.py --simulate`` run (local Ray with fake GPUs, the real broker,
SIMULATED engines and learner) with ``rollout.autoscale`` on and short windows, so that decisions
happen within a couple of minutes. The fleet starts at its maximum, which outruns the simulated learner
about twice: the queue fills and slots idle (drains), until the learner starts waiting (adds); in the
``growth`` case responses lengthen with every version, so generation slows and the fleet must grow again. Written: every decision (time, action, servers before and after, reason, signals,
the scale call's seconds), the staleness the learner saw (lag, in versions), the broker's per-engine
lag at the end, and the run's totals (groups lost must be 0).

    python bench/autoscale.py --json bench/results/autoscale_simulated.json
    python bench/autoscale.py --cases 32+32-growth --steps 200 --json bench/results/autoscale_simulated_growth.json

``--real``: the same with real vLLM CPU servers and the real learner on the tiny recipe, at the
autoscaler's default windows (``REAL_CASES``). Each decision is written with the throughput the
fleet and the learner had in the window before it and after the fleet settled at its new size
(from ``metrics/autoscale_signals.jsonl``, what the autoscaler saw every second)::

    python bench/autoscale.py --real --json bench/results/autoscale_cpu_real.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.report import run_info, write_json  # noqa: E402
from launch.autoscaler_io import SIGNALS_JSONL  # noqa: E402
from rollout_fleet.config import AutoscaleConfig  # noqa: E402

CASES = {
    # one group in flight per server (rollout.max_inflight_groups=1), so the fleet's size sets its rate:
    # a server makes ~10 SIMULATED groups/s; the learner takes groups_per_step / learner_step_s, about
    # half of what the full fleet makes
    "32+32": dict(rollout_gpus=32, learner_gpus=32, min=4, step=4, groups_per_step=16, learner_step_s=0.1),
    "256+32": dict(rollout_gpus=256, learner_gpus=32, min=32, step=32, groups_per_step=128, learner_step_s=0.1),
    # responses that lengthen with training (median 16 tokens x (1 + 0.1 per version), up to 1024, at a
    # slow 200 tokens/s): the fleet first outruns the learner (drains), then falls behind it as generation
    # slows (adds)
    "32+32-growth": dict(
        rollout_gpus=32,
        learner_gpus=32,
        min=4,
        step=4,
        groups_per_step=16,
        learner_step_s=0.1,
        extra=[
            "rollout.simulated.tokens_per_s=200",
            "rollout.simulated.length_median=16",
            "rollout.simulated.length_growth=0.1",
            "rollout.sampling.max_tokens=1024",
            "rollout.max_model_len=2048",
        ],
    ),
}

# Real vLLM CPU servers on the tiny recipe, the autoscaler at its default windows and thresholds.
REAL_CASES = {
    # two servers beside the learner on a 2-core machine: the cores, not the servers, set the fleet's rate
    "cpu-2-servers": dict(servers=2, min=1, max=2, steps=100),
    # synchronous (staleness 0): the learner waits for every step's generation, so the autoscaler adds a
    # server; whether it pays on these cores is what the add's trial measures
    "cpu-1-server-sync": dict(
        servers=1, min=1, max=2, steps=160, extra=["broker.max_staleness=0", "learner.loss.correction=none"]
    ),
}


def simulated_command(c: dict, steps: int, summary: Path, run_dir: Path) -> list[str]:
    over = [
        f"rollout.simulated.learner_step_s={c['learner_step_s']}",
        f"broker.groups_per_step={c['groups_per_step']}",
        "rollout.max_inflight_groups=1",
        "rollout.autoscale.enabled=true",
        f"rollout.autoscale.min={c['min']}",
        f"rollout.autoscale.max={c['rollout_gpus']}",
        f"rollout.autoscale.step={c['step']}",
        "rollout.autoscale.window_s=4",
        "rollout.autoscale.sustain_s=2",
        "rollout.autoscale.cooldown_s=6",
        *c.get("extra", []),
    ]
    return [
        sys.executable,
        "launch/cluster.py",
        "--simulate",
        "--rollout-gpus",
        str(c["rollout_gpus"]),
        "--learner-gpus",
        str(c["learner_gpus"]),
        "--max-steps",
        str(steps),
        "--summary",
        str(summary),
        "--run-dir",
        str(run_dir),
        "--no-live",
        *over,
    ]


def real_command(c: dict, steps: int, summary: Path, run_dir: Path) -> list[str]:
    return [
        sys.executable,
        "launch/cluster.py",
        "--rollout-gpus",
        "0",
        "--learner-gpus",
        "0",
        "--recipe",
        "tiny",
        "--max-steps",
        str(steps),
        "--summary",
        str(summary),
        "--run-dir",
        str(run_dir),
        "--no-live",
        f"rollout.servers={c['servers']}",
        "rollout.autoscale.enabled=true",
        f"rollout.autoscale.min={c['min']}",
        f"rollout.autoscale.max={c['max']}",
        *c.get("extra", []),
    ]


def rates(rows: list[dict], t0: float, t1: float) -> dict | None:
    """The learner's steps/s and the fleet's groups/s between autoscaler times t0 and t1 (trace rows)."""
    rows = [r for r in rows if t0 <= r["t"] <= t1]
    if len(rows) < 2 or rows[-1]["t"] - rows[0]["t"] < 5.0:
        return None
    a, b = rows[0], rows[-1]
    span = b["t"] - a["t"]
    return {
        "from_s": a["t"],
        "to_s": b["t"],
        "servers": sorted({r["servers"] for r in rows}),
        "learner_steps_per_s": round((b["learner_step"] - a["learner_step"]) / span, 3),
        "fleet_groups_per_s": round((b["groups_pushed"] - a["groups_pushed"]) / span, 3),
    }


def before_after(decisions: list[dict], rows: list[dict], window_s: float) -> list[dict]:
    """Each decision with the throughput of the window before it and of the settled fleet after it (from
    the first second at the new size with nothing starting, to the next decision or the end)."""
    out = []
    for i, d in enumerate(decisions):
        end = decisions[i + 1]["at"] if i + 1 < len(decisions) else float("inf")
        settled = next(
            (r["t"] for r in rows if r["t"] > d["at"] and r["servers"] == d["target"] and not r["starting"]), None
        )
        out.append(
            {
                **d,
                "before": rates(rows, d["at"] - window_s, d["at"]),
                "after": None if settled is None else rates(rows, settled, end),
            }
        )
    return out


def run_case(name: str, c: dict, steps: int, timeout_s: float, real: bool) -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix=f"fleetrl-autoscale-{name.replace('+', '_')}-"))
    summary = run_dir / "out.json"
    cmd = (real_command if real else simulated_command)(c, steps, summary, run_dir)
    t = time.monotonic()
    p = subprocess.run(
        cmd,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    wall = time.monotonic() - t
    if p.returncode != 0 or not summary.exists():
        raise RuntimeError(f"{name}: exit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    s = json.loads(summary.read_text())
    lag = s.get("engine_lag_at_end")
    decisions = s.get("autoscale", [])
    if real:
        trace = run_dir / SIGNALS_JSONL
        rows = [json.loads(line) for line in trace.read_text().splitlines()] if trace.exists() else []
        decisions = before_after(decisions, rows, AutoscaleConfig().window_s)  # the cases run at the defaults
    return {
        "command": " ".join(["python", *cmd[1:]]),
        "wall_s": round(wall, 1),
        "steps": s["steps"],
        "max_staleness": s["max_staleness"],
        "staleness_hist": s["staleness_hist"],
        "max_staleness_seen": s["max_staleness_seen"],
        "bound_violations": s["bound_violations"],
        "learner_idle_fraction": s["learner_idle_fraction"],
        "fleet_idle_fraction": s["fleet_idle_fraction"],
        "groups_produced": s["groups_produced"],
        "groups_consumed": s["groups_consumed"],
        "groups_lost": s["groups_lost"],
        "servers_at_end": s["servers_at_end"],
        "engine_lag_at_end": lag,
        "decisions": decisions,
        "simulated": s["simulated"],
        "error": s["error"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--real", action="store_true", help="real vLLM CPU servers and learner (REAL_CASES)")
    ap.add_argument("--cases", default=None, help="comma-separated case names (default: all of the kind)")
    ap.add_argument("--steps", type=int, default=None, help="default: 1500 simulated, the case's own real")
    ap.add_argument("--timeout-s", type=float, default=900)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cases = REAL_CASES if args.real else CASES
    note = (
        "real vLLM CPU servers and FSDP learner (tiny recipe), autoscaler defaults"
        if args.real
        else "SIMULATED engines and learner: control-plane behaviour only"
    )
    out = {**run_info(), "note": note, "machine": f"{os.cpu_count()} CPUs", "cases": {}}
    for name in (args.cases or ",".join(cases)).split(","):
        c = cases[name]
        steps = args.steps or c.get("steps", 1500)
        out["cases"][name] = run_case(name, c, steps, args.timeout_s, args.real)
        r = out["cases"][name]
        print(
            f"{name}: {r['steps']} steps in {r['wall_s']} s, {len(r['decisions'])} decisions, "
            f"servers at end {r['servers_at_end']}, lost {r['groups_lost']}, max staleness {r['max_staleness_seen']}"
        )
    if args.json:
        write_json(args.json, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
