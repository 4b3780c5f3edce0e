"""bench/peers/verl.sh refuses a FLEETRL_UNIFORM it does not know by name, before it starts anything."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def test_an_unknown_uniform_mode_is_refused_by_name(tmp_path):
    smol = tmp_path / "smol"
    smol.mkdir()
    (smol / "config.json").write_text("{}")
    env = dict(os.environ, SMOL=str(smol), OUT=str(tmp_path / "out"), PEERS_WORK=str(tmp_path / "w"))
    env["FLEETRL_UNIFORM"] = "sometimes"
    r = subprocess.run(
        ["bash", "bench/peers/verl.sh", "smol", "compare"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "FLEETRL_UNIFORM: train, skip or drop, got sometimes" in r.stderr
    assert not (tmp_path / "w" / "smol" / "case.json").exists()
