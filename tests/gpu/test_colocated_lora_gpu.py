"""Full weights into a LoRA-serving vLLM server on ONE GPU: a colocated synchronous LoRA run's publish.

Colocated mode with ``learner.lora`` and no ``--async`` publishes the merged weights (base plus adapters) by
CUDA IPC into a server started with ``--enable-lora``. vLLM 0.26 wraps each targeted layer
(``<layer>.base_layer.weight``) and gives the wrapper no ``load_weights``; its loader failed such a load on an
H100 (2026-12-07) until ``engines/vllm/lora_loading.py``. Here: the IPC plan check passes against the wrapped
names, the colocated step's load goes in, greedy tokens fit transformers on the new weights and not on the old
(so the check can fail), and the server's own ``reload_weights`` from a checkpoint folder works too.
"""

from __future__ import annotations

import os
import random
import time

import pytest
from gpu_helpers import Reference, check_logprobs, record
from test_colocated_ipc_gpu import _colocated_publish, _greedy_fits, _on_gpu, start_server

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

TEST = "colocated_lora"


@pytest.fixture(scope="module")
def server(qwen_checkpoints, tmp_path_factory):
    from engines.vllm.lora import lora_server_settings

    lora_args, lora_env = lora_server_settings(rank=16)
    run_dir = os.environ.get("FLEETRL_COLOCATED_LORA_RUN_DIR") or str(tmp_path_factory.mktemp("vllm-lora"))
    srv = start_server(TEST, str(qwen_checkpoints[0]), run_dir, tuple(lora_args), lora_env)
    yield srv
    srv.stop()


def test_merged_weights_load_into_a_lora_server(server, loop, qwen_checkpoints):
    import torch

    from engines.vllm.generation import VLLMGenerationClient
    from engines.vllm.ipc import VLLMIpcClient
    from engines.vllm.weights import VLLMWeightClient
    from weight_sync.ipc_publisher import IpcPublisher
    from weight_sync.plan import build_plan

    v0_dir, v1_dir, s0, s1 = qwen_checkpoints
    torch.cuda.set_device(0)
    plan = build_plan([(n, list(t.shape), t.dtype) for n, t in s1.items()], 256 << 20)
    engine = VLLMIpcClient("vllm-lora", server.url, model=server.model_name, timeout_s=120, update_pause_mode="wait")
    pub = IpcPublisher(plan, device="cuda:0", slots=2, timeout_s=120, engines=[engine])
    sampler = VLLMGenerationClient("vllm-lora-gen", server.url, model=server.model_name)
    rng = random.Random(5)
    prompts = [rng.sample(range(1000, 100000), 16) for _ in range(4)]
    try:
        learner = _on_gpu(s1)
        rep, load_s = _colocated_publish(loop, sampler, lambda w=learner: pub.publish(1, iter(w.items())))
        assert rep.per_engine_checksums == {"vllm-lora": rep.checksum}, rep
        del learner
        ref1, ref0 = Reference(s1), Reference(s0)
        fit1, fit0 = _greedy_fits(loop, sampler, ref1, prompts), _greedy_fits(loop, sampler, ref0, prompts)
        record(TEST, "ipc_load", seconds=load_s, bytes=rep.bytes, fraction_argmax_new=fit1, fraction_argmax_old=fit0)
        print(f"IPC load into the LoRA server {load_s:.3f} s; greedy argmax fit: new {fit1:.3f}, old {fit0:.3f}")
        assert fit1 >= 0.9 and fit0 < 0.5, (fit1, fit0)

        # vLLM's own reload of every weight from a folder (the bench's full publish), back to v0
        full = VLLMWeightClient("vllm-lora-full", server.url, model=server.model_name, timeout_s=120)
        t0 = time.perf_counter()
        loop.run_until_complete(full.load_weights_from_path(str(v0_dir), 2))
        reload_s = time.perf_counter() - t0
        back0, back1 = _greedy_fits(loop, sampler, ref0, prompts), _greedy_fits(loop, sampler, ref1, prompts)
        record(TEST, "reload_from_disk", seconds=reload_s, fraction_argmax_v0=back0, fraction_argmax_v1=back1)
        print(f"reload_weights {reload_s:.3f} s; greedy argmax fit: v0 {back0:.3f}, v1 {back1:.3f}")
        assert back0 >= 0.9 and back1 < 0.5, (back0, back1)
        from engines.base import SamplingParams

        samples = loop.run_until_complete(
            sampler.generate(prompts[0], SamplingParams(n=4, max_tokens=32, temperature=1.0))
        )
        check_logprobs(TEST, samples, prompts[0], ref0, ref1, "logprobs_after_reload")
        loop.run_until_complete(full.close())
    finally:
        pub.close()
        loop.run_until_complete(sampler.close())
