"""The fleet's client of one vLLM server: generation (:class:`VLLMGenerationClient`).

Generation goes through ``/v1/completions`` with token-id prompts (or, with ``api="generate"``, vLLM's
``/inference/v1/generate``, which also reports per-sample ``weight_versions`` spans), ``n`` samples and the
sampler's log-prob of every token. Every request pins every sampling field (:class:`engines.base.SamplingParams`)
and carries a per-version prefix-cache salt.

Token ids in and out: the servers the fleet starts run ``--skip-tokenizer-init`` (``engines.vllm.factory``), so
the server's API process renders no text. The fleet never reads it, and with 256 requests in flight the
per-token text of the sampled token's log-prob alone was ~2.6 ms of that process's CPU per decoding step (about
10 us a token with SmolLM2's tokenizer, measured on the development machine). Such a server knows no EOS token:
the client names it (``eos_token_ids``, the model tokenizer's, as vLLM would have taken it) among the stop ids
of every request that does not ``ignore_eos``. Weights come from the learner's publisher through
:class:`engines.vllm.weights.VLLMWeightClient` (another process); this client learns the version the server
holds from the fleet (:meth:`record_version`) or from the server (``engines.vllm.factory.FleetVLLMClient``).

Example::

    server = VLLMServer(VLLMServerArgs(model="models/tiny-adder"), run_dir)
    server.start()                                  # waits for /health
    client = VLLMGenerationClient("vllm-0", server.url, model="models/tiny-adder")
    samples = await client.generate([1, 5, 7], SamplingParams(n=4, max_tokens=8))
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engines.base import EngineClient, EngineError, Sample, SamplingParams
from engines.vllm.handle import VLLMHandle


@dataclass(kw_only=True, slots=True)
class _Segments:
    starts: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)


def _segments(spans: list[dict] | None, default_version: int) -> _Segments:
    """vLLM's ``weight_versions`` spans ([{version, start, end}]) -> fleetrl's run-length segments."""
    if not spans:
        return _Segments(starts=[0], versions=[default_version])
    seg = _Segments()
    for s in sorted(spans, key=lambda s: s["start"]):
        try:
            v = int(s["version"])
        except (TypeError, ValueError):
            v = default_version  # a label we did not set (e.g. the initial load)
        if seg.versions and seg.versions[-1] == v:
            continue
        seg.starts.append(int(s["start"]))
        seg.versions.append(v)
    seg.starts[0] = 0
    return seg


class VLLMGenerationClient(VLLMHandle, EngineClient):
    """Generation from one vLLM server; one instance per event loop (its HTTP session binds to the loop)."""

    def __init__(
        self,
        engine_id: str,
        url: str,
        *,
        model: str,
        api: str = "completions",
        eos_token_ids: Sequence[int] = (),
        **kw,
    ) -> None:
        """``api``: ``completions`` (``/v1/completions``, every supported vLLM) or ``generate``
        (``/inference/v1/generate``, vLLM >= 0.32 started with ``--enable-scale-out``: also reports
        per-sample ``weight_versions`` spans). ``eos_token_ids``: stop ids added to every request that does
        not ``ignore_eos`` (a server without its tokenizer has no EOS of its own). ``kw``:
        :class:`~engines.vllm.handle.VLLMHandle`'s."""
        if api not in ("completions", "generate"):
            raise ValueError(f"api must be 'completions' or 'generate', got {api!r}")
        super().__init__(engine_id, url, model=model, **kw)
        self.api = api
        self.eos_token_ids = [int(t) for t in eos_token_ids]

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> list[Sample]:
        stop = list(params.stop_token_ids)
        if not params.ignore_eos:
            stop += [t for t in self.eos_token_ids if t not in stop]
        sp: dict[str, Any] = {
            "n": params.n,
            "max_tokens": params.max_tokens,
            **params.processing(),
            "logprobs": 0,
            "stop_token_ids": stop,
            "ignore_eos": params.ignore_eos,
        }
        if params.seed is not None:
            sp["seed"] = params.seed
        # Without per-token spans a sample is tagged with the version the server held when it started:
        # an in-flight update may change the weights mid-sample, and the older version bounds its
        # staleness from above (the server is never behind what this client knows).
        start_version = self._version
        # The prefix cache is salted with the weight version, so a request never reuses KV computed under
        # other weights; vLLM's reset cannot promise that while requests run (see reset_prefix_cache).
        salt = f"fleetrl-v{start_version}"
        model = self.served_model(start_version)
        body: dict[str, Any]
        if self.api == "generate":
            body = {"model": model, "token_ids": list(prompt_ids), "sampling_params": sp, "cache_salt": salt}
            r = await self._request("POST", "/inference/v1/generate", json=body, timeout_s=self.request_timeout_s)
        else:
            # the log-probs' tokens as "token_id:N" placeholders: nothing to render (the fleet reads ids)
            body = {
                "model": model,
                "prompt": list(prompt_ids),
                "return_token_ids": True,
                "return_tokens_as_token_ids": True,
                "cache_salt": salt,
                **sp,
            }
            r = await self._request("POST", "/v1/completions", json=body, timeout_s=self.request_timeout_s)
        return [self._sample(c, start_version) for c in sorted(r.json()["choices"], key=lambda c: c["index"])]

    def _sample(self, c: dict, start_version: int) -> Sample:
        ids = c.get("token_ids")
        lp_field = c.get("logprobs") or {}
        if self.api == "generate":  # [{token_id, logprob, ...}] per generated token
            content = lp_field.get("content")
            lp = None if content is None else [e["logprob"] for e in content]
        else:
            lp = lp_field.get("token_logprobs")
        if ids is None or lp is None or len(ids) != len(lp):
            raise EngineError(
                f"engine {self.engine_id}: choice {c.get('index')} lacks token ids or per-token "
                f"log-probs (token_ids={ids is not None}, logprobs={lp is not None})"
            )
        seg = _segments(c.get("weight_versions"), start_version)
        return Sample(
            token_ids=np.asarray(ids, dtype=np.int32),
            logprobs=np.asarray([-np.inf if x is None else x for x in lp], dtype=np.float32),
            finish_reason=c.get("finish_reason") or "abort",
            segment_starts=seg.starts,
            segment_versions=seg.versions,
        )
