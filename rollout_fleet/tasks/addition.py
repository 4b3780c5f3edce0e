"""Multi-digit addition, the synthetic verifiable task of the tiny CPU setup.

A problem is ``"347+85="`` with the answer ``"432"``. Each operand first draws its
digit count uniformly from ``1..max_digits`` and then a value with that many
digits, so short and long problems are equally common: a partly trained model
solves the short ones and misses many of the long ones, which gives GRPO groups
with a spread of rewards.

Generation is a pure function of the seed. The test split is drawn first and its
problems are excluded from the train split, so the two never share a problem.

CLI::

    python -m rollout_fleet.tasks.addition --out data/addition
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DATA_SOURCE = "addition"
ABILITY = "arithmetic"


@dataclass(frozen=True, slots=True)
class Problem:
    a: int
    b: int

    @property
    def prompt(self) -> str:
        return f"{self.a}+{self.b}="

    @property
    def answer(self) -> str:
        return str(self.a + self.b)


def _operand(rng: random.Random, max_digits: int) -> int:
    digits = rng.randint(1, max_digits)
    low = 0 if digits == 1 else 10 ** (digits - 1)
    return rng.randint(low, 10**digits - 1)


def generate(
    n: int, seed: int, max_digits: int = 3, exclude: set[Problem] | frozenset[Problem] = frozenset()
) -> list[Problem]:
    """``n`` distinct problems, none in ``exclude``, in a seed-determined order."""
    if n < 0 or max_digits < 1:
        raise ValueError(f"need n >= 0 and max_digits >= 1, got n={n}, max_digits={max_digits}")
    space = (10**max_digits) ** 2 - len(exclude)
    if n > space // 2:
        # Rejection sampling would crawl near the size of the problem space.
        raise ValueError(f"n={n} is too many distinct problems for max_digits={max_digits} (at most {space // 2})")
    rng = random.Random(seed)
    seen: set[Problem] = set()
    out: list[Problem] = []
    while len(out) < n:
        p = Problem(_operand(rng, max_digits), _operand(rng, max_digits))
        if p in seen or p in exclude:
            continue
        seen.add(p)
        out.append(p)
    return out


def make_splits(n_train: int, n_test: int, seed: int, max_digits: int = 3) -> tuple[list[Problem], list[Problem]]:
    """Disjoint train and test problems; the test split does not depend on ``n_train``."""
    test = generate(n_test, seed=seed * 2 + 1, max_digits=max_digits)
    train = generate(n_train, seed=seed * 2, max_digits=max_digits, exclude=set(test))
    return train, test


def to_rows(problems: list[Problem], split: str) -> list[dict[str, Any]]:
    """Rows in verl's layout: chat-message prompt, rule-style ground truth, split and index."""
    return [
        {
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": p.prompt}],
            "ability": ABILITY,
            "reward_model": {"style": "rule", "ground_truth": p.answer},
            "extra_info": {"split": split, "index": i},
        }
        for i, p in enumerate(problems)
    ]


def write_parquet(rows: list[dict[str, Any]], path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema(
        [
            ("data_source", pa.string()),
            ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
            ("ability", pa.string()),
            ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
            ("extra_info", pa.struct([("split", pa.string()), ("index", pa.int64())])),
        ]
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    # No timestamps or writer-dependent metadata beyond pyarrow's own: same seed, same bytes.
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path, compression="zstd")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("data/addition"))
    ap.add_argument("--train", type=int, default=20_000)
    ap.add_argument("--test", type=int, default=500)
    ap.add_argument("--max-digits", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    train, test = make_splits(args.train, args.test, args.seed, args.max_digits)
    write_parquet(to_rows(train, "train"), args.out / "train.parquet")
    write_parquet(to_rows(test, "test"), args.out / "test.parquet")
    print(f"wrote {len(train)} train and {len(test)} test problems to {args.out}")


if __name__ == "__main__":
    main()
