"""Behaviour log-probs at temperature 0.7 on vLLM 0.26 (bf16, one GPU) against the learner's forward.

fleetrl starts vLLM with ``--logprobs-mode processed_logprobs`` (engines/vllm/server.py), so
the log-prob a sample carries is that of the distribution it was drawn from: softmax(logits / T). This test
checks, on the GPU engine the product runs on, that
- vLLM 0.26 accepts the flag (the server starts with it in its command line),
- at T=0.7 the engine's log-probs agree with the learner's bf16 forward scored at T=0.7 within
  ``learner.logprob_probe``'s bf16 tolerance (the start-up probe's bound), and
- the same tokens scored at T=1.0 are outside that bound: the probe can tell a temperature the learner does
  not apply (so a raw-log-prob engine would fail this test).

One GPU: the server takes 0.3 of it, the reference model (transformers, bf16) the rest.
Run: ``pytest -m gpu tests/gpu/test_logprob_probe_gpu.py``.
"""

from __future__ import annotations

import asyncio
import random
import time

import pytest
from gpu_helpers import MAX_TOL, Reference, compare, record

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def server(qwen_checkpoints, tmp_path_factory):
    from engines.vllm.server import VLLMServer, VLLMServerArgs

    srv = VLLMServer(
        VLLMServerArgs(
            model=str(qwen_checkpoints[0]),
            dtype="bfloat16",
            max_model_len=2048,
            tensor_parallel_size=1,
            gpu_memory_utilization=0.3,
            max_num_seqs=64,
            enforce_eager=True,
            weight_backend="nccl",
            env={"CUDA_VISIBLE_DEVICES": "0"},
        ),
        str(tmp_path_factory.mktemp("vllm-probe")),
    )
    t0 = time.monotonic()
    srv.start()
    record("logprob_probe", "startup", seconds=time.monotonic() - t0, command=srv.command())
    yield srv
    srv.stop()


def test_processed_logprobs_at_t07_match_learner_within_probe_tolerance(server, qwen_checkpoints):
    import numpy as np

    from engines.base import SamplingParams
    from engines.vllm.generation import VLLMGenerationClient
    from learner.logprob_probe import BF16_TOLERANCE

    cmd = server.command()
    assert "--logprobs-mode" in cmd and cmd[cmd.index("--logprobs-mode") + 1] == "processed_logprobs", cmd

    async def sample(prompts):
        client = VLLMGenerationClient("vllm-probe", server.url, model=server.model_name)
        try:
            return await asyncio.gather(
                *(client.generate(p, SamplingParams(n=4, max_tokens=32, temperature=0.7)) for p in prompts)
            )
        finally:
            await client.close()

    rng = random.Random(0)
    prompts = [rng.sample(range(1000, 100000), 16) for _ in range(4)]
    groups = asyncio.run(sample(prompts))
    ref = Reference(qwen_checkpoints[2])
    at_07 = np.concatenate([compare(g, p, ref, 0.7) for p, g in zip(prompts, groups, strict=True)])
    at_10 = np.concatenate([compare(g, p, ref, 1.0) for p, g in zip(prompts, groups, strict=True)])
    record(
        "logprob_probe",
        "t0.7",
        tokens=int(at_07.size),
        mean_abs=float(at_07.mean()),
        max_abs=float(at_07.max()),
        mean_abs_scored_at_t1=float(at_10.mean()),
        tolerance=BF16_TOLERANCE,
    )
    print(
        f"T=0.7 processed log-probs vs learner at T=0.7: mean {at_07.mean():.4f} max {at_07.max():.4f} over "
        f"{at_07.size} tokens; scored at T=1.0: mean {at_10.mean():.4f} (probe tolerance {BF16_TOLERANCE})"
    )
    assert at_07.mean() < BF16_TOLERANCE and at_07.max() < MAX_TOL
    assert at_10.mean() > BF16_TOLERANCE, "scoring at the wrong temperature fits as well: the probe is blind"
