"""bench/lora_publish.py refuses counts it cannot run, naming them, before it builds or starts anything."""

from __future__ import annotations

import pytest
from bench_module import load_bench


def _bench():
    return load_bench("bench/lora_publish.py", "bench_lora_publish_args")


@pytest.mark.parametrize(
    "argv", [["--full-publishes", "-1"], ["--updates", "0"], ["--cpu", "--updates", "0", "--full-publishes", "0"]]
)
def test_bad_counts_are_refused_by_name(argv, capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        _bench().main([*argv, "--run-dir", str(tmp_path / "run")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--updates must be >= 1 and --full-publishes >= 0" in err, err
    assert not (tmp_path / "run").exists()  # refused before the run directory or a model was made


def test_partial_results_are_written_and_replaced(tmp_path):
    write = _bench()._write
    path = tmp_path / "out" / "r.json"
    write(str(path), {"adapter": [1], "partial": True})
    assert '"partial": true' in path.read_text()
    write(str(path), {"adapter": [1, 2]})
    assert "partial" not in path.read_text() and '"adapter"' in path.read_text()
    write(None, {"x": 1})  # no --json: nothing written, no error
