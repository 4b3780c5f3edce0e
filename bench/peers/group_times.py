"""When each group of a step began and ended generating, from a run's spool (bench/peers/verl.sh).

A colocated step's generation phase is measured from its first group's start to its last group's end. That span is
the engine's decoding time only if every group starts at once; groups that start late (leased in waves, queued
behind the engine's batch, held at the colocated gate) add their delay to it. This reads the per-sample ``t_start``
and ``t_end`` the rollout worker stamps on every trajectory (``python -m broker export SPOOL --out FILE``) and
reports, per step:

* ``groups``, ``samples``: how many were generated for the step (the learner's batch and any left over);
* ``start_spread_s``: last group's start minus the first's (0 when all began together);
* ``span_s``: first start to last end (the step's generation phase as the learner logs it);
* ``group_s``: each group's own duration (its last sample's end minus its start), min / median / max;
* ``starts_s``: every group's start, as an offset from the step's first (sorted).

    python bench/peers/group_times.py SPOOL.parquet --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any


def group_times(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per step, from rows with ``step``, ``group_id``, ``t_start``, ``t_end`` (one row per sample)."""
    groups: dict[tuple[int, str], list[float]] = {}
    for r in rows:
        if r.get("step") is None or r.get("t_start") is None or r.get("t_end") is None:
            continue
        key = (int(r["step"]), str(r["group_id"]))
        start, end = float(r["t_start"]), float(r["t_end"])
        if key in groups:
            g = groups[key]
            g[0], g[1], g[2] = min(g[0], start), max(g[1], end), g[2] + 1
        else:
            groups[key] = [start, end, 1]
    by_step: dict[int, list[list[float]]] = defaultdict(list)
    for (step, _), g in groups.items():
        by_step[step].append(g)
    out = []
    for step in sorted(by_step):
        gs = by_step[step]
        first = min(g[0] for g in gs)
        durations = [g[1] - g[0] for g in gs]
        out.append(
            {
                "step": step,
                "groups": len(gs),
                "samples": int(sum(g[2] for g in gs)),
                "start_spread_s": max(g[0] for g in gs) - first,
                "span_s": max(g[1] for g in gs) - first,
                "group_s": {"min": min(durations), "median": statistics.median(durations), "max": max(durations)},
                "starts_s": sorted(round(g[0] - first, 4) for g in gs),
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("parquet", type=Path, help="a spool exported by `python -m broker export`")
    ap.add_argument("--json", type=Path, help="write the per-step rows here (default: stdout)")
    args = ap.parse_args(argv)
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(args.parquet, columns=["step", "group_id", "t_start", "t_end"])
    except (OSError, ValueError, KeyError) as e:  # no file, not Parquet, or a column missing
        print(f"group_times: cannot read {args.parquet}: {e}", file=sys.stderr)
        return 2
    text = json.dumps({"source": str(args.parquet), "steps": group_times(table.to_pylist())}, indent=1)
    if args.json:
        args.json.write_text(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
