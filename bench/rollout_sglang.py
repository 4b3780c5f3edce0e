"""The SGLang case of bench/rollout.py: SGLang's own offline engine against fleetrl's SGLang server and client.

* engine: ``sglang.Engine(**server_args).generate(input_ids=[...], sampling_params={...},
  return_logprob=True)``: every timed prompt in one call, each repeated ``n`` times (SGLang's own ``n`` on a
  large batch first prefills every prompt alone, one at a time, for its prefix cache: its tokenizer manager warns
  that a batch with ``n`` > 1 is slow and advises repeating the prompts), the sampled token's log-prob per
  generated token (``meta_info.output_token_logprobs``), token ids in and out (``skip_tokenizer_init``);
* fleet: :class:`engines.sglang.server.SGLangServer` started as :class:`engines.sglang.factory.SGLangFactory`
  starts a fleet slot (no radix cache, ``--context-length``, NCCL environment, ``OMP_NUM_THREADS=1``, the
  0.5.16 compatibility flags of :func:`engines.sglang.server.compat_args`), and the fleet's client of it
  (:class:`~engines.sglang.factory.FleetSGLangClient`) behind ``FleetController.run_group`` (driven by
  bench/rollout.py, as for vLLM): one ``/generate`` per group with its prompt ``n`` times and ``return_logprob``
  (without the radix cache the client repeats the prompt rather than ask for SGLang's ``n``:
  engines/sglang/generation.py).

Both sides get the same server arguments (model, dtype, ``mem_fraction_static`` = ``--gpu-memory-utilization``,
``max_running_requests`` = ``--max-num-seqs``, ``context_length``, seed, radix cache, compatibility flags) and
the same process environment (:meth:`SGLangServer.environment`, which also pins
``SGLANG_RETURN_ORIGINAL_LOGPROB=false``); the sampling parameters are the dict the fleet's client sends.
The only server argument the engine side lacks is fleetrl's ``--custom-weight-loader``, which only weight
updates use.

Written from SGLang's source (``python/sglang/srt/entrypoints/engine.py``: ``Engine(**kwargs)`` builds a
``ServerArgs`` from keyword arguments named as the CLI flags' dests; ``generate(input_ids=, sampling_params=,
return_logprob=)``; ``tokenizer_manager.py``: with ``skip_tokenizer_init`` each output is
``{"output_ids", "meta_info"}``). **Not yet run**: SGLang has no CPU build, so nothing here has run on this
machine; importing this module needs neither SGLang nor a GPU.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any


def cli_to_kwargs(flags: list[str]) -> dict[str, Any]:
    """``["--disable-cuda-graph", "--attention-backend", "triton"]`` -> ``{"disable_cuda_graph": True,
    "attention_backend": "triton"}``: SGLang's ``ServerArgs`` fields are its CLI flags' dests. Values stay
    strings (``ServerArgs`` does not convert them), so only string and boolean flags may pass through here."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(flags):
        flag = flags[i]
        if not flag.startswith("--"):
            raise ValueError(f"expected a --flag at position {i} of {flags}, got {flag!r}")
        name = flag[2:].replace("-", "_")
        if "=" in name:
            name, value = name.split("=", 1)
            out[name] = value
            i += 1
        elif i + 1 < len(flags) and not flags[i + 1].startswith("--"):
            out[name] = flags[i + 1]
            i += 2
        else:
            out[name] = True
            i += 1
    return out


def server_args(args, gpu: str, work: Path):
    """The fleet side's server, as SGLangFactory._args builds a fleet slot's (with the bench's limits)."""
    from core.http_client import free_port
    from engines.sglang.server import SGLangServerArgs
    from weight_sync.config import NCCL_ENV

    work.mkdir(parents=True, exist_ok=True)
    return SGLangServerArgs(
        model=str(Path(args.model).resolve()),
        gpus=[int(gpu)],
        port=free_port(),
        mem_fraction_static=args.gpu_memory_utilization,
        max_running_requests=args.max_num_seqs,
        dtype="bfloat16",
        seed=0,
        radix_cache=args.radix_cache,
        extra_args=["--context-length", str(args.max_model_len)],
        env={
            **{k: os.environ.get(k, v) for k, v in NCCL_ENV.items()},
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        },
        log_path=str(work / "sglang_server.log"),
    )


def engine_environment(args, gpu: str, work: Path) -> dict[str, str]:
    """The engine side's process environment: the one the fleet side's server gets."""
    from engines.sglang.server import SGLangServer

    return SGLangServer(server_args(args, gpu, work)).environment()


def engine_kwargs(args, version) -> dict[str, Any]:
    """``sglang.Engine`` keyword arguments equal to the fleet server's command line (less the weight loader)."""
    from engines.sglang.server import compat_args

    kw: dict[str, Any] = {
        "model_path": str(Path(args.model).resolve()),
        "tp_size": 1,
        "dtype": "bfloat16",
        "mem_fraction_static": args.gpu_memory_utilization,
        "max_running_requests": args.max_num_seqs,
        "random_seed": 0,
        "skip_tokenizer_init": True,
        "context_length": args.max_model_len,
        "disable_radix_cache": not args.radix_cache,
    }
    kw.update(cli_to_kwargs(compat_args(version)))
    return kw


def sampling_dict(params) -> dict[str, Any]:
    """The ``sampling_params`` of each sample the fleet's SGLang client sends for ``params`` (no seed: one request
    per group; no ``n``: the prompt is repeated)."""
    sp: dict[str, Any] = {"max_new_tokens": params.max_tokens, **params.processing(), "ignore_eos": params.ignore_eos}
    if params.stop_token_ids:
        sp["stop_token_ids"] = list(params.stop_token_ids)
    if params.seed is not None:
        raise ValueError("the rollout bench samples without a seed (a seed makes the client split each group)")
    return sp


def repeated(prompts: list[list[int]], n: int) -> list[list[int]]:
    """Each prompt ``n`` times in a row: a group's samples, as the fleet's client sends them."""
    return [p for p in prompts for _ in range(n)]


def count_outputs(outs: list[dict], expected: int) -> int:
    """Generated tokens of ``sglang.Engine.generate``'s batch answer; checks one log-prob per token."""
    if len(outs) != expected:
        raise RuntimeError(f"sglang.Engine.generate returned {len(outs)} outputs, expected {expected}")
    tokens = 0
    for o in outs:
        lps = o["meta_info"]["output_token_logprobs"]
        if len(lps) != len(o["output_ids"]):
            raise RuntimeError(f"an output has {len(o['output_ids'])} tokens but {len(lps)} log-probs")
        tokens += len(o["output_ids"])
    return tokens


def engine_side(args, batches: list[list[list[int]]], params) -> dict:
    """SGLang's offline engine on this process's GPU: start-up, a warm-up batch, then the timed batches."""
    import sglang

    from bench.rollout import summed
    from engines.sglang.server import check_sglang_version

    version = check_sglang_version(sglang.__version__)
    sp = sampling_dict(params)
    t0 = time.perf_counter()
    engine = sglang.Engine(**engine_kwargs(args, version))
    startup = time.perf_counter() - t0
    reps = []
    try:
        warm = repeated(batches[0][: args.warmup], params.n)
        count_outputs(engine.generate(input_ids=warm, sampling_params=sp, return_logprob=True), len(warm))
        for prompts in batches:
            t0 = time.perf_counter()
            outs = engine.generate(input_ids=repeated(prompts, params.n), sampling_params=sp, return_logprob=True)
            dt = time.perf_counter() - t0
            reps.append((count_outputs(outs, len(prompts) * params.n), dt))
    finally:
        engine.shutdown()
    return {**summed(reps), "startup_s": startup, "engine_kwargs": engine_kwargs(args, version)}


async def start_fleet_client(args, gpu: str, work: Path, timeout_s: float):
    """Start the fleet side's SGLang server; returns (its fleet client, the server, seconds to healthy)."""
    from engines.sglang.factory import FleetSGLangClient
    from engines.sglang.server import SGLangServer

    server = SGLangServer(server_args(args, gpu, work))
    t0 = time.perf_counter()
    await server.start(timeout_s=timeout_s)
    startup = time.perf_counter() - t0
    client = FleetSGLangClient("sglang-bench", server.url, radix_cache=args.radix_cache, timeout_s=args.request_timeout)
    client.server = server
    return client, server, startup
