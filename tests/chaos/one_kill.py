"""One launch of the chaos soak's run with a single ``kill -9``, and what became of it (not a test).

How the baselines in docs/chaos.md were taken: what the system did, before its recovery existed, when
that process died. The launch is the soak's (tests/chaos/test_chaos_soak.py ``_launch``: the tiny
recipe, or judge-tiny with one CPU reward server for ``reward``); it is ended (SIGINT) after
``--limit`` seconds if it has not ended by itself. Prints, and writes to ``OUT/result.json``, the exit
status, the kill, and the learner's steps with their wall times::

    PYTHONPATH=. python tests/chaos/one_kill.py fleet --out /tmp/one-kill-fleet --limit 300
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["server", "broker", "fleet", "reward", "rank", "driver"])
    ap.add_argument("--out", type=Path, required=True, help="a new folder: the run directory goes in it")
    ap.add_argument("--limit", type=float, default=300.0, help="seconds before the launch is interrupted")
    ap.add_argument("--at-step", type=int, default=3, help="the kill lands once the learner reached this step")
    args = ap.parse_args()
    sys.path.insert(0, str(REPO / "tests" / "support"))
    spec = importlib.util.spec_from_file_location("chaos_soak", REPO / "tests" / "chaos" / "test_chaos_soak.py")
    soak = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(soak)
    soak.LAUNCH_LIMIT_S = args.limit
    args.out.mkdir(parents=True, exist_ok=False)
    run_dir = args.out / "run"
    plan = [{"what": args.what, "at_step": args.at_step, "delay_s": 0.5}]
    r = soak._launch(run_dir, plan, plan, 1)
    steps = [[x["step"], round(x["wall_time"], 1)] for x in soak._records(run_dir) if "metrics" in x]
    res = {"what": args.what, "rc": r["rc"], "seconds": r["seconds"], "kills": r["kills"], "steps": steps}
    print(json.dumps(res, indent=1))
    (args.out / "result.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
