"""Per-process GPU busy time from ``nvidia-smi pmon`` samples: the device's own view of who computed.

``nvidia-smi pmon -s um -d 1 -f FILE`` writes one line per process per second with its share of the
sampling period in which a kernel of that process ran on the SMs (``sm`` %). Two processes on one GPU
time-slice, so their ``sm`` shares add up to at most about 100 between them. This reads such a file
and gives, per process name (the engine core ``VLLM::EngineCor``, the learner ``ray::LearnerAct``),
the mean ``sm`` share and the fraction of samples in which it was above zero::

    python bench/pmon.py FILE [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def parse(text: str) -> list[dict]:
    """Rows of a pmon file as dicts keyed by its header's column names ('-' read as None)."""
    cols: list[str] | None = None
    rows = []
    for line in text.splitlines():
        if line.startswith("#"):
            names = line.lstrip("#").split()
            if names and names[0].lower() in ("gpu", "date", "time") and "pid" in names:
                cols = [n.lower() for n in names]
            continue
        parts = line.split()
        if cols is None or len(parts) < len(cols):
            continue
        row = dict(zip(cols[:-1], parts[: len(cols) - 1], strict=True))
        row[cols[-1]] = " ".join(parts[len(cols) - 1 :])  # the command may hold spaces
        if row.get("pid") in ("-", None):
            continue  # an idle GPU's line
        rows.append({k: (None if v == "-" else v) for k, v in row.items()})
    return rows


def busy_by_process(rows: list[dict]) -> dict[str, dict]:
    """Per command name: samples, mean sm %, fraction of samples with sm > 0, pids seen."""
    out: dict[str, dict] = {}
    for r in rows:
        name = r.get("command") or "?"
        d = out.setdefault(name, {"samples": 0, "sm_sum": 0.0, "sm_active": 0, "pids": set()})
        sm = float(r["sm"]) if r.get("sm") not in (None, "") else 0.0
        d["samples"] += 1
        d["sm_sum"] += sm
        d["sm_active"] += sm > 0
        d["pids"].add(r.get("pid"))
    return {
        k: {
            "samples": d["samples"],
            "sm_mean_pct": round(d["sm_sum"] / d["samples"], 2),
            "sm_active_fraction": round(d["sm_active"] / d["samples"], 4),
            "pids": sorted(d["pids"]),
        }
        for k, d in sorted(out.items())
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/pmon.py", description=__doc__.split("\n\n")[0])
    p.add_argument("file", type=Path)
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    res = busy_by_process(parse(a.file.read_text(errors="replace")))
    text = json.dumps(res, indent=2)
    if a.json:
        a.json.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
