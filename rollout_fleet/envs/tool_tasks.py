"""Word problems with a calculator tool, for a small instruct model (SmolLM2) on the GPU machine.

The numbers are large enough that a 135M model rarely gets the product right in its head
(``"Mia buys 37 bags with 48 stickers in each bag..."``), so calling the calculator pays:
the system turn describes the tool and the Hermes call format; the environment
(rollout_fleet/envs/tools.py) answers each call and scores the last number of the final turn.

CLI::

    python -m rollout_fleet.envs.tool_tasks --out data/tool_word_problems
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

from rollout_fleet.envs.tools import CALCULATOR_SCHEMA

DATA_SOURCE = "fleetrl/tool_word_problems"
SYSTEM = (
    "You can use a calculator. To call it, write exactly\n<tool_call>\n"
    '{"name": "calculator", "arguments": {"expression": "37*48"}}\n</tool_call>\n'
    "and stop; the result comes back in <tool_response>. When you know the answer, reply with only the "
    f"final number.\nTool schema: {json.dumps(CALCULATOR_SCHEMA['function'])}"
)
# One worked exchange before the problem (``--shots 1``): SmolLM2-135M-Instruct given only the system
# turn never wrote a call in 3,840 episodes on the H200 (2026-12-02), so GRPO had no signal. The
# demonstration is rendered as the environment renders a real exchange: the call, a user turn of
# <tool_response>, then the bare number.
DEMO = [
    {"role": "user", "content": "Mia buys 37 bags with 48 stickers in each bag. How many stickers does Mia buy?"},
    {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "calculator", "arguments": {"expression": "37*48"}}\n</tool_call>',
    },
    {"role": "user", "content": "<tool_response>\n1776\n</tool_response>"},
    {"role": "assistant", "content": "1776"},
]
NAMES = ["Mia", "Tom", "Ava", "Leo", "Zoe", "Sam", "Ivy", "Ben", "Lily", "Max"]
THINGS = ["apples", "marbles", "stickers", "shells", "books", "pencils", "cookies", "coins"]
TEMPLATES = [
    ("{n} buys {a} bags with {b} {t} in each bag. How many {t} does {n} buy?", lambda a, b: a * b, (12, 99), (12, 99)),
    (
        "{n} has {a} boxes of {t}. Each box holds {b} {t}. How many {t} are there?",
        lambda a, b: a * b,
        (12, 99),
        (12, 99),
    ),
    (
        "{n} had {a} {t} and found {b} more. How many {t} does {n} have in total?",
        lambda a, b: a + b,
        (100, 999),
        (100, 999),
    ),
    ("{n} has {a} {t} and gives away {b}. How many {t} are left?", lambda a, b: a - b, (500, 999), (100, 499)),
]


def make_rows(
    n: int, seed: int, split: str, exclude: frozenset[str] = frozenset(), shots: int = 1
) -> list[dict[str, Any]]:
    if shots not in (0, 1):
        raise ValueError(f"shots must be 0 or 1 (one worked exchange), got {shots}")
    rng, rows, seen = random.Random(seed), [], set(exclude) | {DEMO[0]["content"]}
    while len(rows) < n:
        template, op, ra, rb = rng.choice(TEMPLATES)
        a, b = rng.randint(*ra), rng.randint(*rb)
        q = template.format(n=rng.choice(NAMES), t=rng.choice(THINGS), a=a, b=b)
        if q in seen:
            continue
        seen.add(q)
        rows.append(
            {
                "data_source": DATA_SOURCE,
                "prompt": [
                    {"role": "system", "content": SYSTEM},
                    *(DEMO if shots else []),
                    {"role": "user", "content": q},
                ],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(op(a, b))},
                "extra_info": {"split": split, "index": len(rows)},
            }
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("data/tool_word_problems"))
    p.add_argument("--train", type=int, default=8000)
    p.add_argument("--test", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shots", type=int, default=1, choices=(0, 1), help="worked tool exchanges before the problem")
    a = p.parse_args(argv)
    test = make_rows(a.test, a.seed * 2 + 1, "test", shots=a.shots)
    train = make_rows(a.train, a.seed * 2, "train", frozenset(r["prompt"][-1]["content"] for r in test), a.shots)
    a.out.mkdir(parents=True, exist_ok=True)
    for split, rows in (("train", train), ("test", test)):
        pq.write_table(pa.Table.from_pylist(rows), a.out / f"{split}.parquet")
        print(f"{split}: {a.out / f'{split}.parquet'} ({len(rows)} problems)")


if __name__ == "__main__":
    main()
