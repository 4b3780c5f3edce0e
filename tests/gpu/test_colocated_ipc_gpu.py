"""Colocated weight loads by CUDA IPC: a vLLM server and this process (the learner's side) on ONE GPU.

The server (fleetrl's ``fleetrl`` weight-transfer backend, sleep mode on, eager) runs on GPU 0 beside
this process, as learner rank 0 and server 0 share a GPU under ``launch/cluster.py --gpus 1``. Each
publish is the colocated step's: sleep (level 1) -> wake the weights -> load the new weights from
this process's GPU memory (weight_sync.ipc_publisher.IpcPublisher -> VLLMIpcClient -> the plugin's
IpcReceiver) -> wake the KV cache. Then greedy tokens and sampled log-probs must fit a transformers
forward on the new weights, and must not fit the old ones (so the check can fail: without the load
the server keeps the v0 weights it started with). The same publish over the gloo path (the one
colocated mode used before) is timed side by side; figures go to $FLEETRL_GPU_RESULTS. A plan whose
shapes do not fit the engine must be refused by name, and the server must go on serving.
"""

from __future__ import annotations

import os
import random
import time

import pytest
from gpu_helpers import Reference, check_logprobs, record

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

TEST = "colocated_ipc"


def start_server(test: str, model: str, run_dir: str, extra_args: tuple[str, ...] = (), env: dict | None = None):
    """A vLLM server on GPU 0 (``FLEETRL_IPC_GPU``) as colocated mode starts it: fleetrl's backend, sleep mode,
    eager; its start-up seconds recorded under ``test``. Also the LoRA variant's (test_colocated_lora_gpu.py)."""
    from engines.vllm.server import VLLMServer, VLLMServerArgs

    srv = VLLMServer(
        VLLMServerArgs(
            model=model,
            dtype="bfloat16",
            max_model_len=2048,
            gpu_memory_utilization=0.35,
            max_num_seqs=64,
            enforce_eager=True,
            weight_backend="fleetrl",
            extra_args=["--enable-sleep-mode", *extra_args],
            env={"CUDA_VISIBLE_DEVICES": os.environ.get("FLEETRL_IPC_GPU", "0"), **(env or {})},
        ),
        run_dir,
    )
    t0 = time.monotonic()
    srv.start()
    record(test, "startup", seconds=time.monotonic() - t0, command=srv.command())
    return srv


@pytest.fixture(scope="module")
def server(qwen_checkpoints, tmp_path_factory):
    run_dir = os.environ.get("FLEETRL_COLOCATED_IPC_RUN_DIR") or str(tmp_path_factory.mktemp("vllm-ipc"))
    srv = start_server(TEST, str(qwen_checkpoints[0]), run_dir)
    yield srv
    srv.stop()


def _on_gpu(state: dict) -> dict:
    import torch

    out = {k: v.to("cuda:0") for k, v in state.items()}
    torch.cuda.synchronize()
    return out


def _greedy_fits(loop, sampler, ref: Reference, prompts: list[list[int]]) -> float:
    """Fraction of the engine's greedy tokens that are the reference's argmax at their position."""
    import torch

    from engines.base import SamplingParams

    hit = total = 0
    for prompt in prompts:
        (s,) = loop.run_until_complete(sampler.generate(prompt, SamplingParams(n=1, max_tokens=8, temperature=0.0)))
        ids = torch.tensor([prompt + [int(t) for t in s.token_ids]], device=ref.device)
        with torch.no_grad():
            top = ref.model(ids).logits[0, len(prompt) - 1 : -1].argmax(-1).cpu().tolist()
        hit += sum(int(a == b) for a, b in zip(top, s.token_ids, strict=True))
        total += len(top)
    return hit / total


def _colocated_publish(loop, engine, publish):
    """The colocated step around one publish: sleep, wake the weights, publish, wake the KV cache. ``engine``:
    a client on ``loop`` (the publisher's own clients live on its RPC thread's loop)."""
    loop.run_until_complete(engine.sleep(1))
    loop.run_until_complete(engine.wake_up(["weights"]))
    t0 = time.perf_counter()
    rep = publish()
    load_s = time.perf_counter() - t0
    loop.run_until_complete(engine.wake_up(["kv_cache"]))
    return rep, load_s


def test_ipc_load_matches_transformers_and_beats_gloo(server, loop, qwen_checkpoints):
    import torch

    from engines.base import SamplingParams
    from engines.vllm.generation import VLLMGenerationClient
    from engines.vllm.ipc import VLLMIpcClient
    from engines.vllm.weights import VLLMWeightClient
    from weight_sync.config import WeightSyncConfig
    from weight_sync.ipc_publisher import IpcPublisher
    from weight_sync.plan import build_plan
    from weight_sync.publisher import Publisher

    _, _, s0, s1 = qwen_checkpoints
    torch.cuda.set_device(0)
    params = [(n, list(t.shape), t.dtype) for n, t in s1.items()]
    ws = WeightSyncConfig(backend="gloo", bucket_mb=256, timeout_s=120)
    plan = build_plan(params, 256 << 20)  # as learner/rank.py builds the IPC plan (no tail pieces)
    engine = VLLMIpcClient("vllm-ipc", server.url, model=server.model_name, timeout_s=120, update_pause_mode="wait")
    pub = IpcPublisher(plan, device="cuda:0", slots=3, timeout_s=120, engines=[engine])
    sampler = VLLMGenerationClient("vllm-ipc-gen", server.url, model=server.model_name)
    try:
        ipc_s, steps = [], []
        for version, state in ((1, s1), (2, s0), (3, s1), (4, s0), (5, s1)):  # v1 includes the join
            learner = _on_gpu(state)
            rep, load_s = _colocated_publish(
                loop, sampler, lambda v=version, w=learner: pub.publish(v, iter(w.items()))
            )
            assert rep.per_engine_checksums == {"vllm-ipc": rep.checksum}, rep
            ipc_s.append(load_s)
            steps.append(dict(engine.last_update_steps))
            del learner
        record(
            TEST,
            "ipc_load",
            bytes=rep.bytes,
            buckets=len(plan.buckets),
            slots=len(pub.bufs),
            rounds=len(pub.rounds),
            first_s=ipc_s[0],
            seconds=ipc_s[1:],
            http_steps_s=steps[1:],
        )
        print(
            "IPC load per publish (s):",
            [round(x, 4) for x in ipc_s],
            "buckets",
            len(plan.buckets),
            "rounds",
            len(pub.rounds),
        )
        ref1, ref0 = Reference(s1), Reference(s0)
        rng = random.Random(3)
        prompts = [rng.sample(range(1000, 100000), 16) for _ in range(4)]
        fit1, fit0 = _greedy_fits(loop, sampler, ref1, prompts), _greedy_fits(loop, sampler, ref0, prompts)
        record(TEST, "greedy_after_ipc", fraction_argmax_new=fit1, fraction_argmax_old=fit0)
        print(f"greedy tokens that are transformers' argmax: new weights {fit1:.3f}, old {fit0:.3f}")
        assert fit1 >= 0.9 and fit0 < 0.5, (fit1, fit0)
        samples = loop.run_until_complete(
            sampler.generate(prompts[0], SamplingParams(n=4, max_tokens=32, temperature=1.0))
        )
        check_logprobs(TEST, samples, prompts[0], ref1, ref0, "logprobs_after_ipc")
        del ref0, ref1
        torch.cuda.empty_cache()

        # the gloo path colocated mode took so far, side by side (same server, same weights, same step)
        gplan = build_plan(params, int(ws.bucket_mb * (1 << 20)), ws.tail_bytes(False))  # as rank.py for gloo
        gengine = VLLMWeightClient(
            "vllm-gloo",
            server.url,
            model=server.model_name,
            weight_backend="fleetrl",
            timeout_s=120,
            update_pause_mode="wait",
        )
        gpub = Publisher(ws, gplan, rank=0, engines=[gengine], device="cpu")
        try:
            gloo_s = []
            for version, state in ((6, s0), (7, s1), (8, s0)):
                learner = _on_gpu(state)
                rep, load_s = _colocated_publish(
                    loop, sampler, lambda v=version, w=learner: gpub.publish(v, iter(w.items()))
                )
                assert rep.per_engine_checksums == {"vllm-gloo": rep.checksum}, rep
                gloo_s.append(load_s)
                del learner
        finally:
            gpub.close()
        record(TEST, "gloo_load", bytes=rep.bytes, first_s=gloo_s[0], seconds=gloo_s[1:])
        ratio = (sum(gloo_s[1:]) / len(gloo_s[1:])) / (sum(ipc_s[1:]) / len(ipc_s[1:]))
        record(TEST, "gloo_over_ipc", ratio=ratio)
        print(f"gloo load per publish (s): {[round(x, 4) for x in gloo_s]}; gloo / ipc (warm means) {ratio:.1f}x")

        # back to IPC after gloo (a new publisher: a new join), and the weights are v9's
        pub.close()
        pub = IpcPublisher(plan, device="cuda:0", slots=2, timeout_s=120, engines=[engine])
        learner = _on_gpu(s1)
        rep, _ = _colocated_publish(loop, sampler, lambda: pub.publish(9, iter(learner.items())))
        assert rep.per_engine_checksums == {"vllm-ipc": rep.checksum}, rep
        samples = loop.run_until_complete(
            sampler.generate(prompts[1], SamplingParams(n=4, max_tokens=32, temperature=1.0))
        )
        check_logprobs(TEST, samples, prompts[1], Reference(s1), Reference(s0), "logprobs_after_ipc_rejoin")
    finally:
        pub.close()
        loop.run_until_complete(sampler.close())


def test_ipc_plan_that_does_not_fit_is_refused_by_name(server, loop, qwen_checkpoints):
    import torch

    from engines.base import SamplingParams
    from engines.vllm.generation import VLLMGenerationClient
    from engines.vllm.ipc import VLLMIpcClient
    from weight_sync.ipc_publisher import IpcPublisher
    from weight_sync.plan import build_plan
    from weight_sync.publish_run import PublishError

    _, _, _, s1 = qwen_checkpoints
    torch.cuda.set_device(0)
    bad_name = "model.layers.3.mlp.down_proj.weight"
    bad = {k: (v.t().contiguous() if k == bad_name else v) for k, v in s1.items()}  # [896, 4864] -> [4864, 896]
    plan = build_plan([(n, list(t.shape), t.dtype) for n, t in bad.items()], 256 << 20)
    engine = VLLMIpcClient("vllm-bad", server.url, model=server.model_name, timeout_s=120)
    pub = IpcPublisher(plan, device="cuda:0", slots=2, timeout_s=120, engines=[engine])
    sampler = VLLMGenerationClient("vllm-bad-gen", server.url, model=server.model_name)
    try:
        with pytest.raises(PublishError) as err:
            pub.publish(20, iter(_on_gpu(bad).items()))
        text = str(err.value)
        print("refused:", text[:600])
        record(TEST, "bad_shape_refused", message=text[:600])
        assert "does not fit" in text and bad_name in text, text
        assert err.value.blamed == ["vllm-bad"]
        # the server is alive and serving (nothing was loaded, nothing was paused)
        assert loop.run_until_complete(sampler.health())
        out = loop.run_until_complete(sampler.generate([5, 6, 7], SamplingParams(n=1, max_tokens=4, temperature=0.0)))
        assert len(out[0].token_ids) >= 1
    finally:
        pub.close()
        loop.run_until_complete(sampler.close())
