"""A sequence-classifier reward model on the real vLLM CPU server (``--runner pooling``).

The classifier is the tiny model's body with a seeded random 2-class head
(``Qwen2ForSequenceClassification``), built here. It is no judge of anything. What the test checks
is that ``ClassifierClient`` and ``ModelRewardScorer`` give, through vLLM's ``/classify``, the
probabilities a transformers forward of the same checkpoint gives, in input order. It also checks
that ``/pooling`` of a 2-class model is refused by name rather than read as one reward.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from rollout_fleet.reward_models import ClassifierClient, ModelRewardScorer, RewardModelError
from rollout_fleet.worker import Prompt
from tests.support.vllm_cpu import cpu_vllm_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
TINY_MODEL = Path(__file__).resolve().parents[3] / "models" / "tiny-adder"
TEXTS = ["12+3=15", "12+3=9", "40+45=85", "7+2="]


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory):
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    out = tmp_path_factory.mktemp("tiny_classifier")
    cfg = AutoConfig.from_pretrained(TINY_MODEL)
    cfg.num_labels, cfg.architectures = 2, ["Qwen2ForSequenceClassification"]
    cfg.id2label, cfg.label2id = {0: "bad", 1: "good"}, {"bad": 0, "good": 1}
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(TINY_MODEL, config=cfg, dtype=torch.float32)
    with torch.no_grad():  # small enough that the probabilities are not all 0 or 1
        model.score.weight.normal_(0.0, 0.05)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(TINY_MODEL).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def classifier_server(classifier_dir, tmp_path_factory):
    with cpu_vllm_server(
        classifier_dir,
        tmp_path_factory.mktemp("classifier_server"),
        max_model_len=64,
        max_num_seqs=8,
        served_model_name="tiny-rm",
        weight_transfer=False,
        extra_args=["--runner", "pooling"],
    ) as s:
        yield s


def reference_probs(classifier_dir, texts):
    """transformers' class probabilities of each text, tokenised as the server does (special tokens added)."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(classifier_dir)
    model = AutoModelForSequenceClassification.from_pretrained(classifier_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for t in texts:  # one at a time: no padding, the last token is the text's own
            logits = model(torch.tensor([tok(t)["input_ids"]])).logits[0]
            out.append(logits.softmax(-1).tolist())
    return out


def test_the_classifier_rewards_are_the_models_class_probabilities(classifier_server, classifier_dir):
    async def main():
        rm = ClassifierClient(
            classifier_server.url,
            model="tiny-rm",
            endpoint="classify",
            label=1,
            timeout_s=60,
            retries=1,
            backoff_s=0.01,
        )
        got = await rm.score_texts(TEXTS)
        wrong_label = ClassifierClient(
            classifier_server.url, model="tiny-rm", endpoint="classify", label=2, timeout_s=60, retries=1
        )
        with pytest.raises(RewardModelError, match="label 2 asked of a classifier with 2 classes"):
            await wrong_label.score_texts(TEXTS[:1])
        await rm.close()
        await wrong_label.close()
        return got, rm

    got, rm = asyncio.run(main())
    ref = [p[1] for p in reference_probs(classifier_dir, TEXTS)]
    # fp32 on both sides, different kernels: a probability agrees to well under 1e-4
    assert got == pytest.approx(ref, abs=1e-4)
    assert max(got) - min(got) > 1e-3  # the inputs really got different scores, in their own order
    assert rm.failures == {} and rm.calls_ok == 1


def test_the_scorer_sends_prompt_and_answer_and_pooling_of_a_classifier_is_refused(classifier_server, classifier_dir):
    from rollout_fleet.envs.base import HFCodec

    codec = HFCodec.from_pretrained(str(classifier_dir))
    tok = codec.tokenizer
    prompt = Prompt(prompt_ids=tok("12+3=", add_special_tokens=False)["input_ids"], ground_truth="15")

    class Sample:
        def __init__(self, text):
            self.token_ids = tok(text, add_special_tokens=False)["input_ids"]

    async def main():
        rm = ClassifierClient(classifier_server.url, model="tiny-rm", endpoint="classify", label=1, timeout_s=60)
        scores = await ModelRewardScorer(rm, codec, tokenizer=tok).score(prompt, [Sample("15"), Sample("9")])
        pooled = ClassifierClient(classifier_server.url, model="tiny-rm", endpoint="pooling", timeout_s=60, retries=2)
        with pytest.raises(RewardModelError, match="2 values per input") as e:
            await pooled.score_texts(["12+3=15"])
        await rm.close()
        await pooled.close()
        return scores, e.value, pooled

    scores, err, pooled = asyncio.run(main())
    ref = [p[1] for p in reference_probs(classifier_dir, ["12+3=15", "12+3=9"])]
    assert scores == pytest.approx(ref, abs=1e-4)
    assert err.reason == "bad_response" and pooled.failures == {"bad_response": 1}  # not retried
