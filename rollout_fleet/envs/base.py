"""The environment interface of multi-turn episodes, and the limits every episode runs under.

An episode alternates model turns and observations::

    obs0 = await env.reset(prompt)                 # the task; the prompt ids come from the dataset
    result = await env.step(Turn(...))             # the model's turn: its sampled ids and their text
    result.observation -> tokenised once, appended (masked out of the loss) -> next turn ...
    until result.done, or a limit (turns, tokens, wall time) ends it

The episode's token sequence is the prompt, then each turn's tokens exactly as sampled, then
each observation's tokens: nothing is ever rendered again through a chat template, so what
the learner trains on is what the engine saw. An environment that raises fails its episode
with a named, counted reason (:class:`EnvError`); it never becomes a made-up reward.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np


class EnvError(RuntimeError):
    """An episode could not be completed. ``reason`` is a short name the worker counts by
    (``env_reset``, ``env_step``, ``wall_time``, ``tokens``, ``engine``)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason


@dataclass(kw_only=True, slots=True)
class Turn:
    """One model turn, as sampled. ``text`` is decoded from ``token_ids`` (the stop token included
    when the tokenizer renders it); environments parse the text but never return it."""

    index: int
    token_ids: np.ndarray  # int32
    text: str
    finish_reason: str  # "stop" (a stop token) or "length" (the turn's token limit)


@dataclass(kw_only=True, slots=True)
class StepResult:
    """What the environment answers to a turn.

    ``observation``: text (tokenised once by the episode loop, without special tokens added),
    token ids (appended as they are), or None (no observation: only legal with ``done``).
    ``reward`` adds to the episode's reward (the sum over steps).
    """

    observation: str | list[int] | None = None
    done: bool = False
    reward: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)


class Environment(abc.ABC):
    """One episode's environment: a fresh instance per episode (:class:`EnvFactory`)."""

    name: str = "env"

    @abc.abstractmethod
    async def reset(self, ground_truth: str, extra_info: dict[str, Any]) -> None:
        """Set up the task of a prompt (its dataset row's ground truth and extra info)."""

    @abc.abstractmethod
    async def step(self, turn: Turn) -> StepResult:
        """React to the model's turn."""

    async def close(self) -> None:  # noqa: B027 (optional: most environments hold nothing)
        """Release what the episode held (sandboxes, connections)."""


class EnvFactory(Protocol):
    def __call__(self) -> Environment: ...


class Codec(Protocol):
    """The model's tokenizer as the episode loop needs it (the same one the engine serves)."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class HFCodec:
    """A Hugging Face tokenizer: ``encode`` adds no special tokens (observations are pieces of
    an episode, not documents); ``decode`` keeps special tokens, so a parser sees the stop token."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    @classmethod
    def from_pretrained(cls, path: str) -> HFCodec:
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(path))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)


@dataclass(frozen=True, kw_only=True, slots=True)
class EpisodeLimits:
    """Per-episode limits. ``max_tokens``: the episode's tokens after the prompt (turns and
    observations); ``turn_max_tokens``: one turn's sampling limit; ``wall_time_s``: the whole
    episode, environment calls included (exceeding it fails the episode, reason ``wall_time``)."""

    max_turns: int
    max_tokens: int
    turn_max_tokens: int
    wall_time_s: float
    env_timeout_s: float = 30.0  # one reset or step

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_tokens", "turn_max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"EpisodeLimits.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("wall_time_s", "env_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"EpisodeLimits.{name} must be > 0 seconds, got {getattr(self, name)}")
