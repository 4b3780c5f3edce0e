"""The fleet's data position on disk: ``RUN_DIR/fleet_state.json``, so a re-run continues the data.

The rollout worker's checkpoint (:meth:`rollout_fleet.worker.RolloutWorker.state_dict`: the
dataset's read position and the prompts of groups in flight) is written atomically about once a
second while the fleet runs and once when it stops; a fleet that starts on a run directory holding
the file loads it (a file of other data or another seed is refused by the dataset, naming the key).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

FILE = "fleet_state.json"


def save(run_dir: str | Path, state: dict[str, Any]) -> None:
    path = Path(run_dir) / FILE
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(state))
    tmp.replace(path)


def load(run_dir: str | Path) -> dict[str, Any] | None:
    path = Path(run_dir) / FILE
    if not path.exists():
        return None
    return json.loads(path.read_text())


def latest_export(run_dir: str | Path) -> tuple[int, str] | None:
    """(version, path) of the learner's newest HF export, ``RUN_DIR/export/latest``, or None without one.

    The export folder names its version in ``fleetrl_version.json`` (learner.checkpoint.publish_export
    writes it; the name is repeated here: the fleet does not import the learner)."""
    latest = Path(run_dir) / "export" / "latest"
    try:
        version = int(json.loads((latest / "fleetrl_version.json").read_text())["version"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        if latest.exists():
            log.warning("export %s names no version (%s): a restarted fleet starts from its model path", latest, exc)
        return None
    return version, str(latest)
