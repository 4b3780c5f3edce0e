"""bench/overlap_probe.py refuses bad arguments before it starts any engine (its runs are GPU work)."""

from __future__ import annotations

import pytest

from bench import overlap_probe


def _error(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as e:
        overlap_probe.main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


def test_model_folder_is_required(capsys, tmp_path):
    err = _error(capsys, ["--model", str(tmp_path / "missing")])
    assert "--model must be an HF model folder" in err and "missing" in err


def test_unknown_case_is_named(capsys):
    err = _error(capsys, ["--cpu", "--cases", "gen,train,three_process"])
    assert "three_process" in err


def test_alone_baselines_are_needed(capsys):
    err = _error(capsys, ["--cpu", "--cases", "two_process"])
    assert "gen and train are needed" in err
