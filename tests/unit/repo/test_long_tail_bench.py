"""bench/long_tail_data.py draws seeded lognormal budgets (stratified per step when asked) and its stand-in
reward spreads; bench/long_tail_collect.py turns a run's step logs into the per-step figures, also for a
run cut short (no summary)."""

from __future__ import annotations

import json
import math
from statistics import NormalDist

import numpy as np
import pytest

from bench.long_tail_collect import collect
from bench.long_tail_data import budgets, distribution_quantiles, spread_reward


def test_every_block_is_a_stratified_sample_of_the_distribution():
    g, median, sigma = 16, 1e6, 1.5  # a large median: rounding to whole tokens moves no draw across a stratum
    b = budgets(8 * g, median=median, sigma=sigma, lo=1, cap=10**12, seed=3, block=g)
    u = np.array([NormalDist().cdf(math.log(x / median) / sigma) for x in b])
    for i in range(0, len(b), g):
        assert sorted(np.floor(u[i : i + g] * g).astype(int).tolist()) == list(range(g))
    assert np.array_equal(b, budgets(8 * g, median=median, sigma=sigma, lo=1, cap=10**12, seed=3, block=g))
    assert not np.array_equal(b, budgets(8 * g, median=median, sigma=sigma, lo=1, cap=10**12, seed=4, block=g))


def test_budgets_are_clipped_whole_tokens_and_bad_parameters_refused():
    b = budgets(1000, median=1024, sigma=1.5, lo=16, cap=16384, seed=0)
    assert b.dtype == np.int64 and b.min() >= 16 and b.max() == 16384 and 700 < np.median(b) < 1400
    q = distribution_quantiles(1024, 1.5, 16, 16384)
    assert q["q0.5"] == 1024 and q["q0"] == 16 and q["q1"] == 16384
    assert list(q.values()) == sorted(q.values())
    with pytest.raises(ValueError, match="not a multiple of --block"):
        budgets(20, median=10, sigma=1, lo=1, cap=100, seed=0, block=16)
    with pytest.raises(ValueError, match="bad budget distribution"):
        budgets(16, median=10, sigma=1, lo=200, cap=100, seed=0)


def test_spread_reward_is_in_unit_range_and_differs_between_responses():
    scores = [spread_reward(f"response {i}", "") for i in range(200)]
    assert all(0.0 <= s <= 1.0 for s in scores) and len(set(scores)) > 150
    assert spread_reward("abc", "x") == spread_reward("abc", "y")  # the text alone decides


def _write_run(tmp_path, with_summary: bool):
    run = tmp_path / "colocated_s0"
    (run / "run" / "metrics").mkdir(parents=True)
    steps = [
        {"step": 1, "t0_unix": 100.0, "t_unix": 160.0, "gen_start_min_unix": 120.0, "gen_end_max_unix": 150.0,
         "compute_seconds": 5.0, "response_tokens": 3000, "prompt_tokens": 200, "samples": 8,
         "gpu_max_reserved_gib": 12.5},
        {"step": 2, "t0_unix": 100.0, "t_unix": 200.0, "gen_start_min_unix": 162.0, "gen_end_max_unix": 194.0,
         "compute_seconds": 4.0, "response_tokens": 4000, "prompt_tokens": 200, "samples": 8,
         "colocate/wake_seconds": 0.5},
    ]  # fmt: skip
    (run / "run" / "metrics" / "learner_steps.jsonl").write_text("\n".join(json.dumps(s) for s in steps) + "\n")
    m = {"rollout/response_length_min_tokens": 16.0, "rollout/response_length_p50_tokens": 300.0,
         "rollout/response_length_p90_tokens": 1500.0, "rollout/response_length_max_tokens": 1600.0,
         "rollout/response_length_mean_tokens": 500.0, "rollout/truncated_fraction": 1.0}  # fmt: skip
    (run / "run" / "metrics" / "learner.jsonl").write_text(
        "\n".join(json.dumps({"step": k, "metrics": m}) for k in (1, 2)) + "\n"
    )
    (tmp_path / "colocated_s0.smi.csv").write_text(
        "2026/12/06 10:00:00.000, 1000, 5\n2026/12/06 10:00:01.000, 30000, 95\n"
    )
    if with_summary:
        summary = {"mode": "colocated-sync", "learner_idle_fraction": 0.8, "steps": 2, "samples_truncated": 16}
        (tmp_path / "colocated_s0.summary.json").write_text(json.dumps(summary))
    return run


def test_collect_computes_the_per_step_figures(tmp_path):
    res = collect(_write_run(tmp_path, with_summary=True))
    s1, s2 = res["steps"]
    assert (s1["wall_s"], s1["generation_s"], s1["training_s"]) == (60.0, 30.0, 5.0)
    assert (s2["wall_s"], s2["generation_s"]) == (40.0, 32.0)
    assert s2["trained_tokens_per_s"] == 1050.0 and s2["generated_tokens_per_s"] == 125.0
    assert s2["response_length"]["p90"] == 1500.0 and s2["truncated_samples"] == 8
    assert s2["colocated"] == {"colocate/wake_seconds": 0.5} and s1["learner_peak_reserved_gib"] == 12.5
    assert res["after_step_1"] == {
        "steps": 1,
        "mean_wall_s": 40.0,
        "trained_tokens_per_s": 1050.0,
        "generated_tokens_per_s": 125.0,
        "generation_share_of_wall": 0.8,
    }
    assert res["learner_idle_fraction"] == 0.8 and res["gpu_memory_used_peak_mib"] == 30000
    assert res["gpu_util_mean_pct"] == 50.0 and res["summary_missing"] is False


def test_collect_keeps_the_steps_of_a_run_cut_short(tmp_path):
    res = collect(_write_run(tmp_path, with_summary=False))
    assert res["summary_missing"] is True and [r["step"] for r in res["steps"]] == [1, 2]
    assert res["steps_done"] == 2 and res["learner_idle_fraction"] is None
