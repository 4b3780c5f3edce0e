"""LoRA policy publishing into a real SGLang server on one GPU: the server's log-probs at each new adapter equal
the learner's (the GPU counterpart of tests/integration/learner/test_lora_vllm.py, for SGLang 0.5.16).

GPU 0 holds both: an SGLang server started with fleetrl's LoRA arguments (engines/sglang/lora.py,
``--mem-fraction-static 0.3``, no radix cache so every prompt log-prob is computed) and, in this process, one FSDP
learner rank (NCCL, world size 1) with ``learner.lora`` on the random Qwen2-0.5B-shaped checkpoint of
tests/gpu/conftest.py. Per step the learner trains, :class:`weight_sync.adapter_publisher.AdapterPublisher`
writes the peft folder and loads it through :class:`engines.sglang.weights.SGLangWeightClient` (``adapter_prefix``)
as ``policy-v<v>``; the server's prompt log-probs of fixed sequences under that adapter (``/generate`` with
``lora_path``) must equal the learner's forward, the previous adapter must still serve its version, and the base
(no adapter) must still be the base. Then: the export's ``adapter/`` folder through the prefixed client's
``load_weights_from_path`` (a restarted server's path), generation through the fleet's client (``lora_path`` from
its version label), and the merged export through a client without the prefix (``/update_weights_from_disk``:
the base itself becomes the trained policy). Timings go to $FLEETRL_GPU_RESULTS (jsonl) when set.
"""

from __future__ import annotations

import importlib.util
import os
import random
import time
from pathlib import Path

import pytest
from gpu_helpers import MAX_TOL, MEAN_TOL, OTHER_MIN, VOCAB, record

from core.http_client import free_port

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
RANK, ALPHA, STEPS = 16, 32.0, 3
# Prompts inside the random model's vocabulary (the ids its scaled embeddings make peaked, as the other GPU tests).
_rng = random.Random(0)
PROBES = [_rng.sample(range(1000, 100000), n) for n in (24, 40, 17)]
# bf16 on both sides (the learner computes in bf16 from its fp32 master copy, whose values are the bf16
# checkpoint's; the published adapter is bf16): gpu_helpers' bound for a bf16 engine against a bf16 reference on
# this model, mean < MEAN_TOL (0.1) and every token < MAX_TOL (0.35) nats, with the reasoning there. So that the
# match proves the adapter was applied, every version must move the learner's log-probs by more than
# MOVED_MIN = 3 x MEAN_TOL on average, and the last by more than OTHER_MIN (1 nat, the other GPU tests' blind check).
MOVED_MIN = 3 * MEAN_TOL


def _mean_max(a: list[list[float]], b: list[list[float]]) -> tuple[float, float]:
    import numpy as np

    d = np.abs(
        np.concatenate([np.asarray(x, dtype=np.float64) for x in a])
        - np.concatenate([np.asarray(x, dtype=np.float64) for x in b])
    )
    return float(d.mean()), float(d.max())


@pytest.fixture(scope="module")
def server(qwen_checkpoints, loop, tmp_path_factory):
    from engines.sglang.lora import sglang_lora_server_args
    from engines.sglang.server import SGLangServer, SGLangServerArgs

    if importlib.util.find_spec("sglang") is None:
        pytest.skip("needs sglang (the SGLang 0.5.16 bundle on PYTHONPATH)")
    v0, _, _, _ = qwen_checkpoints
    log_path = os.environ.get("FLEETRL_SGLANG_LOG") or str(tmp_path_factory.mktemp("sglang") / "server.log")
    srv = SGLangServer(
        SGLangServerArgs(
            model=str(v0),
            gpus=[0],
            port=free_port(),
            mem_fraction_static=0.3,
            max_running_requests=64,
            radix_cache=False,
            fleetrl_loader=False,
            extra_args=sglang_lora_server_args(RANK),
            log_path=log_path,
        )
    )
    t0 = time.monotonic()
    loop.run_until_complete(srv.start(timeout_s=600))
    record(
        "sglang_lora",
        "startup",
        seconds=time.monotonic() - t0,
        version=str(srv.version),
        command=srv.command(srv.version),
    )
    yield srv
    srv.stop()


def _headers(server) -> dict:
    from core.engine_auth import auth_headers, engine_token

    return auth_headers(engine_token(server.environment()))


def _server_logprobs(server, adapter: str | None) -> list[list[float]]:
    """Prompt log-probs of PROBES (token i given tokens < i, i >= 1) at temperature 1, under ``adapter``."""
    import httpx

    out = []
    for ids in PROBES:
        body = {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": 1, "temperature": 1.0},
            "return_logprob": True,
            "logprob_start_len": 0,
        }
        if adapter is not None:
            body["lora_path"] = adapter
        r = httpx.post(server.url + "/generate", json=body, headers=_headers(server), timeout=180)
        assert r.status_code == 200, (adapter, r.status_code, r.text[:500])
        got = [(e[0], e[1]) for e in r.json()["meta_info"]["input_token_logprobs"]]
        if len(got) == len(ids):  # the first prompt token has no log-prob (None)
            got = got[1:]
        assert [t for _, t in got] == ids[1:], f"input_token_logprobs are not the prompt's tokens: {got[:4]}"
        assert all(lp is not None for lp, _ in got)
        out.append([float(lp) for lp, _ in got])
    return out


def _served_adapters(server) -> set[str]:
    import httpx

    r = httpx.get(server.url + "/v1/models", headers=_headers(server), timeout=60)
    r.raise_for_status()
    return {m["id"] for m in r.json()["data"] if m["id"].startswith("policy-")}


def _learner_logprobs(model, seqs: list[list[int]], start: list[int] | None = None) -> list[list[float]]:
    """log p(token i | tokens < i) for i >= start (default 1) of each sequence, the learner's forward (with the
    varlen kwargs of one packed sequence: on CUDA the learner's attention is varlen by default)."""
    import torch

    from learner.attention import varlen_kwargs

    out = []
    with torch.no_grad():
        for k, ids in enumerate(seqs):
            x = torch.tensor([ids], device="cuda")
            cu = torch.tensor([0, len(ids)], device="cuda", dtype=torch.int32)
            kw = varlen_kwargs(cu, len(ids))
            pos = torch.arange(len(ids), device="cuda").unsqueeze(0)
            lp = torch.log_softmax(model(input_ids=x, position_ids=pos, use_cache=False, **kw).logits.float(), -1)[
                0, :-1
            ]
            tok = lp.gather(-1, x[0, 1:].view(-1, 1)).squeeze(-1)
            s = (start[k] if start else 1) - 1
            out.append(tok[s:].tolist())
    return out


def _bench_learner():
    spec = importlib.util.spec_from_file_location("bench_learner", REPO / "bench" / "learner.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


async def _closing(client, coro):
    try:
        return await coro
    finally:
        await client.close()


def test_sglang_lora_adapters_match_the_learner(server, loop, qwen_checkpoints, tmp_path):
    import torch

    from engines.base import SamplingParams
    from engines.sglang.factory import FleetSGLangClient
    from learner.batch import plan_step
    from learner.config import LearnerConfig
    from learner.fsdp import FSDPEngine
    from learner.run import init_distributed
    from weight_sync.adapter_publisher import AdapterPublisher

    v0, _, _, _ = qwen_checkpoints
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        NCCL_CUMEM_ENABLE="0",
    )
    torch.cuda.set_device(0)
    init_distributed("nccl", timeout_s=300)
    try:
        cfg = LearnerConfig.model_validate(
            {
                # 'none': no behaviour weight (the batch's behaviour log-probs, -12, are far from this peaked
                # model's, ~-16, and tis would scale the gradient by exp(-4)); Adam's first steps move each
                # adapter weight by ~lr whatever the gradient's size. This setup on CPU (fp32, 8 sequences) moved
                # the probes' log-probs by 0.9, 2.9 and 3.4 nats on average after steps 1-3, logits staying
                # within +-18 (the regime of gpu_helpers' bf16 bound).
                "loss": {"correction": "none"},
                "optim": {"lr": 1e-2},
                "micro_batch_tokens": 4096,
                "activation_checkpointing": False,
                "logprob_probe_tolerance": None,
                "lora": {"rank": RANK, "alpha": ALPHA},
            }
        )
        engine = FSDPEngine(cfg, str(v0), total_steps=STEPS, seed=0)
        batch = _bench_learner().make_batch(16, 32, 32, VOCAB - 1000)
        plan = plan_step(
            batch,
            rank=0,
            world_size=1,
            micro_batch_tokens=cfg.micro_batch_tokens,
            advantage="mean_std",
            drop_uniform=True,
            aggregation="token",
        )
        base_learner = _learner_logprobs(engine.model, PROBES)  # B = 0: the adapters add nothing yet
        base_server = _server_logprobs(server, None)
        gap = _mean_max(base_server, base_learner)
        print(f"base: server vs learner |diff| mean {gap[0]:.4f} max {gap[1]:.4f}")
        assert gap[0] < MEAN_TOL and gap[1] < MAX_TOL, ("base", gap)

        client = server.weight_client("sglang-lora", adapter_prefix="policy")
        pub = AdapterPublisher([client], tmp_path / "adapters", timeout_s=300, dtype=torch.bfloat16)
        learner_at: dict[int, list[list[float]]] = {}
        for v in range(1, STEPS + 1):
            engine.train_step(plan)
            pub.publish(v, engine)
            learner_at[v] = _learner_logprobs(engine.model, PROBES)
            at_v = _server_logprobs(server, f"policy-v{v}")
            gap, moved = _mean_max(at_v, learner_at[v]), _mean_max(learner_at[v], base_learner)
            base_now = _mean_max(_server_logprobs(server, None), base_learner)
            record(
                "sglang_lora",
                f"v{v}",
                bytes=pub.last["bytes"],
                publish_s=pub.last["seconds"],
                engine_steps=pub.last["engines"],
                mean_abs=gap[0],
                max_abs=gap[1],
                moved_mean=moved[0],
                base_mean_abs=base_now[0],
            )
            print(
                f"v{v}: server vs learner |diff| mean {gap[0]:.4f} max {gap[1]:.4f}; learner moved {moved[0]:.3f} "
                f"from base; base request vs base {base_now[0]:.4f}; publish {pub.last['seconds']:.3f} s"
            )
            assert moved[0] > MOVED_MIN, f"v{v}: the adapter moved the policy {moved[0]:.3f} nats: the check is blind"
            assert gap[0] < MEAN_TOL and gap[1] < MAX_TOL, (v, gap)
            # a request without lora_path is still served by the base, not by the adapter just loaded
            assert base_now[0] < MEAN_TOL and base_now[1] < MAX_TOL, (v, base_now)
            if v > 1:  # the previous version stays loaded for lagging workers, with its own weights
                prev = _mean_max(_server_logprobs(server, f"policy-v{v - 1}"), learner_at[v - 1])
                assert prev[0] < MEAN_TOL and prev[1] < MAX_TOL, (v - 1, prev)
            assert pub.last["bytes"] > 0
        assert moved[0] > OTHER_MIN, f"after {STEPS} steps the policy moved only {moved[0]:.3f} nats"
        assert {f"policy-v{STEPS}", f"policy-v{STEPS - 1}"} <= _served_adapters(server)
        assert f"policy-v{STEPS - 2}" not in _served_adapters(server)

        # A server that restarts: the export's adapter/ folder through the prefixed client, as the next version.
        export = tmp_path / "export"
        engine.export_hf(export, dtype=torch.bfloat16)
        assert (export / "adapter" / "adapter_model.safetensors").exists()
        lora_client = server.weight_client("sglang-lora-2", adapter_prefix="policy")
        loop.run_until_complete(_closing(lora_client, lora_client.load_weights_from_path(str(export), STEPS + 1)))
        names = _served_adapters(server)
        assert f"policy-v{STEPS + 1}" in names and f"policy-v{STEPS - 1}" not in names, names
        gap = _mean_max(_server_logprobs(server, f"policy-v{STEPS + 1}"), learner_at[STEPS])
        assert gap[0] < MEAN_TOL and gap[1] < MAX_TOL, ("export adapter", gap)

        # The fleet's generation client: its version label names the adapter (lora_path) of each request.
        gen = FleetSGLangClient("sglang-lora-gen", server.url, radix_cache=False, adapter_prefix="policy")
        assert loop.run_until_complete(gen.refresh_version()) == STEPS + 1
        prompt = PROBES[0]
        samples = loop.run_until_complete(
            _closing(gen, gen.generate(prompt, SamplingParams(n=2, max_tokens=16, temperature=1.0)))
        )
        assert all(s.segment_versions == [STEPS + 1] for s in samples)
        seqs = [prompt + [int(t) for t in s.token_ids] for s in samples]
        want = _learner_logprobs(engine.model, seqs, start=[len(prompt)] * len(seqs))
        gap = _mean_max([list(map(float, s.logprobs)) for s in samples], want)
        print(f"generate at v{STEPS + 1}: sampled-token |diff| mean {gap[0]:.4f} max {gap[1]:.4f}")
        record(
            "sglang_lora", "generate", mean_abs=gap[0], max_abs=gap[1], tokens=sum(len(s.token_ids) for s in samples)
        )
        assert gap[0] < MEAN_TOL and gap[1] < MAX_TOL, ("generate", gap)

        # The full-weight path of the bench: the merged export through a client WITHOUT the prefix reloads every
        # weight (/update_weights_from_disk); the base is then the trained policy.
        full = server.weight_client("sglang-full")
        t0 = time.perf_counter()
        loop.run_until_complete(_closing(full, full.load_weights_from_path(str(export), STEPS + 2)))
        record("sglang_lora", "full_reload", seconds=time.perf_counter() - t0)
        gap = _mean_max(_server_logprobs(server, None), learner_at[STEPS])
        print(f"merged export as the base: |diff| mean {gap[0]:.4f} max {gap[1]:.4f}")
        assert gap[0] < MEAN_TOL and gap[1] < MAX_TOL, ("merged base", gap)
    finally:
        torch.distributed.destroy_process_group()
