"""What every engine has: the generation interface, the HTTP server handle both roles share, the factory base.

An engine is a server process (vLLM, SGLang, or the simulated engine) plus clients that speak its API,
one class per role::

    weight_sync.endpoint.ServerHandle       engine_id, health, load_weights_from_path, weight_version, close
     +- EngineClient (here)                 generation: generate, pause, resume, is_paused, generated_tokens,
     |                                      reset_prefix_cache
     |                                      (the fleet's client: workers and the fleet controller see only this)
     +- weight_sync.endpoint.WeightEndpoint weight transfer: init_weight_transfer, update_weights, staged publish
                                            (the learner's publisher sees only this)

:class:`HttpServerHandle` is the concrete base of every HTTP client of one server, whichever its role (the
session, ``health``, the version held). Each engine's package (``engines/vllm/``, ``engines/sglang/``) adds a
server-control base on top (pause, resume, prefix cache, sleep, the load from disk) and a generation client
and a weight client over it; :mod:`engines.simulated` is the in-process stand-in; :mod:`engines.registry`
picks a weight client for the learner.

All methods are coroutines and every one has a timeout: an engine that does not
answer raises :class:`EngineError` naming the engine, the call and the limit.
"""

from __future__ import annotations

import abc
import asyncio
import enum
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from core.http_client import BadRequest, EngineError, HttpEngineClient
from weight_sync.endpoint import ServerHandle

__all__ = [
    "BadRequest",
    "EngineClient",
    "EngineError",
    "HttpServerHandle",
    "PauseMode",
    "Sample",
    "SamplingParams",
    "ServerFactory",
    "lora_name",
    "model_sampling_defaults",
]


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
    # True: decode past the end-of-sequence token, so every sample is exactly max_tokens long (finish reason
    # 'length'); a length-control setting for benchmarks (rollout.sampling.ignore_eos)
    ignore_eos: bool = False

    def processing(self) -> dict[str, float | int]:
        """The logits-processing fields, named as vLLM's and SGLang's sampling parameters both name them."""
        return {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
        }


# A generation_config.json field and the value under which it leaves the distribution log_softmax(z / T) alone.
NEUTRAL_SAMPLING = {
    "top_k": (0, -1, None),
    "top_p": (1, 1.0, None),
    "min_p": (0, 0.0, None),
    "repetition_penalty": (1, 1.0, None),
    "presence_penalty": (0, 0.0, None),
    "frequency_penalty": (0, 0.0, None),
    "typical_p": (1, 1.0, None),
    "no_repeat_ngram_size": (0, None),
    "temperature": (1, 1.0, None),
}


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


def lora_name(prefix: str, version: int) -> str:
    """The name policy ``version`` is served under when LoRA adapters carry the policy (both engines)."""
    return f"{prefix}-v{version}"


def adapter_versions(max_staleness: int) -> int:
    """How many policy versions' adapters a server keeps loaded (both engines): every version whose requests may
    still run. With ``broker.max_staleness`` k, requests of versions v-k..v can be in flight when v arrives, so
    k + 1 (and at least 2: the previous version's requests run beside the new one's)."""
    return max(2, max_staleness + 1)


def check_adapter_versions(versions: int) -> int:
    """``versions`` if a server may keep that many adapter versions (the previous and the new one at least)."""
    if versions < 2:
        raise ValueError(f"adapter_versions must be at least 2 (the previous and the new version), got {versions}")
    return versions


def adapters_out_of_window(previous: int, version: int, kept: int) -> list[int]:
    """The adapter versions a server that held ``previous`` unloads once ``version`` is loaded and ``kept`` versions
    stay (both engines): v - kept, and before it the server's own last version if that left the window earlier (a
    server that skipped versions). Version 0 is the base model, not an adapter."""
    dropped = version - kept  # versions dropped + 1 .. version stay loaded
    return ([previous] if 0 < previous < dropped else []) + ([dropped] if dropped > 0 else [])


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


class EngineClient(ServerHandle):
    """The generation role: the fleet's client of one engine server."""

    simulated: bool = False

    @abc.abstractmethod
    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> list[Sample]:
        """``params.n`` samples for one prompt, with token ids and per-token log-probs."""

    @abc.abstractmethod
    async def pause(self, mode: PauseMode = PauseMode.KEEP) -> None:
        """Stop admitting; ``abort`` running requests, ``wait`` for them, or ``keep`` them frozen."""

    @abc.abstractmethod
    async def resume(self) -> None: ...

    async def is_paused(self) -> bool | None:
        """Whether the server is paused (by anyone: a publish from the learner is loading); None: this
        engine cannot say. The fleet's stall detector asks it before it takes a silent server out."""
        return None

    async def generated_tokens(self) -> int | None:
        """How many tokens the server has generated since it started (a counter that rises while it decodes,
        before any request ends); None: this engine cannot say. The fleet's stall detector reads it twice in a
        silence: a server that answers nothing but whose count rises is generating long responses, not hung.
        Never raises for a failed read: None."""
        return None

    @abc.abstractmethod
    async def reset_prefix_cache(self) -> None: ...

    @abc.abstractmethod
    def record_version(self, version: int) -> None:
        """The learner's publisher loaded ``version`` into this client's server (the fleet hears it from the
        learner): samples started from now on are tagged with it. Never lowers the version held."""


class HttpServerHandle(HttpEngineClient, ServerHandle):
    """Concrete base of the HTTP clients of one server (both roles): the session, ``health``, the version held.

    Subclasses set ``engine_id``, ``url``, ``timeout_s`` and ``_version`` (the policy version the server
    holds, as far as this client knows) and ``health_timeout_s`` (the bound of a health probe).
    """

    _version: int = 0
    health_timeout_s: float

    async def health(self) -> bool:
        try:
            r = await self.http.get(self.url + "/health", timeout=self.health_timeout_s)
            return r.status_code == 200
        except httpx.HTTPError:
            return False

    @property
    def weight_version(self) -> int:
        return self._version

    def record_version(self, version: int) -> None:
        self._version = max(self._version, int(version))


class ServerFactory:
    """What the fleet asks of an engine factory besides ``start(index)``: restart and stop a server.

    Clients are named ``<engine>-<index>`` and hold their server process in ``.server``.
    """

    async def start(self, index: int):
        raise NotImplementedError

    async def restart(self, engine):
        index = int(engine.engine_id.rsplit("-", 1)[1])
        await self.stop(engine)
        return await self.start(index)

    async def stop(self, engine) -> None:
        await engine.close()
        if engine.server is not None:  # None: attached (rollout.urls), not ours to stop
            await asyncio.to_thread(engine.server.stop)
