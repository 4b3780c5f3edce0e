"""Easy GSM8K-style word problems in verl's layout, sized for a small pretrained instruct model.

One-step problems over small numbers (``"Mia has 14 shells. She finds 5 more. How many shells
does Mia have now?"`` -> ``"19"``), written as verl's GSM8K preprocessing writes its rows:
a chat-message ``prompt`` (a system turn asking for only the final number, then the question),
``reward_model``
``{"style": "rule", "ground_truth": "19"}``, ``data_source`` :data:`DATA_SOURCE`, and
``extra_info`` with the split, index, question and answer. The default reward routes this
data source to GSM8K's scorer in flexible mode (the answer after ``####`` if any, else the
response's last number), so a model that answers without the marker still scores.

Generation is a pure function of the seed; test problems are drawn first and excluded from
the train split, so the two share no problem text.

CLI::

    python -m rollout_fleet.tasks.word_problems --out data/word_problems
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path
from typing import Any

DATA_SOURCE = "fleetrl/word_problems"
SYSTEM = "Answer with only the final number."

NAMES = ["Mia", "Tom", "Ava", "Leo", "Zoe", "Sam", "Ivy", "Ben", "Lily", "Max", "Emma", "Noah"]
THINGS = ["apples", "marbles", "stickers", "shells", "books", "pencils", "cookies", "coins", "cards", "stamps"]
# (template, operation): {n} name, {t} thing, {a} {b} numbers; every template has one answer
TEMPLATES = [
    ("{n} has {a} {t}. {n} gets {b} more. How many {t} does {n} have now?", "+"),
    ("{n} had {a} {t} and found {b} more. How many {t} does {n} have in total?", "+"),
    ("There are {a} {t} in a box and {b} {t} on the table. How many {t} are there altogether?", "+"),
    ("{n} has {a} {t}. {n} gives away {b} of them. How many {t} does {n} have left?", "-"),
    ("{n} had {a} {t} and lost {b}. How many {t} are left?", "-"),
    ("{n} buys {a} bags with {b} {t} in each bag. How many {t} does {n} buy?", "*"),
    ("{n} has {a} boxes of {t}. Each box holds {b} {t}. How many {t} are there?", "*"),
]


def _problem(rng: random.Random, max_value: int) -> tuple[str, int]:
    template, op = rng.choice(TEMPLATES)
    if op == "*":
        a, b = rng.randint(2, 9), rng.randint(2, 9)
        answer = a * b
    else:
        a, b = rng.randint(2, max_value), rng.randint(1, max_value)
        if op == "-":
            a, b = max(a, b) + 1, min(a, b)
        answer = a + b if op == "+" else a - b
    text = template.format(n=rng.choice(NAMES), t=rng.choice(THINGS), a=a, b=b)
    return text, answer


def generate(
    n: int, seed: int, max_value: int = 10, exclude: frozenset[str] | set[str] = frozenset()
) -> list[tuple[str, int]]:
    """``n`` distinct ``(question, answer)`` pairs, none whose question is in ``exclude``."""
    if n < 0 or max_value < 2:
        raise ValueError(f"need n >= 0 and max_value >= 2, got n={n}, max_value={max_value}")
    rng = random.Random(seed)
    seen: set[str] = set()
    out: list[tuple[str, int]] = []
    tries = 0
    while len(out) < n:
        tries += 1
        if tries > 50 * (n + 10):
            raise ValueError(f"cannot draw {n} distinct problems with max_value={max_value}")
        q, a = _problem(rng, max_value)
        if q in seen or q in exclude:
            continue
        seen.add(q)
        out.append((q, a))
    return out


def make_splits(n_train: int, n_test: int, seed: int, max_value: int = 10):
    test = generate(n_test, seed=seed * 2 + 1, max_value=max_value)
    train = generate(n_train, seed=seed * 2, max_value=max_value, exclude={q for q, _ in test})
    return train, test


def to_rows(problems: list[tuple[str, int]], split: str) -> list[dict[str, Any]]:
    """Rows exactly as verl's ``examples/data_preprocess/gsm8k.py`` lays them out."""
    return [
        {
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(a)},
            "extra_info": {"split": split, "index": i, "question": q, "answer": f"#### {a}"},
        }
        for i, (q, a) in enumerate(problems)
    ]


def write(out: Path, n_train: int = 4000, n_test: int = 200, seed: int = 0, max_value: int = 10) -> dict[str, Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    out.mkdir(parents=True, exist_ok=True)
    train, test = make_splits(n_train, n_test, seed, max_value)
    paths = {}
    for split, probs in (("train", train), ("test", test)):
        paths[split] = out / f"{split}.parquet"
        pq.write_table(pa.Table.from_pylist(to_rows(probs, split)), paths[split])
    return paths


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("data/word_problems"))
    p.add_argument("--train", type=int, default=4000)
    p.add_argument("--test", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-value", type=int, default=10)
    a = p.parse_args(argv)
    for split, path in write(a.out, a.train, a.test, a.seed, a.max_value).items():
        print(f"{split}: {path}")


if __name__ == "__main__":
    main()
