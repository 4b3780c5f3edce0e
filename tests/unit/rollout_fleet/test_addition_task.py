"""The synthetic addition task: determinism, correctness, disjoint splits, verl's layout."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest

from rollout_fleet.tasks import addition
from rollout_fleet.tasks.addition import Problem, generate, make_splits

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[3]


def test_problem_text_and_answer():
    p = Problem(347, 85)
    assert p.prompt == "347+85="
    assert p.answer == "432"


def test_generate_is_deterministic_and_seed_dependent():
    assert generate(200, seed=3) == generate(200, seed=3)
    assert generate(200, seed=3) != generate(200, seed=4)


def test_generated_problems_are_correct_distinct_and_in_range():
    probs = generate(2000, seed=1, max_digits=3)
    assert len(set(probs)) == len(probs)
    for p in probs:
        assert 0 <= p.a <= 999 and 0 <= p.b <= 999
        assert int(p.answer) == p.a + p.b
    # Digit counts are drawn uniformly, so one-digit operands are common (about a third).
    one_digit = sum(p.a < 10 for p in probs) / len(probs)
    assert 0.25 < one_digit < 0.42


def test_splits_are_disjoint_and_test_split_is_stable():
    train, test = make_splits(3000, 200, seed=0)
    assert not set(train) & set(test)
    _, test_again = make_splits(500, 200, seed=0)
    assert test == test_again  # the test split does not depend on the train size


def test_generate_rejects_impossible_requests():
    with pytest.raises(ValueError, match="too many distinct problems"):
        generate(60, seed=0, max_digits=1)
    with pytest.raises(ValueError, match="max_digits"):
        generate(1, seed=0, max_digits=0)


def test_cli_writes_verl_layout(tmp_path):
    addition.main(["--out", str(tmp_path), "--train", "300", "--test", "50", "--seed", "5"])
    train = pq.read_table(tmp_path / "train.parquet")
    test = pq.read_table(tmp_path / "test.parquet")
    assert train.num_rows == 300 and test.num_rows == 50
    assert set(train.column_names) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
    row = test.to_pylist()[0]
    assert row["data_source"] == "addition"
    assert row["prompt"][0]["role"] == "user"
    a, b = row["prompt"][0]["content"].rstrip("=").split("+")
    assert row["reward_model"] == {"style": "rule", "ground_truth": str(int(a) + int(b))}
    assert row["extra_info"] == {"split": "test", "index": 0}
    prompts = {r["prompt"][0]["content"] for r in train.to_pylist()}
    assert not prompts & {r["prompt"][0]["content"] for r in test.to_pylist()}
    # Same seed, same bytes: the committed files can be regenerated exactly.
    again = tmp_path / "again"
    addition.main(["--out", str(again), "--train", "300", "--test", "50", "--seed", "5"])
    assert (again / "train.parquet").read_bytes() == (tmp_path / "train.parquet").read_bytes()


def test_committed_files_match_the_generator():
    train = pq.read_table(REPO / "data/addition/train.parquet").to_pylist()
    test = pq.read_table(REPO / "data/addition/test.parquet").to_pylist()
    assert len(train) == 20_000 and len(test) == 500
    want_train, want_test = make_splits(20_000, 500, seed=0)
    assert [r["prompt"][0]["content"] for r in test] == [p.prompt for p in want_test]
    assert [r["reward_model"]["ground_truth"] for r in train[:1000]] == [p.answer for p in want_train[:1000]]
