"""Collects one run of bench/long_tail_gpu.sh into one JSON: per step wall, generation and training
seconds, tokens/s trained and generated, the response length distribution, truncated samples and the
learner's peak memory; the run's learner idle and busy fractions, peak GPU memory (nvidia-smi samples) and
the budgets' quantiles. Reads whatever the run got to (a run stopped by its time limit keeps its steps).

    python bench/long_tail_collect.py /tmp/long_tail/colocated_s0 $OUT/long_tail/long_tail_colocated.json

RUN is the run's prefix: RUN/run/metrics/{learner_steps,learner}.jsonl and RUN.{summary.json,budgets.json,
smi.csv,rc.json,command.txt,commit.txt,nvidia_smi.csv} (the names bench/long_tail_gpu.sh writes).

Per step: ``wall_s`` is the time since the previous step's end (step 1: since the learner started, so it
holds the start); ``generation_s`` the window from the first to the last generation of the step's groups;
``training_s`` the learner's compute seconds (host clock); trained tokens/s counts prompt and response tokens.
``after_step_1`` aggregates the steps after the first (which carries compilation and first-touch costs);
its ``generation_share_of_wall`` is the share of a step spent generating in colocated (synchronous) mode,
where generation and training alternate; in the async modes generation windows overlap earlier steps and
it can exceed 1. In async modes a step trains the groups that finished first within the staleness bound,
so short responses land in earlier steps: the per-step length figures are measured, not the data's blocks.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np


def _load(p: Path, default: Any = None) -> Any:
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return default


def _jsonl(p: Path) -> list[dict]:
    try:
        return [json.loads(x) for x in p.read_text().splitlines() if x.strip()]
    except (OSError, ValueError):
        return []


def _text(p: Path) -> str | None:
    return p.read_text().strip() if p.exists() else None


def step_rows(steps: list[dict], metrics: dict[int, dict]) -> list[dict]:
    rows, prev = [], None
    for s in steps:
        m = metrics.get(s["step"], {})
        gen = s["gen_end_max_unix"] - s["gen_start_min_unix"] if "gen_start_min_unix" in s else None
        train = s.get("compute_seconds")
        resp, prompt, n = s.get("response_tokens"), s.get("prompt_tokens"), s.get("samples")
        tf = m.get("rollout/truncated_fraction")
        rows.append(
            {
                "step": s["step"],
                "wall_s": round(s["t_unix"] - (prev if prev is not None else s["t0_unix"]), 2),
                "learner_step_s": s.get("total_step_seconds"),
                "generation_s": round(gen, 2) if gen is not None else None,
                "training_s": train,
                "training_gpu_s": s.get("gpu_compute_seconds"),
                "wait_for_data_s": s.get("pull_seconds"),
                "publish_s": s.get("publish_seconds"),
                "samples": n,
                "response_tokens": resp,
                "prompt_tokens": prompt,
                "trained_tokens_per_s": round((resp + prompt) / train, 1)
                if train and resp is not None and prompt is not None
                else None,
                "generated_tokens_per_s": round(resp / gen, 1) if gen and resp is not None else None,
                "response_length": {
                    k: m.get(f"rollout/response_length_{k}_tokens") for k in ("min", "p50", "p90", "max", "mean")
                },
                "truncated_samples": round(tf * n) if tf is not None and n is not None else None,
                "learner_peak_reserved_gib": s.get("gpu_max_reserved_gib"),
                # learner vs engine log-probs of the step's tokens (the first step's is the run's probe)
                "mismatch_logp_diff": s.get("mismatch_logp_diff"),
                "mismatch_kl_k3": s.get("mismatch_kl_k3"),
                "colocated": {k: v for k, v in s.items() if k.startswith("colocate/")} or None,
            }
        )
        prev = s["t_unix"]
    return rows


def smi_samples(path: Path) -> list[tuple[int, int | None]]:
    """(memory used MiB, utilisation %) per line of ``nvidia-smi --query-gpu=timestamp,memory.used,
    utilization.gpu --format=csv,noheader,nounits``."""
    out = []
    if path.exists():
        for line in path.read_text(errors="replace").splitlines():
            parts = [x.strip() for x in line.split(",")]
            if len(parts) >= 3 and parts[1].isdigit():
                out.append((int(parts[1]), int(parts[2]) if parts[2].isdigit() else None))
    return out


def after_first(rows: list[dict]) -> dict[str, Any]:
    later = rows[1:]
    if not later:
        return {"steps": 0}

    def tot(k: str) -> float:
        return float(sum(r[k] for r in later if r[k] is not None))

    trained = sum((r["response_tokens"] or 0) + (r["prompt_tokens"] or 0) for r in later)
    return {
        "steps": len(later),
        "mean_wall_s": round(float(np.mean([r["wall_s"] for r in later])), 2),
        "trained_tokens_per_s": round(trained / tot("training_s"), 1) if tot("training_s") else None,
        "generated_tokens_per_s": round(tot("response_tokens") / tot("generation_s"), 1)
        if tot("generation_s")
        else None,
        "generation_share_of_wall": round(tot("generation_s") / tot("wall_s"), 3) if tot("wall_s") else None,
    }


def collect(run: Path) -> dict[str, Any]:
    def side(suffix: str) -> Path:
        return Path(f"{run}.{suffix}")

    summary = _load(side("summary.json"), {}) or {}
    steps = _jsonl(run / "run" / "metrics" / "learner_steps.jsonl")
    metrics = {r["step"]: r.get("metrics", {}) for r in _jsonl(run / "run" / "metrics" / "learner.jsonl")}
    rows = step_rows(steps, metrics)
    smi = smi_samples(side("smi.csv"))
    util = [g for _, g in smi if g is not None]
    return {
        "mode": summary.get("mode"),
        "commit": _text(side("commit.txt")),
        "gpu": _text(side("nvidia_smi.csv")),
        "command": _text(side("command.txt")),
        **(_load(side("rc.json"), {}) or {}),
        "budgets": _load(side("budgets.json")),
        "steps": rows,
        "after_step_1": after_first(rows),
        "learner_idle_fraction": summary.get("learner_idle_fraction"),
        "fleet_idle_fraction": summary.get("fleet_idle_fraction"),
        "busy": summary.get("busy"),
        "samples_truncated": summary.get("samples_truncated"),
        "tokens_generated": summary.get("tokens_generated"),
        "steps_done": summary.get("steps", len(rows)),
        "groups_lost": summary.get("groups_lost"),
        "server_stalls": summary.get("server_stalls"),
        "servers_kept_generating": summary.get("servers_kept_generating"),  # silent, decoding long responses
        "learner_settings": summary.get("learner_settings"),
        "gpu_memory_used_peak_mib": max((u for u, _ in smi), default=None),
        "gpu_util_mean_pct": round(float(np.mean(util)), 1) if util else None,
        "error": summary.get("error"),
        "summary_missing": not summary,
    }


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__)
        return 2
    res = collect(Path(argv[0]))
    Path(argv[1]).write_text(json.dumps(res, indent=1))
    print("steps", len(res["steps"]), "rc", res.get("rc"), "mode", res["mode"], "error", res["error"])
    for r in res["steps"]:
        print(
            f"  step {r['step']}: wall {r['wall_s']} s, gen {r['generation_s']} s, train {r['training_s']} s, "
            f"lengths {r['response_length']}, trained tok/s {r['trained_tokens_per_s']}, "
            f"generated tok/s {r['generated_tokens_per_s']}, truncated {r['truncated_samples']}, "
            f"learner peak {r['learner_peak_reserved_gib']} GiB"
        )
    print(
        "after step 1:",
        res["after_step_1"],
        "| learner idle",
        res["learner_idle_fraction"],
        "| busy",
        res["busy"],
        "| GPU peak MiB",
        res["gpu_memory_used_peak_mib"],
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
