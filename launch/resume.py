"""Re-running a command on the same ``--run-dir`` continues the run.

What a run directory keeps, and what a re-run does with it (``launch.driver.run`` calls
:func:`with_defaults` and :func:`prepare` before anything starts)::

    checkpoints/step_XXXXXXXX   the learner resumes from the newest complete one (version c)
                                (learner.checkpoint_every, default 10; and at a clean stop/Ctrl-C)
    spool/                      the broker's spool (on by default: RUN_DIR/spool), rewound to c
                                (broker/rewind.py): groups acked by steps after c are handed out
                                again, groups sampled by versions after c are dropped by name
    fleet_state.json            the fleet's data position and the prompts it had in flight
    metrics/learner.jsonl       per-step records, appended (a start line marks each re-run)
    logs/*.log                  appended
    wandb_run_id                W&B resumes the same run

Before that it makes sure no job is still running there (a live driver refuses the re-run) and
ends the engine servers a ``kill -9``-ed driver left behind (their pids in ``metrics/pids.json``;
each must still be a process of this run directory). The broker and Ray's processes die with
their driver by themselves (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def with_defaults(cfg, run_dir: Path):
    """The spool in ``RUN_DIR/spool`` (``run.default_spool``) and, with ``run.prometheus``, a fixed broker
    metrics port, unless set."""
    from core.http_client import free_port

    broker: dict[str, Any] = {}
    # SIMULATED runs have no checkpoints: nothing to resume
    if cfg.broker.spool_dir is None and cfg.run.default_spool and cfg.rollout.engine != "simulated":
        broker["spool_dir"] = str(Path(run_dir) / "spool")
    if cfg.run.prometheus and cfg.broker.metrics_port is None:
        broker["metrics_port"] = free_port()  # fixed for the job: a restarted broker keeps its address
    if not broker:
        return cfg
    return cfg.model_copy(update={"broker": cfg.broker.model_copy(update=broker)})


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _of_run(pid: int, run_dir: Path) -> bool:
    """The process's command line or environment names ``run_dir`` (engine servers keep their temp dir there)."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
    except OSError:
        env = ""
    return str(run_dir) in _cmdline(pid) or str(run_dir) in env


def _members(pgid: int) -> list[int]:
    """Live processes of process group ``pgid``."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if os.getpgid(int(d.name)) == pgid and _alive(int(d.name)):
                    out.append(int(d.name))
            except (ProcessLookupError, PermissionError, OSError):
                pass
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    try:  # a zombie is not alive
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return True


def end_leftovers(run_dir: Path, timeout_s: float = 10.0) -> list[int]:
    """End engine servers a dead driver of ``run_dir`` left running; refuse if that driver lives."""
    path = Path(run_dir) / "metrics" / "pids.json"
    if not path.exists():
        return []
    pids = json.loads(path.read_text())
    driver = int(pids.get("driver") or 0)
    if driver and driver != os.getpid() and _alive(driver) and "cluster.py" in _cmdline(driver):
        raise SystemExit(
            f"error: a job is still running in {run_dir} (driver pid {driver}); stop it first "
            f"(Ctrl-C, or `kill {driver}`) or choose another --run-dir"
        )
    # each server leads its own process group; its leader may be gone while its engine core lives on
    groups = {p for p in pids.get("engines", []) if any(_of_run(m, Path(run_dir).resolve()) for m in _members(p))}
    left = sorted(m for g in groups for m in _members(g))
    if left:
        from launch.broker_supervisor import end_engine_groups

        log.warning("ending engine server processes %s left by the previous driver of %s", left, run_dir)
        end_engine_groups(groups, timeout_s)
    return left


def checkpoint_version(cfg, run_dir: Path) -> int:
    """The version of the newest complete learner checkpoint (0: none); reads ``meta.json`` only."""
    root = Path(cfg.learner.checkpoint_dir) if cfg.learner.checkpoint_dir else Path(run_dir) / "checkpoints"
    if not cfg.learner.resume or not root.is_dir():
        return 0
    done = sorted(p for p in root.glob("step_*") if (p / "meta.json").exists())
    return int(json.loads((done[-1] / "meta.json").read_text())["extra"]["version"]) if done else 0


def prepare(cfg, run_dir: Path) -> dict[str, Any]:
    """Make ``run_dir`` ready for this run: leftovers ended, the spool rewound to the checkpoint."""
    run_dir = Path(run_dir)
    left = end_leftovers(run_dir)
    (run_dir / "metrics" / "learner_endpoint.json").unlink(missing_ok=True)  # the old learner's: gone
    version = checkpoint_version(cfg, run_dir)
    info: dict[str, Any] = {"checkpoint_version": version, "leftovers_ended": left}
    spool = Path(cfg.broker.spool_dir) if cfg.broker.spool_dir else None
    if spool is not None and (spool / "log.bin").exists():
        from broker.rewind import rewind

        info["spool"] = rewind(spool, version)
    if version or left or "spool" in info:
        log.info("resuming %s: %s", run_dir, info)
        print(f"resuming {run_dir} from learner version {version} ({info})", flush=True)
    return info
