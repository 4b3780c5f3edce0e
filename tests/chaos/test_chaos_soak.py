"""Chaos soak: the CPU system through launch/cluster.py while a seeded schedule ``kill -9``s its processes.

A schedule drawn from ``FLEETRL_CHAOS_SEED`` (default 13) picks the kills and when they land:

* during launch 1, one process the job survives on its own: the engine server (the fleet
  restarts it; its groups are re-queued), the broker (the launcher restarts it on its spool), the
  fleet actor (the Ray actor of the controller and the rollout workers: Ray restarts it, the driver
  starts it again, launch/fleet_recovery.py) or the reward server (the launcher restarts it on its
  address, the fleet's scorers wait for it; only this kill gives the run a reward server: the
  judge-tiny recipe, a second vLLM CPU server);
* then one that ends the launch: a learner rank (the driver names it and ends the job; launch 2
  redoes at most one checkpoint interval) or the driver itself; launch 2, the same command on the
  same run directory, resumes from the last checkpoint and finishes the run.

Each kill lands once the learner has reached a seeded step, after a seeded delay (so at a
random point inside a step). The verdicts come from the run's own records, not from its summary
figures: the spool (``python -m broker export``: every accepted group's fate) and the learner's
per-step records (``metrics/learner.jsonl``, the last record of each step):

* no group lost: every step 1..STEPS was trained on exactly G groups that the spool shows acked
  by that step, and every accepted group is acked, queued, or dropped for a counted reason (stale,
  or sampled by weights newer than the checkpoint the resume rewound to);
* none trained twice: no group in two steps' records, and the broker agrees step by step;
* the staleness bound held for every consumed row (``consumed_step - 1 - version <= k``);
* no process left: every process either launch started (tracked by pid) is gone at the end, or
  within LINGER_S of it (each one that needed that is named in the JSON).

The schedule, each kill's recovery time and the outcome go to ``chaos-seed<N>.json`` in the
run directory, and to ``$FLEETRL_CHAOS_OUT`` (e.g. bench/results/chaos) when set.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "support"))  # procs, test_cpu_system: helpers of the launcher tests

from procs import alive, descendants  # noqa: E402

from tests.integration.launch.test_cpu_system import spool_rows  # noqa: E402

SEED = int(os.environ.get("FLEETRL_CHAOS_SEED", "13"))  # the fleet actor, then a rank: schedule(13)
JUDGE = "tiny-judge"  # reward.model.model of launch/recipes/judge-tiny.yaml: the reward server's served name
STEPS, GROUPS, EVERY, K = 14, 8, 2, 2  # steps, groups per step, checkpoint interval, max staleness
LINGER_S = 60.0  # a process of the job may take this long to exit after the job ended
LAUNCH_LIMIT_S = 900.0  # one launch: a vLLM start (40-80 s on 2 quiet cores, 150+ s loaded) and a server restart
pytestmark = [pytest.mark.slow, pytest.mark.long, pytest.mark.timeout(2400)]


SURVIVED = ("server", "broker", "fleet", "reward")  # the first kill: the run recovers on its own
ENDING = ("rank", "driver")  # the second: it ends launch 1
WAIT_BACK = ("fleet", "reward")  # the second kill waits until this first one is back in service


def schedule(seed: int) -> list[dict]:
    """The seeded kills: one the run survives, then one that ends launch 1 (resumed by launch 2)."""
    rng = random.Random(seed)
    first = {"what": rng.choice(SURVIVED), "at_step": rng.randint(2, 4), "delay_s": round(rng.uniform(0.0, 1.5), 2)}
    second = {
        "what": rng.choice(ENDING),
        "at_step": rng.randint(first["at_step"] + 3, 9),
        "delay_s": round(rng.uniform(0.0, 1.5), 2),
    }
    return [first, second]


def _records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics" / "learner.jsonl"
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut by kill -9
                pass
    return out


def _last_step(run_dir: Path) -> int:
    return max((r["step"] for r in _records(run_dir) if "metrics" in r), default=0)


def _target(driver: int, what: str) -> int | None:
    """The pid to kill: the driver, its broker child, the learner rank actor, the fleet actor, the rollout
    vLLM server or the reward (judge) vLLM server."""
    if what == "driver":
        return driver
    try:
        procs = psutil.Process(driver).children(recursive=True)
    except psutil.Error:
        return None
    for p in procs:
        try:
            cmd = p.cmdline()
        except psutil.Error:
            continue
        vllm = "vllm.entrypoints.openai.api_server" in cmd
        judge = JUDGE in cmd  # the reward server serves the judge under its reward.model.model name
        if (
            (what == "broker" and cmd[1:3] == ["-m", "broker"])
            or (what == "rank" and "LearnerActor" in " ".join(cmd))
            or (what == "fleet" and "ray::FleetActor" in " ".join(cmd))
            or (what == "server" and vllm and not judge)
            or (what == "reward" and vllm and judge)
        ):
            return p.pid
    return None


def _recipe(plan: list[dict]) -> list[str]:
    """The tiny recipe; with a reward-server kill in the plan, its judge variant and one CPU reward server."""
    if any(k["what"] == "reward" for k in plan):
        return ["--recipe", "judge-tiny", "--reward-gpus", "1"]
    return ["--recipe", "tiny"]


def _launch(run_dir: Path, plan: list[dict], kills: list[dict], n: int) -> dict:
    """One launch of the plan's recipe; each of ``kills`` in order once the learner reached its step."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("FLEETRL_ENGINE_TOKEN", None)  # the run makes its own token (core.engine_auth)
    cmd = [
        sys.executable,
        "launch/cluster.py",
        "--rollout-gpus",
        "0",
        "--learner-gpus",
        "0",
        *_recipe(plan),
        "--max-steps",
        str(STEPS),
        "--run-dir",
        str(run_dir),
        "--no-live",
        f"broker.groups_per_step={GROUPS}",
        f"broker.max_staleness={K}",
        "run.eval_samples=0",
        f"learner.checkpoint_every={EVERY}",
    ]
    log = run_dir.parent / f"{run_dir.name}-launch-{n}.out"
    with open(log, "w") as f:
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
    seen: set[int] = {proc.pid}
    done: list[dict] = []
    armed: float | None = None
    t0 = time.monotonic()
    try:
        while proc.poll() is None and time.monotonic() - t0 < LAUNCH_LIMIT_S:
            seen |= descendants(proc.pid)
            step = _last_step(run_dir)
            if len(done) < len(kills):
                k = kills[len(done)]
                # a kill is armed once the learner reached its step and recovered from the kill before
                # (trained past it): kills that overlap test the restart of a restart, not each one. A fleet
                # actor or a reward server must also be back in service: the learner trains past the step
                # on queued groups long before either is, and their recovery is what their kill tests.
                settled = not done or (
                    step > done[-1]["step_at_kill"]
                    and (done[-1]["what"] not in WAIT_BACK or _back(run_dir, log, done[-1]))
                )
                if armed is None and settled and step >= k["at_step"]:
                    armed = time.monotonic() + k["delay_s"]
                if armed is not None and time.monotonic() >= armed:
                    pid = _target(proc.pid, k["what"])
                    if pid is not None:
                        os.kill(pid, signal.SIGKILL)
                        done.append({**k, "pid": pid, "step_at_kill": step, "t": time.monotonic(), "unix": time.time()})
                        armed = None
            for d in done:  # the learner trains a step past the one it was at (it may never have stalled)
                if d["what"] in SURVIVED and "learner_next_step_s" not in d and step > d["step_at_kill"]:
                    d["learner_next_step_s"] = round(time.monotonic() - d["t"], 2)
            time.sleep(0.25)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)
    for d in done:
        d.pop("t")
        if d["what"] in SURVIVED:
            d["back_s"] = _back(run_dir, log, d)
    text = log.read_text()
    # recoveries the launch logged, the soak's kills and any other (Ray's memory monitor kills a restartable
    # actor first when the host runs short: on the shared dev box it has killed the fleet actor while it started)
    recovered = {
        "fleet": text.count("launch.fleet_recovery: fleet back in service"),
        "reward": text.count("restarted and healthy at http"),
        "ray_memory_monitor_kills": text.count("killed due to the node running low on memory"),
    }
    return {
        "rc": proc.returncode,
        "kills": done,
        "seen": seen,
        "seconds": round(time.monotonic() - t0, 1),
        "text": text,
        "recovered": recovered,
    }


def _back(run_dir: Path, log: Path, kill: dict) -> float | None:
    """Seconds from ``kill`` to the killed process back in service (its first "up" log line after it)."""
    path, marker, also = {
        "server": (run_dir / "logs" / "fleet.log", "engines.vllm.server: vLLM server", "healthy after"),
        "broker": (log, "launch.broker_supervisor: broker restarted", ""),
        "fleet": (log, "launch.fleet_recovery: fleet back in service", ""),
        "reward": (log, "launch.reward_servers: reward server", "restarted and healthy"),
    }[kill["what"]]
    return _first_after(path, marker, also, kill["unix"])


def _first_after(path: Path, marker: str, also: str, unix: float) -> float | None:
    """Seconds from ``unix`` to the first log line of ``path`` after it holding ``marker`` (and ``also``)."""
    from datetime import datetime

    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return None
    for line in lines:
        if marker in line and also in line:
            try:  # logging's asctime: local time, milliseconds after the comma
                t = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            except ValueError:
                continue
            if t > unix:
                return round(t - unix, 2)
    return None


@pytest.fixture(scope="module")
def soak(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("chaos")
    plan = schedule(SEED)
    t_start = time.time()
    first = _launch(run_dir, plan, plan, 1)
    time.sleep(3.0)  # the driver's children die with it (PR_SET_PDEATHSIG); give them the moment
    resumed_from = _last_step(run_dir)
    second = _launch(run_dir, plan, [], 2)
    starts = [r["step"] for r in _records(run_dir) if "event" in r]
    resume_s = None
    terminal = first["kills"][-1] if first["kills"] else None
    if terminal is not None:
        firsts = [r["wall_time"] for r in _records(run_dir) if "metrics" in r and r["wall_time"] > terminal["unix"]]
        resume_s = round(min(firsts) - terminal["unix"], 2) if firsts else None
        terminal["back_s"] = resume_s  # kill to the resumed run's first step (a vLLM start included)
    # Processes of a kill -9-ed launch that outlive it for a while (Ray's dashboard agent of a driver
    # killed with -9 has been seen to linger tens of seconds after its raylet) get LINGER_S to exit
    # on their own; each one that needed it is recorded, one still there after it fails the test.
    t_end = time.monotonic()
    lingered: dict[int, dict] = {}
    while (left := alive(first["seen"] | second["seen"])) and time.monotonic() - t_end < LINGER_S:
        for p in left:
            if p not in lingered:
                try:
                    lingered[p] = {"cmd": " ".join(psutil.Process(p).cmdline())[:120]}
                except psutil.Error:
                    lingered[p] = {"cmd": "?"}
            lingered[p]["seconds"] = round(time.monotonic() - t_end, 1)
        time.sleep(1.0)
    rows = spool_rows(run_dir / "spool", run_dir / "spool.parquet")
    return {
        "dir": run_dir,
        "plan": plan,
        "launches": [first, second],
        "starts": starts,
        "left": left,
        "lingered": list(lingered.values()),
        "spool": rows,
        "resumed_from": resumed_from,
        "seconds": round(time.time() - t_start, 1),
    }


def _effective(run_dir: Path) -> dict[int, dict]:
    from learner.metrics_sink import effective_rows

    return effective_rows(run_dir)


def test_chaos_soak_loses_nothing_trains_nothing_twice_and_leaves_no_process(soak):
    first, second = soak["launches"]
    outcome: dict = {
        "seed": SEED,
        "schedule": soak["plan"],
        "steps": STEPS,
        "groups_per_step": GROUPS,
        "max_staleness": K,
        "kills": first["kills"],
        "launch_rc": [first["rc"], second["rc"]],
        "launch_seconds": [first["seconds"], second["seconds"]],
        "learner_starts": soak["starts"],
        "seconds": soak["seconds"],
        "processes_lingered": soak["lingered"],
        "recoveries_logged": [first["recovered"], second["recovered"]],
    }
    try:
        assert [k["what"] for k in first["kills"]] == [p["what"] for p in soak["plan"]], (
            first["kills"],
            first["text"][-3000:],
        )
        assert first["rc"] != 0 and second["rc"] == 0, (first["rc"], second["text"][-4000:])
        survived = first["kills"][0]
        if survived["what"] in WAIT_BACK:  # it came back within launch 1, before the second kill
            assert survived.get("back_s") is not None, (survived, first["text"][-3000:])
        rows = _effective(soak["dir"])
        assert list(rows) == list(range(1, STEPS + 1)), sorted(rows)
        trained = [g for r in rows.values() for g in r["groups"]]
        outcome["groups_trained"] = len(trained)
        assert all(len(r["groups"]) == GROUPS for r in rows.values()), "a step trained on fewer groups"
        assert len(trained) == len(set(trained)) == STEPS * GROUPS, "a group trained twice"
        spool = soak["spool"]
        fate: dict[str, set] = {}
        for r in spool:
            fate.setdefault(r["group"], set()).add((r["status"], r["consumed_step"]))
        assert all(len(f) == 1 for f in fate.values()), "a group's rows have different fates"
        acked = {g: next(iter(f))[1] for g, f in fate.items() if next(iter(f))[0] == "acked"}
        assert acked == {g: s for s, r in rows.items() for g in r["groups"]}, "broker and learner disagree"
        statuses = [next(iter(f))[0] for f in fate.values()]
        # every accepted group is acked, still queued, or dropped for a counted reason: past the staleness
        # bound, or sampled by weights newer than the checkpoint a resume rewound to (broker/rewind.py)
        assert set(statuses) <= {"acked", "pending", "dropped:stale", "dropped:rewound_future_version"}, statuses
        outcome["groups_accepted"] = len(fate)
        outcome["groups_by_fate"] = {x: statuses.count(x) for x in sorted(set(statuses))}
        outcome["groups_lost"] = 0
        stale = [r["consumed_step"] - 1 - r["v0"] for r in spool if r["status"] == "acked"]
        outcome["max_staleness_seen"] = max(stale)
        assert max(stale) <= K, max(stale)
        s = json.loads((soak["dir"] / "summary.json").read_text())
        assert s["bound_violations"] == 0 and s["groups_lost"] == 0, s
        assert soak["starts"][0] == 1 and len(soak["starts"]) >= 2  # the run was resumed, not restarted
        ending = first["kills"][-1]
        if ending["what"] == "rank":  # the driver names the dead rank and ends the job, every process with it
            assert f"error: RankFailed: learner rank 0 (pid {ending['pid']}) died" in first["text"], first["text"][
                -3000:
            ]
            # the re-run starts after the newest checkpoint the dead rank wrote: at most one interval is redone (a
            # step's record is written before its checkpoint, so the rank may have died before committing the last)
            nxt, last = soak["starts"][-1], ending["step_at_kill"]
            assert (nxt - 1) % EVERY == 0 and last - EVERY <= nxt - 1 <= last + 1, (soak["starts"], ending)
        assert not soak["left"], [" ".join(psutil.Process(p).cmdline())[:200] for p in soak["left"]]
        outcome["processes_left"] = 0
        outcome["passed"] = True
    except AssertionError:
        outcome["passed"] = False
        raise
    finally:
        outcome["processes_left"] = len(soak["left"])
        text = json.dumps(outcome, indent=2)
        (soak["dir"] / f"chaos-seed{SEED}.json").write_text(text)
        if out := os.environ.get("FLEETRL_CHAOS_OUT"):
            Path(out).mkdir(parents=True, exist_ok=True)
            (Path(out) / f"chaos-seed{SEED}.json").write_text(text)
