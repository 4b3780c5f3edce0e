"""Waiting for a test's server process to answer ``GET /health``."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import httpx


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, what: str, timeout_s: float = 60.0) -> None:
    """Return once ``url`` answers /health with 200; fail with the process's log if it exits or takes too long."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, f"{what} did not start: {log.read_text()}"
        time.sleep(0.2)
