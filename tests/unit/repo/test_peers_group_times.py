"""bench/peers/group_times.py: per-step group start spread and generation span, from a spool's Parquet export."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bench.peers.group_times import group_times

REPO = Path(__file__).resolve().parents[3]


def _rows(groups: dict[tuple[int, str], list[tuple[float, float]]]) -> list[dict]:
    return [
        {"step": step, "group_id": gid, "t_start": s, "t_end": e}
        for (step, gid), samples in groups.items()
        for s, e in samples
    ]


def test_waves_show_as_start_spread_and_span():
    # step 1: two groups at t=100, one starting 2.5 s later (a second wave); step 2: all together
    rows = _rows(
        {
            (1, "a"): [(100.0, 104.0), (100.0, 105.0)],
            (1, "b"): [(100.0, 103.0), (100.0, 103.5)],
            (1, "c"): [(102.5, 108.0), (102.5, 107.0)],
            (2, "d"): [(200.0, 201.0), (200.0, 202.0)],
            (2, "e"): [(200.0, 202.0), (200.0, 201.5)],
        }
    )
    one, two = group_times(rows)
    assert (one["step"], one["groups"], one["samples"]) == (1, 3, 6)
    assert one["start_spread_s"] == pytest.approx(2.5)
    assert one["span_s"] == pytest.approx(8.0)
    assert one["starts_s"] == [0.0, 0.0, 2.5]
    # a group lasts from its start to its LAST sample's end
    assert one["group_s"] == {"min": pytest.approx(3.5), "median": pytest.approx(5.0), "max": pytest.approx(5.5)}
    assert two["start_spread_s"] == 0.0 and two["span_s"] == pytest.approx(2.0)


def test_rows_without_times_or_step_are_left_out():
    rows = _rows({(3, "x"): [(10.0, 12.0)]}) + [
        {"step": None, "group_id": "y", "t_start": 1.0, "t_end": 2.0},
        {"step": 3, "group_id": "z", "t_start": None, "t_end": 2.0},
    ]
    (only,) = group_times(rows)
    assert only["groups"] == 1 and only["span_s"] == pytest.approx(2.0)


def test_cli_reads_parquet_and_refuses_a_bad_file_by_name(tmp_path):
    rows = _rows({(1, "a"): [(5.0, 6.0)], (1, "b"): [(5.5, 7.0)]})
    path = tmp_path / "spool.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    out = tmp_path / "g.json"
    r = subprocess.run(
        [sys.executable, "bench/peers/group_times.py", str(path), "--json", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    (step,) = json.loads(out.read_text())["steps"]
    assert step["start_spread_s"] == pytest.approx(0.5) and step["span_s"] == pytest.approx(2.0)

    bad = tmp_path / "not.parquet"
    bad.write_text("not parquet")
    r = subprocess.run(
        [sys.executable, "bench/peers/group_times.py", str(bad)], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 2 and f"cannot read {bad}" in r.stderr
