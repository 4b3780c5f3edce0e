"""launch.fleet_recovery: which engine processes a dead fleet actor left (orphaned_engines), and which of a run
the job's shutdown ends (engine_groups_of_run), with real processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from launch.fleet_recovery import engine_groups_of_run, orphaned_engines


def _engine(run_dir, new_session: bool = True) -> subprocess.Popen:
    """A process whose command line reads like a vLLM server's of ``run_dir`` (it only sleeps)."""
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time; time.sleep(60)",
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--download-dir",
            str(run_dir),
        ],
        start_new_session=new_session,
    )


def test_engines_of_this_run_without_a_ray_parent_are_orphans_and_no_other(tmp_path):
    mine, other = tmp_path / "run", tmp_path / "other-run"
    procs = [_engine(mine), _engine(other), _engine(mine, new_session=False)]
    try:
        time.sleep(0.3)
        found = orphaned_engines(mine)
        # the first: this run's, leading its own group, its parent (this test) no Ray worker; the second names
        # another run; the third does not lead its own process group (an engine's child, not a server)
        assert procs[0].pid in found
        assert procs[1].pid not in found and procs[2].pid not in found
        assert orphaned_engines(tmp_path / "nothing-here") == set()
        # at the end of a job every engine process group of the run goes, led by a server or not
        groups = engine_groups_of_run(mine)
        assert procs[0].pid in groups and procs[1].pid not in groups
        assert os.getpgid(procs[2].pid) == os.getpgrp() not in groups  # never the caller's own group
    finally:
        for p in procs:
            p.kill()
            p.wait()
