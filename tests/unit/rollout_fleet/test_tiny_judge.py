"""The shipped tiny judge (models/tiny-judge, tools/pretrain_judge.py) grades addition answers, and the
judge-tiny recipe wires it in as the run's reward model.

The judge is read the way ``reward.model.verdict_from: logprobs`` reads it from a vLLM server: P(Y) /
(P(Y) + P(N)) of its first token after the rendered template (the server path itself is tested against
transformers in test_reward_models.py). Held-out references, right answers and the wrong kinds a
partly trained adder writes: a judge that cannot grade would score near AUC 0.5 (SmolLM2-135M did,
bench/results/judge_cpu/)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
JUDGE = REPO / "models" / "tiny-judge"


@pytest.fixture(scope="module")
def judge():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    return (
        AutoModelForCausalLM.from_pretrained(JUDGE, dtype=torch.float32).eval(),
        AutoTokenizer.from_pretrained(JUDGE / "tokenizer"),
    )  # as the server loads it (tokenizer_path)


def test_the_tiny_judge_separates_right_from_wrong_answers(judge):
    from rollout_fleet.tasks.addition import make_splits
    from tools.pretrain_judge import grade, make_pairs

    model, tok = judge
    _, test = make_splits(20_000, 500, 0, 3)
    pairs = make_pairs(600, seed=12345, refs=[p.answer for p in test])  # not the training or saved test seeds
    m = grade(model, tok, pairs)
    assert m["right"] > 150 and m["n"] - m["right"] > 250, m
    # the shipped judge measured AUC 0.97 on 2000 held-out pairs and 0.99 on the adder's own answers at
    # training time (judge.json); on 600 pairs the AUC's spread is about 0.01, and chance is 0.5
    assert m["auc"] > 0.93 and m["accuracy"] > 0.85, m
    assert m["mean_p_yes_right"] > m["mean_p_yes_wrong"] + 0.5, m


def test_the_template_renders_as_the_judge_was_trained(judge):
    """The reward client sends the recipe's template as a chat user message: the judge's chat template
    must render it to exactly the text it was trained on (no system prompt, no role markers)."""
    from launch.config import load_run_config
    from tools.pretrain_judge import TEMPLATE, Pair

    _, tok = judge
    cfg = load_run_config("judge-tiny")
    rm = cfg.reward.model
    assert rm.template == TEMPLATE and rm.verdict_from == "text" and set(rm.scores) == {"Y", "N"}
    assert Path(rm.server.model_path).resolve() == JUDGE.resolve()  # resolved against the repo root
    assert Path(rm.server.tokenizer_path).resolve() == (JUDGE / "tokenizer").resolve()
    assert not (JUDGE / "tokenizer" / "config.json").exists()
    text = rm.template.format(question="347+85=", response="432", reference="432")
    msgs = [{"role": "user", "content": text}]
    assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == Pair("432", "432").prompt
    assert json.loads((JUDGE / "judge.json").read_text())["template"] == TEMPLATE


def test_the_model_folders_tokenizer_would_blind_the_judge():
    """Why the recipe names tokenizer_path: loaded from the model folder (config.json says qwen2), the
    tokenizer drops the template's spaces, so the served ids differ from the ones the judge was trained on."""
    from transformers import AutoTokenizer

    text = "ref 432 ans 431 ok?"
    served = AutoTokenizer.from_pretrained(JUDGE / "tokenizer").encode(text, add_special_tokens=False)
    assert len(served) == len(text)  # one id a character, spaces included
    folder = AutoTokenizer.from_pretrained(JUDGE).encode(text, add_special_tokens=False)
    if folder == served:  # a transformers that honours tokenizer_class: nothing to guard against any more
        pytest.skip("this transformers loads the model folder's tokenizer as saved")
    assert len(folder) < len(text)


@pytest.mark.parametrize("engine, flag", [("vllm", "--tokenizer"), ("sglang", "--tokenizer-path")])
def test_tokenizer_path_reaches_the_reward_servers_command_line(engine, flag):
    from launch.config import load_run_config
    from launch.reward_servers import server_spec

    cfg = load_run_config("judge-tiny", [f"reward.model.server.engine={engine}"])
    extra = server_spec(cfg, 0)["extra_args"]
    assert extra[-2:] == [flag, str((JUDGE / "tokenizer").resolve())], extra
    cfg = load_run_config("judge-tiny", ["reward.model.server.tokenizer_path=null"])
    assert "--tokenizer" not in server_spec(cfg, 0)["extra_args"]


def test_auc_from_ranks_equals_the_pairwise_definition():
    """The one AUC the judge tools use (tools.pretrain_judge.auc, from the rank sum) against the count
    over every pair, ties half, on draws with many ties; exact but for float rounding of sums."""
    import math
    import random

    from tools.pretrain_judge import auc

    rng = random.Random(0)
    for _ in range(200):
        draw = lambda: [rng.choice([0.0, 0.5, 1.0, rng.random()]) for _ in range(rng.randint(1, 30))]  # noqa: E731
        pos, neg = draw(), draw()
        pairwise = sum((p > q) + 0.5 * (p == q) for p in pos for q in neg) / (len(pos) * len(neg))
        assert math.isclose(auc(pos, neg), pairwise, abs_tol=1e-12), (pos, neg)
    assert math.isnan(auc([], [1.0])) and math.isnan(auc([1.0], []))
