"""vLLM TP=1 on GPU 1 through fleetrl's VLLMServer / VLLMGenerationClient / VLLMNcclClient: log-probs vs the learner's forward,
then an NCCL publish from this process (the learner, GPU 0) into vLLM's built-in NCCL backend.

One server for the module. The publish is fleetrl's Publisher (nccl_impl="vllm": the
PyNccl group vLLM's workers join) feeding fleetrl's weight client (VLLMNcclClient: the
per-version placement of the packed settings, engines/vllm/nccl.py).
Timings go to $FLEETRL_GPU_RESULTS (jsonl) when set.
"""

from __future__ import annotations

import os
import random
import time

import pytest
from gpu_helpers import Reference, check_logprobs, record, vllm_server_on_gpu1

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]

# Every process of the weight group must agree on it (see engines/sglang/weights.py); the
# server inherits this environment.
os.environ.setdefault("NCCL_CUMEM_ENABLE", "0")


def _record(what: str, **kw) -> None:
    record("vllm_tp1", what, **kw)


@pytest.fixture(scope="module")
def server(qwen_checkpoints, tmp_path_factory):
    run_dir = os.environ.get("FLEETRL_VLLM_RUN_DIR") or str(tmp_path_factory.mktemp("vllm-tp1"))
    srv = vllm_server_on_gpu1("vllm_tp1", str(qwen_checkpoints[0]), run_dir, weight_backend="nccl")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server, loop):
    from engines.vllm.generation import VLLMGenerationClient

    c = VLLMGenerationClient("vllm-0", server.url, model=server.model_name)
    yield c
    loop.run_until_complete(c.close())


def _group(client, loop, prompt):
    from engines.base import SamplingParams

    return loop.run_until_complete(client.generate(prompt, SamplingParams(n=4, max_tokens=32, temperature=1.0)))


def _check(samples, prompt, ref_same, ref_other, label):
    check_logprobs("vllm_tp1", samples, prompt, ref_same, ref_other, label)


def test_generate_logprobs_match_learner(client, loop, qwen_checkpoints):
    _, _, s0, s1 = qwen_checkpoints
    prompt = random.Random(0).sample(range(1000, 100000), 16)
    samples = _group(client, loop, prompt)
    assert len(samples) == 4 and all(s.finish_reason in ("length", "stop") for s in samples)
    assert len({tuple(s.token_ids) for s in samples}) > 1, "n samples of a group must differ at temperature 1"
    _check(samples, prompt, Reference(s0), Reference(s1), "generate_v0")


def test_nccl_publish_from_learner_then_logprobs_match_new_weights(server, client, loop, qwen_checkpoints):
    """fleetrl's Publisher (learner rank 0, GPU 0) -> vLLM's NCCL backend, through VLLMNcclClient."""
    import torch

    from engines.vllm.nccl import VLLMNcclClient
    from weight_sync.config import WeightSyncConfig
    from weight_sync.plan import build_plan
    from weight_sync.publisher import Publisher

    _, _, s0, s1 = qwen_checkpoints
    torch.cuda.set_device(0)
    plan = build_plan([(n, list(t.shape), t.dtype) for n, t in s1.items()], 256 << 20)
    # The publisher drives its engines from its own event loop: it gets its own client of the server.
    engine = VLLMNcclClient("vllm-0", server.url, model=server.model_name)
    pub = Publisher(
        WeightSyncConfig(backend="nccl", nccl_impl="vllm", bucket_mb=256, timeout_s=120),
        plan,
        rank=0,
        engines=[engine],
        device="cuda:0",
    )
    try:
        reports, walls, steps = [], [], []
        for version, state in ((1, s1), (2, s0), (3, s1), (4, s0), (5, s1)):  # v1 includes the group's creation
            learner = {k: v.to("cuda:0") for k, v in state.items()}
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            reports.append(pub.publish(version, iter(learner.items())))
            walls.append(time.perf_counter() - t0)
            steps.append(dict(engine.last_update_steps))
        # VLLMWeightClient.update_weights pauses (keep), loads, resets the prefix cache and resumes: the
        # publish's wall time is the engine's unavailability per update.
        _record(
            "nccl_update",
            bytes=reports[-1].bytes,
            buckets=len(plan.buckets),
            first_s=walls[0],
            rebuild_s=reports[0].rebuild_seconds,
            pause_to_resume_s=walls[1:],
            broadcast_s=[r.broadcast_seconds for r in reports[1:]],
            http_steps_s=steps[1:],
        )
        print("pause-to-resume per update:", [round(w, 4) for w in walls[1:]])
        for st in steps[1:]:
            print("  steps:", {k: round(v, 4) for k, v in st.items()})
        assert engine.weight_version == 5
        prompt = random.Random(1).sample(range(1000, 100000), 16)
        samples = _group(client, loop, prompt)
        _check(samples, prompt, Reference(s1), Reference(s0), "generate_after_publish_v1")
    finally:
        pub.close()
