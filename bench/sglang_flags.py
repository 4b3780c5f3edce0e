"""Which SGLang serving flag does SGLang 0.5.16 need on the H200? One run, each candidate alone.

Seen on the GPU machine: SGLang 0.5.16 served a Qwen2 model only with ``--disable-overlap-schedule
--skip-server-warmup`` (with triton attention, pytorch sampling, no CUDA graph); with fa3,
or with triton and no CUDA graph, its scheduler died on the first forward. This starts
every candidate configuration at once (two GPUs, a small memory fraction each, separate
kernel caches), sends each a 4-sample group with log-probs, and records which served.

    python bench/sglang_flags.py --json bench/results/sglang_flags.json
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "gpu"))

from bench.report import run_info, write_json  # noqa: E402
from core.http_client import free_port  # noqa: E402

SAFE = ["--attention-backend", "triton", "--sampling-backend", "pytorch", "--disable-cuda-graph"]
CANDIDATES = {
    "defaults": [],
    "defaults+no-overlap": ["--disable-overlap-schedule"],
    "defaults+skip-warmup": ["--skip-server-warmup"],
    "safe": SAFE,
    "safe+no-overlap": SAFE + ["--disable-overlap-schedule"],
    "safe+skip-warmup": SAFE + ["--skip-server-warmup"],
}


async def try_one(name: str, extra: list[str], model: str, gpu: int, work: Path, timeout_s: float) -> dict:
    from engines.base import SamplingParams
    from engines.sglang.server import SGLangServer, SGLangServerArgs

    home = work / name
    home.mkdir(parents=True, exist_ok=True)
    srv = SGLangServer(
        SGLangServerArgs(
            model=model,
            gpus=[gpu],
            port=free_port(),
            mem_fraction_static=0.12,
            max_running_requests=64,
            compat=False,
            extra_args=extra,
            env={"HOME": str(home)},
            log_path=str(home / "server.log"),
        )
    )
    res = {"config": name, "flags": extra, "gpu": gpu}
    t0 = time.monotonic()
    try:
        await srv.start(timeout_s=timeout_s)
        res["healthy_s"] = round(time.monotonic() - t0, 1)
        client = srv.generation_client(name)
        try:
            samples = await asyncio.wait_for(
                client.generate(list(range(1000, 1016)), SamplingParams(n=4, max_tokens=32)), 120
            )
            res["generated_tokens"] = sum(len(s.token_ids) for s in samples)
            res["served"] = True
        finally:
            await client.close()
    except Exception as e:  # noqa: BLE001 - the outcome is the measurement
        res["served"] = False
        res["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    finally:
        srv.stop()
    log_text = (home / "server.log").read_text(errors="replace").splitlines() if (home / "server.log").exists() else []
    errors = [ln for ln in log_text if "Error" in ln or "error" in ln or "Traceback" in ln]
    res["log_errors"] = errors[-8:]
    return res


async def run(args) -> list[dict]:
    names = args.configs or list(CANDIDATES)
    tasks = [
        try_one(n, CANDIDATES[n], args.model, i % 2, Path(args.workdir), args.timeout) for i, n in enumerate(names)
    ]
    return await asyncio.gather(*tasks)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="HF folder; default: a random Qwen2-0.5B-shaped checkpoint made here")
    ap.add_argument("--configs", nargs="*", choices=sorted(CANDIDATES))
    ap.add_argument("--workdir", default="/tmp/fleetrl-sglang-flags")
    ap.add_argument("--timeout", type=float, default=360.0)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    if args.model is None:
        from gpu_helpers import random_qwen2_state, save_checkpoint

        args.model = str(save_checkpoint(random_qwen2_state(0), Path(args.workdir) / "model"))
    results = asyncio.run(run(args))
    for r in results:
        print(f"{r['config']:>24}: served={r['served']} {r.get('healthy_s', '')} {r.get('error', '')[:160]}")
    out = {"results": results, **run_info(argv)}
    if args.json:
        write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
