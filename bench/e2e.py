"""End to end: colocated synchronous training against disaggregated sync and async, at equal accuracy.

One command runs every case on the same recipe, data, seed and sample budget (``--steps`` steps of
``broker.groups_per_step`` groups), one ``launch/cluster.py`` run at a time, and writes one JSON and
one PNG (eval accuracy against the learner's wall time, every case and seed)::

    python bench/e2e.py --out-dir /tmp/e2e --gpus 0 --steps 60 --seeds 0,1          # CPU (servers on CPU)
    python bench/e2e.py --out-dir $OUT/e2e --gpus 2 --recipe smollm2-gpu --steps 40  # G GPUs: (a) on G, the rest G/2+G/2
    python bench/e2e.py --out-dir /tmp/e2e --collect-only                            # recompute from the runs

Cases: ``colocated`` (a: ``--gpus G``, or ``--colocate`` on CPU), ``sync_k0`` (b: disaggregated,
``broker.max_staleness=0``), ``async_k1|2|4`` (c: disaggregated, ``broker.max_staleness=k``, the
``--correction`` chosen), ``shared_k1|2`` (shared async mode on colocated's devices: ``--gpus G --async``,
``broker.max_staleness=k``; bench/e2e_shared_gpu.sh, docs/shared_gpu.md). The target accuracy of a seed is what (a) reaches at the end of its budget
(its final evaluation); a case's time to target is the learner wall time (from the learner's start,
so server start-up is left out for every case alike; colocated runs' in-line evaluations are taken
off too) of its first evaluation at or above it. The
headline is time(a) / time(best async case) to that accuracy, per seed. ``headline_common_target`` is
the same ratio to the lowest final accuracy among the seed's cases (an accuracy every case reached), so a
case that ends a hair below (a) still gets a time. Evaluations during the run
are every ``--eval-every`` steps: in colocated mode at the wake after the step (they add to its wall
time), in the disaggregated cases beside training on the same fleet (they take fleet time).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CASES = ("colocated", "sync_k0", "async_k1", "async_k2", "async_k4")
SHARED_CASES = ("colocated", "shared_k1", "shared_k2")  # one set of devices: bench/e2e_shared_gpu.sh


def case_args(case: str, gpus: int, correction: str) -> list[str]:
    """The launch/cluster.py flags and overrides that make ``case`` (on ``gpus`` GPUs in all)."""
    if case == "colocated":
        return ["--gpus", str(gpus)] if gpus else ["--colocate"]
    if case.startswith("shared_k") and case[8:].isdigit() and int(case[8:]) >= 1:  # shared async, same devices
        return [
            *(["--gpus", str(gpus)] if gpus else ["--colocate"]),
            "--async",
            f"broker.max_staleness={int(case[8:])}",
            f"learner.loss.correction={correction}",
        ]
    if gpus % 2:
        raise ValueError(f"--gpus {gpus}: the disaggregated cases split the GPUs in two halves (give an even count)")
    pools = ["--rollout-gpus", str(gpus // 2), "--learner-gpus", str(gpus // 2)]
    if case == "sync_k0":
        return pools + ["broker.max_staleness=0"]
    if case.startswith("async_k") and case[7:].isdigit() and int(case[7:]) >= 1:
        return pools + [f"broker.max_staleness={int(case[7:])}", f"learner.loss.correction={correction}"]
    raise ValueError(
        f"unknown case {case!r}; expected one of {', '.join(CASES + SHARED_CASES)} (or async_kN, shared_kN, N >= 1)"
    )


def run_case(out: Path, case: str, seed: int, a: argparse.Namespace) -> dict:
    name = f"{case}_s{seed}"
    cmd = [
        sys.executable,
        "launch/cluster.py",
        "--recipe",
        a.recipe,
        "--max-steps",
        str(a.steps),
        "--no-live",
        "--run-dir",
        str(out / name),
        "--summary",
        str(out / f"{name}.json"),
        *case_args(case, a.gpus, a.correction),
        f"run.seed={seed}",
        f"run.eval_every={a.eval_every}",
        f"run.eval_samples={a.eval_samples}",
        *a.set,
    ]
    print(" ".join(cmd), flush=True)
    full = ["flock", a.lock, *cmd] if a.lock else cmd  # a shared machine: one heavy job at a time
    t0 = time.monotonic()
    with open(out / f"{name}.log", "w") as log:
        rc = subprocess.run(
            full,
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            check=False,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        ).returncode
    rec = {"case": case, "seed": seed, "rc": rc, "command": cmd[1:], "job_wall_s": round(time.monotonic() - t0, 1)}
    (out / f"{name}.cmd.json").write_text(json.dumps(rec))
    return rec


def read_steps(run_dir: Path) -> list[dict]:
    p = run_dir / "metrics" / "learner_steps.jsonl"
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()] if p.exists() else []


def _mean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def collect_run(summary: dict, steps: list[dict]) -> dict:
    """One run's figures from its summary and its learner's per-step log (see module docstring)."""
    if not steps:
        raise ValueError("the run has no learner step log (metrics/learner_steps.jsonl): did it train?")
    t0 = steps[0]["t0_unix"]
    # colocated mode evaluates in line (at the wake after a step): that time is measurement, not training,
    # so it comes off the time axis (the disaggregated cases evaluate beside training, which costs them
    # fleet time instead). Runs whose log lacks the figure keep their raw times (inline_eval_s None).
    inline = [r.get("colocate/wake_rest_eval_seconds", 0.0) for r in steps]
    has_inline = any("colocate/wake_rest_eval_seconds" in r for r in steps)
    t_of, off = {}, 0.0
    for r, e in zip(steps, inline, strict=True):
        t_of[r["step"]] = r["t_unix"] - t0 - off - e
        off += e
    wall = t_of[steps[-1]["step"]]
    curve = [{"step": 0, "t": 0.0, "accuracy": summary["eval_accuracy_before"]}]
    curve += [
        {"step": e["step"], "t": t_of[e["step"]], "accuracy": e["accuracy"]}
        for e in summary.get("eval_history", [])
        if e["step"] in t_of
    ]
    curve.append({"step": steps[-1]["step"], "t": wall, "accuracy": summary["eval_accuracy_after"]})
    samples = sum(r["samples"] for r in steps)
    tokens = sum(r["prompt_tokens"] + r["response_tokens"] for r in steps)
    busy = sum(r["total_step_seconds"] - r["pull_seconds"] for r in steps)
    colo = {
        k: _mean([r.get(f"colocate/{k}") for r in steps])
        for k in ("release_sleep_seconds", "wake_weights_seconds", "weight_load_seconds", "wake_rest_seconds")
    }
    return {
        "steps": len(steps),
        "learner_wall_s": round(wall, 2),
        "job_wall_s": summary.get("wall_s"),
        "inline_eval_s": round(sum(inline), 2) if has_inline else None,
        "learner_wall_raw_s": round(steps[-1]["t_unix"] - t0, 2),
        "curve": curve,
        "final_accuracy": summary["eval_accuracy_after"],
        "accuracy_before": summary["eval_accuracy_before"],
        "samples_per_s": samples / wall,
        "generated_tok_per_s": summary["tokens_generated"] / wall,
        "learner_tok_per_s": tokens / wall,
        "learner_tok_per_busy_s": tokens / busy if busy > 0 else None,
        "learner_idle_fraction": summary["learner_idle_fraction"],
        "fleet_idle_fraction": summary["fleet_idle_fraction"],
        "staleness_mean": sum(r["staleness_mean_versions"] * r["samples"] for r in steps) / samples,
        "staleness_max": max(r["staleness_max_versions"] for r in steps),
        "mismatch_kl_k3_per_step": [r.get("mismatch_kl_k3") for r in steps],
        "mismatch_kl_k3_mean": _mean([r.get("mismatch_kl_k3") for r in steps]),
        "colocated_seconds_per_step": colo if any(v is not None for v in colo.values()) else None,
        "steps_per_s": len(steps) / wall if wall > 0 else None,
        "mode": summary.get("mode"),
        "busy": summary.get("busy"),  # launch/busy.py: generation/training fractions
    }


def time_to(curve: list[dict], target: float | None) -> float | None:
    """Wall time of the first evaluation at or above ``target`` (None: never reached, or no target)."""
    if target is None:
        return None
    return next((p["t"] for p in curve if p["accuracy"] is not None and p["accuracy"] >= target), None)


def _times_to(seed_runs: dict[str, dict], target: float | None) -> tuple[dict, dict, str | None]:
    """Each case's time to ``target``, the async cases that reached it, and the fastest of those."""
    times = {case: time_to(r["curve"], target) for case, r in seed_runs.items()}
    asyncs = {c: t for c, t in times.items() if c.startswith(("async_k", "shared_k")) and t is not None}
    return times, asyncs, (min(asyncs, key=asyncs.get) if asyncs else None)


def _over_best(t: float | None, asyncs: dict, best: str | None) -> float | None:
    return t / asyncs[best] if best and t and asyncs[best] > 0 else None


def analyse(runs: dict[tuple[str, int], dict]) -> dict:
    """Targets, times to target, per-case spread over seeds and the headline ratio, from collected runs."""
    seeds = sorted({s for _, s in runs})
    per_seed = {}
    for seed in seeds:
        seed_runs = {case: r for (case, s), r in runs.items() if s == seed}
        colo = seed_runs.get("colocated")
        target = colo["final_accuracy"] if colo else None
        times, asyncs, best = _times_to(seed_runs, target)
        t_full = colo["learner_wall_s"] if colo else None
        # the common target: the lowest final accuracy of this seed's cases, the accuracy every case reached
        # by its end. With 100 evaluation prompts two finals 0.01 apart are equal within noise, and colocated's
        # own final as the target would leave a case that ended 0.01 lower without a time at all.
        finals = [r["final_accuracy"] for r in seed_runs.values() if r.get("final_accuracy") is not None]
        common = min(finals) if finals else None
        times_common, asyncs_common, best_common = _times_to(seed_runs, common)
        per_seed[str(seed)] = {
            "common_target_accuracy": common,
            "time_to_common_target_s": times_common,
            "headline_common_target": _over_best(times_common.get("colocated"), asyncs_common, best_common),
            "target_accuracy": target,
            "time_to_target_s": times,
            "best_async": best,
            # every case by the same rule: its first evaluation at or above the target
            "headline_colocated_over_best_async": _over_best(times.get("colocated"), asyncs, best),
            # (a) charged its whole budget (the target is by definition its final accuracy)
            "headline_full_budget": _over_best(t_full, asyncs, best),
            # steps per second of each case over colocated's, equal step counts (no accuracy involved)
            "per_step_speedup_over_colocated": {
                c: r["steps_per_s"] / colo["steps_per_s"]
                for c, r in seed_runs.items()
                if colo and r.get("steps_per_s") and colo.get("steps_per_s")
            },
        }
    cases = {}
    for case in dict.fromkeys(c for c, _ in runs):
        rs = [runs[(case, s)] for s in seeds if (case, s) in runs]
        agg = {}
        for key in (
            "final_accuracy",
            "samples_per_s",
            "generated_tok_per_s",
            "learner_tok_per_s",
            "learner_wall_s",
            "learner_idle_fraction",
            "fleet_idle_fraction",
            "staleness_mean",
            "staleness_max",
            "mismatch_kl_k3_mean",
            "steps_per_s",
        ):
            xs = [r.get(key) for r in rs if r.get(key) is not None]
            agg[key] = {"mean": _mean(xs), "min": min(xs) if xs else None, "max": max(xs) if xs else None}
        tt = [per_seed[str(s)]["time_to_target_s"].get(case) for s in seeds if (case, s) in runs]
        agg["time_to_target_s"] = {"per_seed": tt, "mean": _mean(tt) if all(t is not None for t in tt) else None}
        cases[case] = agg

    def summary(key: str) -> dict:
        hs = [v[key] for v in per_seed.values()]
        return {
            "per_seed": hs,
            "mean": _mean(hs) if hs and all(h is not None for h in hs) else None,
            "min": min(hs) if hs and all(h is not None for h in hs) else None,
            "max": max(hs) if hs and all(h is not None for h in hs) else None,
        }

    return {
        "per_seed": per_seed,
        "cases": cases,
        "headline": summary("headline_colocated_over_best_async"),
        "headline_full_budget": summary("headline_full_budget"),
        "headline_common_target": summary("headline_common_target"),
    }


def plot(runs: dict[tuple[str, int], dict], path: Path, title: str) -> None:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit(
            "matplotlib is not installed (pip install 'fleetrl[bench]', or the lock "
            "requirements/cpu.txt): the figure needs it"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = {c: f"C{i}" for i, c in enumerate(dict.fromkeys(c for c, _ in sorted(runs)))}
    for (case, seed), r in sorted(runs.items()):
        pts = [p for p in r["curve"] if p["accuracy"] is not None]
        style = dict(
            marker="o",
            ms=3,
            color=colors[case],
            linestyle="-" if seed == min(s for c, s in runs if c == case) else "--",
            label=f"{case} seed {seed}",
        )
        ax.plot([p["t"] for p in pts], [p["accuracy"] for p in pts], **style)
        by_step.plot([p["step"] for p in pts], [p["accuracy"] for p in pts], **style)
    ax.set_xlabel(
        "learner wall time (s, from the learner's start; colocated: in-line evaluations left out)", fontsize=8
    )
    by_step.set_xlabel("learner step")
    for a in (by_step, ax):
        a.set_ylabel("eval accuracy (greedy)")
        a.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/e2e.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--out-dir", required=True, type=Path, help="runs, logs and summaries go here")
    p.add_argument("--gpus", type=int, default=0, help="G: colocated on G GPUs, the other cases on G/2 + G/2 (0: CPU)")
    p.add_argument("--recipe", default="tiny")
    p.add_argument("--steps", type=int, default=60, help="the sample budget: optimizer steps of every case")
    p.add_argument("--seeds", default="0", help="comma-separated run.seed values")
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument(
        "--correction", choices=("decoupled", "tis"), default="decoupled", help="the async cases' correction"
    )
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--eval-samples", type=int, default=200)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="an override for every case")
    p.add_argument("--lock", default=None, metavar="PATH", help="run each case under `flock PATH` (shared machines)")
    p.add_argument("--collect-only", action="store_true", help="do not run; read the runs in --out-dir")
    p.add_argument("--skip-existing", action="store_true", help="run only the cases without a summary in --out-dir")
    p.add_argument("--json", type=Path, default=None, help="default: OUT_DIR/e2e.json")
    p.add_argument("--png", type=Path, default=None, help="default: OUT_DIR/e2e.png")
    a = p.parse_args(argv)
    cases = [c.strip() for c in a.cases.split(",") if c.strip()]
    seeds = [int(s) for s in a.seeds.split(",") if s.strip()]
    for c in cases:
        case_args(c, a.gpus, a.correction)  # a bad case name or GPU count fails before anything runs
    a.out_dir.mkdir(parents=True, exist_ok=True)
    started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    records = {}
    for seed in seeds:  # seed-major: a cut-short bench still has every case of the first seed
        for case in cases:
            done = (a.out_dir / f"{case}_s{seed}.json").exists()
            if not a.collect_only and not (a.skip_existing and done):
                records[(case, seed)] = run_case(a.out_dir, case, seed, a)
    runs, failed = {}, {}
    for seed in seeds:
        for case in cases:
            name = f"{case}_s{seed}"
            try:
                summary = json.loads((a.out_dir / f"{name}.json").read_text())
                if summary.get("error"):
                    raise ValueError(summary["error"])
                if summary["steps"] != a.steps:
                    raise ValueError(f"ran {summary['steps']} steps, the budget is {a.steps}")
                runs[(case, seed)] = collect_run(summary, read_steps(a.out_dir / name))
            except (OSError, ValueError, KeyError) as exc:
                failed[name] = f"{type(exc).__name__}: {exc}"
    result = {
        "bench": "e2e",
        "date_utc": started,
        "command": " ".join([sys.executable, "bench/e2e.py", *(argv or sys.argv[1:])]),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "gpus": a.gpus},
        "recipe": a.recipe,
        "steps": a.steps,
        "seeds": seeds,
        "correction": a.correction,
        "eval_every": a.eval_every,
        "eval_samples": a.eval_samples,
        "overrides": a.set,
        "runs": {f"{c}_s{s}": r for (c, s), r in runs.items()},
        "failed": failed,
        "job_records": {f"{c}_s{s}": r for (c, s), r in records.items()},
        **analyse(runs),
    }
    json_path = a.json or a.out_dir / "e2e.json"
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=2))
    if runs:
        plot(
            runs,
            a.png or a.out_dir / "e2e.png",
            f"fleetrl e2e, recipe {a.recipe}, {a.steps} steps, {'CPU' if not a.gpus else f'{a.gpus} GPUs'}",
        )
    h = result["headline"]
    print(
        json.dumps(
            {
                "headline_colocated_over_best_async": h,
                "headline_full_budget": result["headline_full_budget"],
                "headline_common_target": result["headline_common_target"],
                "failed": failed,
                "final_accuracy": {k: v["final_accuracy"]["mean"] for k, v in result["cases"].items()},
            }
        )
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
