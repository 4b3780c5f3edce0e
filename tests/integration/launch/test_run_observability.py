"""Seeing a run and resuming it, through launch/cluster.py on the CPU system (real vLLM server, FSDP learner).

One run directory serves every test here (each launch costs a vLLM start, 60-80 s on 2 cores). The
same command is launched three times, each in a session of its own as a terminal would run it:

* launch A runs the tiny recipe (20 steps of 8 groups, checkpoints every 2 steps, W&B offline);
  past step 3 the test ``kill -9``s the driver;
* launch C gets a Ctrl-C (SIGINT to its whole process group, as a terminal sends) three steps in:
  the learner finishes its step, checkpoints and exports there, the job ends (rc 130);
* launch D, the same command again, finishes the run. Once its learner has written a step the
  test scrapes every Prometheus endpoint the job lists in ``metrics.json`` (driver, broker,
  learner, the engine's own) and asks ``status``.

The assertions read the run's own records: TensorBoard's event files (TensorBoard's reader), the
learner's per-step JSONL, the W&B offline files, the broker spool (``python -m broker export``),
the fleet's data position, the checkpoints, the logs, the report's PNGs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest
from procs import alive, descendants

from tests.integration.launch.test_cpu_system import spool_rows
from tests.integration.launch.test_wandb_logging import history, read_wandb_records
from tests.unit.launch.test_observability import dashboard_series

REPO = Path(__file__).resolve().parents[3]
STEPS, GROUPS, EVERY = 20, 8, 2  # a step takes ~0.5 s here: enough left after three stops for the probe
pytestmark = [pytest.mark.slow, pytest.mark.long, pytest.mark.timeout(1500)]


def _step(run_dir: Path) -> int:
    from learner.metrics_sink import effective_rows

    rows = effective_rows(run_dir)
    return max(rows) if rows else 0


def _starts(run_dir: Path) -> list[int]:
    """The first step of each learner process that ran on ``run_dir`` (its start lines)."""
    from learner.metrics_sink import JSONL

    path = run_dir / JSONL
    return [json.loads(x)["step"] for x in path.read_text().splitlines() if '"event"' in x] if path.exists() else []


def _segments(run_dir: Path) -> list[tuple[int, int]]:
    """(first step, last step written) of each learner process that ran on ``run_dir``, in order."""
    from learner.metrics_sink import JSONL

    out: list[list[int]] = []
    for line in (run_dir / JSONL).read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a line cut by kill -9
            continue
        if "event" in row:
            out.append([row["step"], row["step"] - 1])
        elif "metrics" in row:
            out[-1][1] = row["step"]
    return [(a, b) for a, b in out]


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def _series(text: str) -> set[str]:
    """Every series an endpoint exports: its samples' names, and the names its declared families
    give (a counter family without samples yet, e.g. drops by reason before the first drop)."""
    from prometheus_client.parser import text_string_to_metric_families

    out = set()
    for fam in text_string_to_metric_families(text):
        out |= {s.name for s in fam.samples}
        out |= {
            fam.name + x
            for x in {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}.get(fam.type, ("",))
        }
    return out


def _launch(run_dir: Path, kill: str | None = None, at: int = 0, probe=None) -> dict:
    """One launch; ``kill`` ("driver": kill -9; "ctrl-c": SIGINT to the launch's process group)
    once this launch's learner has trained ``at`` steps."""
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
    }
    env.pop("WANDB_API_KEY", None)
    cmd = [
        sys.executable,
        "launch/cluster.py",
        "--rollout-gpus",
        "0",
        "--learner-gpus",
        "0",
        "--recipe",
        "tiny",
        "--max-steps",
        str(STEPS),
        "--run-dir",
        str(run_dir),
        "--no-live",
        f"broker.groups_per_step={GROUPS}",
        "run.eval_samples=16",
        "run.eval_every=3",
        f"learner.checkpoint_every={EVERY}",
        "learner.log_samples_every=2",
        "run.wandb.project=fleetrl-test",
    ]
    log = run_dir.parent / f"{run_dir.name}-launch-{len(list(run_dir.parent.glob(run_dir.name + '-launch-*')))}.out"
    with open(log, "w") as f:  # a file, not a pipe: nothing blocks on a full pipe, orphans hold nothing
        # its own session, as a terminal's foreground job: Ctrl-C is SIGINT to the whole process group
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
    seen, out, killed, probed = set(), {}, None, False
    before = len(_starts(run_dir))
    deadline = time.monotonic() + 600
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            seen |= descendants(proc.pid)
            step = _step(run_dir)
            if probe is not None and not probed and _has_learner(run_dir):
                probed = True
                out["probe"] = probe(run_dir)
            mine = _starts(run_dir)[before:]
            if kill and killed is None and mine and step >= mine[0] + at - 1:
                killed = {"pid": proc.pid, "step": step, "group": _group(proc.pid), "unix": time.time()}
                if kill == "ctrl-c":
                    os.killpg(proc.pid, signal.SIGINT)  # what a terminal sends on Ctrl-C
                else:
                    os.kill(proc.pid, signal.SIGKILL)
            time.sleep(0.5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    out.update(rc=proc.returncode, killed=killed, seen=seen, text=log.read_text())
    return out


def _group(pgid: int) -> list[str]:
    """The command lines of the processes in process group ``pgid`` (what a terminal's Ctrl-C reaches)."""
    out = []
    for p in [psutil.Process(pgid)] + psutil.Process(pgid).children(recursive=True):
        try:
            if os.getpgid(p.pid) == pgid:
                out.append(" ".join(p.cmdline())[:120])
        except (psutil.Error, ProcessLookupError):
            pass
    return out


def _has_learner(run_dir: Path) -> bool:
    """This launch's learner endpoint is listed (the file is rewritten by each launch's driver)."""
    try:
        eps = json.loads((run_dir / "metrics.json").read_text())
        return (
            "learner" in eps
            and eps["learner"] == json.loads((run_dir / "metrics" / "learner_endpoint.json").read_text())["learner"]
            and _scrape(eps["learner"]) != ""
        )
    except (OSError, ValueError):
        return False


def _probe(run_dir: Path) -> dict:
    """Every endpoint in metrics.json scraped, and the `status` text."""
    eps = json.loads((run_dir / "metrics.json").read_text())
    got = {k: _scrape(eps[k]) for k in ("driver", "broker", "learner")}
    got["engines"] = {e: _scrape(u) for e, u in eps["engines"].items()}
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    st = subprocess.run(
        [sys.executable, "launch/cluster.py", "status", "--run-dir", str(run_dir)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return {"endpoints": eps, "scrapes": got, "status": st.stdout + st.stderr}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("observed")
    after = {}  # what each launch left in the run directory before the next one started
    launches = {"A": _launch(d, kill="driver", at=EVERY + 1)}  # past the first checkpoint
    time.sleep(3.0)  # the broker and Ray die with their driver (PR_SET_PDEATHSIG); the engine is left
    launches["C"] = _launch(d, kill="ctrl-c", at=EVERY + 1)
    after["C"] = {
        "summary": json.loads((d / "summary.json").read_text()),
        "checkpoints": sorted(p.name for p in (d / "checkpoints").glob("step_*") if (p / "meta.json").exists()),
        "export_latest": os.readlink(d / "export" / "latest"),
        "export_files": sorted(p.name for p in (d / "export" / "latest").iterdir()),
    }
    launches["D"] = _launch(d, probe=_probe)
    rep = subprocess.run(
        [sys.executable, "launch/cluster.py", "report", "--run-dir", str(d)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    return {
        "dir": d,
        "launches": launches,
        "after": after,
        "report": rep,
        "starts": _starts(d),
        "segments": _segments(d),
        "spool": spool_rows(d / "spool", d / "spool.parquet"),
    }


def test_run_finishes_after_the_kills(run):
    first, last = run["launches"]["A"], run["launches"]["D"]
    assert first["killed"] and first["killed"]["step"] >= EVERY + 1, first
    assert last["rc"] == 0, last["text"][-4000:]
    s = json.loads((run["dir"] / "summary.json").read_text())
    assert s["steps"] == STEPS and s["groups_lost"] == 0, s
    assert len(s["reward_per_step"]) == STEPS  # the curve continues across the restarts


def test_ctrl_c_checkpoints_and_exports_at_its_step_and_the_rerun_continues_from_there(run):
    c, (first, last), after = run["launches"]["C"], run["segments"][1], run["after"]["C"]
    k = after["summary"]["steps"]
    assert c["killed"] and c["rc"] == 130 and "error: interrupted" in c["text"], (c["killed"], c["text"][-3000:])
    assert after["summary"]["error"] == "interrupted" and after["summary"]["groups_lost"] == 0, after["summary"]
    # the learner finished the step it was in and stopped there: that step is checkpointed and exported
    assert last == k >= c["killed"]["step"] > first, (run["segments"], c["killed"])
    assert after["checkpoints"][-1] == f"step_{k:08d}", (after, c["killed"]["group"])
    assert Path(after["export_latest"]).name == f"step_{k:08d}", after
    assert {"config.json", "model.safetensors"} <= set(after["export_files"]), after
    assert f"stopped at version {k}: checkpoint and export written" in (run["dir"] / "logs" / "learner.log").read_text()
    assert run["starts"][2] == k + 1, run["segments"]  # nothing redone, nothing skipped


def test_tensorboard_has_every_metric_at_every_step(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from learner.metrics_sink import EVERY_STEP

    acc = EventAccumulator(
        str(run["dir"] / "tensorboard" / "learner"), size_guidance={"scalars": 0, "histograms": 0, "tensors": 0}
    )
    acc.Reload()
    want = list(range(1, STEPS + 1))
    for tag in EVERY_STEP + ("rollout/reward_mean_addition",):
        assert [e.step for e in acc.Scalars(tag)] == want, tag  # once each: redone steps replaced
    assert [e.step for e in acc.Histograms("learner/staleness_versions")] == want
    assert sorted({e.step for e in acc.Tensors("rollout/samples")}) == list(range(2, STEPS + 1, 2))
    assert all(0 < e.value <= 8 for e in acc.Scalars("rollout/response_length_max_tokens"))


def test_prometheus_endpoints_answer_with_every_series_the_board_reads(run):
    from learner.metrics_sink import EVERY_STEP

    p = run["launches"]["D"]["probe"]
    series = {k: _series(v) for k, v in p["scrapes"].items() if k != "engines"}
    assert {
        "broker_queue_depth_groups",
        "broker_staleness_versions_bucket",
        "broker_engine_version_lag",
        "broker_acked_groups_total",
    } <= series["broker"]
    assert {"fleetrl_learner_step", "fleetrl_rollout_tokens_per_s"} <= series["driver"]
    learner = {"fleetrl_step_" + k.replace("/", "_") for k in EVERY_STEP}
    assert learner <= series["learner"], learner - series["learner"]
    assert p["scrapes"]["engines"] and all("vllm:" in t for t in p["scrapes"]["engines"].values())
    exported = set().union(*series.values())
    assert dashboard_series() <= exported, dashboard_series() - exported
    for name in ("driver", "broker", "learner"):
        assert f"prometheus {name}: {p['endpoints'][name]}" in p["status"], p["status"]


def test_wandb_resumes_the_same_run_with_every_learner_step(run):
    runs = sorted((run["dir"] / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == len(run["launches"]), runs
    records = [read_wandb_records(r) for r in runs]
    ids = {next(r.run.run_id for r in recs if r.WhichOneof("record_type") == "run") for recs in records}
    assert len(ids) == 1, ids  # one W&B run, resumed
    steps = [{row["_step"] for row in history(recs) if "learner/loss_total" in row} for recs in records]
    assert set().union(*steps) == set(range(1, STEPS + 1)), steps
    # a driver that shut down (rank failed, Ctrl-C, finished) logged every step its learner wrote; the
    # kill -9-ed driver's W&B process may not have written its last ones
    for i, (first, last) in enumerate(run["segments"][1:], start=1):
        assert set(range(first, last + 1)) <= steps[i], (i, run["segments"], steps)


def test_report_writes_its_pngs(run):
    from launch.report import PLOTS

    assert run["report"].returncode == 0, run["report"].stderr
    for name in PLOTS:
        data = (run["dir"] / "report" / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, name
    assert "learner processes started" in (run["dir"] / "report" / "report.md").read_text()


def test_resume_trains_every_group_once_and_continues_the_data(run):
    from learner.metrics_sink import effective_rows

    d, starts = run["dir"], run["starts"]
    assert starts[0] == 1 and len(starts) == len(run["launches"])
    # the re-run after kill -9 of the driver starts after a checkpoint step, no later than the checkpoint
    # after the step the kill saw (the Ctrl-C and the dead rank: their own tests)
    killed = run["launches"]["A"]["killed"]
    assert (starts[1] - 1) % EVERY == 0 and 1 < starts[1] <= killed["step"] + 1 + EVERY, (starts, killed)
    rows = effective_rows(d)
    assert list(rows) == list(range(1, STEPS + 1))
    trained = [g for r in rows.values() for g in r["groups"]]
    assert all(len(r["groups"]) == GROUPS for r in rows.values())
    assert len(trained) == len(set(trained)) == STEPS * GROUPS  # no group trained twice
    acked = {r["group"]: r["consumed_step"] for r in run["spool"] if r["status"] == "acked"}
    assert acked == {g: s for s, r in rows.items() for g in r["groups"]}  # the broker agrees, step by step
    # the fleet's data position went on: launch A's prompts were not drawn again from the start
    prompts = [tuple(r["prompt_ids"]) for r in _groups(d)]
    assert len(prompts) - len(set(prompts)) <= 16, "prompts repeated: the data position restarted"
    assert json.loads((d / "fleet_state.json").read_text())["data"]["position"] >= len(prompts) - 16
    logs = (d / "logs" / "driver.log").read_text()
    assert logs.count("=== driver starts") == len(run["launches"])  # appended, not overwritten
    time.sleep(1.0)
    left = alive(p for L in run["launches"].values() for p in L["seen"])
    assert not left, [psutil.Process(p).cmdline() for p in left]


def _groups(d: Path) -> list[dict]:
    """One row per accepted group of the spool (its prompt)."""
    import pyarrow.parquet as pq

    rows = pq.read_table(d / "spool.parquet", columns=["group_id", "prompt_ids"]).to_pylist()
    return list({r["group_id"]: r for r in rows}.values())
