"""Rollout benchmark (GPU): fleetrl's generation throughput through the fleet against the engine's own
offline throughput, same model, prompts and sampling, in the same run.

* ``fleet``: a vLLM server started by fleetrl (``VLLMServer``) behind a ``FleetController``;
  every GRPO group goes through ``FleetController.run_group`` -> ``VLLMGenerationClient.generate``
  (HTTP ``/v1/completions`` with token ids, ``n``, per-token log-probs), all groups in
  flight at once, as rollout workers would keep them.
* ``engine``: vLLM's own ``LLM.generate`` on the same prompts and ``SamplingParams``
  (``n``, ``max_tokens``, temperature, ``logprobs=0`` = the sampled token's log-prob).

The two run at the same time, each on its own H200 of the machine (engine on GPU 0 in a
child process, fleet on GPU 1), so the comparison costs one start-up, not two.
Throughput = generated tokens / wall time of the timed batch (start-up and a warm-up
batch excluded on both sides).

    python bench/rollout.py --json bench/results/rollout.json     # 2-GPU machine, vLLM installed
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "gpu"))

from bench.report import run_info, write_json  # noqa: E402

log = logging.getLogger("bench.rollout")


def make_prompts(count: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, 100000) for _ in range(length)] for _ in range(count)]


def run_engine_offline(args) -> dict:
    """vLLM's LLM.generate on this process's GPU (CUDA_VISIBLE_DEVICES chosen by the parent)."""
    from vllm import LLM, SamplingParams

    prompts = [{"prompt_token_ids": p} for p in make_prompts(args.prompts, args.prompt_len)]
    sp = SamplingParams(n=args.n, max_tokens=args.max_tokens, temperature=1.0, top_p=1.0, logprobs=0)
    t0 = time.perf_counter()
    llm = LLM(
        model=args.model,
        dtype="bfloat16",
        max_model_len=args.max_model_len,
        seed=0,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_seqs=args.max_num_seqs,
    )
    startup = time.perf_counter() - t0
    llm.generate(prompts[: args.warmup], sp, use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    dt = time.perf_counter() - t0
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    assert all(c.logprobs is not None and len(c.logprobs) == len(c.token_ids) for o in outs for c in o.outputs)
    return {"tokens": tokens, "seconds": dt, "tok_per_s": tokens / dt, "startup_s": startup}


class _OneServer:
    """EngineFactory over one already-started vLLM server (the bench starts it to time start-up apart)."""

    def __init__(self, client) -> None:
        self.client = client

    async def start(self, index: int):
        return self.client

    async def restart(self, engine):
        raise RuntimeError("the benchmark does not restart servers")

    async def stop(self, engine) -> None:
        await engine.close()


async def run_fleet(args, url: str, model_name: str) -> dict:
    from engines.base import SamplingParams
    from engines.vllm.generation import VLLMGenerationClient
    from rollout_fleet.config import RolloutConfig
    from rollout_fleet.controller import FleetController

    cfg = RolloutConfig(engine="vllm", max_num_seqs=args.max_num_seqs, request_timeout_s=1200.0, health_interval_s=30.0)
    client = VLLMGenerationClient("vllm-bench", url, model=model_name, request_timeout_s=1200.0)
    fleet = FleetController(cfg, _OneServer(client))
    await fleet.start(1)
    prompts = make_prompts(args.prompts, args.prompt_len)
    params = SamplingParams(n=args.n, max_tokens=args.max_tokens, temperature=1.0, top_p=1.0)
    try:
        await asyncio.gather(*(fleet.run_group(f"w{i}", p, params) for i, p in enumerate(prompts[: args.warmup])))
        t0 = time.perf_counter()
        results = await asyncio.gather(*(fleet.run_group(f"g{i}", p, params) for i, p in enumerate(prompts)))
        dt = time.perf_counter() - t0
    finally:
        await fleet.close()
    samples = [s for _, group in results for s in group]
    assert len(samples) == args.prompts * args.n
    assert all(len(s.logprobs) == len(s.token_ids) for s in samples)
    tokens = sum(len(s.token_ids) for s in samples)
    return {"tokens": tokens, "seconds": dt, "tok_per_s": tokens / dt}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="HF folder; default: a random Qwen2-0.5B-shaped checkpoint made here")
    ap.add_argument("--workdir", default="/tmp/fleetrl-bench-rollout")
    ap.add_argument("--prompts", type=int, default=512)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--engine-gpu", default="0")
    ap.add_argument("--fleet-gpu", default="1")
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--offline-child", help=argparse.SUPPRESS)  # internal: run the engine side, write JSON
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)

    if args.offline_child:
        Path(args.offline_child).write_text(json.dumps(run_engine_offline(args)))
        return 0

    if args.model is None:
        from gpu_helpers import random_qwen2_state, save_checkpoint

        args.model = str(save_checkpoint(random_qwen2_state(0), work / "qwen2-0.5b-random"))

    from engines.vllm.server import VLLMServer, VLLMServerArgs, check_vllm_version

    vllm_version = check_vllm_version()
    child_out = work / "engine_offline.json"
    child_out.unlink(missing_ok=True)
    child_cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--offline-child",
        str(child_out),
        "--model",
        args.model,
        "--prompts",
        str(args.prompts),
        "--prompt-len",
        str(args.prompt_len),
        "--n",
        str(args.n),
        "--max-tokens",
        str(args.max_tokens),
        "--warmup",
        str(args.warmup),
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--max-model-len",
        str(args.max_model_len),
        "--gpu-memory-utilization",
        str(args.gpu_memory_utilization),
        "--workdir",
        str(work / "child"),
    ]
    child_env = {**os.environ, "CUDA_VISIBLE_DEVICES": args.engine_gpu, "VLLM_USE_FLASHINFER_SAMPLER": "0"}
    with open(work / "engine_offline.log", "wb") as child_log:
        child = subprocess.Popen(child_cmd, env=child_env, stdout=child_log, stderr=subprocess.STDOUT)
        server = VLLMServer(
            VLLMServerArgs(
                model=args.model,
                dtype="bfloat16",
                max_model_len=args.max_model_len,
                gpu_memory_utilization=args.gpu_memory_utilization,
                max_num_seqs=args.max_num_seqs,
                weight_backend="nccl",
                env={"CUDA_VISIBLE_DEVICES": args.fleet_gpu},
            ),
            work / "server",
        )
        t0 = time.perf_counter()
        try:
            server.start()
            startup = time.perf_counter() - t0
            fleet = asyncio.run(run_fleet(args, server.url, server.model_name))
            fleet["startup_s"] = startup
        finally:
            server.stop()
        rc = child.wait(timeout=900)
    if rc != 0 or not child_out.exists():
        tail = (work / "engine_offline.log").read_text(errors="replace").splitlines()[-30:]
        print("engine (LLM.generate) side failed:\n" + "\n".join(tail), file=sys.stderr)
        return 1
    engine = json.loads(child_out.read_text())
    import torch

    case = {
        "engine": f"vllm {vllm_version}",
        "model": "qwen2-0.5b-shape (random, bf16)",
        "fleet_tok_per_s": fleet["tok_per_s"],
        "engine_tok_per_s": engine["tok_per_s"],
        "ratio": fleet["tok_per_s"] / engine["tok_per_s"],
        "fleet": fleet,
        "engine_offline": engine,
        "workload": {
            "prompts": args.prompts,
            "prompt_len": args.prompt_len,
            "n": args.n,
            "max_tokens": args.max_tokens,
            "temperature": 1.0,
            "logprobs": "sampled token",
            "max_num_seqs": args.max_num_seqs,
            "gpu_memory_utilization": args.gpu_memory_utilization,
        },
    }
    out = {
        "cases": [case],
        "device": f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)} "
        f"(engine on GPU {args.engine_gpu}, fleet on GPU {args.fleet_gpu}, concurrently)",
        **run_info(argv),
    }
    print(f"fleet {fleet['tok_per_s']:.0f} tok/s, engine {engine['tok_per_s']:.0f} tok/s, ratio {case['ratio']:.3f}")
    if args.json:
        write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
