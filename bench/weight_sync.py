"""Weight-sync benchmark (GPU, 2 GPUs): fleetrl's publish against raw NCCL broadcast, same group, same run.

The learner side is this process on GPU 0 holding a random bf16 model shaped like
Qwen2 (0.5B, 1.5B) or an 8B dense model in the Qwen2 layout (Qwen3-8B's sizes), as a
plain dict of full tensors (no HF download, no FSDP gather). The receiver is a
second process on GPU 1 running fleetrl's :class:`weight_sync.receiver.WeightReceiver`,
driven through a :class:`WeightEndpoint` over a pipe, so the publish is the real
:class:`weight_sync.publisher.Publisher` path: RPC to the engine, bucket packing,
broadcast overlapped with the next bucket, receive + load, checksums, acks.

Acks go through the group by default (``--acks group``): the receiver all-gathers its
fingerprints, queued behind its last load, and ``publish_s`` ends when the publisher
has checked them; ``publish_with_rpc_answer_s`` also waits for the engine's RPC
answer. ``--acks rpc`` waits for that answer inside the publish.

``raw_broadcast_s`` is the same bytes in the same buckets broadcast over the very
same process group (``publisher.pg`` / ``receiver.pg``) from preallocated buffers,
all posted back to back, nothing else: the wire's ceiling for that group.

    python bench/weight_sync.py --json bench/results/weight_sync.json        # on the 2-GPU machine
    python bench/weight_sync.py --models 0.5B --reps 3

Output: ``{"cases": [{"model", "bytes", "publish_s", "raw_broadcast_s", "ratio_vs_raw", ...}],
"device", "date"}``; ``ratio_vs_raw = raw_broadcast_s / publish_s`` (1.0 = at the wire's limit,
target >= 0.85).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures as cf
import contextlib
import logging
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from bench.report import run_info, write_json  # noqa: E402
from core.http_client import EngineError  # noqa: E402
from weight_sync.endpoint import WeightEndpoint  # noqa: E402
from weight_sync.messages import GroupInfo, WeightPlan  # noqa: E402

log = logging.getLogger("bench.weight_sync")

# (hidden, intermediate, layers, heads, kv_heads, head_dim, vocab, tied embeddings)
SHAPES = {
    "0.5B": (896, 4864, 24, 14, 2, 64, 151936, True),  # Qwen2-0.5B
    "1.5B": (1536, 8960, 28, 12, 2, 128, 151936, True),  # Qwen2-1.5B
    "8B": (4096, 12288, 36, 32, 8, 128, 151936, False),  # Qwen3-8B's sizes, Qwen2 tensor layout
    "tiny": (64, 128, 2, 4, 2, 16, 1024, False),  # --cpu smoke runs only
}


def qwen2_params(model: str) -> list[tuple[str, list[int]]]:
    """HF names and shapes of a Qwen2-layout causal LM, in state-dict order."""
    h, inter, layers, heads, kv, hd, vocab, tied = SHAPES[model]
    out = [("model.embed_tokens.weight", [vocab, h])]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [
            (p + "self_attn.q_proj.weight", [heads * hd, h]),
            (p + "self_attn.q_proj.bias", [heads * hd]),
            (p + "self_attn.k_proj.weight", [kv * hd, h]),
            (p + "self_attn.k_proj.bias", [kv * hd]),
            (p + "self_attn.v_proj.weight", [kv * hd, h]),
            (p + "self_attn.v_proj.bias", [kv * hd]),
            (p + "self_attn.o_proj.weight", [h, heads * hd]),
            (p + "mlp.gate_proj.weight", [inter, h]),
            (p + "mlp.up_proj.weight", [inter, h]),
            (p + "mlp.down_proj.weight", [h, inter]),
            (p + "input_layernorm.weight", [h]),
            (p + "post_attention_layernorm.weight", [h]),
        ]
    out.append(("model.norm.weight", [h]))
    if not tied:
        out.append(("lm_head.weight", [vocab, h]))
    return out


def random_model(model: str, device: str, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(seed)
    return {n: torch.randn(s, generator=g, device=device, dtype=torch.bfloat16) * 0.02 for n, s in qwen2_params(model)}


# ---- the receiver process (GPU 1) -----------------------------------------------------------
def _receiver_main(conn, device: str) -> None:
    """Serve commands from the pipe: join / receive / raw broadcast / checksum of held tensors."""
    logging.basicConfig(level=logging.WARNING)
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    from weight_sync.receiver import WeightReceiver

    rx = WeightReceiver("bench-rx", device=device)
    held: dict[str, torch.Tensor] = {}
    raw_bufs: list[torch.Tensor] = []
    profile_to: str | None = None  # a path: profile the next receive (torch.profiler, chrome trace)

    def load(pairs):
        if all(name in held for name, _ in pairs):
            # what an engine does: write into the parameters it already has (one launch for the bucket,
            # as a replayed copy plan does)
            torch._foreach_copy_([held[name] for name, _ in pairs], [t for _, t in pairs])
            return
        for name, t in pairs:
            held[name] = t.clone()

    while True:
        cmd, arg = conn.recv()
        try:
            if cmd == "stop":
                rx.leave()
                conn.send(("ok", None))
                return
            if cmd == "join":
                group, plan, timeout_s = arg
                held.clear()  # a new plan (model) replaces the old tensors
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                rx.join(group, plan, group.rank_offset, timeout_s)
                conn.send(("ok", None))
            elif cmd == "receive":
                t_cmd = time.perf_counter()  # CLOCK_MONOTONIC: comparable with the publisher's stamps
                version, plan_id = arg
                with _profiled(profile_to):
                    checksum = rx.receive(version, plan_id, load)
                    _sync()
                profile_to = None
                conn.send(
                    (
                        "ok",
                        {
                            "checksum": checksum,
                            "timeline": [("command", t_cmd), *rx.timeline, ("synced", time.perf_counter())],
                        },
                    )
                )
            elif cmd == "profile_next":
                profile_to = arg
                conn.send(("ok", None))
            elif cmd == "raw_prepare":
                raw_bufs = [torch.empty(n, dtype=torch.uint8, device=device) for n in arg]
                conn.send(("ok", None))
            elif cmd == "raw":
                works = [_bcast(rx.pg, b) for b in raw_bufs]
                for w in works:
                    w.wait()
                _sync()
                conn.send(("ok", None))
            elif cmd == "dump":  # tests compare bit for bit
                from safetensors.torch import save_file

                save_file({n: t.contiguous().cpu() for n, t in held.items()}, arg)
                conn.send(("ok", None))
            elif cmd == "digest":
                # Bitwise digest of every held tensor, computed on the GPU (int64 wrap-around sum of
                # position-weighted 16-bit words): equal digests for all names <=> equal bytes w.h.p.
                conn.send(("ok", {n: _digest(t) for n, t in held.items()}))
            else:
                conn.send(("error", f"unknown command {cmd!r}"))
        except Exception as e:  # noqa: BLE001 - reported to the publisher side, which names us
            conn.send(("error", f"{type(e).__name__}: {e}"))


@contextlib.contextmanager
def _profiled(path: str | None):
    """torch.profiler (CPU ops and CUDA kernels) around the block, written to ``path`` as a chrome trace."""
    if path is None:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        yield
    prof.export_chrome_trace(path)


@contextlib.contextmanager
def receiver_process(device: str):
    """A :func:`_receiver_main` process on ``device``; yields (its pipe, the process) and stops it at exit."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver_main, args=(child, device), daemon=True)
    proc.start()
    try:
        yield parent, proc
    finally:
        try:
            parent.send(("stop", None))
            parent.poll(10)
        except (BrokenPipeError, OSError):
            pass
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(5)


def _bcast(group, buf: torch.Tensor):
    """A broadcast from rank 0 over the publish's own group object (a wrapper or a bare ProcessGroup)."""
    if hasattr(group, "broadcast_async"):
        return group.broadcast_async(buf)
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = 0, 0
    return group.broadcast([buf], opts)


def _digest(t: torch.Tensor) -> int:
    w = t.contiguous().view(-1).view(torch.int16).to(torch.int64)
    pos = torch.arange(1, w.numel() + 1, device=w.device, dtype=torch.int64)
    return int(((w + 40503) * (pos * 2654435761 % 1000003)).sum().item())


class PipeEngine(WeightEndpoint):
    """WeightEndpoint of the receiver process: the publisher's RPCs go over a multiprocessing pipe."""

    def __init__(self, engine_id: str, conn) -> None:
        self.engine_id = engine_id
        self.group_ranks = 1
        self.supports_group_acks = True  # fleetrl's WeightReceiver on the other side
        self._conn = conn
        self.inline_start = True
        self._reader: cf.ThreadPoolExecutor | None = None
        self._lock = asyncio.Lock()
        self._version = 0
        self.last_timeline: list[tuple[str, float]] = []  # the receiver's stamps of the last publish
        self.rpc_stamps: list[
            tuple[str, float]
        ] = []  # the RPC's: started, request written, reply read (on the publisher's loop)

    def send_update(self, version: int, plan_id: str):
        """The request written from the publishing thread (as :class:`ReceiverClient` does over HTTP), the
        reply read on a thread of this client's; ``None`` with ``--no-inline-start`` (then the publisher's
        RPC loop sends it)."""
        if not self.inline_start:
            return None
        if self._reader is None:
            self._reader = cf.ThreadPoolExecutor(1, thread_name_prefix="bench-rx-answers")
        t = time.perf_counter()
        self._conn.send(("receive", (version, plan_id)))
        self.rpc_stamps = [("receive started", t), ("receive sent", time.perf_counter())]

        def answer() -> str:
            return self._received(version, self._answer("receive", 600.0))

        return self._reader.submit(answer)

    def call(self, cmd: str, arg=None, timeout_s: float = 600.0):
        self._conn.send((cmd, arg))
        return self._answer(cmd, timeout_s)

    def _answer(self, cmd: str, timeout_s: float):
        """Wait (bounded) for the receiver's answer to ``cmd`` on the pipe; an error answer raises."""
        if not self._conn.poll(timeout_s):
            raise EngineError(f"engine {self.engine_id}: {cmd} got no answer within {timeout_s:.0f}s")
        return self._value(cmd, self._conn.recv())

    def _value(self, cmd: str, answer):
        self.rpc_stamps.append((f"{cmd} reply read", time.perf_counter()))
        status, value = answer
        if status != "ok":
            raise EngineError(f"engine {self.engine_id}: {cmd} failed: {value}")
        return value

    def _received(self, version: int, reply: dict) -> str:
        self._version, self.last_timeline = version, reply["timeline"]
        return reply["checksum"]

    async def _acall(self, cmd: str, arg=None, timeout_s: float = 600.0):
        """Send from the event loop's thread and wake on the pipe's readability, as an HTTP client
        would on its socket (a thread-pool hop each way cost about 0.2 ms of every publish)."""
        woke = time.perf_counter()  # when the RPC thread started on this call
        async with self._lock:
            loop = asyncio.get_running_loop()
            ready = loop.create_future()
            fd = self._conn.fileno()
            self._conn.send((cmd, arg))
            self.rpc_stamps = [(f"{cmd} started", woke), (f"{cmd} sent", time.perf_counter())]
            loop.add_reader(fd, lambda: ready.done() or ready.set_result(None))
            try:
                async with asyncio.timeout(timeout_s):  # lighter than wait_for: no task of its own
                    await ready
            except TimeoutError:
                raise EngineError(f"engine {self.engine_id}: {cmd} got no answer within {timeout_s:.0f}s") from None
            finally:
                loop.remove_reader(fd)
                os.set_blocking(fd, True)  # uvloop makes a watched fd non-blocking; call() and raw() block
            return self._value(cmd, self._conn.recv())

    async def init_weight_transfer(self, group: GroupInfo, plan: WeightPlan) -> None:
        await self._acall("join", (group, plan, 120.0))

    async def update_weights(self, version: int, plan_id: str) -> str:
        return self._received(version, await self._acall("receive", (version, plan_id)))

    async def health(self) -> bool:
        return True

    async def load_weights_from_path(self, path: str, version: int) -> None:
        raise EngineError("the benchmark receiver loads only over the group")

    @property
    def weight_version(self) -> int:
        return self._version


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _sync_time(fn) -> float:
    _sync()
    t0 = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - t0


def bench_model(
    model: str,
    bucket_mb: float,
    reps: int,
    engine: PipeEngine,
    device: str = "cuda:0",
    acks: str = "group",
    tail_mb: float | None = None,
    inflight: int = 2,
    tail_factor: int = 0,
    profile_dir: str | None = None,
) -> dict:
    from weight_sync.config import WeightSyncConfig
    from weight_sync.plan import TAIL_FACTOR, build_plan
    from weight_sync.publisher import Publisher

    state = random_model(model, device)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    # nccl_impl="torch": fleetrl's own receivers join a ProcessGroupNCCL (vLLM engines use "vllm")
    if tail_mb is None:
        tail_mb = WeightSyncConfig().tail_bucket_mb
    cfg = WeightSyncConfig(
        backend="nccl" if device.startswith("cuda") else "gloo",
        bucket_mb=bucket_mb,
        timeout_s=120.0,
        nccl_impl="torch",
        acks=acks,
        tail_bucket_mb=tail_mb,
        inflight_buckets=inflight,
    )
    plan = build_plan(
        [(n, list(t.shape), t.dtype) for n, t in state.items()],
        int(bucket_mb * (1 << 20)),
        cfg.tail_bytes(device.startswith("cuda")),
        tail_factor,
    )
    pub = Publisher(cfg, plan, rank=0, engines=[engine], device=device)
    try:
        first = _sync_time(lambda: pub.publish(1, iter(state.items())))  # rebuild + NCCL communicator warm-up
        if pub.settle():
            raise EngineError("the receiver's answer to v1 failed after its group ack")
        sizes = plan.bucket_bytes()
        engine.call("raw_prepare", sizes)
        bufs = [torch.empty(n, dtype=torch.uint8, device=device) for n in sizes]

        def raw():
            engine._conn.send(("raw", None))
            works = [_bcast(pub.pg, b) for b in bufs]
            for w in works:
                w.wait()
            _sync()
            status, value = engine._conn.recv()
            if status != "ok":
                raise EngineError(f"raw broadcast failed on the receiver: {value}")

        raw()  # warm-up
        pubs, settles, raws, reports = [], [], [], []
        for r in range(reps):  # interleaved, so drift (clocks, other tenants) hits both alike
            _sync()
            t0 = time.perf_counter()
            reports.append(pub.publish(2 + r, iter(state.items())))
            t_ret = time.perf_counter()
            _sync()
            t_end = time.perf_counter()
            pubs.append(t_end - t0)
            # With group acks the engine's RPC answer is still on its way: collect it (and check it) before
            # the pipe is used directly; until then the answer is not counted in publish_s.
            if pub.settle():
                raise EngineError(f"the receiver's answer to v{2 + r} failed after its group ack")
            t_settled = time.perf_counter()
            settles.append(t_settled - t0)
            raws.append(_sync_time(raw))
        # Where the last publish's time went: both processes' stamps, in ms from its start.
        t0 = pub.timeline[0][1]
        timeline_pub, timeline_rx, timeline_rpc = (
            list(pub.timeline),
            list(engine.last_timeline),
            list(engine.rpc_stamps),
        )
        timeline = sorted(
            [(round((t - t0) * 1e3, 3), "publisher " + e) for e, t in timeline_pub]
            + [(round((t - t0) * 1e3, 3), "receiver " + e) for e, t in timeline_rx]
            + [(round((t - t0) * 1e3, 3), "rpc " + e) for e, t in timeline_rpc]
            + [
                (round((t - t0) * 1e3, 3), "bench " + e)
                for e, t in (("publish returned", t_ret), ("synced", t_end), ("settled", t_settled))
            ]
        )
        if profile_dir:  # one more publish (not counted), profiled on both sides
            os.makedirs(profile_dir, exist_ok=True)
            engine.call("profile_next", os.path.join(profile_dir, f"{model}_receiver.json"))
            with _profiled(os.path.join(profile_dir, f"{model}_publisher.json")):
                pub.publish(2 + reps, iter(state.items()))
                _sync()
            pub.settle()
        # Bit-identity of the last publish: digests on both GPUs.
        want = {n: _digest(t) for n, t in state.items()}
        got = engine.call("digest")
        identical = got == want
        publish_s, raw_s = statistics.median(pubs), statistics.median(raws)
        case = {
            "model": f"qwen2-{model}-shape",
            "bytes": nbytes,
            "publish_s": publish_s,
            "raw_broadcast_s": raw_s,
            "ratio_vs_raw": raw_s / publish_s,
            "publish_gb_per_s": nbytes / publish_s / 1e9,
            "bucket_sizes_mb": [round(n / (1 << 20), 1) for n in sizes],
            "tail_bucket_mb": tail_mb,
            "inflight_buckets": inflight,
            "tail_factor": tail_factor or TAIL_FACTOR,
            "raw_gb_per_s": nbytes / raw_s / 1e9,
            "buckets": len(sizes),
            "bucket_mb": bucket_mb,
            "acks": "group" if pub.group_acks else "rpc",
            "inline_start": engine.inline_start,
            # the publish until the engine's RPC answer is in as well (the whole publish with acks='rpc')
            "publish_with_rpc_answer_s": statistics.median(settles),
            "first_publish_s": first,
            "publish_runs_s": pubs,
            "raw_runs_s": raws,
            "publisher_broadcast_s": statistics.median(r.broadcast_seconds for r in reports),
            "bit_identical": identical,
            "checksum": reports[-1].checksum,
            "timeline_ms": timeline,
        }
        log.info(
            "%s: %.2f GB publish %.4fs raw %.4fs ratio %.3f identical=%s",
            model,
            nbytes / 1e9,
            publish_s,
            raw_s,
            raw_s / publish_s,
            identical,
        )
        return case
    finally:
        pub.close()
        state.clear()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["0.5B", "1.5B", "8B"], choices=sorted(SHAPES))
    ap.add_argument("--bucket-mb", type=float, default=256.0)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--inflight", type=int, default=2, help="weight_sync.inflight_buckets")
    ap.add_argument("--tail-factor", type=int, default=0, help="build_plan's tail_factor (0: its default)")
    ap.add_argument(
        "--tail-mb",
        type=float,
        default=None,
        help="weight_sync.tail_bucket_mb: the last bucket's size limit (0 = as the packed rule cuts it; "
        "default: the config's default)",
    )
    ap.add_argument(
        "--acks",
        choices=("group", "rpc"),
        default="group",
        help="weight_sync.acks: through the group (default) or each engine's RPC answer",
    )
    ap.add_argument("--json", help="write results here")
    ap.add_argument(
        "--no-inline-start",
        action="store_true",
        help="start the receiver from the publisher's "
        "RPC loop (its thread) instead of from the publishing thread (EngineClient.send_update)",
    )
    ap.add_argument(
        "--profile",
        metavar="DIR",
        help="after the timed reps, profile one more publish per model on "
        "both sides (torch.profiler chrome traces MODEL_publisher.json / MODEL_receiver.json in DIR)",
    )
    ap.add_argument("--cpu", action="store_true", help="smoke run of this script over gloo on CPU (not a result)")
    ap.add_argument(
        "--switch-interval",
        type=float,
        help="sys.setswitchinterval for this process (seconds; "
        "Python's default is 0.005): how long the publishing thread may keep the GIL from the RPC thread",
    )
    args = ap.parse_args(argv)
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.cpu:
        devices = ("cpu", "cpu")
    elif torch.cuda.device_count() < 2:
        print("bench/weight_sync.py needs 2 CUDA GPUs (or --cpu for a smoke run)", file=sys.stderr)
        return 2
    else:
        devices = ("cuda:0", "cuda:1")
        torch.cuda.set_device(0)
    cases = []
    with receiver_process(devices[1]) as (parent, _):
        for i, model in enumerate(args.models):
            # a fresh engine id per model: each model is its own plan, hence its own group epoch
            engine = PipeEngine(f"bench-rx-{i}", parent)
            engine.inline_start = not args.no_inline_start
            cases.append(
                bench_model(
                    model,
                    args.bucket_mb,
                    args.reps,
                    engine,
                    devices[0],
                    args.acks,
                    args.tail_mb,
                    args.inflight,
                    args.tail_factor,
                    args.profile,
                )
            )
    device = "cpu (smoke run, gloo)" if args.cpu else f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"
    out = {
        "cases": cases,
        "device": device,
        **run_info(argv),
        "torch": torch.__version__,
        "switch_interval_s": sys.getswitchinterval(),
        "nccl": None if args.cpu else ".".join(map(str, torch.cuda.nccl.version())),
        "env": {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "NCCL_CUMEM_ENABLE")},
    }
    for c in cases:
        print(
            f"{c['model']:>18}  {c['bytes'] / 1e9:6.2f} GB  publish {c['publish_s']:.4f}s  "
            f"raw {c['raw_broadcast_s']:.4f}s  ratio {c['ratio_vs_raw']:.3f}  identical={c['bit_identical']}"
        )
    if args.json:
        write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
