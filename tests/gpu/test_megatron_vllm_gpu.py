"""A publish from Megatron TP=2 leaves a vLLM engine's log-probs equal to the learner's forward pass.

Megatron TP=2 ranks on GPUs 0 and 1 hold a random Qwen2-0.5B-shaped model (version v1 of the
``qwen_checkpoints`` fixture) and take one optimizer step; a TP=1 vLLM server on GPU 1 (started
from v0, a small share of the GPU's memory) receives the learner's weights through fleetrl's
weight-transfer backend over NCCL (the ``fleetrl`` plugin, publisher ``nccl_impl="torch"``) and
samples; Megatron computes the log-probs of the sampled tokens with its own forward. They must
agree within the bf16 tolerance of the engine tests (gpu_helpers: mean < 0.1, every token < 0.35
nats), and must not agree with the server's original weights (v0: > 1 nat), so the check can fail.

Needs vLLM (the ``vllm-install`` target of bench/gpu_calls.sh) and megatron-core (the base wheels)::

    NCCL_CUMEM_ENABLE=0 pytest -m gpu -s tests/gpu/test_megatron_vllm_gpu.py
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1] / "tests" / "support"))

from gpu_helpers import MAX_TOL, MEAN_TOL, OTHER_MIN, Reference, record, vllm_server_on_gpu1  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

os.environ.setdefault("NCCL_CUMEM_ENABLE", "0")  # every process of the weight group must agree
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")


def _need() -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    for mod in ("vllm", "megatron.core"):
        if importlib.util.find_spec(mod.split(".")[0]) is None or importlib.util.find_spec(mod) is None:
            pytest.skip(f"{mod} is not importable here")
    if torch.cuda.device_count() < 2:
        pytest.fail(f"this test needs 2 GPUs, found {torch.cuda.device_count()}")


@pytest.fixture(scope="module")
def server(qwen_checkpoints, tmp_path_factory):
    _need()
    run_dir = os.environ.get("FLEETRL_MEGATRON_VLLM_RUN_DIR") or str(tmp_path_factory.mktemp("vllm-megatron"))
    # GPU 1 also holds Megatron's TP rank 1 (~5 GB for this model with Adam state): vLLM takes 30%.
    srv = vllm_server_on_gpu1(
        "megatron_vllm",
        str(qwen_checkpoints[0]),
        run_dir,
        weight_backend="fleetrl",
        gpu_memory_utilization=0.3,
        enforce_eager=True,
    )
    yield srv
    srv.stop()


def test_publish_from_megatron_tp2_matches_engine_logprobs(server, qwen_checkpoints, tmp_path):
    import megatron_worker as mw
    import numpy as np
    import torch
    from learner_testkit import run_procs

    _, v1_dir, s0, s1 = qwen_checkpoints
    kw = {
        "model": str(v1_dir),
        "url": server.url,
        "model_name": server.model_name,
        "out": str(tmp_path / "mv"),
        "v0": str(qwen_checkpoints[0]),
    }
    run_procs(mw.megatron_vllm_rank, 2, kw, 300, "spawn")
    res = torch.load(kw["out"] + ".rank0.pt", weights_only=False)
    checksum, per_engine = res["checksums"]
    print(
        f"megatron TP=2 step: loss {res['metrics']['loss_total']:.5f} grad_norm {res['metrics']['grad_norm']:.3f}; "
        f"publish {res['publish_s']:.2f}s, checksum {checksum}, engine {per_engine}"
    )
    assert per_engine == {"vllm-megatron": checksum}, "the engine did not acknowledge the bytes we sent"
    prompt, samples = res["prompt"], res["samples"]
    assert len(samples) == 4 and all(len(t) > 0 for t, _ in samples)
    d_learner = np.concatenate(
        [
            np.abs(np.asarray(lp, dtype=np.float64) - mine.astype(np.float64))
            for (_, lp), mine in zip(samples, res["learner_logp"], strict=True)
        ]
    )
    ref_v0, ref_v1 = Reference(s0), Reference(s1)
    d_v0 = np.concatenate([np.abs(np.asarray(lp, dtype=np.float64) - ref_v0.logprobs(prompt, t)) for t, lp in samples])
    d_v1 = np.concatenate([np.abs(np.asarray(lp, dtype=np.float64) - ref_v1.logprobs(prompt, t)) for t, lp in samples])
    record(
        "megatron_vllm",
        "engine_vs_megatron_forward",
        tokens=int(d_learner.size),
        mean_abs=float(d_learner.mean()),
        max_abs=float(d_learner.max()),
        v0_mean_abs=float(d_v0.mean()),
        pre_step_v1_mean_abs=float(d_v1.mean()),
        publish_s=res["publish_s"],
    )
    print(
        f"engine vs Megatron forward: log-prob |diff| mean {d_learner.mean():.4f} max {d_learner.max():.4f} over "
        f"{d_learner.size} tokens; vs the server's original weights (v0) mean {d_v0.mean():.3f}; vs the "
        f"learner's weights before its step (v1, transformers) mean {d_v1.mean():.3f}"
    )
    assert d_learner.mean() < MEAN_TOL and d_learner.max() < MAX_TOL, (d_learner.mean(), d_learner.max())
    assert d_v0.mean() > OTHER_MIN, "the server's original weights fit as well: the check is blind"
    # the engine held v0 again just before Megatron's publish, which was a staged commit replayed from the
    # copies recorded at the v0 publish: the match above is the replay's doing
    print(
        f"staged commits: buckets replayed {res['replayed_after_v0']:.0f} after v0, {res['replayed']:.0f} after "
        f"Megatron's publish; steps {res['update_steps']}"
    )
    record(
        "megatron_vllm",
        "staged_replay",
        replayed_after_v0=res["replayed_after_v0"],
        replayed=res["replayed"],
        steps=res["update_steps"],
    )
    assert res["replayed"] > res["replayed_after_v0"], "Megatron's publish was not replayed from the copy plan"
