"""Chain addition: a multi-turn task the tiny CPU model can learn (``a+b=`` then ``S+c=`` ...).

Turn 1 answers the prompt ``a+b=``. The environment reads the model's number ``S`` and asks
``S+c=`` (the model's own answer carried on, as a tool would return it), and so on through
the addends in ``extra_info["addends"]``. Reward 1 when the last answer equals the true total
``a+b+c+...`` (the ground truth): every turn must be right, so RL has to make the model
reliable across turns, with earlier turns and observations in its context.
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

    async def reset(self, ground_truth: str, extra_info: dict[str, Any]) -> None:
        addends = extra_info.get("addends")
        if not isinstance(addends, list) or not all(isinstance(a, int) for a in addends):
            raise ValueError(f"chain_addition needs extra_info['addends'] as a list of ints, got {addends!r}")
        self.addends, self.total, self.k = list(addends), str(ground_truth).strip(), 0

    async def step(self, turn: Turn) -> StepResult:
        text = turn.text.split(self.eos_text, 1)[0]
        m = _NUMBER.match(text)
        last = self.k == len(self.addends)
        if m is None:  # no number: the chain is broken
            return StepResult(done=True, reward=0.0, info={"parsed": None, "turn": self.k})
        if last:
            return StepResult(done=True, reward=float(m.group(1) == self.total), info={"parsed": m.group(1)})
        obs = f"{m.group(1)}+{self.addends[self.k]}="
        self.k += 1
        return StepResult(observation=obs, info={"parsed": m.group(1)})


def make_rows(n: int, seed: int, *, turns: int = 2, max_digits: int = 2, split: str = "train") -> list[dict[str, Any]]:
    """Rows in the dataset layout (verl's), ``turns`` additions each: ``a+b=`` then ``turns - 1`` addends."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = _operand(rng, max_digits), _operand(rng, max_digits)
        addends = [_operand(rng, max_digits) for _ in range(turns - 1)]
        rows.append({"data_source": DATA_SOURCE, "prompt": [{"role": "user", "content": f"{a}+{b}="}],
                     "ability": "arithmetic",
                     "reward_model": {"style": "rule", "ground_truth": str(a + b + sum(addends))},
                     "extra_info": {"split": split, "index": i, "addends": addends}})
    return rows
