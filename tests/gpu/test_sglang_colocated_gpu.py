"""Colocated mode on a real SGLang server (TP=1) sharing GPU 0 with this process (the learner).

The server runs with ``--enable-memory-saver``. Per cycle, as the colocated gate drives it
(rollout_fleet/colocated_gate.py): the engine releases its weights and KV cache
(``/release_memory_occupation``; the freed memory is measured here with ``torch.cuda.mem_get_info``
and taken by a learner-sized allocation), refuses generation while released, resumes its weights,
takes a publish from this process over gloo (SGLang's own ``/update_weights_from_distributed`` into
the group its worker joins with ``backend="gloo"``: no NCCL between two processes on one GPU),
resumes its KV cache, and then samples with log-probs that match a transformers forward on the
published weights (and not the previous ones). Timings go to $FLEETRL_GPU_RESULTS (jsonl) when set.
"""

from __future__ import annotations

import importlib.util
import os
import random
import time

import pytest
from gpu_helpers import Reference, check_logprobs, record

from core.http_client import free_port

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]
GIB = 1 << 30


@pytest.fixture(scope="module")
def server(qwen_checkpoints, loop, tmp_path_factory):
    from engines.sglang.server import SGLangServer, SGLangServerArgs

    if importlib.util.find_spec("torch_memory_saver") is None:
        pytest.fail("torch_memory_saver is not installed: SGLang's --enable-memory-saver needs it")
    v0, _, _, _ = qwen_checkpoints
    log_path = os.environ.get("FLEETRL_SGLANG_LOG") or str(tmp_path_factory.mktemp("sglang") / "server.log")
    srv = SGLangServer(
        SGLangServerArgs(
            model=str(v0),
            gpus=[0],
            port=free_port(),
            mem_fraction_static=0.5,
            max_running_requests=64,
            memory_saver=True,
            log_path=log_path,
        )
    )
    t0 = time.monotonic()
    loop.run_until_complete(srv.start(timeout_s=600))
    record(
        "sglang_colocated",
        "startup",
        seconds=time.monotonic() - t0,
        version=str(srv.version),
        command=srv.command(srv.version),
    )
    yield srv
    srv.stop()


def _free() -> int:
    import torch

    torch.cuda.synchronize()
    return torch.cuda.mem_get_info(0)[0]


def _settled_free(limit_s: float = 5.0) -> int:
    """Free memory once it stops changing (slime and miles saw SGLang's release answer before the memory
    was back; the cycle records what was free at the answer too)."""
    last, t0 = _free(), time.monotonic()
    while time.monotonic() - t0 < limit_s:
        time.sleep(0.2)
        now = _free()
        if abs(now - last) < (64 << 20):
            return now
        last = now
    return last


def test_release_frees_memory_then_publish_and_resume_serve_the_new_weights(server, loop, qwen_checkpoints):
    import torch

    from core.http_client import EngineError
    from engines.base import SamplingParams
    from engines.sglang.weights import SGLangPublishClient
    from weight_sync.config import WeightSyncConfig
    from weight_sync.plan import build_plan
    from weight_sync.publisher import Publisher
    from weight_sync.sglang_group import publisher_nccl_env

    for k, v in publisher_nccl_env().items():  # NCCL_CUMEM_ENABLE=0, as the server's
        os.environ.setdefault(k, v)
    _, _, s0, s1 = qwen_checkpoints
    torch.cuda.set_device(0)
    refs = {0: Reference(s0), 1: Reference(s1)}
    params = SamplingParams(n=4, max_tokens=32, temperature=1.0)
    engine = server.generation_client("sglang-colo", timeout_s=300, control_timeout_s=120)
    learner_side = SGLangPublishClient(
        "sglang-colo", server.url, version=str(server.version), timeout_s=120, control_timeout_s=120
    )
    plan = build_plan([(n, list(t.shape), t.dtype) for n, t in s1.items()], 256 << 20)
    pub = Publisher(
        WeightSyncConfig(backend="gloo", nccl_impl="sglang", timeout_s=120.0),
        plan,
        rank=0,
        engines=[learner_side],
        device="cpu",
    )
    weight_bytes = sum(t.numel() * t.element_size() for t in s1.values())
    prompt = random.Random(0).sample(range(1000, 100000), 16)
    try:
        samples = loop.run_until_complete(engine.generate(prompt, params))
        check_logprobs("sglang_colocated", samples, prompt, refs[0], refs[1], "generate_v0")
        cycles = []
        for version, new in ((1, s1), (2, s0)):  # publish v1 (= s1), then back to s0
            held = 1 if version == 1 else 0
            free0 = _free()
            t0 = time.perf_counter()
            loop.run_until_complete(engine.sleep(2))
            t_sleep = time.perf_counter() - t0
            free_at_answer = _free()
            free1 = _settled_free()
            assert loop.run_until_complete(engine.is_sleeping())
            with pytest.raises(EngineError, match="generate while its GPU memory is released"):
                loop.run_until_complete(engine.generate(prompt, params))
            # the learner's step can have what the engine gave back
            big = torch.empty(int((free1 - free0) * 0.8), dtype=torch.uint8, device="cuda:0")
            del big
            torch.cuda.empty_cache()
            t0 = time.perf_counter()
            loop.run_until_complete(engine.wake_up(["weights"]))
            t_weights = time.perf_counter() - t0
            free2 = _free()
            t0 = time.perf_counter()
            rep = pub.publish(version, iter(new.items()))
            t_publish = time.perf_counter() - t0
            assert rep is not None and set(rep.engines) == {"sglang-colo"}
            t0 = time.perf_counter()
            loop.run_until_complete(engine.wake_up(["kv_cache"]))
            t_kv = time.perf_counter() - t0
            free3 = _free()
            cycles.append(
                {
                    "version": version,
                    "freed_gib": (free1 - free0) / GIB,
                    "freed_at_answer_gib": (free_at_answer - free0) / GIB,
                    "weights_back_gib": (free1 - free2) / GIB,
                    "kv_back_gib": (free2 - free3) / GIB,
                    "sleep_s": t_sleep,
                    "wake_weights_s": t_weights,
                    "publish_s": t_publish,
                    "wake_kv_s": t_kv,
                }
            )
            print(f"cycle v{version}: {cycles[-1]}")
            # released: at least the weights (and the KV cache, far larger at mem_fraction_static=0.5)
            assert free1 - free0 > weight_bytes + 4 * GIB, cycles[-1]
            assert free1 - free2 > 0.8 * weight_bytes, cycles[-1]  # the weights are back
            assert free2 - free3 > 4 * GIB, cycles[-1]  # and the KV cache
            samples = loop.run_until_complete(engine.generate(prompt, params))
            check_logprobs(
                "sglang_colocated", samples, prompt, refs[held], refs[1 - held], f"generate_after_v{version}"
            )
        record("sglang_colocated", "cycles", weight_bytes=weight_bytes, buckets=len(plan.buckets), cycles=cycles)
    finally:
        pub.close()
        loop.run_until_complete(engine.close())
