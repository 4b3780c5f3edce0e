"""Chain addition: a multi-turn task the tiny CPU model can learn (``a+b=`` then ``S+c=`` ...).

Turn 1 answers the prompt ``a+b=``. The environment reads the model's number ``S`` and asks
``S+c=`` (the model's own answer carried on, as a tool would return it), and so on through
the addends in ``extra_info["addends"]``. Each turn is checked against the sum it was asked
for (turn 1: ``a+b``; turn k: the carried answer plus the k-th addend), and the reward is the
fraction of correct turns: the tiny model, pretrained on single problems, solves few turns
with an earlier problem in its context, so the later turns are what RL must teach it. A turn
without a number ends the episode. ``info["chain_ok"]``: every turn right (the last answer
is the true total, the ground truth).
"""

from __future__ import annotations

import random
import re
from typing import Any

from rollout_fleet.envs.base import Environment, StepResult, Turn
from rollout_fleet.tasks.addition import _operand

DATA_SOURCE = "chain_addition"
_NUMBER = re.compile(r"^\s*(-?\d+)")


class ChainAdditionEnv(Environment):
    name = "chain_addition"

    def __init__(self, eos_text: str = "<eos>") -> None:
        self.eos_text = eos_text
        self.addends: list[int] = []
        self.total = ""
        self.k = 0
        self.expected = 0
        self.correct = 0

    async def reset(self, ground_truth: str, extra_info: dict[str, Any]) -> None:
        addends = extra_info.get("addends")
        if not isinstance(addends, list) or not all(isinstance(a, int) for a in addends):
            raise ValueError(f"chain_addition needs extra_info['addends'] as a list of ints, got {addends!r}")
        first = extra_info.get("first")
        if not isinstance(first, int):
            raise ValueError(f"chain_addition needs extra_info['first'] (a+b) as an int, got {first!r}")
        self.addends, self.total, self.k = list(addends), str(ground_truth).strip(), 0
        self.expected, self.correct = first, 0

    async def step(self, turn: Turn) -> StepResult:
        n_turns = len(self.addends) + 1
        m = _NUMBER.match(turn.text.split(self.eos_text, 1)[0])
        if m is None:  # no number: the chain is broken
            return StepResult(done=True, info={"parsed": None, "turn": self.k, "chain_ok": False})
        value = int(m.group(1))
        ok = value == self.expected
        self.correct += ok
        reward = float(ok) / n_turns
        if self.k == len(self.addends):
            return StepResult(
                done=True,
                reward=reward,
                info={"parsed": value, "correct": self.correct, "chain_ok": m.group(1) == self.total},
            )
        self.expected = value + self.addends[self.k]
        obs = f"{value}+{self.addends[self.k]}="
        self.k += 1
        return StepResult(observation=obs, reward=reward, info={"parsed": value})


def make_rows(n: int, seed: int, *, turns: int = 2, max_digits: int = 2, split: str = "train") -> list[dict[str, Any]]:
    """Rows in the dataset layout (verl's), ``turns`` additions each: ``a+b=`` then ``turns - 1`` addends."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = _operand(rng, max_digits), _operand(rng, max_digits)
        addends = [_operand(rng, max_digits) for _ in range(turns - 1)]
        rows.append(
            {
                "data_source": DATA_SOURCE,
                "prompt": [{"role": "user", "content": f"{a}+{b}="}],
                "ability": "arithmetic",
                "reward_model": {"style": "rule", "ground_truth": str(a + b + sum(addends))},
                "extra_info": {"split": split, "index": i, "first": a + b, "addends": addends},
            }
        )
    return rows


def write_parquet(rows: list[dict[str, Any]], path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema(
        [
            ("data_source", pa.string()),
            ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
            ("ability", pa.string()),
            ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
            (
                "extra_info",
                pa.struct(
                    [
                        ("split", pa.string()),
                        ("index", pa.int64()),
                        ("first", pa.int64()),
                        ("addends", pa.list_(pa.int64())),
                    ]
                ),
            ),
        ]
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path, compression="zstd")


def main(argv: list[str] | None = None) -> None:
    """``python -m rollout_fleet.envs.chain_addition --out data/chain_addition`` (train and test splits)."""
    import argparse
    from pathlib import Path

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("data/chain_addition"))
    ap.add_argument("--train", type=int, default=20_000)
    ap.add_argument("--test", type=int, default=500)
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--max-digits", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    write_parquet(
        make_rows(args.train, args.seed * 2, turns=args.turns, max_digits=args.max_digits), args.out / "train.parquet"
    )
    write_parquet(
        make_rows(args.test, args.seed * 2 + 1, turns=args.turns, max_digits=args.max_digits, split="test"),
        args.out / "test.parquet",
    )
    print(f"wrote {args.train} train and {args.test} test episodes' prompts to {args.out}")


if __name__ == "__main__":
    main()
