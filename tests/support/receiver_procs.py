"""Standalone weight receivers (``python -m weight_sync.receiver``) as processes, for the weight-sync tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from core.http_client import free_port

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def start_receiver(engine_id: str, log_dir: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    """Start a receiver on a free port, its output in ``log_dir/<engine_id>.log``; returns (process, url).
    Wait for it with ``health.wait_healthy``."""
    port = free_port()
    log = open(log_dir / f"{engine_id}.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "weight_sync.receiver", "--engine-id", engine_id, "--port", str(port), *extra],
        env=ENV,
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    return proc, f"http://127.0.0.1:{port}"
