"""Can a model grade word-problem answers? Its first-token P(YES) / (P(YES) + P(NO)) as a judge, per template.

The policy's own answers are the test set: ``--answers N`` prompts of ``data/word_problems/train.parquet``
sampled 4 times each (temperature 1, 48 tokens) from ``--policy``, labelled right or wrong by the rule (the
last number against the ground truth). ``--hacked DIR`` adds 2 samples each of the first 32 prompts from
another checkpoint (e.g. a policy trained against the judge), labelled ``hack`` unless right. For each
template it reports the judge's mean score per label and the ROC AUC of right against wrong and right
against hack (0.5: no better than chance; below 0.5: the judge prefers the wrong ones). It reads the
same verdict tokens as ``reward.model.verdict_from=logprobs`` (every first token that starts YES or NO,
any case, with or without a leading space), from a transformers forward of the whole vocabulary.

``--equality N`` asks the simplest question instead: N pairs of equal and N of unequal numbers (the
unequal one off by 1, 2 or 10, or random), "are these the same number?", in three phrasings.

    python bench/judge_probe.py --json bench/results/judge_cpu/probe.json [--hacked RUN/export/step_00000002]
    python bench/judge_probe.py --equality 60 --json bench/results/judge_cpu/probe_equality.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tools.pretrain_judge import auc as roc_auc  # noqa: E402

TEMPLATES = {
    # launch/recipes/smollm2-judge-1gpu.yaml's
    "reference": "Reference answer: {reference}\n\nStudent's answer:\n{response}\n\nDoes the student's answer give "
    "the reference answer as its final result? Answer YES or NO.",
    "states": "Reference answer: {reference}\n\nStudent's answer:\n{response}\n\nDoes the student's answer state the "
    "number {reference}? Answer YES or NO.",
    "contains": 'Text: "{response}"\n\nDoes this text contain the number {reference}? Answer YES or NO.',
    "final": "Student's answer:\n{response}\n\nThe correct final answer is {reference}. Did the student write "
    "{reference} as the answer? Answer YES or NO.",
    "few_shot": "Reference: 12\nAnswer: 12\nMatch: YES\n\nReference: 7\nAnswer: 15\nMatch: NO\n\nReference: 30\n"
    "Answer: The answer is 30.\nMatch: YES\n\nReference: 4\nAnswer: 9 apples\nMatch: NO\n\n"
    "Reference: {reference}\nAnswer: {response}\nMatch:",
}


EQUALITY_TEMPLATES = {
    "same": "Reference answer: {reference}\nStudent's final answer: {answer}\n\nAre these the same number? "
    "Answer YES or NO.",
    "equal": "Is {answer} equal to {reference}? Answer YES or NO.",
    "match": "The correct answer is {reference}. The student answered {answer}. Is the student correct? "
    "Answer YES or NO.",
}


def equality_pairs(n: int, seed: int) -> list[tuple[int, int, str]]:
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        ref = rng.randint(2, 99)
        other = ref
        while other == ref:
            other = rng.choice([ref + rng.choice([-2, -1, 1, 2, 10]), rng.randint(2, 99)])
        out += [(ref, ref, "right"), (other, ref, "wrong")]
    return out


def first_token_scores(judge, tok, prompts: list[str], yes: list[int], no: list[int]) -> list[float]:
    scores: list[float] = []
    for k in range(0, len(prompts), 32):
        texts = [
            tok.apply_chat_template([{"role": "user", "content": c}], tokenize=False, add_generation_prompt=True)
            for c in prompts[k : k + 32]
        ]
        enc = tok(texts, return_tensors="pt", padding=True)
        with torch.no_grad():
            p = judge(**enc).logits[:, -1].float().softmax(-1)
        py, pn = p[:, yes].sum(-1), p[:, no].sum(-1)
        scores += (py / (py + pn)).tolist()
    return scores


def last_number_is(text: str, truth: str) -> bool:
    nums = re.findall(r"-?\d+(?:\.\d+)?", text)
    return bool(nums) and nums[-1] == truth


def sample(model, tok, rows, n: int, max_new: int, seed: int) -> list[tuple[dict, str]]:
    torch.manual_seed(seed)
    out: list[tuple[dict, str]] = []
    for i in range(0, len(rows), 16):
        batch = rows[i : i + 16]
        texts = [tok.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True) for r in batch]
        enc = tok(texts, return_tensors="pt", padding=True)
        with torch.no_grad():
            gen = model.generate(
                **enc,
                do_sample=True,
                temperature=1.0,
                max_new_tokens=max_new,
                num_return_sequences=n,
                pad_token_id=tok.pad_token_id,
            )
        for j, seq in enumerate(gen):
            out.append((batch[j // n], tok.decode(seq[enc["input_ids"].shape[1] :], skip_special_tokens=True)))
    return out


def verdict_ids(tok, word: str) -> list[int]:
    variants = {word.upper(), word.capitalize(), word.lower()}
    return sorted({tok.encode(p + v, add_special_tokens=False)[0] for v in variants for p in ("", " ")})


def auc(pos: list[float], neg: list[float]) -> float | None:
    """tools.pretrain_judge.auc, None (JSON null) when a side is empty."""
    return roc_auc(pos, neg) if pos and neg else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--judge", default=".cache/models/smollm2-135m-instruct")
    ap.add_argument("--policy", default=None, help="the model whose answers are graded (default: the judge's)")
    ap.add_argument("--hacked", default=None, help="a further checkpoint whose answers are labelled 'hack'")
    ap.add_argument("--data", default="data/word_problems/train.parquet")
    ap.add_argument("--answers", type=int, default=64, help="prompts, 4 samples each")
    ap.add_argument("--templates", default=",".join(TEMPLATES))
    ap.add_argument("--equality", type=int, default=0, help="N equal and N unequal number pairs instead")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    t0 = time.monotonic()
    tok = AutoTokenizer.from_pretrained(args.judge)
    tok.padding_side = "left"
    judge = AutoModelForCausalLM.from_pretrained(args.judge, dtype=torch.float32).eval()
    yes, no = verdict_ids(tok, "yes"), verdict_ids(tok, "no")
    if args.equality:
        pairs = equality_pairs(args.equality, args.seed)
        results = {}
        for name, tpl in EQUALITY_TEMPLATES.items():
            sc = first_token_scores(judge, tok, [tpl.format(answer=a, reference=r) for a, r, _ in pairs], yes, no)
            by = {k: [x for x, q in zip(sc, pairs, strict=True) if q[2] == k] for k in ("right", "wrong")}
            results[name] = {
                "mean_score": {k: round(sum(v) / len(v), 4) for k, v in by.items()},
                "auc_equal_vs_unequal": auc(by["right"], by["wrong"]),
            }
            print(name, json.dumps(results[name]), flush=True)
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(
                json.dumps(
                    {
                        "judge": args.judge,
                        "pairs": len(pairs),
                        "seed": args.seed,
                        "templates": EQUALITY_TEMPLATES,
                        "results": results,
                        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                        "seconds": round(time.monotonic() - t0, 1),
                    },
                    indent=1,
                )
            )
        return
    policy = (
        judge if args.policy is None else AutoModelForCausalLM.from_pretrained(args.policy, dtype=torch.float32).eval()
    )
    rows = pq.read_table(args.data).to_pylist()
    answers = [
        (r, a, "right" if last_number_is(a, r["reward_model"]["ground_truth"]) else "wrong")
        for r, a in sample(policy, tok, rows[: args.answers], 4, 48, args.seed)
    ]
    if args.hacked:
        hacked = AutoModelForCausalLM.from_pretrained(args.hacked, dtype=torch.float32).eval()
        answers += [
            (r, a, "right" if last_number_is(a, r["reward_model"]["ground_truth"]) else "hack")
            for r, a in sample(hacked, tok, rows[:32], 2, 24, args.seed + 1)
        ]
    counts = {k: sum(1 for a in answers if a[2] == k) for k in ("right", "wrong", "hack")}
    print("answers:", counts, flush=True)
    results = {}
    for name in filter(None, args.templates.split(",")):
        scores = first_token_scores(
            judge,
            tok,
            [
                TEMPLATES[name].format(reference=r["reward_model"]["ground_truth"], response=a.strip())
                for r, a, _ in answers
            ],
            yes,
            no,
        )
        by = {k: [s for s, a in zip(scores, answers, strict=True) if a[2] == k] for k in counts}
        results[name] = {
            "mean_score": {k: round(sum(v) / len(v), 4) if v else None for k, v in by.items()},
            "auc_right_vs_wrong": auc(by["right"], by["wrong"]),
            "auc_right_vs_hack": auc(by["right"], by["hack"]),
        }
        print(name, json.dumps(results[name]), flush=True)
    report = {
        "judge": args.judge,
        "policy": args.policy or args.judge,
        "hacked": args.hacked,
        "answers": counts,
        "seed": args.seed,
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "seconds": round(time.monotonic() - t0, 1),
        "templates": TEMPLATES,
        "results": results,
        "examples": {k: [a for _, a, lab in answers if lab == k][:4] for k in counts},
    }
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
