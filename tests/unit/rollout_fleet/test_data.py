"""The Parquet prompt reader: verl's layout, GSM8K files unchanged, bad rows, resumable position."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rollout_fleet.config import DataConfig
from rollout_fleet.data import DatasetError, PromptDataset, from_config, load_tokenizer
from rollout_fleet.rewards import math_answer

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[3]
TEST_FILE = REPO / "data/addition/test.parquet"

# Three rows exactly as verl's examples/data_preprocess/gsm8k.py writes them.
_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
GSM8K_ROWS = [
    {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": q + " " + _INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": gt},
        "extra_info": {"split": "train", "index": i, "answer": ans, "question": q},
    }
    for i, (q, ans, gt) in enumerate(
        [
            (
                "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                "How many clips did Natalia sell altogether in April and May?",
                "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips "
                "altogether in April and May.\n#### 72",
                "72",
            ),
            (
                "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. "
                "How much did she earn?",
                "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\nWorking 50 minutes, she earned "
                "0.2 x 50 = $<<0.2*50=10>>10.\n#### 10",
                "10",
            ),
            (
                "A robe takes 2 bolts of blue fiber and half that much white fiber. How many bolts in total does it take?",
                "It takes 2/2=<<2/2=1>>1 bolt of white fiber\nSo the total amount of fabric is 2+1=<<2+1=3>>3 "
                "bolts of fabric\n#### 3",
                "3",
            ),
        ]
    )
]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(REPO / "models/tiny-adder")


def _write(path: Path, rows: list[dict] | pa.Table) -> Path:
    table = rows if isinstance(rows, pa.Table) else pa.Table.from_pylist(rows)
    pq.write_table(table, path)
    return path


def _addition_rows(n: int) -> list[dict]:
    return [
        {
            "data_source": "addition",
            "prompt": [{"role": "user", "content": f"{i}+1="}],
            "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
            "extra_info": {"split": "train", "index": i},
        }
        for i in range(n)
    ]


def test_addition_test_split_loads_and_tokenizes(tok):
    ds = PromptDataset([TEST_FILE], tok, seed=0)
    assert len(ds) == 500 and not ds.skipped
    row = ds.rows[0]
    assert row.data_source == "addition" and row.extra_info == {"split": "test", "index": 0}
    content = row.messages[0]["content"]
    # The chat template renders the user text only: prompt ids are exactly its characters.
    assert tok.decode(row.prompt_ids.tolist()) == content
    assert row.prompt_ids.tolist() == tok.encode(content, add_special_tokens=False)
    a, b = content.rstrip("=").split("+")
    assert row.ground_truth == str(int(a) + int(b))


def test_gsm8k_verl_file_loads_unchanged(tmp_path, tok):
    path = _write(tmp_path / "gsm8k_train.parquet", GSM8K_ROWS)
    ds = PromptDataset([path], tok, shuffle=False)
    assert [r.ground_truth for r in ds.rows] == ["72", "10", "3"]
    assert all(r.data_source == "openai/gsm8k" for r in ds.rows)
    assert ds.rows[0].messages[0]["content"].startswith("Natalia sold clips")
    assert ds.rows[2].extra_info["index"] == 2
    # The reference solutions score 1 against their ground truth under the math reward.
    for r in ds.rows:
        assert math_answer(r.extra_info["answer"], r.ground_truth) == 1.0


def test_optional_columns_get_defaults(tmp_path, tok):
    rows = [{"prompt": r["prompt"], "reward_model": r["reward_model"]} for r in _addition_rows(3)]
    ds = PromptDataset([_write(tmp_path / "bare.parquet", rows)], tok)
    assert {r.data_source for r in ds.rows} == {"bare"} and all(r.extra_info == {} for r in ds.rows)


@pytest.mark.parametrize("column", ["prompt", "reward_model"])
def test_missing_column_names_file_and_column(tmp_path, tok, column):
    rows = [{k: v for k, v in r.items() if k != column} for r in _addition_rows(3)]
    path = _write(tmp_path / "nocol.parquet", rows)
    with pytest.raises(DatasetError) as err:
        PromptDataset([path], tok)
    assert str(path) in str(err.value) and f"column '{column}' is missing" in str(err.value)


def test_reward_model_without_ground_truth_field(tmp_path, tok):
    rows = _addition_rows(2)
    for r in rows:
        r["reward_model"] = {"style": "rule"}
    path = _write(tmp_path / "nogt.parquet", rows)
    with pytest.raises(DatasetError, match=r"nogt.parquet: column 'reward_model.ground_truth' is missing"):
        PromptDataset([path], tok)


def test_null_ground_truth_names_file_row_column(tmp_path, tok):
    rows = _addition_rows(4)
    rows[2]["reward_model"]["ground_truth"] = None
    path = _write(tmp_path / "nullgt.parquet", rows)
    with pytest.raises(DatasetError) as err:
        PromptDataset([path], tok)
    assert str(err.value) == f"{path} row 2, column 'reward_model.ground_truth': missing (null)"


def test_wrong_types_name_file_row_column(tmp_path, tok):
    text_prompt = pa.table(
        {
            "prompt": ["1+1=", "2+2="],
            "reward_model": [{"style": "rule", "ground_truth": "2"}, {"style": "rule", "ground_truth": "4"}],
        }
    )
    path = _write(tmp_path / "textprompt.parquet", text_prompt)
    with pytest.raises(DatasetError, match=r"textprompt.parquet row 0, column 'prompt': expected a non-empty list"):
        PromptDataset([path], tok)

    list_truth = _addition_rows(2)
    rows = [dict(r, reward_model={"style": "rule", "ground_truth": [1, 2]}) for r in list_truth]
    path = _write(tmp_path / "listgt.parquet", rows)
    with pytest.raises(
        DatasetError, match=r"listgt.parquet row 0, column 'reward_model.ground_truth': expected a string"
    ):
        PromptDataset([path], tok)

    rows = _addition_rows(3)
    rows[1]["prompt"] = [{"role": "user", "content": None}]
    path = _write(tmp_path / "nullcontent.parquet", rows)
    with pytest.raises(DatasetError, match=r"nullcontent.parquet row 1, column 'prompt\[0\]'"):
        PromptDataset([path], tok)


def test_too_long_prompt_names_the_longest_row_per_file(tmp_path, tok):
    rows = _addition_rows(4)
    rows[1]["prompt"] = [{"role": "user", "content": "1+" * 40 + "1="}]
    rows[2]["prompt"] = [{"role": "user", "content": "1+" * 30 + "1="}]
    path = _write(tmp_path / "long.parquet", rows)
    with pytest.raises(
        DatasetError,
        match=r"data.max_prompt_tokens=32 = 32 tokens:\n.*long.parquet: 2 prompts over "
        r"32 tokens, the longest row 1 with 82 tokens",
    ):
        PromptDataset([path], tok, max_prompt_tokens=32)


def test_prompt_plus_response_must_fit_the_model_length(tmp_path, tok):
    rows = _addition_rows(3)
    rows[2]["prompt"] = [{"role": "user", "content": "1+" * 20 + "1="}]  # 42 tokens
    path = _write(tmp_path / "fit.parquet", rows)
    with pytest.raises(DatasetError) as err:
        PromptDataset([path], tok, max_model_len=64, response_tokens=32)
    msg = str(err.value)
    assert "rollout.max_model_len=64 - rollout.sampling.max_tokens=32 = 32 tokens" in msg
    assert "fit.parquet: 1 prompts over 32 tokens, the longest row 2 with 42 tokens" in msg
    assert "raise rollout.max_model_len to at least 74" in msg and "data.filter_overlong_prompts=true" in msg
    ds = PromptDataset([path], tok, max_model_len=64, response_tokens=32, filter_overlong=True)
    assert len(ds) == 2 and ds.overlong == [(42, str(path), 2)]
    assert len(PromptDataset([path], tok, max_model_len=74, response_tokens=32)) == 3


@pytest.mark.parametrize("side", ["left", "right", "middle"])
def test_truncation_cuts_overlong_prompts_as_verl(tmp_path, tok, side):
    """verl's data.truncation: the prompt ids cut to the limit (filter_overlong_prompts still skips first)."""
    rows = _addition_rows(3)
    rows[1]["prompt"] = [{"role": "user", "content": "1+" * 40 + "1="}]  # 82 tokens
    path = _write(tmp_path / "long.parquet", rows)
    ds = PromptDataset([path], tok, max_prompt_tokens=32, truncation=side)
    whole = PromptDataset([path], tok, max_prompt_tokens=128).rows[1].prompt_ids
    cut = ds.rows[1].prompt_ids
    assert len(ds) == 3 and ds.truncated == 1 and len(cut) == 32 and len(whole) == 82
    expect = {"left": whole[-32:], "right": whole[:32], "middle": np.concatenate([whole[:16], whole[-16:]])}[side]
    assert cut.tolist() == expect.tolist()
    assert len(PromptDataset([path], tok, max_prompt_tokens=32, truncation=side, filter_overlong=True)) == 2


def test_media_columns_are_refused_not_dropped(tmp_path, tok):
    rows = [{**r, "images": [{"bytes": b"x"}] if i == 1 else []} for i, r in enumerate(_addition_rows(2))]
    with pytest.raises(DatasetError, match="column 'images' holds media for a vision-language model"):
        PromptDataset([_write(tmp_path / "vl.parquet", rows)], tok)
    empty = [{**r, "images": []} for r in _addition_rows(2)]
    assert len(PromptDataset([_write(tmp_path / "text.parquet", empty)], tok)) == 2


def test_chat_template_kwargs_reach_the_template(tmp_path, tok):
    path = _write(tmp_path / "a.parquet", _addition_rows(2))
    seen = []
    real = tok.apply_chat_template

    def spy(messages, **kw):
        seen.append(kw.get("enable_thinking"))
        return real(messages, add_generation_prompt=kw["add_generation_prompt"], tokenize=kw["tokenize"])

    tok.apply_chat_template = spy
    try:
        PromptDataset([path], tok, chat_template_kwargs={"enable_thinking": False})
    finally:
        del tok.apply_chat_template
    assert seen == [False, False]


def test_skip_mode_counts_bad_rows_and_warns(tmp_path, tok, caplog):
    rows = _addition_rows(5)
    rows[1]["reward_model"]["ground_truth"] = None
    rows[3]["prompt"] = []
    path = _write(tmp_path / "mixed.parquet", rows)
    with caplog.at_level(logging.WARNING, logger="rollout_fleet.data"):
        ds = PromptDataset([path], tok, on_bad_row="skip")
    assert [r.row for r in ds.rows] == [0, 2, 4]
    assert len(ds.skipped) == 2 and "row 1" in ds.skipped[0] and "row 3" in ds.skipped[1]
    assert "skipped 2 bad rows of 5" in caplog.text


def test_missing_file_is_named(tmp_path, tok):
    with pytest.raises(DatasetError, match="does not exist"):
        PromptDataset([tmp_path / "nope.parquet"], tok)


def test_epochs_are_seeded_permutations(tmp_path, tok):
    path = _write(tmp_path / "small.parquet", _addition_rows(20))
    a = PromptDataset([path], tok, seed=1)
    first, second = [r.row for r in a.next_batch(20)], [r.row for r in a.next_batch(20)]
    assert sorted(first) == sorted(second) == list(range(20))
    assert first != second and a.epoch == 1
    assert [r.row for r in PromptDataset([path], tok, seed=1).next_batch(20)] == first
    assert [r.row for r in PromptDataset([path], tok, seed=2).next_batch(20)] != first
    assert [r.row for r in PromptDataset([path], tok, shuffle=False).next_batch(20)] == list(range(20))


def test_resume_yields_the_same_sequence(tmp_path, tok):
    path = _write(tmp_path / "resume.parquet", _addition_rows(30))
    a = PromptDataset([path], tok, seed=7)
    a.next_batch(47)  # into the second epoch
    state = a.state_dict()
    want = [r.uid for r in a.next_batch(50)]  # crosses into the third
    b = PromptDataset([path], tok, seed=7)
    b.load_state_dict(dict(state))
    assert [r.uid for r in b.next_batch(50)] == want

    other = PromptDataset([path], tok, seed=8)
    with pytest.raises(ValueError, match="seed=7 in the state, 8 here"):
        other.load_state_dict(state)
    fewer = PromptDataset([_write(tmp_path / "resume2.parquet", _addition_rows(29))], tok, seed=7)
    with pytest.raises(ValueError, match="num_rows"):
        fewer.load_state_dict(state)


def test_from_config(tok):
    cfg = DataConfig(train_files=[str(TEST_FILE)], test_files=[str(TEST_FILE)])
    train = from_config(cfg, tok, seed=3)
    test = from_config(cfg, tok, seed=3, split="test")
    assert len(train) == len(test) == 500
    assert [r.row for r in test.next_batch(5)] == [0, 1, 2, 3, 4]  # evaluation reads in file order
    assert [r.row for r in train.next_batch(5)] != [0, 1, 2, 3, 4]
