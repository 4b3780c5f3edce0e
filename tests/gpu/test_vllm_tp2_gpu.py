"""vLLM TP=2 over both GPUs through fleetrl's VLLMServer / VLLMNcclClient: a group's log-probs vs the
learner's forward, then a load of new weights on every TP worker (from the learner's HF export).

With 2 GPUs the TP=2 engine holds both, so no learner GPU is left for an NCCL group
(NCCL refuses two ranks of one communicator on one GPU): the TP weight path tested
here is the late joiner's load from the export, which every TP worker performs for
its own shard. The NCCL publish is tested at TP=1 (test_vllm_gpu.py).
"""

from __future__ import annotations

import os
import random
import time

import pytest
from gpu_helpers import Reference, check_logprobs, record

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]


def _record(what: str, **kw) -> None:
    record("vllm_tp2", what, **kw)


@pytest.fixture(scope="module")
def client(qwen_checkpoints, tmp_path_factory, loop):
    import torch

    from engines.vllm.generation import VLLMGenerationClient
    from engines.vllm.nccl import VLLMNcclClient
    from engines.vllm.server import VLLMServer, VLLMServerArgs

    if torch.cuda.device_count() < 2:
        pytest.fail("the TP=2 test needs 2 GPUs")
    v0 = qwen_checkpoints[0]
    run_dir = os.environ.get("FLEETRL_VLLM_TP2_RUN_DIR") or str(tmp_path_factory.mktemp("vllm-tp2"))
    # 0.4 of each GPU: the reference forward of the learner runs beside it on GPU 0
    srv = VLLMServer(
        VLLMServerArgs(
            model=str(v0),
            dtype="bfloat16",
            max_model_len=2048,
            tensor_parallel_size=2,
            gpu_memory_utilization=0.4,
            weight_backend="nccl",
            env={"CUDA_VISIBLE_DEVICES": "0,1"},
        ),
        run_dir,
    )
    t0 = time.monotonic()
    srv.start()
    _record("startup", seconds=time.monotonic() - t0, command=srv.command())
    # generation, and the learner's side (vLLM 0.26's load from disk: the NCCL client's)
    c = VLLMGenerationClient("vllm-tp2", srv.url, model=srv.model_name)
    w = VLLMNcclClient("vllm-tp2", srv.url, model=srv.model_name, group_ranks=2)
    yield c, w
    loop.run_until_complete(c.close())
    loop.run_until_complete(w.close())
    srv.stop()


def _check(samples, prompt, ref_same, ref_other, label):
    check_logprobs("vllm_tp2", samples, prompt, ref_same, ref_other, label)


def test_tp2_generate_then_load_new_weights(client, loop, qwen_checkpoints):
    from engines.base import SamplingParams

    client, weights = client
    _, v1, s0, s1 = qwen_checkpoints
    ref0, ref1 = Reference(s0), Reference(s1)
    params = SamplingParams(n=4, max_tokens=32, temperature=1.0)
    prompt = random.Random(0).sample(range(1000, 100000), 16)
    samples = loop.run_until_complete(client.generate(prompt, params))
    assert len(samples) == 4
    _check(samples, prompt, ref0, ref1, "generate_v0")

    t0 = time.perf_counter()
    loop.run_until_complete(weights.load_weights_from_path(str(v1), 1))
    _record("load_from_export", seconds=time.perf_counter() - t0)
    assert weights.weight_version == 1
    client.record_version(1)
    prompt = random.Random(1).sample(range(1000, 100000), 16)
    samples = loop.run_until_complete(client.generate(prompt, params))
    _check(samples, prompt, ref1, ref0, "generate_after_load_v1")
