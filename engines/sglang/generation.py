"""The fleet's client of one SGLang server: generation (:class:`SGLangGenerationClient`).

Generation is SGLang's native ``/generate`` with ``input_ids`` (token in, token
out, no tokenizer in the loop: the server runs with ``--skip-tokenizer-init``),
``n`` samples and ``return_logprob``; the sampler's log-probs come back per
token in ``meta_info.output_token_logprobs``.

Weights come from the learner's publisher through :class:`engines.sglang.weights.SGLangWeightClient` (another
process); this client learns the version the server holds from the fleet or the server
(``engines.sglang.factory.FleetSGLangClient``).
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from engines.base import EngineClient, EngineError, Sample, SamplingParams, lora_name
from engines.sglang.handle import RELEASE_TAGS, SGLangHandle


class _Meta(msgspec.Struct):
    output_token_logprobs: list = []
    finish_reason: dict | None = None
    weight_version: str | None = None


class _Out(msgspec.Struct):
    output_ids: list[int]
    meta_info: _Meta


_decode_one = msgspec.json.Decoder(_Out)
_decode_many = msgspec.json.Decoder(list[_Out])


class SGLangGenerationClient(SGLangHandle, EngineClient):
    """Generation from one SGLang server (any TP size). ``kw``: :class:`~engines.sglang.handle.SGLangHandle`'s."""

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> list[Sample]:
        # every processing field pinned: SGLang's --sampling-defaults=model would fill unset ones from the model
        sp: dict[str, Any] = {
            "max_new_tokens": params.max_tokens,
            **params.processing(),
            "ignore_eos": params.ignore_eos,
        }
        if params.stop_token_ids:
            sp["stop_token_ids"] = list(params.stop_token_ids)
        if params.n > 1 and (params.seed is not None or not self.radix_cache):
            # n copies of the prompt, one sampling dict each. With a seed: one seed for n parallel samples would
            # make them identical, so each gets its own. Without the radix cache: SGLang's own n first prefills the
            # prompt alone to cache it for the n samples (its tokenizer manager's prefix step), a prefill that is
            # then thrown away and a round trip the group waits for
            seeds = [None if params.seed is None else params.seed + i for i in range(params.n)]
            body = {
                "input_ids": [list(prompt_ids)] * params.n,
                "return_logprob": True,
                "sampling_params": [sp if s is None else dict(sp, sampling_seed=s) for s in seeds],
            }
        else:
            if params.seed is not None:
                sp["sampling_seed"] = params.seed
            body = {"input_ids": list(prompt_ids), "return_logprob": True, "sampling_params": dict(sp, n=params.n)}
        if self._released or self._releasing:  # SGLang would run the batch on unmapped memory
            raise EngineError(
                f"engine {self.engine_id}: generate while its GPU memory is released "
                f"({sorted(self._released or RELEASE_TAGS)}); wake_up first"
            )
        start_version = self._version
        if self.adapter_prefix and start_version > 0:
            body["lora_path"] = lora_name(self.adapter_prefix, start_version)
        self._inflight += 1
        self._idle.clear()
        try:
            raw = await self._post("/generate", body, self.timeout_s)
        finally:
            self._inflight -= 1
            if self._inflight == 0:
                self._idle.set()
        outs = _decode_one.decode(raw) if raw.lstrip()[:1] == b"{" else _decode_many.decode(raw)
        outs = [outs] if isinstance(outs, _Out) else outs
        if len(outs) != params.n:
            raise EngineError(f"engine {self.engine_id}: asked for {params.n} samples, got {len(outs)}")
        return [self._sample(o, start_version) for o in outs]

    def _sample(self, o: _Out, start_version: int) -> Sample:
        lps = o.meta_info.output_token_logprobs
        if len(lps) != len(o.output_ids):
            raise EngineError(f"engine {self.engine_id}: {len(o.output_ids)} tokens but {len(lps)} log-probs")
        fr = (o.meta_info.finish_reason or {}).get("type", "abort")
        # A sample that spans an in-flight update is tagged with its oldest version: SGLang does
        # not say at which token the weights changed, and staleness is counted from the oldest.
        return Sample(
            token_ids=np.asarray(o.output_ids, dtype=np.int32),
            logprobs=np.asarray([x[0] for x in lps], dtype=np.float32),
            finish_reason=fr if fr in ("stop", "length", "abort") else "stop",
            segment_starts=[0],
            segment_versions=[start_version],
        )
