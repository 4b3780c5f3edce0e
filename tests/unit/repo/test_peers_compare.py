"""bench/peers/compare.py reads verl's console lines and fleetrl's step log, leaves the warm-up out, and takes
the ratio against verl's fastest attempt that ran (a failed attempt is kept with its error, never chosen); verl's
colocate_async attempts count for ``ratio`` but not for ``ratio_sync`` or the generation ratio."""

from __future__ import annotations

import json
import statistics

from bench.peers.compare import build, parse_verl_log


def _verl_line(step: int, total: float, gen: float) -> str:
    # verl's LocalLogger: "step:N - key:value - ...", numpy scalars as np.float64(...)
    return (
        f"(TaskRunner pid=1) step:{step} - actor/pg_loss:np.float64(-0.0123) - timing_s/gen:{gen} - "
        f"timing_s/old_log_prob:np.float64(3.5) - timing_s/update_actor:10.25 - timing_s/step:{total} - "
        f"perf/mfu/actor:0.05 - response_length/mean:511.2"
    )


def test_verl_lines_parse():
    rows = parse_verl_log("noise\n" + _verl_line(3, 20.5, 4.25) + "\nstep:4 without timing\n")
    assert len(rows) == 1
    r = rows[0]
    assert (r["step"], r["timing_s/step"], r["timing_s/gen"], r["timing_s/old_log_prob"]) == (3, 20.5, 4.25, 3.5)
    assert r["actor/pg_loss"] == -0.0123 and r["perf/mfu/actor"] == 0.05


def test_ratio_against_the_fastest_verl_attempt_that_ran(tmp_path):
    fl, vd = tmp_path / "fleetrl", tmp_path / "verl"
    fl.mkdir()
    (fl / "case.json").write_text(json.dumps({"case": "smol", "device": "NVIDIA H100 80GB HBM3"}))
    t0, rows, t = 1000.0, [], 1000.0
    for step, dt in enumerate([60.0, 4.0, 5.0, 4.5, 6.0], start=1):  # the first step carries the start-up
        t += dt
        rows.append(
            {
                "step": step,
                "t_unix": t,
                "t0_unix": t0,
                "pull_seconds": dt - 1.0,
                "train_start_unix": t - 0.8,
                "train_end_unix": t - 0.2,
                "colocate/weight_load_seconds": 0.08,
            }
        )
    (fl / "learner_steps.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (fl / "rc").write_text("0")
    for name, totals, rc in (
        ("best", None, "1"),
        ("nofused", [90.0, 20.0, 22.0, 21.0], "0"),
        ("as_written", [95.0, 24.0, 25.0], "0"),
    ):
        a = vd / f"attempt_{name}"
        a.mkdir(parents=True)
        (a / "rc").write_text(rc)
        (a / "overrides.txt").write_text(f"{name} keys")
        if totals is None:
            (a / "verl.log").write_text("Traceback (most recent call last):\nImportError: flash_attn\n")
            (a / "error.txt").write_text("ImportError: flash_attn")
        else:
            (a / "verl.log").write_text("\n".join(_verl_line(i + 1, x, 4.0 + i) for i, x in enumerate(totals)))
    r = build("smol", fl, vd, skip=1)
    assert r["device"] == "NVIDIA H100 80GB HBM3" and r["verl"]["best"] == "nofused"
    failed = {a["name"]: a for a in r["verl"]["attempts"]}["best"]
    assert failed["summary"] is None and "flash_attn" in failed["error"] and failed["rc"] == "1"
    fleet_median = statistics.median([5.0, 4.5, 6.0, 4.0])  # steps 2-5
    assert abs(r["fleetrl"]["step_s"]["median"] - fleet_median) < 1e-9
    assert abs(r["ratio"] - fleet_median / statistics.median([20.0, 22.0, 21.0])) < 1e-9
    gen = statistics.median([3.0, 4.0, 3.5, 5.0]) / statistics.median([5.0, 6.0, 7.0])
    assert abs(r["generation_ratio"] - gen) < 1e-9
    assert r["fleetrl"]["weight_update_s"]["median"] == 0.08


def test_missing_runs_give_no_ratio(tmp_path):
    r = build("q15-1k", tmp_path / "nofleet", tmp_path / "noverl")
    assert r["ratio"] is None and r["verl"]["best"] is None and "error" in r["fleetrl"]


def test_an_async_verl_attempt_is_not_a_generation_baseline(tmp_path):
    fl, vd = tmp_path / "fleetrl", tmp_path / "verl"
    fl.mkdir()
    rows = [
        {"step": i, "t_unix": 1000.0 + 5.0 * i, "t0_unix": 1000.0, "pull_seconds": 4.0} for i in range(1, 5)
    ]  # 5 s steps, 4 s of generation
    (fl / "learner_steps.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    for name, overrides, total, gen in (
        ("best", "actor_rollout_ref.actor.use_torch_compile=True", 20.0, 5.0),
        ("colocate_async", "trainer.use_v1=True trainer.v1.trainer_mode=colocate_async", 8.0, 0.5),
    ):
        a = vd / f"attempt_{name}"
        a.mkdir(parents=True)
        (a / "overrides.txt").write_text(overrides)
        (a / "verl.log").write_text("\n".join(_verl_line(i, total, gen) for i in range(1, 5)))
    r = build("smol", fl, vd, skip=1)
    kinds = {a["name"]: a["schedule"] for a in r["verl"]["attempts"]}
    assert kinds == {"best": "sync", "colocate_async": "async"}
    assert (r["verl"]["best"], r["verl"]["best_sync"]) == ("colocate_async", "best")
    assert abs(r["ratio"] - 5.0 / 8.0) < 1e-9 and abs(r["ratio_sync"] - 5.0 / 20.0) < 1e-9
    assert abs(r["generation_ratio"] - 4.0 / 5.0) < 1e-9  # against the synchronous attempt's 5 s, not 0.5 s


def _fleet_rows(trained: list[float], sampled: float = 128.0) -> list[dict]:
    return [
        {
            "step": i,
            "t_unix": 1000.0 + 6.0 * i,
            "t0_unix": 1000.0,
            "pull_seconds": 5.0,
            "samples": sampled,
            "batch_samples_trained": k,
        }
        for i, k in enumerate(trained, start=1)
    ]


def test_trained_share_says_whether_fleetrl_did_verls_work(tmp_path):
    """A random-weight model's rewards are all equal in almost every group; fleetrl's default drops those groups,
    so its step trains a few samples where verl trains all. The record must say so (measured steps only)."""
    vd = tmp_path / "verl"
    for name, trained, share in (("dropped", [8.0, 0.0, 8.0, 8.0], 16.0 / 384.0), ("all", [0.0, 128.0, 128.0], 1.0)):
        fl = tmp_path / name
        fl.mkdir()
        (fl / "learner_steps.jsonl").write_text("\n".join(json.dumps(r) for r in _fleet_rows(trained)) + "\n")
        r = build("q15-1k", fl, vd, skip=1)  # the warm-up step is left out of the share too
        assert abs(r["trained_share"] - share) < 1e-12
        assert r["same_work"] is (share == 1.0)
        assert r["fleetrl"]["samples_trained"]["min"] == min(trained[1:])


def test_a_step_log_without_the_trained_count_leaves_same_work_unknown(tmp_path):
    fl = tmp_path / "fleetrl"
    fl.mkdir()
    rows = _fleet_rows([128.0, 128.0])
    del rows[1]["batch_samples_trained"]  # a log written before the learner recorded it
    (fl / "learner_steps.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    r = build("q15-1k", fl, tmp_path / "verl", skip=0)
    assert r["trained_share"] is None and r["same_work"] is None
