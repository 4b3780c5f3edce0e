"""The engine client interface every rollout engine implements: generation and the server's lifecycle.

An engine is a server process (vLLM, SGLang, or the simulated engine) plus a client that
speaks its API. Workers and the fleet controller only see :class:`EngineClient`, so switching
engines is one config value. Weight sync reaches an engine's receiving side through
:class:`weight_sync.endpoint.WeightEndpoint`, which the vLLM and SGLang clients implement as
well; of the weights the fleet itself needs only the version a server holds and the load of an
export into a server that (re)joins.

All methods are coroutines and every one has a timeout: an engine that does not
answer raises :class:`EngineError` naming the engine, the call and the limit.
"""

from __future__ import annotations

import abc
import enum
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from core.net import BadRequest, EngineError

__all__ = ["BadRequest", "EngineClient", "EngineError", "PauseMode", "Sample", "SamplingParams",
           "model_sampling_defaults"]


class PauseMode(enum.StrEnum):
    """What a pause does with the requests running on the server."""

    KEEP = "keep"  # freeze them; they continue (under new weights) after resume
    WAIT = "wait"  # let them finish first (under the old weights)
    ABORT = "abort"  # end them now (their groups are re-run elsewhere)


@dataclass(kw_only=True, slots=True)
class SamplingParams:
    """One request's sampling. Every field is sent on every request (:meth:`processing`), so a model folder's
    ``generation_config.json`` can never fill one in behind the learner's back: training keeps ``top_p=1``,
    ``top_k=-1`` and no penalties, the distribution ``log_softmax(z / T)`` that the learner scores."""

    n: int
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off (both engines accept it)
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)

    def processing(self) -> dict[str, float | int]:
        """The logits-processing fields, named as vLLM's and SGLang's sampling parameters both name them."""
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
                "repetition_penalty": self.repetition_penalty, "presence_penalty": self.presence_penalty,
                "frequency_penalty": self.frequency_penalty}


# A generation_config.json field and the value under which it leaves the distribution log_softmax(z / T) alone.
NEUTRAL_SAMPLING = {"top_k": (0, -1, None), "top_p": (1, 1.0, None), "min_p": (0, 0.0, None),
                    "repetition_penalty": (1, 1.0, None), "presence_penalty": (0, 0.0, None),
                    "frequency_penalty": (0, 0.0, None), "typical_p": (1, 1.0, None),
                    "no_repeat_ngram_size": (0, None), "temperature": (1, 1.0, None)}


def model_sampling_defaults(model_dir: str | Path) -> dict[str, Any]:
    """The sampling fields a model folder's ``generation_config.json`` sets to a non-neutral value.

    vLLM (``--generation-config auto``) and SGLang (``--sampling-defaults model``) would fill a request's unset
    fields from them; fleetrl pins every field instead, so these are reported, never applied. Example::

        model_sampling_defaults("Qwen2.5-7B-Instruct")  # {'top_k': 20, 'repetition_penalty': 1.05, ...}
    """
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not readable JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    found = {}
    for key, neutral in NEUTRAL_SAMPLING.items():
        if key in raw and raw[key] not in neutral:
            found[key] = raw[key]
    if raw.get("do_sample") is False:
        found["do_sample"] = False
    return found


@dataclass(kw_only=True, slots=True)
class Sample:
    """One generated sample: token ids and the sampler's log-prob of each.

    ``segment_starts``/``segment_versions`` say which policy version produced
    which tokens (one segment unless weights changed mid-sample).
    """

    token_ids: np.ndarray  # int32 [T]
    logprobs: np.ndarray  # float32 [T]
    finish_reason: str  # "stop" | "length" | "abort"
    segment_starts: list[int] = field(default_factory=lambda: [0])
    segment_versions: list[int] = field(default_factory=lambda: [0])


class EngineClient(abc.ABC):
    """Client of one engine server. ``engine_id`` is unique in the fleet."""

    engine_id: str
    simulated: bool = False

    @abc.abstractmethod
    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> list[Sample]:
        """``params.n`` samples for one prompt, with token ids and per-token log-probs."""

    @abc.abstractmethod
    async def health(self) -> bool:
        """True if the server answers and can generate."""

    @abc.abstractmethod
    async def pause(self, mode: PauseMode = PauseMode.KEEP) -> None:
        """Stop admitting; ``abort`` running requests, ``wait`` for them, or ``keep`` them frozen."""

    @abc.abstractmethod
    async def resume(self) -> None: ...

    async def is_paused(self) -> bool | None:
        """Whether the server is paused (by anyone: a publish from the learner is loading); None: this
        engine cannot say. The fleet's stall detector asks it before it takes a silent server out."""
        return None

    @abc.abstractmethod
    async def reset_prefix_cache(self) -> None: ...

    @abc.abstractmethod
    async def load_weights_from_path(self, path: str, version: int) -> None:
        """Load a published HF safetensors export (a server that (re)joins the fleet late)."""

    @property
    @abc.abstractmethod
    def weight_version(self) -> int:
        """The policy version the server holds."""

    async def close(self) -> None:  # noqa: B027 (optional hook: most clients hold nothing)
        """Release client resources (HTTP sessions); does not stop the server."""
