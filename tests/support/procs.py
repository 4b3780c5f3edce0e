"""Process bookkeeping for tests that start a job as a subprocess: what it started, what outlived it."""

from __future__ import annotations

from collections.abc import Iterable

import psutil


def descendants(pid: int) -> set[int]:
    """Every process below ``pid`` now (none once it is gone)."""
    try:
        return {c.pid for c in psutil.Process(pid).children(recursive=True)}
    except psutil.NoSuchProcess:
        return set()


def alive(pids: Iterable[int]) -> list[int]:
    """The processes of ``pids`` that still run (a zombie has ended: only its parent has not reaped it)."""
    out = []
    for p in pids:
        try:
            if psutil.Process(p).status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out
