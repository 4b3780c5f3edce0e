"""Suite-wide settings: one thread per process (2-core machines), GPU tests skipped without CUDA, and the
machine's room in the report header (a full disk shows as a wall of setup errors, not as its cause)."""

import os
import resource
import shutil
import tempfile

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# Open files up to the hard limit, as Ray raises its own: a launch's servers, broker and ranks inherit it, and a
# machine whose soft limit is 1,024 must not fail the suite where a cluster node would not.
_soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
_want = 65536 if _hard == resource.RLIM_INFINITY else _hard
if _soft != resource.RLIM_INFINITY and _soft < _want:
    resource.setrlimit(resource.RLIMIT_NOFILE, (_want, _hard))


def _room(config) -> str:
    gib = 2**30
    room = []
    for name, path in (("checkout", str(config.rootpath)), ("tmp", tempfile.gettempdir()), ("shm", "/dev/shm")):
        if os.path.isdir(path):
            room.append(f"{name} {shutil.disk_usage(path).free / gib:.1f}")
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
        room.append(f"memory {avail * 1024 / gib:.1f}")
    except (OSError, StopIteration, ValueError):
        pass
    files = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return f"free GiB: {', '.join(room)}; {os.cpu_count()} cores; open files {files}"


def pytest_report_header(config):
    return _room(config)


_INLINE_FAILURES = 5  # the first failures' one-line causes, printed where they happen


def pytest_runtest_logreport(report):
    """The first few failures' causes inline, beside their F or E: a log cut short still names the first cause
    (the full reports come at the end, as always)."""
    global _INLINE_FAILURES
    if not report.failed or _INLINE_FAILURES <= 0:
        return
    _INLINE_FAILURES -= 1
    crash = getattr(report.longrepr, "reprcrash", None)
    # the crash message's first line; without one (a plain-text report), the report's last line
    lines = crash.message.splitlines()[:1] if crash is not None else str(report.longrepr).strip().splitlines()[-1:]
    print(f"\n[{report.when} failed] {report.nodeid}: {lines[0][:300] if lines else '?'}", flush=True)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    terminalreporter.write_line(f"at the end, {_room(config)}")


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA GPUs: run on the GPU machine (see bench/results/)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
