"""bench/mirror.sh: the GPU scripts' copier of a run's files into $OUT while the run goes on."""

from __future__ import annotations

import subprocess
from pathlib import Path

MIRROR = Path(__file__).resolve().parents[3] / "bench" / "mirror.sh"

SCRIPT = """
. "$MIRROR"
MIRROR_EVERY_S=0.2 mirror_start out "src/a.json" "src/*.log"
echo 1 > src/a.json; echo x > src/b.log
sleep 1
ls out > seen_while_running
echo 2 > src/a.json; echo y > src/c.log   # after the last periodic copy: mirror_stop's own copy takes them
mirror_stop
echo "$MIRROR_PID" > pid_after_stop
"""


def test_files_are_copied_while_the_run_goes_and_once_more_at_the_stop(tmp_path):
    (tmp_path / "src").mkdir()
    r = subprocess.run(
        ["bash", "-c", SCRIPT], cwd=tmp_path, env={"MIRROR": str(MIRROR), "PATH": "/usr/bin:/bin"}, timeout=30
    )
    assert r.returncode == 0
    assert (tmp_path / "seen_while_running").read_text().split() == ["a.json", "b.log"]
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == ["a.json", "b.log", "c.log"]
    assert (out / "a.json").read_text() == "2\n"  # the last copy is the file as the run left it
    assert (tmp_path / "pid_after_stop").read_text() == "\n"  # the copier is gone


def test_a_missing_file_is_no_error(tmp_path):
    r = subprocess.run(
        ["bash", "-c", '. "$MIRROR"; set -e; mirror_start out "nothing/*.json"; mirror_stop; ls out | wc -l'],
        cwd=tmp_path,
        env={"MIRROR": str(MIRROR), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 0 and r.stdout.strip() == "0", r.stderr
