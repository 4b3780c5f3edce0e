"""fleetrl against verl on the same work in one lease: per-step times of both, side by side (bench/peers/verl.sh).

Reads what the two runs leave behind: verl's console log (one ``step:N - key:value - ...`` line a step, verl's
``LocalLogger``) of every verl attempt (its settings, tried best first), and fleetrl's
``metrics/learner_steps.jsonl`` (one row a step; colocated mode). The first ``--skip`` steps of each are
warm-up (compiles, CUDA graphs, allocator growth) and left out. ``ratio`` = fleetrl's median step time / the
fastest verl attempt's median step time (below 1: fleetrl is faster); ``ratio_sync`` the same against verl's
fastest synchronous attempt. ``trained_share`` is the share of its sampled responses fleetrl trained on over the
measured steps: verl's GRPO trains every response, while fleetrl's learner drops groups whose rewards are all equal
(``learner.loss.drop_uniform_groups``, on by default), which with a random-weight model is every group, so a
fleetrl step then does almost no training. ``same_work`` is true when fleetrl trained every response
(bench/peers/verl.sh's ``FLEETRL_UNIFORM=train``, its default), false when it did not (``skip``: verl's gradient
without the uniform groups' compute; ``drop``), null for a log without the count.
An attempt in verl's ``colocate_async`` trainer mode generates the next batch while it
trains, so its ``timing_s/gen`` is the trainer's wait for a batch begun earlier, not a generation span:
``generation_ratio`` compares fleetrl's generation with synchronous verl attempts only.

    python bench/peers/compare.py --case smol --fleetrl RUN/fleetrl --verl RUN/verl --json out.json

Writes ``{"case", "device", "date_utc", "ratio", "ratio_sync", "generation_ratio", "trained_share", "same_work",
"fleetrl": {...}, "verl":
{"best", "best_sync", "attempts": [{"name", "schedule": "sync" | "async", ...}]}}``.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

# key:value pairs of a verl console line; numpy scalars print as np.float64(1.5)
_PAIR = re.compile(r"([A-Za-z_][\w/@.\-]*):(?:np\.\w+\()?(-?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)")
VERL_PHASES = {
    "step_s": "timing_s/step",
    "generation_s": "timing_s/gen",
    "old_log_prob_s": "timing_s/old_log_prob",
    "update_actor_s": "timing_s/update_actor",
    "weight_update_s": "timing_s/update_weights",
    "reward_s": "timing_s/reward",
    "actor_mfu": "perf/mfu/actor",
}


def parse_verl_log(text: str) -> list[dict[str, float]]:
    """One dict per verl step line (``step`` and every numeric metric), in order."""
    rows = []
    for line in text.splitlines():
        i = line.find("step:")
        if i < 0 or "timing_s/step" not in line:
            continue
        row = {k: float(v) for k, v in _PAIR.findall(line[i:])}
        if "step" in row:
            rows.append(row)
    return rows


def verl_steps(rows: list[dict[str, float]]) -> list[dict[str, float]]:
    """verl's metrics under this module's phase names (missing ones left out)."""
    out = []
    for r in rows:
        d = {"step": int(r["step"])}
        d.update({ours: r[theirs] for ours, theirs in VERL_PHASES.items() if theirs in r})
        # verl >= 0.6 names the weight push differently in some trainers: take whichever is there
        if "weight_update_s" not in d:
            for k in ("timing_s/update_weight", "timing_s/sync_weights"):
                if k in r:
                    d["weight_update_s"] = r[k]
        out.append(d)
    return out


def fleetrl_steps(jsonl: Path) -> list[dict[str, float]]:
    """Per step of a colocated fleetrl run: wall time between step records, generation (the wait for the
    batch), training window, weight load into the engines."""
    rows = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
    out = []
    prev = rows[0]["t0_unix"] if rows and "t0_unix" in rows[0] else None
    for r in rows:
        d = {"step": int(r["step"])}
        if prev is not None:
            d["step_s"] = r["t_unix"] - prev
        prev = r["t_unix"]
        if "pull_seconds" in r:
            d["generation_s"] = r["pull_seconds"]
        if "train_end_unix" in r and "train_start_unix" in r:
            d["train_s"] = r["train_end_unix"] - r["train_start_unix"]
        if "colocate/weight_load_seconds" in r:
            d["weight_update_s"] = r["colocate/weight_load_seconds"]
        for src, dst in (("samples", "samples"), ("batch_samples_trained", "samples_trained")):
            if src in r:
                d[dst] = r[src]
        out.append(d)
    return out


def summarize(steps: list[dict[str, float]], skip: int) -> dict:
    """Median, min and max of each phase over the steps after the first ``skip``."""
    kept = steps[skip:]
    out: dict = {"steps_total": len(steps), "steps_measured": len(kept), "per_step": steps}
    keys = sorted({k for s in kept for k in s if k != "step"})
    for k in keys:
        xs = [s[k] for s in kept if k in s]
        out[k] = {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}
    return out


def trained_share(steps: list[dict[str, float]]) -> float | None:
    """Responses trained / responses sampled over ``steps``; None when a step lacks either count."""
    if not steps or any("samples" not in s or "samples_trained" not in s for s in steps):
        return None
    sampled = sum(s["samples"] for s in steps)
    return sum(s["samples_trained"] for s in steps) / sampled if sampled else None


def _median(summary: dict | None, key: str) -> float | None:
    v = (summary or {}).get(key)
    return v["median"] if isinstance(v, dict) else None


def build(case: str, fleetrl_dir: Path, verl_dir: Path, skip: int = 1) -> dict:
    """The comparison record of one case from the two runs' folders (either may be missing: then null)."""
    result: dict = {
        "case": case,
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "skip_warmup_steps": skip,
        "ratio": None,
        "ratio_sync": None,
        "generation_ratio": None,
        "trained_share": None,
        "same_work": None,
    }
    meta = fleetrl_dir / "case.json"
    if meta.exists():
        result.update(json.loads(meta.read_text()))
    fl = None
    jsonl = fleetrl_dir / "learner_steps.jsonl"
    if jsonl.exists():
        steps = fleetrl_steps(jsonl)
        fl = summarize(steps, skip)
        share = trained_share(steps[skip:])
        result["trained_share"] = share
        result["same_work"] = None if share is None else share == 1.0
        rc = fleetrl_dir / "rc"
        fl["rc"] = int(rc.read_text()) if rc.exists() else None
    result["fleetrl"] = fl if fl is not None else {"error": f"no {jsonl} (fleetrl not run or did not train)"}
    attempts = []
    for adir in sorted(p for p in verl_dir.glob("attempt_*") if p.is_dir()):
        a: dict = {"name": adir.name.removeprefix("attempt_")}
        for name in ("overrides.txt", "rc", "error.txt"):
            f = adir / name
            if f.exists():
                a[name.split(".")[0]] = f.read_text().strip()
        log = adir / "verl.log"
        steps = verl_steps(parse_verl_log(log.read_text(errors="replace"))) if log.exists() else []
        a["schedule"] = "async" if "colocate_async" in a.get("overrides", "") else "sync"
        a["summary"] = summarize(steps, skip) if steps else None
        attempts.append(a)

    def fastest(schedules: tuple[str, ...]) -> dict | None:
        ok = [a for a in attempts if a["schedule"] in schedules and _median(a["summary"], "step_s") is not None]
        return min(ok, key=lambda a: _median(a["summary"], "step_s")) if ok else None

    best, best_sync = fastest(("sync", "async")), fastest(("sync",))
    result["verl"] = {
        "attempts": attempts,
        "best": best["name"] if best else None,
        "best_sync": best_sync["name"] if best_sync else None,
    }
    fl_step, fl_gen = _median(fl, "step_s"), _median(fl, "generation_s")
    if best is not None and fl_step:
        result["ratio"] = fl_step / _median(best["summary"], "step_s")
    if best_sync is not None and fl_step:
        result["ratio_sync"] = fl_step / _median(best_sync["summary"], "step_s")
        if fl_gen and _median(best_sync["summary"], "generation_s"):
            result["generation_ratio"] = fl_gen / _median(best_sync["summary"], "generation_s")
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--case", required=True)
    ap.add_argument("--fleetrl", required=True, type=Path, help="the fleetrl run's folder (learner_steps.jsonl)")
    ap.add_argument("--verl", required=True, type=Path, help="the verl runs' folder (attempt_*/verl.log)")
    ap.add_argument("--skip", type=int, default=1, help="warm-up steps left out of each")
    ap.add_argument("--json", required=True, type=Path)
    a = ap.parse_args(argv)
    r = build(a.case, a.fleetrl, a.verl, a.skip)
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(r, indent=1))
    print(
        json.dumps(
            {k: r.get(k) for k in ("case", "ratio", "ratio_sync", "generation_ratio", "trained_share", "same_work")}
            | {"verl_best": r["verl"]["best"]}
        )
    )
    return 0 if r["ratio"] is not None else 1


if __name__ == "__main__":
    sys.exit(main())
