"""SIMULATED prompts and rewards for ``--simulate`` runs (no dataset, no model, no tokenizer).

They let the whole control plane run at full size on one CPU machine. The reward is a
coin whose bias grows with the policy version that produced the sample, so the lag view
has something moving; it is labelled simulated everywhere and says nothing about learning.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import numpy as np

from engines.base import Sample
from rollout_fleet.worker import Prompt

log = logging.getLogger(__name__)


class SyntheticPrompts:
    """Random prompts from a seeded generator; the position is the number drawn so far."""

    def __init__(self, *, seed: int = 0, vocab_size: int = 1024, min_len: int = 8, max_len: int = 64) -> None:
        if not 1 <= min_len <= max_len:
            raise ValueError(f"SyntheticPrompts: need 1 <= min_len <= max_len, got {min_len}, {max_len}")
        self.seed, self.vocab_size, self.min_len, self.max_len = seed, vocab_size, min_len, max_len
        self.position = 0

    def next(self) -> Prompt:
        rng = np.random.default_rng([self.seed, self.position])
        self.position += 1
        n = int(rng.integers(self.min_len, self.max_len + 1))
        ids = rng.integers(0, self.vocab_size, n).tolist()
        return Prompt(prompt_ids=ids, ground_truth="", data_source="simulated")

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["seed"] != self.seed:
            raise ValueError(f"SyntheticPrompts: checkpoint seed {state['seed']} != configured seed {self.seed}")
        self.position = int(state["position"])


class SimulatedRewards:
    """A SIMULATED reward: 1 with probability ``base + gain * version`` (capped), else 0."""

    simulated = True

    def __init__(
        self, *, seed: int = 0, base: float = 0.2, gain: float = 0.005, cap: float = 0.9, delay_s: float = 0.0
    ) -> None:
        self._rng = np.random.default_rng(seed)
        self.base, self.gain, self.cap, self.delay_s = base, gain, cap, delay_s

    async def score(self, prompt: Prompt, samples: list[Sample]) -> list[float]:
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        out = []
        for s in samples:
            p = min(self.cap, self.base + self.gain * float(s.segment_versions[0]))
            out.append(float(self._rng.random() < p))
        return out
