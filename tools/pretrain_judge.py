"""Train the tiny judge from scratch on CPU: a generative grader for the addition task.

The judge reads ``"ref=432;ans=431;ok?"`` (the reward's template, rendered by its chat template
as the user message only) and answers ``Y`` or ``N`` then ``<eos>``: ``Y`` when the candidate, with
surrounding spaces stripped, is the reference answer (the rule of ``reward.function: exact_match``).
It never sees the question: it is a reference-based judge, the kind a run uses when a reference
exists but the answers' form varies. Served by vLLM like the policy, it is scored through
``reward.model`` with ``verdict_from: logprobs``, so its reward is P(Y) / (P(Y) + P(N)).

Why a judge of our own: the only instruction model installable here, SmolLM2-135M, cannot tell
whether two numbers are equal (``bench/results/judge_cpu/``: AUC 0.43-0.55), and a judge that
cannot grade teaches the policy to please it, not to answer. This one is trained on wrong answers
of the kinds a partly trained adder gives (a digit off, a carry missed, a digit dropped or added,
digits swapped, junk), and is checked at the end on answers the tiny adder itself samples.

    python -m tools.pretrain_judge --out models/tiny-judge
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from rollout_fleet.scorers import exact_match
from rollout_fleet.tasks.addition import generate, make_splits
from tools.pretrain_tiny import (
    add_training_args,
    build_model,
    build_tokenizer,
    encode_batch,
    fit,
    save_folder,
    save_tokenizer,
)

logger = logging.getLogger(__name__)

TEMPLATE = "ref {reference} ans {response} ok?"  # the recipe's reward.model.template (judge-tiny.yaml)
MAX_RESPONSE_CHARS = 8  # the tiny recipes' sampling.max_tokens: one character a token


@dataclass(frozen=True, slots=True)
class Pair:
    """One judge example in the shape tools.pretrain_tiny.encode_batch takes (``prompt``, ``answer``)."""

    reference: str
    response: str

    @property
    def prompt(self) -> str:
        return TEMPLATE.format(reference=self.reference, response=self.response)

    @property
    def answer(self) -> str:
        return "Y" if exact_match(self.response, self.reference) else "N"


def _wrong(rng: random.Random, ref: str) -> str:
    """A wrong answer of one of the kinds a partly trained adder writes."""
    digits = "0123456789"
    kind = rng.random()
    if kind < 0.30:  # one digit changed
        i = rng.randrange(len(ref))
        out = ref[:i] + rng.choice(digits.replace(ref[i], "")) + ref[i + 1 :]
    elif kind < 0.50:  # off by a little (a missed or extra carry, a slip)
        out = str(max(0, int(ref) + rng.choice([-1, 1]) * rng.choice([1, 1, 2, 9, 10, 11, 100])))
    elif kind < 0.65:  # a digit dropped or added
        i = rng.randrange(len(ref) + 1)
        out = (
            (ref[:i] + ref[i + 1 :]) if rng.random() < 0.5 and len(ref) > 1 else ref[:i] + rng.choice(digits) + ref[i:]
        )
    elif kind < 0.75 and len(ref) > 1:  # two neighbours swapped
        i = rng.randrange(len(ref) - 1)
        out = ref[:i] + ref[i + 1] + ref[i] + ref[i + 2 :]
    elif kind < 0.85:  # the reference and more after it
        out = ref + "".join(rng.choice(digits + "+= ") for _ in range(rng.randint(1, 3)))
    elif kind < 0.95:  # another number
        out = str(rng.randint(0, 1998))
    else:  # junk, or nothing
        out = "".join(rng.choice(digits + "+= ") for _ in range(rng.randint(0, 6)))
    out = out[:MAX_RESPONSE_CHARS]
    return out if out.strip() != ref else _wrong(rng, ref)


def make_pairs(n: int, seed: int, refs: list[str]) -> list[Pair]:
    """``n`` pairs over the references ``refs``: 40% right (some with spaces around), 60% wrong."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        ref = rng.choice(refs)
        if rng.random() < 0.4:
            resp = (" " if rng.random() < 0.1 else "") + ref + (" " if rng.random() < 0.1 else "")
        else:
            resp = _wrong(rng, ref)
        out.append(Pair(ref, resp))
    return out


@torch.no_grad()
def p_yes(model, tok, pairs: list[Pair], batch: int = 512) -> list[float]:
    """P(Y) / (P(Y) + P(N)) of the judge's first answer token, as ``verdict_from: logprobs`` reads it."""
    model.eval()
    y, n = tok.convert_tokens_to_ids("Y"), tok.convert_tokens_to_ids("N")
    out: list[float] = []
    for i in range(0, len(pairs), batch):
        enc = [tok.encode(p.prompt, add_special_tokens=False) for p in pairs[i : i + batch]]
        width = max(len(e) for e in enc)
        ids = torch.full((len(enc), width), tok.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(enc), width), dtype=torch.long)
        for r, e in enumerate(enc):  # left padding: the last position is each prompt's end
            ids[r, width - len(e) :] = torch.tensor(e)
            mask[r, width - len(e) :] = 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -1]
        two = torch.log_softmax(logits.float(), -1)[:, [y, n]].exp()
        out += (two[:, 0] / two.sum(-1)).tolist()
    model.train()
    return out


def auc(pos: list[float], neg: list[float]) -> float:
    """P(a right answer scores above a wrong one), ties half (ROC AUC, from the rank sum: O(n log n));
    NaN when either side is empty."""
    if not pos or not neg:
        return float("nan")
    ranked = sorted([(v, 1) for v in pos] + [(v, 0) for v in neg])
    rank_sum, i = 0.0, 0
    while i < len(ranked):
        j = i
        while j < len(ranked) and ranked[j][0] == ranked[i][0]:
            j += 1
        rank_sum += (i + j + 1) / 2 * sum(k for _, k in ranked[i:j])  # a tie block shares its mean rank
        i = j
    return (rank_sum - len(pos) * (len(pos) + 1) / 2) / (len(pos) * len(neg))


def grade(model, tok, pairs: list[Pair]) -> dict[str, float]:
    scores = p_yes(model, tok, pairs)
    right = [s for s, p in zip(scores, pairs, strict=True) if p.answer == "Y"]
    wrong = [s for s, p in zip(scores, pairs, strict=True) if p.answer == "N"]
    acc = sum((s > 0.5) == (p.answer == "Y") for s, p in zip(scores, pairs, strict=True)) / len(pairs)
    return {
        "accuracy": round(acc, 4),
        "auc": round(auc(right, wrong), 4),
        "n": len(pairs),
        "right": len(right),
        "mean_p_yes_right": round(sum(right) / max(1, len(right)), 4),
        "mean_p_yes_wrong": round(sum(wrong) / max(1, len(wrong)), 4),
    }


@torch.no_grad()
def adder_pairs(adder: Path, n: int, seed: int) -> list[Pair]:
    """Answers the tiny adder samples (temperature 1, up to 8 tokens) to ``n`` test problems."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollout_fleet.tasks.addition import make_splits as splits

    atok = AutoTokenizer.from_pretrained(adder)
    model = AutoModelForCausalLM.from_pretrained(adder, dtype=torch.float32).eval()
    _, test = splits(20_000, 500, 0, 3)
    torch.manual_seed(seed)
    out = []
    for p in test[:n]:
        ids = torch.tensor([atok.encode(p.prompt, add_special_tokens=False)])
        gen = model.generate(
            ids,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            max_new_tokens=MAX_RESPONSE_CHARS,
            num_return_sequences=4,
            pad_token_id=atok.pad_token_id,
            eos_token_id=atok.eos_token_id,
        )
        for row in gen[:, ids.shape[1] :]:
            out.append(Pair(p.answer, atok.decode(row.tolist(), skip_special_tokens=True)))
    return out


def as_served(tok):
    """The tokenizer as the judge's server loads it: from ``OUT/tokenizer``, a folder with no ``config.json``
    (the recipe's ``reward.model.server.tokenizer_path``, vLLM's ``--tokenizer``). From the model folder
    itself transformers 5 would load ``Qwen2Tokenizer`` (the config's model type), whose byte-level
    pre-tokenizer drops some spaces the character vocabulary has: a judge trained on the template's
    spaces then saw other ids and graded at chance (AUC 0.51)."""
    import tempfile

    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as d:
        save_tokenizer(tok, Path(d))
        return AutoTokenizer.from_pretrained(d)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("models/tiny-judge"))
    ap.add_argument(
        "--adder",
        type=Path,
        default=Path("models/tiny-adder"),
        help="the policy whose sampled answers the final check grades",
    )
    ap.add_argument("--pairs", type=int, default=60_000)
    add_training_args(ap, batch=256, lr=2e-3, max_steps=4000, eval_every=100, target_acc=0.99)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    t0 = time.time()

    train_problems, test_problems = make_splits(20_000, 500, 0, 3)  # data/addition's splits
    train = make_pairs(args.pairs, args.seed, [p.answer for p in train_problems])
    val = make_pairs(2000, args.seed + 1, [p.answer for p in generate(500, seed=7, exclude=set(test_problems))])
    test = make_pairs(2000, args.seed + 2, [p.answer for p in test_problems])
    tok = build_tokenizer()
    seen = as_served(tok)
    model = build_model(len(tok), args.hidden, args.layers, args.heads, args.kv_heads, args.intermediate, tok)
    n_params = sum(p.numel() for p in model.parameters())
    logger.info(
        "judge: %d parameters; %d training pairs, %.0f%% right",
        n_params,
        len(train),
        100 * sum(p.answer == "Y" for p in train) / len(train),
    )
    all_ids, all_lab = encode_batch(train, seen)
    step, val_m = fit(model, args, all_ids, all_lab, lambda: grade(model, seen, val), t0)
    val_m = val_m or {"accuracy": 0.0}
    test_m = grade(model, seen, test)
    sampled = grade(model, seen, adder_pairs(args.adder, 200, args.seed)) if args.adder.exists() else None
    wall = time.time() - t0
    logger.info("stopped at step %d: test %s; on the adder's own answers %s; %.0f s", step, test_m, sampled, wall)
    save(
        model,
        tok,
        args,
        step=step,
        val=val_m,
        test=test_m,
        sampled=sampled,
        wall=wall,
        n_params=n_params,
        argv=sys.argv[1:] if argv is None else argv,
    )


def save(model, tok, args, *, step, val, test, sampled, wall, n_params, argv) -> None:
    save_folder(model, tok, args.out)
    save_tokenizer(tok, args.out / "tokenizer")  # what the server loads (as_served)
    meta = {
        "step": step,
        "val": val,
        "test": test,
        "adder_samples": sampled,
        "wall_s": round(wall, 1),
        "parameters": n_params,
        "template": TEMPLATE,
        "command": "python -m tools.pretrain_judge " + " ".join(argv),
    }
    (args.out / "judge.json").write_text(json.dumps(meta, indent=2) + "\n")
    s = sampled or {}
    (args.out / "README.md").write_text(f"""# tiny-judge

A {n_params:,}-parameter Qwen2ForCausalLM trained from scratch on CPU to grade answers of the
addition task against the reference (`tools/pretrain_judge.py`). Input, the user message only:
`{TEMPLATE}`; output `Y` or `N` then `<eos>`: `Y` when the stripped candidate equals the reference
(the rule of `exact_match`). Same character-level tokenizer as `models/tiny-adder`; serve it with
`--tokenizer models/tiny-judge/tokenizer` (no `config.json` there: from this folder transformers 5 loads
a byte-level `Qwen2Tokenizer` that drops spaces of the template, and the judge grades at chance).

- command: `{meta["command"]}` (seed {args.seed}, {args.threads} thread(s), batch {args.batch}, lr {args.lr})
- shape: hidden {args.hidden}, {args.layers} layers, {args.heads} heads, {args.kv_heads} KV heads,
  intermediate {args.intermediate}, vocab {model.config.vocab_size}, float32
- stopped at step {step}; validation accuracy {val["accuracy"]:.3f}
- held-out pairs (test-split references, {test["n"]} pairs): accuracy **{test["accuracy"]:.3f}**, AUC {test["auc"]:.3f}
- answers the tiny adder samples to test problems ({s.get("n", 0)} answers, {s.get("right", 0)} right by the
  rule): accuracy **{s.get("accuracy", float("nan")):.3f}**, AUC {s.get("auc", float("nan")):.3f}
  (mean P(Y) {s.get("mean_p_yes_right", float("nan")):.3f} on right answers, {s.get("mean_p_yes_wrong", float("nan")):.3f} on wrong)
- wall time: {wall:.0f} s on the shared 2-core CPU machine
- figures also in `judge.json`
""")
    logger.info("saved to %s", args.out)


if __name__ == "__main__":
    main()
