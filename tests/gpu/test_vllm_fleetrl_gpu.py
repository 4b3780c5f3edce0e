"""vLLM TP=1 on GPU 1 taking weights through fleetrl's own backend over NCCL (the ``fleetrl``
weight-transfer plugin), against the learner's forward; unavailability per update.

The other vLLM test (test_vllm_gpu.py) feeds vLLM's built-in ``nccl`` backend. This one
starts the server with ``--weight-transfer-config {"backend": "fleetrl"}``: the workers
join a ProcessGroupNCCL from fleetrl's TCP store (publisher ``nccl_impl="torch"``),
receive with two buckets posted ahead, load an unquantized model in place (no
layer-wise reload), and acknowledge with the checksum of the bytes they received,
which the publisher compares with its own. The plugin is found through the
``vllm.general_plugins`` entry point, so fleetrl must be installed (or have its
dist-info on the path: bench/gpu_calls.sh ``base``).
"""

from __future__ import annotations

import os
import random
import time

import pytest
from gpu_helpers import (
    MAX_TOL,
    MEAN_TOL,
    OTHER_MIN,
    Reference,
    compare,
    record,
    vllm_server_on_gpu1,
)

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]

os.environ.setdefault("NCCL_CUMEM_ENABLE", "0")  # every process of the weight group must agree


def _record(what: str, **kw) -> None:
    record("vllm_fleetrl_nccl", what, **kw)


@pytest.fixture(scope="module")
def server(qwen_checkpoints, tmp_path_factory):
    run_dir = os.environ.get("FLEETRL_VLLM_FLEETRL_RUN_DIR") or str(tmp_path_factory.mktemp("vllm-fleetrl"))
    srv = vllm_server_on_gpu1("vllm_fleetrl_nccl", str(qwen_checkpoints[0]), run_dir, weight_backend="fleetrl")
    yield srv
    srv.stop()


def test_fleetrl_nccl_publish_checked_and_logprobs_match(server, loop, qwen_checkpoints):
    import torch

    from engines.base import SamplingParams
    from engines.vllm.generation import VLLMGenerationClient
    from engines.vllm.weights import VLLMWeightClient
    from weight_sync.config import WeightSyncConfig
    from weight_sync.plan import build_plan
    from weight_sync.publisher import Publisher

    _, _, s0, s1 = qwen_checkpoints
    torch.cuda.set_device(0)
    plan = build_plan([(n, list(t.shape), t.dtype) for n, t in s1.items()], 256 << 20)
    engine = VLLMWeightClient("vllm-f", server.url, model=server.model_name, weight_backend="fleetrl")
    pub = Publisher(
        WeightSyncConfig(backend="nccl", nccl_impl="torch", bucket_mb=256, timeout_s=120),
        plan,
        rank=0,
        engines=[engine],
        device="cuda:0",
    )
    sampler = VLLMGenerationClient("vllm-f-gen", server.url, model=server.model_name)
    try:
        reports, walls, steps = [], [], []
        for version, state in ((1, s1), (2, s0), (3, s1), (4, s0), (5, s1)):  # v1 includes the group's creation
            learner = {k: v.to("cuda:0") for k, v in state.items()}
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            reports.append(pub.publish(version, iter(learner.items())))
            walls.append(time.perf_counter() - t0)
            steps.append(dict(engine.last_update_steps))
        for r in reports:  # the engine acknowledged exactly the bytes we sent
            assert r.per_engine_checksums == {"vllm-f": r.checksum}, r
        _record(
            "update",
            bytes=reports[-1].bytes,
            buckets=len(plan.buckets),
            first_s=walls[0],
            pause_to_resume_s=walls[1:],
            broadcast_s=[r.broadcast_seconds for r in reports[1:]],
            http_steps_s=steps[1:],
        )
        print("pause-to-resume per update:", [round(w, 4) for w in walls[1:]])
        for st in steps[1:]:
            print("  steps:", {k: round(v, 4) for k, v in st.items()})
        prompt = random.Random(1).sample(range(1000, 100000), 16)
        samples = loop.run_until_complete(sampler.generate(prompt, SamplingParams(n=4, max_tokens=32, temperature=1.0)))
        d_same = compare(samples, prompt, Reference(s1))
        d_other = compare(samples, prompt, Reference(s0))
        _record(
            "generate_after_publish",
            tokens=int(d_same.size),
            mean_abs=float(d_same.mean()),
            max_abs=float(d_same.max()),
            other_mean_abs=float(d_other.mean()),
        )
        print(
            f"log-prob |diff| vs new weights: mean {d_same.mean():.4f} max {d_same.max():.4f}; "
            f"vs old: mean {d_other.mean():.3f}"
        )
        assert d_same.mean() < MEAN_TOL and d_same.max() < MAX_TOL
        assert d_other.mean() > OTHER_MIN, "the old weights fit as well: the check is blind"
    finally:
        pub.close()
        loop.run_until_complete(sampler.close())


def test_staged_publish_keeps_serving_and_logprobs_match(server, loop, qwen_checkpoints):
    """weight_sync.staging over NCCL: the engine's receives are posted into a standing copy while it
    serves; only the commit (one /collective_rpc between two engine steps) holds it still."""
    import torch

    from engines.base import SamplingParams
    from engines.vllm.generation import VLLMGenerationClient
    from engines.vllm.weights import VLLMWeightClient
    from weight_sync.config import WeightSyncConfig
    from weight_sync.plan import build_plan
    from weight_sync.publisher import Publisher

    _, _, s0, s1 = qwen_checkpoints
    torch.cuda.set_device(0)
    plan = build_plan([(n, list(t.shape), t.dtype) for n, t in s1.items()], 256 << 20)
    engine = VLLMWeightClient(
        "vllm-s", server.url, model=server.model_name, weight_backend="fleetrl", update_pause_mode="keep"
    )
    pub = Publisher(
        WeightSyncConfig(backend="nccl", nccl_impl="torch", bucket_mb=256, timeout_s=120, staging=True),
        plan,
        rank=0,
        engines=[engine],
        device="cuda:0",
    )
    sampler = VLLMGenerationClient("vllm-s-gen", server.url, model=server.model_name)
    try:
        reports, steps = [], []
        for version, state in ((11, s0), (12, s1), (13, s0), (14, s1)):
            learner = {k: v.to("cuda:0") for k, v in state.items()}
            torch.cuda.synchronize()
            reports.append(pub.publish(version, iter(learner.items())))
            steps.append(dict(engine.last_update_steps))
        for r in reports:
            assert r.per_engine_checksums == {"vllm-s": r.checksum}, r
        assert all("pause" not in st for st in steps), steps
        replayed = [st.get("commit_replayed", 0) for st in steps]
        _record(
            "staged_update",
            bytes=reports[-1].bytes,
            publish_s=[r.seconds for r in reports[1:]],
            commit_in_engine_s=[st["commit_in_engine"] for st in steps[1:]],
            http_steps_s=steps[1:],
            replayed_buckets=replayed,
        )
        print(
            "staged: commit inside the engine per update:",
            [round(st["commit_in_engine"], 4) for st in steps[1:]],
            "buckets replayed so far:",
            replayed,
        )
        prompt = random.Random(2).sample(range(1000, 100000), 16)
        samples = loop.run_until_complete(sampler.generate(prompt, SamplingParams(n=4, max_tokens=32, temperature=1.0)))
        d_same, d_other = compare(samples, prompt, Reference(s1)), compare(samples, prompt, Reference(s0))
        _record(
            "generate_after_staged_publish",
            tokens=int(d_same.size),
            mean_abs=float(d_same.mean()),
            max_abs=float(d_same.max()),
            other_mean_abs=float(d_other.mean()),
        )
        assert d_same.mean() < MEAN_TOL and d_same.max() < MAX_TOL
        assert d_other.mean() > OTHER_MIN, "the old weights fit as well: the check is blind"
    finally:
        pub.close()
        loop.run_until_complete(sampler.close())
