"""Learner benchmark (GPU): tokens/s and MFU of one training step, FSDP2 vs Megatron-core, same model and batch.

The model is a random Qwen2-0.5B-shaped checkpoint built from a config dict (no download), saved once
in bf16; every case loads it. The step batch is the same synthetic trajectory batch for every case
(``--seqs`` sequences of ``--prompt`` + ``--response`` tokens, packed into ``--micro-tokens`` rows).
A training step is ``engine.train_step`` (forward, backward, gradient reduction, clip, AdamW) with
correction ``tis`` and no proximal pass. Each case runs in fresh processes (one per GPU, NCCL):
one warm-up step, then ``--steps`` timed steps.

Time: each case costs ~20-30 s of process start, imports, NCCL set-up and model load, and a few
seconds of steps (16 x 1024 tokens a step). A case that hangs is killed after ``--case-timeout``
and recorded with its error; cases that would start past ``--budget-s`` are recorded as skipped;
the JSON is rewritten after every case, so an outer timeout still leaves the finished cases.

MFU = model FLOPs per second / (measured bf16 matmul peak of one GPU x GPUs used). Model FLOPs of a
step (PaLM appendix B): 6 x tokens x (non-embedding parameters + LM head) + 12 x layers x heads x
head_dim x sum(sequence length^2) (attention scores and values, forward + backward, no causal halving).
Tokens/s counts the whole step batch (all data-parallel ranks together) over the step time.

    python bench/learner.py --json bench/results/learner.json            # 2-GPU machine, ~2 min
    python bench/learner.py --cases fsdp:1:1,megatron:1:1 --steps 2

A case is ``ENGINE:TP:GPUS[:VARIANT[@TOKENS]]``: VARIANT names learner-config overrides (``VARIANTS``: the
engine before issue 21's remedies, then each remedy added in turn), TOKENS the micro-batch token budget
(``--micro-tokens`` when omitted, except for ``default``: the config as shipped, micro-batch budget included).
Each case also reports peak GPU memory, the host RSS peak while the engine is built (sampled every 10 ms,
relative to the process before), and with ``--profile VARIANT,...`` a torch.profiler breakdown (GPU time by
phase and kernel category) of the step's first 4 micro-batches; ``--shape 1.5b`` runs the Qwen2-1.5B shape.

Output: ``{"cases": [{"engine", "tp", "gpus", "variant", "micro_batch_tokens", "model", "tokens_per_s", "mfu",
"step_s", "peak_mem_gib", "host_rss_load_delta_gib", "profile", ...}], "device", "date", "peak_bf16_tflops"}``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.report import run_info, write_json  # noqa: E402

log = logging.getLogger("bench.learner")

QWEN2_05B = dict(
    model_type="qwen2",
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    hidden_act="silu",
    use_sliding_window=False,
    bos_token_id=151643,
    eos_token_id=151643,
)


QWEN2_15B = dict(QWEN2_05B, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12)
SHAPES = {"0.5b": QWEN2_05B, "1.5b": QWEN2_15B}

# Learner-config overrides of each named variant (case spec ENGINE:TP:GPUS[:VARIANT]). "before" is the engine
# as it was before issue 21 (full logits, sdpa with a packed mask, foreach AdamW, fp32 copy per rank); each
# later variant adds one remedy to the one before it, so the JSON keeps the before and after of each.
_EAGER = {"compile_blocks": False, "activation_checkpointing": False}  # what "auto" would otherwise turn on
VARIANTS = {
    "before": {
        "logprobs": "full",
        "attn_implementation": "sdpa",
        "fused_optimizer": "off",
        "meta_init": "off",
        **_EAGER,
    },
    "chunked": {
        "logprobs": "chunked",
        "attn_implementation": "sdpa",
        "fused_optimizer": "off",
        "meta_init": "off",
        **_EAGER,
    },
    "varlen": {
        "logprobs": "chunked",
        "attn_implementation": "varlen",
        "fused_optimizer": "off",
        "meta_init": "off",
        **_EAGER,
    },
    "fused": {
        "logprobs": "chunked",
        "attn_implementation": "varlen",
        "fused_optimizer": "on",
        "meta_init": "off",
        **_EAGER,
    },
    "meta": {
        "logprobs": "chunked",
        "attn_implementation": "varlen",
        "fused_optimizer": "on",
        "meta_init": "on",
        **_EAGER,
    },
    "compile": {
        "logprobs": "chunked",
        "attn_implementation": "varlen",
        "fused_optimizer": "on",
        "meta_init": "on",
        "compile_blocks": True,
        "activation_checkpointing": False,
    },
    # compile with the head as it was before issue 36 (fp32 root, eager per-chunk arithmetic): "_settings" are
    # not config keys but replacements of the resolved settings (learner/fastpath.py), for this A/B only
    "compile_oldhead": {
        "logprobs": "chunked",
        "attn_implementation": "varlen",
        "fused_optimizer": "on",
        "meta_init": "on",
        "compile_blocks": True,
        "activation_checkpointing": False,
        "_settings": {"root_dtype": "float32", "fused_head": False},
    },
    "ac": {
        "logprobs": "chunked",
        "attn_implementation": "varlen",
        "fused_optimizer": "on",
        "meta_init": "on",
        "activation_checkpointing": True,
        "compile_blocks": False,
    },
    # the config's defaults as shipped; without @TOKENS also its micro_batch_tokens (auto: sized from free memory)
    "default": {},
    # the defaults as shipped before issue 36 (compiled blocks and auto sizing off), at --micro-tokens
    "shipped_before": {**_EAGER, "_settings": {"root_dtype": "float32"}},
    # long responses (bench/long_context_gpu.sh): + parameter/optimizer shards in CPU memory; + Ulysses SP=2
    "ac_offload": {
        "logprobs": "chunked",
        "attn_implementation": "varlen",
        "fused_optimizer": "on",
        "meta_init": "on",
        "activation_checkpointing": True,
        "compile_blocks": False,
        "param_offload": True,
    },
    "ac_sp2": {
        "logprobs": "chunked",
        "attn_implementation": "varlen",
        "fused_optimizer": "on",
        "meta_init": "on",
        "activation_checkpointing": True,
        "compile_blocks": False,
        "sequence_parallel_size": 2,
    },
    # Megatron: flash varlen core attention instead of the T x T mask; full-vocabulary fp32 logits and foreach
    # AdamW (the engine as measured before its chunked head: learner.logprobs' auto is now chunked at TP=1)
    "mvarlen": {"attn_implementation": "varlen", "logprobs": "full", "fused_optimizer": "off", **_EAGER},
    "mvarlen_ac": {
        "attn_implementation": "varlen",
        "logprobs": "full",
        "fused_optimizer": "off",
        "activation_checkpointing": True,
        "compile_blocks": False,
    },
    # + chunked log-probs (the output processor hook, learner/megatron/engine.py), still foreach AdamW
    "mchunked": {"attn_implementation": "varlen", "logprobs": "chunked", "fused_optimizer": "off", **_EAGER},
    # + fused AdamW (torch's fused kernel in Megatron's optimizer; without TE/apex it is foreach AdamW)
    "mfused": {"attn_implementation": "varlen", "logprobs": "chunked", "fused_optimizer": "on", **_EAGER},
    # + torch.compile of each layer's MLP
    "mcompile": {
        "attn_implementation": "varlen",
        "logprobs": "chunked",
        "fused_optimizer": "on",
        "compile_blocks": True,
        "activation_checkpointing": False,
    },
}


class RssSampler:
    """Peak resident set size (GiB) of this process over a region, sampled every 10 ms from /proc."""

    def __init__(self) -> None:
        import threading

        self.peak = self.start = self.now()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def now() -> float:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 2**20
        return 0.0

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, self.now())

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, self.now())


def _category(name: str) -> str:
    n = name.lower()
    if "nccl" in n:
        return "communication"
    if "memcpy" in n or "memset" in n:
        return "copy"
    if "adam" in n or "multi_tensor" in n:
        return "optimizer"
    if "flash" in n or "fmha" in n or "attention" in n or "efficient" in n:
        return "attention"
    if "gemm" in n or "sm90" in n or "cutlass" in n or "nvjet" in n or "matmul" in n or "ampere" in n:
        return "matmul"
    if "softmax" in n or "logsumexp" in n or "log_softmax" in n:
        return "softmax"
    if "reduce" in n:
        return "reduction"
    return "elementwise/other"


def profile_step(engine, plan, out_path: str | None) -> dict:
    """One train_step under torch.profiler: GPU time by phase and by kernel category, and GPU idle."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    t = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], acc_events=True) as prof:
        engine.train_step(plan)
        torch.cuda.synchronize()
    wall = time.perf_counter() - t
    kernels: dict[str, float] = {}
    cats: dict[str, float] = {}
    phase = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}

    def dev(ev, attr: str) -> float:  # torch renamed cuda_* to device_* (2.4+); read either
        v = getattr(ev, attr.replace("cuda", "device"), None)
        return (v if v is not None else getattr(ev, attr, 0.0)) / 1e6

    for ev in prof.key_averages():
        annotation = ev.key.startswith(("fleetrl.", "FSDP::", "Optimizer.", "autograd::", "ProfilerStep", "## "))
        if ev.device_type == torch.autograd.DeviceType.CUDA and not annotation:  # a kernel, memcpy or memset
            kernels[ev.key] = kernels.get(ev.key, 0.0) + dev(ev, "self_cuda_time_total")
        elif ev.key == "fleetrl.forward":
            phase["forward"] += dev(ev, "cuda_time_total")
        elif ev.key.startswith("autograd::engine::evaluate_function"):
            # backward kernels run on autograd's thread, outside the "fleetrl.backward" range of the main thread
            phase["backward"] += dev(ev, "cuda_time_total")
        elif ev.key.startswith("Optimizer.step"):
            phase["optimizer"] += dev(ev, "cuda_time_total")
    for k, v in kernels.items():
        c = _category(k)
        cats[c] = cats.get(c, 0.0) + v
    busy = sum(kernels.values())
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:25]
    if out_path:
        avg = prof.key_averages()
        Path(out_path).write_text(
            avg.table(sort_by="self_cuda_time_total", row_limit=45)
            + "\n\n"
            + avg.table(sort_by="cpu_time_total", row_limit=35)
        )
    return {
        "wall_s": wall,
        "gpu_busy_s": busy,
        "gpu_busy_fraction": busy / wall if wall else None,
        "gpu_idle_s": max(0.0, wall - busy),
        "phases_gpu_s": phase,
        "categories_gpu_s": dict(sorted(cats.items(), key=lambda kv: -kv[1])),
        "top_kernels_s": dict(top),
    }


def matmul_peak_tflops(n: int = 8192, reps: int = 20) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    torch.cuda.synchronize()
    return 2 * n**3 * reps / (time.perf_counter() - t) / 1e12


def make_model(out: Path, cfg: dict) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    conf = Qwen2Config(**{k: v for k, v in cfg.items() if k != "model_type"})
    with torch.device("cuda:0"):
        model = Qwen2ForCausalLM(conf).to(torch.bfloat16)
    model.save_pretrained(str(out))
    del model
    torch.cuda.empty_cache()
    return out


def make_batch(seqs: int, prompt: int, response: int, vocab: int, group: int = 8):
    import numpy as np

    from broker.schema import Trajectory, to_record_batch

    rng = np.random.default_rng(0)
    trajs = []
    for i in range(seqs):
        g = i // group
        trajs.append(
            Trajectory(
                traj_id=f"b{i}",
                group_id=f"g{g}",
                sample_index=i % group,
                group_size=group,
                step=1,
                prompt_ids=rng.integers(0, vocab, size=prompt).tolist(),
                response_ids=rng.integers(0, vocab, size=response).tolist(),
                behaviour_logprobs=(-12.0 + rng.normal(0, 0.3, size=response)).clip(max=0).tolist(),
                segment_starts=[0],
                segment_versions=[0],
                reward=float(i % group),
                finish_reason="stop",
                engine_id="bench",
                data_source="synthetic",
            )
        )
    return to_record_batch(trajs)


def model_flops(cfg: dict, seq_lens: list[int]) -> float:
    h, f, L, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    nh, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = h // nh
    per_layer = h * (nh * hd + 2 * kv * hd) + nh * hd * h + 3 * h * f  # qkv, o, gate/up/down (biases ignored)
    n = L * per_layer + v * h  # + LM head (tied or not, it is a matmul per token)
    tokens = sum(seq_lens)
    return 6 * tokens * n + 12 * L * nh * hd * sum(s * s for s in seq_lens)


def _case_main(rank: int, world: int, port: int, kw: dict) -> None:
    t_start = time.perf_counter()
    try:
        os.environ.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(rank),
            NCCL_NVLS_ENABLE="0",
            NCCL_CUMEM_ENABLE="0",
            OMP_NUM_THREADS="4",
        )
        logging.basicConfig(level=logging.WARNING)
        import pyarrow as pa
        import torch.distributed as dist

        from learner.batch import plan_step
        from learner.config import LearnerConfig
        from learner.run import init_distributed, make_engine

        init_distributed("nccl", timeout_s=300)
        over = dict(VARIANTS[kw["variant"]])  # Megatron reads attn_implementation, activation_checkpointing,
        # logprobs, logprob_chunk, fused_optimizer and compile_blocks
        replace = over.pop("_settings", None)
        if replace:
            import dataclasses

            import learner.fsdp as fsdp_mod

            resolve = fsdp_mod.resolve_fast_path
            fsdp_mod.resolve_fast_path = lambda *a, **k: dataclasses.replace(resolve(*a, **k), **replace)
        lc = LearnerConfig.model_validate(
            {
                "engine": kw["engine"],
                "loss": {"correction": "tis"},
                "optim": {"lr": 1e-6},
                **({"micro_batch_tokens": kw["micro_tokens"]} if kw["micro_tokens"] is not None else {}),
                "megatron": {"tensor_model_parallel_size": kw["tp"]},
                **over,
            }
        )
        with RssSampler() as rss:
            engine = make_engine(lc, kw["model"], total_steps=100, seed=0)
        torch.cuda.synchronize()
        load_gpu_gib = torch.cuda.max_memory_allocated() / 2**30
        with pa.ipc.open_file(kw["batch"]) as f:
            batch = f.get_batch(0)
        plan = plan_step(
            batch,
            rank=engine.data_rank,
            world_size=engine.data_world_size,
            micro_batch_tokens=engine.micro_batch_tokens,
            advantage="mean_std",
            drop_uniform=True,
            aggregation="token",
        )
        build_s = time.perf_counter() - t_start
        times = []
        for i in range(1 + kw["steps"]):
            torch.cuda.synchronize()
            dist.barrier()
            t = time.perf_counter()
            m = engine.train_step(plan)
            torch.cuda.synchronize()
            if i:
                times.append(time.perf_counter() - t)
            else:
                warmup_s = time.perf_counter() - t
        t = torch.tensor(
            [
                max(times) if times else 0.0,
                torch.cuda.max_memory_allocated() / 2**30,
                rss.peak - rss.start,
                RssSampler.now(),
            ],
            device="cuda",
        )
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if rank == 0:
            Path(kw["out"]).write_text(
                json.dumps(
                    {
                        "step_times": times,
                        "peak_mem_gib": float(t[1]),
                        "loss": m.get("loss_total"),
                        "grad_norm": m.get("grad_norm"),
                        "start_to_engine_s": build_s,
                        "warmup_step_s": warmup_s,
                        "host_rss_load_delta_gib": float(t[2]),
                        "host_rss_before_load_gib": rss.start,
                        "host_rss_after_steps_gib": float(t[3]),
                        "gpu_mem_after_load_gib": load_gpu_gib,
                        "micro_batches": int(plan.stats["micro_batches"]),
                        "config_overrides": over,
                        "profile": None,
                        "micro_batch_tokens": engine.micro_batch_tokens,
                        "settings": engine.settings.as_dict(),
                    }
                )
            )
        if kw["profile"]:
            # Profiler post-processing of a full 32-micro-batch step takes minutes: profile the step's first
            # (at most) 4 micro-batches plus its clip and optimizer step (the per-micro-batch costs are alike).
            from learner.batch import StepPlan

            part = StepPlan(micro_batches=plan.micro_batches[:4], stats=plan.stats)
            prof = profile_step(engine, part, kw["profile_table"] if rank == 0 else None)
            if rank == 0:
                res = json.loads(Path(kw["out"]).read_text())
                res["profile"] = dict(prof, micro_batches_profiled=len(part.micro_batches))
                Path(kw["out"]).write_text(json.dumps(res))
        dist.destroy_process_group()
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)
    os._exit(0)


def run_case(engine: str, tp: int, gpus: int, variant: str, kw: dict, timeout: float) -> dict:
    import socket

    ctx = torch.multiprocessing.get_context("spawn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    name = f"{engine}_{tp}_{gpus}_{variant}_{kw['micro_tokens'] or 'auto'}"
    prof = variant in kw["profile_variants"]
    kw = dict(
        kw,
        engine=engine,
        tp=tp,
        variant=variant,
        out=f"{kw['tmp']}/case_{name}.json",
        profile=prof,
        profile_table=f"{kw['profile_dir']}/profile_{name}.txt" if prof and kw["profile_dir"] else None,
    )
    procs = [ctx.Process(target=_case_main, args=(r, gpus, port, kw), daemon=True) for r in range(gpus)]
    t0 = time.time()
    for p in procs:
        p.start()
    for p in procs:
        p.join(max(1.0, timeout - (time.time() - t0)))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
    codes = [p.exitcode for p in procs]
    if codes != [0] * gpus:
        if Path(kw["out"]).exists():  # the timed steps finished; what came after them (a profile) did not
            return json.loads(Path(kw["out"]).read_text()) | {
                "wall_s": time.time() - t0,
                "error_after_steps": f"ranks exited with {codes}",
            }
        return {"error": f"ranks exited with {codes}"}
    return json.loads(Path(kw["out"]).read_text()) | {"wall_s": time.time() - t0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write results here")
    ap.add_argument(
        "--cases",
        default="fsdp:1:1,megatron:1:1,megatron:2:2,fsdp:1:2",
        help="engine:tp:gpus[:variant] (variant: FSDP config overrides, see VARIANTS; default 'default'), "
        "comma separated, most important first (the budget may cut the tail)",
    )
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--response", type=int, default=768)
    ap.add_argument("--micro-tokens", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="0.5b", help="Qwen2 model shape")
    ap.add_argument("--profile", default="", help="comma-separated variants to profile one extra step of")
    ap.add_argument("--profile-dir", default=None, help="write each profiled case's kernel table here")
    ap.add_argument("--case-timeout", type=float, default=70.0)
    ap.add_argument(
        "--budget-s",
        type=float,
        default=175.0,
        help="no case starts after this many seconds minus --case-timeout (it is recorded as skipped)",
    )
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if not torch.cuda.is_available():
        print("bench/learner.py needs CUDA GPUs", file=sys.stderr)
        return 2
    import pyarrow as pa

    t_begin = time.time()
    peak = matmul_peak_tflops()
    log.info("measured bf16 matmul peak: %.0f TFLOP/s per GPU", peak)
    cases = []
    out = {
        "cases": cases,
        "device": f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}",
        "peak_bf16_tflops": peak,
        "micro_batch_tokens": args.micro_tokens,
        **run_info(argv),
    }

    def write() -> None:
        if args.json:
            write_json(args.json, out, indent=1)

    with tempfile.TemporaryDirectory(prefix="fleetrl_bench_learner_") as tmp:
        t = time.time()
        shape = SHAPES[args.shape]
        model = make_model(Path(tmp) / f"qwen2-{args.shape}-random", shape)
        batch = make_batch(args.seqs, args.prompt, args.response, shape["vocab_size"])
        with pa.ipc.new_file(f"{tmp}/batch.arrow", batch.schema) as w:
            w.write_batch(batch)
        log.info("model and batch ready in %.1fs", time.time() - t)
        seq_lens = [args.prompt + args.response - 1] * args.seqs  # the last token is never an input
        flops = model_flops(shape, seq_lens)
        out["batch_tokens"] = sum(seq_lens)
        kw = dict(
            model=str(model),
            batch=f"{tmp}/batch.arrow",
            micro_tokens=args.micro_tokens,
            steps=args.steps,
            tmp=tmp,
            profile_variants=set(filter(None, args.profile.split(","))),
            profile_dir=args.profile_dir,
        )
        for spec in args.cases.split(","):
            engine, tp, gpus, *rest = spec.split(":")
            tp, gpus = int(tp), int(gpus)
            variant, micro = (rest + ["default"])[0], None
            if "@" in variant:  # VARIANT@TOKENS: the variant with another micro-batch token budget
                variant, micro = variant.split("@")
                micro = int(micro)
            elif variant != "default":
                micro = args.micro_tokens  # "default" alone keeps the shipped micro_batch_tokens (auto)
            if variant not in VARIANTS:
                raise SystemExit(f"unknown variant {variant!r}; known: {sorted(VARIANTS)}")
            if gpus > torch.cuda.device_count():
                log.warning("skipping %s: needs %d GPUs", spec, gpus)
                continue
            case = {
                "engine": engine,
                "tp": tp,
                "gpus": gpus,
                "variant": variant,
                "micro_batch_tokens": micro or "auto",
                "model": f"qwen2-{args.shape}-shaped (random, bf16)",
            }
            if time.time() - t_begin > args.budget_s - args.case_timeout:
                case.update(
                    error=f"skipped: --budget-s {args.budget_s:.0f} s would be exceeded", tokens_per_s=None, mfu=None
                )
                log.warning("%s", json.dumps(case))
                cases.append(case)
                write()
                continue
            r = run_case(engine, tp, gpus, variant, dict(kw, micro_tokens=micro), args.case_timeout)
            if "error" in r:
                case.update(error=r["error"], tokens_per_s=None, mfu=None)
            else:
                step = sum(r["step_times"]) / len(r["step_times"])
                case.update(
                    tokens_per_s=sum(seq_lens) / step,
                    mfu=flops / step / (peak * 1e12 * gpus),
                    step_s=step,
                    step_times=r["step_times"],
                    peak_mem_gib=r["peak_mem_gib"],
                    loss=r["loss"],
                    grad_norm=r["grad_norm"],
                    wall_s=r["wall_s"],
                    start_to_engine_s=r["start_to_engine_s"],
                    warmup_step_s=r["warmup_step_s"],
                    **{
                        k: r[k]
                        for k in (
                            "host_rss_load_delta_gib",
                            "host_rss_before_load_gib",
                            "host_rss_after_steps_gib",
                            "gpu_mem_after_load_gib",
                            "micro_batches",
                            "config_overrides",
                            "profile",
                            "micro_batch_tokens",
                            "settings",
                        )
                    },
                    **({"error_after_steps": r["error_after_steps"]} if "error_after_steps" in r else {}),
                )
            log.info("%s", json.dumps(case))
            cases.append(case)
            write()
    out["wall_s"] = time.time() - t_begin
    print(json.dumps(out, indent=1))
    write()
    return 0 if all("error" not in c for c in cases) else 1


if __name__ == "__main__":
    sys.exit(main())
