"""The autoscaler in SIMULATED runs at full size: 32 + 32 and 256 servers (+ 32 learner GPUs).

Each case is one ``launch/cluster.py --simulate`` run (local Ray with fake GPUs, the real broker,
SIMULATED engines and learner) with ``rollout.autoscale`` on and short windows, so that decisions
happen within a couple of minutes. The fleet starts at its maximum, which outruns the simulated learner
about twice: the queue fills and slots idle (drains), until the learner starts waiting (adds); in the
``growth`` case responses lengthen with every version, so generation slows and the fleet must grow again. Written: every decision (time, action, servers before and after, reason, signals,
the scale call's seconds), the staleness the learner saw (lag, in versions), the broker's per-engine
lag at the end, and the run's totals (groups lost must be 0).

    python bench/autoscale.py --json bench/results/autoscale_simulated.json
    python bench/autoscale.py --cases 32+32-growth --steps 200 --json bench/results/autoscale_simulated_growth.json
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

CASES = {
    # one group in flight per server (rollout.max_inflight_groups=1), so the fleet's size sets its rate:
    # a server makes ~10 SIMULATED groups/s; the learner takes groups_per_step / learner_step_s, about
    # half of what the full fleet makes
    "32+32": dict(rollout_gpus=32, learner_gpus=32, min=4, step=4, groups_per_step=16, learner_step_s=0.1),
    "256+32": dict(rollout_gpus=256, learner_gpus=32, min=32, step=32, groups_per_step=128, learner_step_s=0.1),
    # responses that lengthen with training (median 16 tokens x (1 + 0.1 per version), up to 1024, at a
    # slow 200 tokens/s): the fleet first outruns the learner (drains), then falls behind it as generation
    # slows (adds)
    "32+32-growth": dict(rollout_gpus=32, learner_gpus=32, min=4, step=4, groups_per_step=16, learner_step_s=0.1,
                         extra=["rollout.simulated.tokens_per_s=200", "rollout.simulated.length_median=16", "rollout.simulated.length_growth=0.1",
                                "rollout.sampling.max_tokens=1024", "rollout.max_model_len=2048"]),
}


def run_case(name: str, c: dict, steps: int, timeout_s: float) -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix=f"fleetrl-autoscale-{name.replace('+', '_')}-"))
    summary = run_dir / "out.json"
    over = [f"rollout.simulated.learner_step_s={c['learner_step_s']}", f"broker.groups_per_step={c['groups_per_step']}",
            "rollout.max_inflight_groups=1",
            "rollout.autoscale.enabled=true", f"rollout.autoscale.min={c['min']}",
            f"rollout.autoscale.max={c['rollout_gpus']}", f"rollout.autoscale.step={c['step']}",
            "rollout.autoscale.window_s=4", "rollout.autoscale.sustain_s=2", "rollout.autoscale.cooldown_s=6",
            *c.get("extra", [])]
    cmd = [sys.executable, "launch/cluster.py", "--simulate", "--rollout-gpus", str(c["rollout_gpus"]),
           "--learner-gpus", str(c["learner_gpus"]), "--max-steps", str(steps), "--summary", str(summary),
           "--run-dir", str(run_dir), "--no-live", *over]
    t = time.monotonic()
    p = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
                       capture_output=True, text=True, timeout=timeout_s)
    wall = time.monotonic() - t
    if p.returncode != 0 or not summary.exists():
        raise RuntimeError(f"{name}: exit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    s = json.loads(summary.read_text())
    lag = s.get("engine_lag_at_end")
    return {"command": " ".join(["python", *cmd[1:]]), "wall_s": round(wall, 1), "steps": s["steps"],
            "max_staleness": s["max_staleness"], "staleness_hist": s["staleness_hist"],
            "max_staleness_seen": s["max_staleness_seen"], "bound_violations": s["bound_violations"],
            "learner_idle_fraction": s["learner_idle_fraction"], "fleet_idle_fraction": s["fleet_idle_fraction"],
            "groups_produced": s["groups_produced"], "groups_consumed": s["groups_consumed"],
            "groups_lost": s["groups_lost"], "servers_at_end": s["servers_at_end"], "engine_lag_at_end": lag,
            "decisions": s.get("autoscale", []), "simulated": s["simulated"], "error": s["error"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--timeout-s", type=float, default=900)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    out = {**run_info(), "note": "SIMULATED engines and learner: control-plane behaviour only", "cases": {}}
    for name in args.cases.split(","):
        out["cases"][name] = run_case(name, CASES[name], args.steps, args.timeout_s)
        r = out["cases"][name]
        print(f"{name}: {r['steps']} steps in {r['wall_s']} s, {len(r['decisions'])} decisions, "
              f"servers at end {r['servers_at_end']}, lost {r['groups_lost']}, max staleness {r['max_staleness_seen']}")
    if args.json:
        write_json(args.json, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
