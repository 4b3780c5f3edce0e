"""The suite's own diagnostics (tests/conftest.py), run on a throwaway suite in a child pytest: the header and
the last lines name the machine's free room, and the first failures' causes are printed where they happen, so
a log cut short still names them (a full disk once showed in CI as a wall of bare set-up errors)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

CONFTEST = Path(__file__).resolve().parents[2] / "conftest.py"

SUITE = """
import pytest

@pytest.fixture
def disk():
    raise OSError(28, "No space left on device")

def test_setup_error(disk):
    pass

def test_assertion():
    assert 1 + 1 == 3, "arithmetic broke"

@pytest.mark.parametrize("i", range(6))
def test_more_failures(i):
    raise RuntimeError(f"failure number {i}")

def test_passes():
    pass
"""


def _child_pytest(tmp_path, tests: str, *args: str) -> subprocess.CompletedProcess:
    """A pytest over ``tests`` (one test file's text) beside a copy of the suite's conftest, in ``tmp_path``; its
    --basetemp is there too, so it never numbers or cleans this run's temp folders."""
    shutil.copy(CONFTEST, tmp_path / "conftest.py")
    (tmp_path / "test_throwaway.py").write_text(tests)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", f"--basetemp={tmp_path / 'basetemp'}", *args]
        + [str(tmp_path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_header_inline_causes_and_closing_room(tmp_path):
    p = _child_pytest(tmp_path, SUITE, "-q")
    out = p.stdout
    assert p.returncode == 1, out
    lines = out.splitlines()
    inline = [ln for ln in lines if ln.startswith("[") and " failed] " in ln]
    # five causes, in order, each on the line after its test's mark; the rest only in the final report
    assert len(inline) == 5, inline
    assert inline[0].startswith("[setup failed] test_throwaway.py::test_setup_error: OSError: [Errno 28] No space")
    assert inline[1] == "[call failed] test_throwaway.py::test_assertion: AssertionError: arithmetic broke"
    assert inline[2].endswith("RuntimeError: failure number 0") and inline[4].endswith("failure number 2"), inline
    assert lines.index(inline[-1]) < next(i for i, ln in enumerate(lines) if "FAILURES" in ln or "ERRORS" in ln)
    room = [ln for ln in lines if "free GiB: " in ln]
    assert len(room) == 1 and room[0].startswith("at the end, free GiB: checkout "), room  # -q hides the header
    assert "open files " in room[0] and " cores" in room[0], room


def test_header_names_the_room(tmp_path):
    p = _child_pytest(tmp_path, "def test_ok():\n    pass\n")
    assert p.returncode == 0, p.stdout
    header = p.stdout.split("collected", 1)[0]
    assert "free GiB: checkout " in header and ", tmp " in header and "memory " in header, header
