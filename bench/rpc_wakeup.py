"""How long a publish's RPC hop takes to wake up, on this host (CPU only; run it beside bench/weight_sync.py).

A publish hands its engine RPCs to an event loop on another thread, and the
engine's answer wakes that loop again. On the 2x H200 machine those hops took
0.2-0.6 ms in bench/weight_sync.py's timelines while a blocking pipe read in the
receiver process woke within about 20 us. This measures each kind of wake-up in
isolation, median and 90th percentile over ``--n`` round trips, with the sender
blocked (the GIL free) as in a publish:

- ``uvloop_thread`` / ``asyncio_thread``: ``run_coroutine_threadsafe`` into a loop that
  runs on another thread, until the coroutine runs;
- ``uvloop_reader``: a loop thread woken by a pipe becoming readable (an engine's answer);
- ``thread_event``: a plain thread blocked on a ``threading.Event``;
- ``process_pipe``: another process blocked in a pipe read (the bench's receiver).

    python bench/rpc_wakeup.py --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time


def _stats(samples: list[float]) -> dict:
    s = sorted(samples)
    return {
        "median_us": statistics.median(s) * 1e6,
        "p90_us": s[int(0.9 * (len(s) - 1))] * 1e6,
        "min_us": s[0] * 1e6,
        "n": len(s),
    }


def _loop_thread(factory) -> asyncio.AbstractEventLoop:
    loop = factory()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    return loop


def coroutine_hop(loop, n: int, gap_s: float) -> list[float]:
    out = []

    async def stamp() -> float:
        return time.perf_counter()

    for _ in range(n):
        time.sleep(gap_s)  # let the loop go idle, as between publishes
        t0 = time.perf_counter()
        t1 = asyncio.run_coroutine_threadsafe(stamp(), loop).result(5)
        out.append(t1 - t0)
    return out


def reader_hop(loop, n: int, gap_s: float) -> list[float]:
    r, w = os.pipe()
    out = []
    for _ in range(n):

        async def wait_readable() -> float:
            fut = asyncio.get_running_loop().create_future()
            asyncio.get_running_loop().add_reader(r, lambda: fut.done() or fut.set_result(time.perf_counter()))
            try:
                return await fut
            finally:
                asyncio.get_running_loop().remove_reader(r)
                os.read(r, 1)

        cf = asyncio.run_coroutine_threadsafe(wait_readable(), loop)
        time.sleep(gap_s)  # the loop is idle in its poll with the reader registered
        t0 = time.perf_counter()
        os.write(w, b"x")
        out.append(cf.result(5) - t0)
    os.close(r)
    os.close(w)
    return out


def event_hop(n: int, gap_s: float) -> list[float]:
    go, done = threading.Event(), threading.Event()
    woke = [0.0]

    def worker() -> None:
        while True:
            go.wait()
            woke[0] = time.perf_counter()
            go.clear()
            done.set()

    threading.Thread(target=worker, daemon=True).start()
    out = []
    for _ in range(n):
        time.sleep(gap_s)
        done.clear()
        t0 = time.perf_counter()
        go.set()
        done.wait(5)
        out.append(woke[0] - t0)
    return out


def _echo(conn) -> None:
    while True:
        msg = conn.recv()
        if msg is None:
            return
        conn.send(time.perf_counter())


def process_hop(n: int, gap_s: float) -> list[float]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_echo, args=(child,), daemon=True)
    p.start()
    parent.send(0)
    parent.recv()
    out = []
    for _ in range(n):
        time.sleep(gap_s)
        t0 = time.perf_counter()
        parent.send(1)
        out.append(parent.recv() - t0)
    parent.send(None)
    p.join(5)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--gap-ms", type=float, default=2.0, help="idle time before each wake-up")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    gap = args.gap_ms / 1e3
    res = {}
    try:
        import uvloop

        uv = _loop_thread(uvloop.new_event_loop)
        res["uvloop_thread"] = _stats(coroutine_hop(uv, args.n, gap))
        res["uvloop_reader"] = _stats(reader_hop(uv, args.n, gap))
    except ImportError:
        pass
    aio = _loop_thread(asyncio.new_event_loop)
    res["asyncio_thread"] = _stats(coroutine_hop(aio, args.n, gap))
    res["asyncio_reader"] = _stats(reader_hop(aio, args.n, gap))
    res["thread_event"] = _stats(event_hop(args.n, gap))
    res["process_pipe"] = _stats(process_hop(args.n, gap))
    out = {
        "cases": res,
        "gap_ms": args.gap_ms,
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    for k, v in res.items():
        print(f"{k:>16}: median {v['median_us']:7.1f} us  p90 {v['p90_us']:7.1f} us  min {v['min_us']:6.1f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
