"""Broker throughput and latency against raw pyzmq PUSH/PULL moving the same bytes, in one run.

    python bench/broker.py --quick --json bench/results/broker.json     # < 60 s
    python bench/broker.py --json out.json                              # full sweep
    python bench/broker.py --validation-only --json bench/results/chaos/validation.json  # seconds

For each batch size (one prompt group of realistic rows per batch: ~1,000 response
token ids and log-probs, 100 prompt ids) it runs, in separate processes:

* broker: producer (pushes with 32 in flight, stamped 16 per event-loop turn; new tickets
  come back with the push replies, or in bulk of at least 32 when it runs out and no push
  is in flight) -> ``python -m broker`` -> consumer (next_batch of ``--groups-per-step``
  groups, default 1, with the next 16 steps requested ahead, at most (k + 1) // 2; each
  step's ack rides on the next request), spool off and on (fsync=never: the kill -9 guarantee; see
  broker/spool.py). Both clients send the requests made in one event-loop turn as one
  message (a ``Multi``), and the broker its replies to one peer (see broker/protocol.py);
  every batch is still its own push: validated (the pushes of one message together),
  leased, sent on and acked on its own;
* raw: PUSH -> PULL of the same Arrow IPC bytes, serialised, sent and parsed the same way
  as the broker's clients do it (``trajectory_to_ipc``; frames under ``COPY_BELOW`` copied,
  larger ones zero-copy), so the ratio is the cost of the broker and nothing else.

Against the fleet: each case also reports rows (samples) per second of one broker core
(``rows_per_broker_core_s``: rows per batch over the broker process's CPU per batch) and
how many such cores a 1,024-GPU fleet would need (``FLEET_1024_SAMPLES_PER_S``: about 20k
samples/s of 1k tokens on a 0.5B model); see the README's broker scaling section.

``--versus OLD_TREE`` measures this broker against another checkout's (e.g. ``git archive``
of an older commit unpacked in a folder): the broker process runs from each tree in turn,
with this tree's clients, ``--rounds`` runs each per case, alternating, and the JSON gets
every run's rows/s and broker CPU per batch, the ratio new/old of their medians and bests,
and the spread of the pairwise ratios.

Both run over loopback TCP (the broker's default address); ``--transport ipc`` runs both over
Unix sockets instead (ipc://), which costs either path's libzmq I/O threads less per byte
(measured at 1 MiB: 0.65 ms of the broker's per-batch CPU is its I/O thread over TCP), so it
moves both sides and hardly the ratio; the JSON records which one ran.

Each case (batch size x spool) runs raw and broker alternately ``--repeat`` times (default 1
with --quick, else 2) and keeps the best run of each, because the machine is shared; every
run's rows/s and the load average are in the JSON. On a 2-core machine all processes share
the same cores, so the ratio is roughly raw's CPU per batch over the broker path's (three
processes and their ZMQ I/O threads, validation, bookkeeping, two hops); the JSON has each
process's CPU per batch (``cpu_ms_per_batch``) to show where it goes. Both paths hold at most ~64 batches in flight (broker: G * (k + 1) = 64 groups;
raw: HWM 32 at each end), so latency (send to receipt, p50/p99)
is measured under the same bounded queueing. Throughput is counted at the
consumer from its first to its last batch.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import multiprocessing as mp
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from broker.schema import TRAJECTORY_SCHEMA  # noqa: E402
from tests.support.broker_groups import make_groups  # noqa: E402

RESP_LEN, PROMPT_LEN = 1000, 100
WINDOW = 32  # pushes in flight (each holds a ticket: with the groups held, at most IN_FLIGHT)
BURST = 16  # pushes stamped per event-loop turn (they go out as one message)
PREFETCH = 16  # learner steps the bench consumer requests ahead
IN_FLIGHT = 64  # groups the broker path may hold (G * (k + 1)); raw: HWM 32 at each end
FLEET_1024_SAMPLES_PER_S = 20_000  # a 1,024-GPU fleet, 1k-token samples, 0.5B model (issue 25)


def base_batch(batch_bytes: int) -> pa.RecordBatch:
    row = make_groups(["probe"], step=1, version=0, group_size=1, resp_len=RESP_LEN, prompt_len=PROMPT_LEN)
    rows = max(1, round(batch_bytes / row.nbytes))
    return make_groups(["g"], step=1, version=0, group_size=rows, resp_len=RESP_LEN, prompt_len=PROMPT_LEN)


def stamp(base: pa.RecordBatch, gid: str, step: int) -> pa.RecordBatch:
    """Per-message columns: a fresh group id, the ticket's step, its version, the send time.

    Types are given: pyarrow's type inference tries an import on every call (a file-system
    search of sys.path), which would dominate the producers of both paths."""
    n = base.num_rows
    cols = base.columns
    cols[0] = pa.array([f"{gid}/{i}" for i in range(n)], pa.string())
    cols[1] = pa.array([gid] * n, pa.string())
    cols[4] = pa.array(np.full(n, step, np.int64))
    cols[9] = pa.ListArray.from_arrays(
        pa.array(np.arange(n + 1, dtype=np.int32)), pa.array(np.full(n, max(0, step - 1), np.int64))
    )
    cols[14] = pa.array(np.full(n, time.time()))
    return pa.RecordBatch.from_arrays(cols, schema=TRAJECTORY_SCHEMA)


# -- structural validation -----------------------------------------------------------------------
def validation_cost(sizes: list[int], seconds_per_size: float = 1.0) -> dict:
    """What Arrow's full structural validation (broker.schema.check_structure, run on every
    pushed batch) costs, per batch and per MiB of IPC payload, next to the whole admission
    check (broker.schema.inspect_batch, which includes it). Batches are read from their IPC
    bytes the way the broker reads a push; the best of five timed rounds is kept (shared
    machine: the minimum is the least disturbed)."""
    from broker import protocol as P
    from broker.schema import check_structure, inspect_batch

    out = []
    for size in sizes:
        payload = P.batch_to_ipc(stamp(base_batch(size), "v", 1)).to_pybytes()
        (batch,) = P.ipc_to_batches(payload)
        mib = len(payload) / (1 << 20)
        row = {"batch_bytes": len(payload), "rows": batch.num_rows}
        for name, fn in (("check_structure", check_structure), ("inspect_batch", inspect_batch)):
            fn(batch)
            reps = max(1, int(seconds_per_size / 5 / max(_time_once(fn, batch), 1e-6)))
            best = min(_time_once(fn, batch, reps) for _ in range(5))
            row[f"{name}_ms_per_batch"] = best * 1e3
            row[f"{name}_ms_per_mib"] = best * 1e3 / mib
        out.append(row)
        print(
            f"validation {len(payload) >> 10:>6} KiB: full structural {row['check_structure_ms_per_batch']:.3f} ms "
            f"({row['check_structure_ms_per_mib']:.3f} ms/MiB), whole admission check "
            f"{row['inspect_batch_ms_per_batch']:.3f} ms"
        )
    big = out[-1]
    return {
        "cases": out,
        "structural_ms_per_mib": big["check_structure_ms_per_mib"],
        "structural_ms_per_mib_at_bytes": big["batch_bytes"],
    }


def _time_once(fn, batch, reps: int = 1) -> float:
    t = time.perf_counter()
    for _ in range(reps):
        fn(batch)
    return (time.perf_counter() - t) / reps


# -- raw PUSH/PULL -------------------------------------------------------------------------------


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process, all its threads (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def raw_producer(addr: str, batch_bytes: int, n: int, cpu=None) -> None:
    import zmq

    from broker.client import COPY_BELOW
    from broker.protocol import trajectory_to_ipc

    base = base_batch(batch_bytes)
    ctx = zmq.Context()
    s = ctx.socket(zmq.PUSH)
    s.setsockopt(zmq.SNDHWM, 32)
    s.connect(addr)
    c0 = time.process_time()
    for i in range(n):
        buf = trajectory_to_ipc(stamp(base, f"g{i}", 1))
        s.send(buf, copy=len(buf) < COPY_BELOW)
    s.close(linger=10_000)
    ctx.term()
    if cpu is not None:
        cpu.value = time.process_time() - c0


def raw_run(batch_bytes: int, n: int, transport: str = "tcp") -> dict:
    import zmq

    from broker.protocol import ipc_to_batches

    ctx = zmq.Context()
    s = ctx.socket(zmq.PULL)
    s.setsockopt(zmq.RCVHWM, 32)
    sock_dir = tempfile.TemporaryDirectory(prefix="bench-raw-") if transport == "ipc" else None
    if sock_dir is not None:
        addr = f"ipc://{sock_dir.name}/raw.sock"
        s.bind(addr)
    else:
        addr = f"tcp://127.0.0.1:{s.bind_to_random_port('tcp://127.0.0.1')}"
    fork = mp.get_context("fork")
    prod_cpu = fork.Value("d", 0.0)
    p = fork.Process(target=raw_producer, args=(addr, batch_bytes, n, prod_cpu))
    p.start()
    c0 = time.process_time()
    lat, rows, t0, nbytes = [], 0, None, 0
    for _ in range(n):
        if not s.poll(30_000):
            raise TimeoutError("raw PUSH/PULL: no message within 30 s")
        f = s.recv(copy=False)
        now = time.time()
        t0 = t0 or time.perf_counter()
        b = ipc_to_batches(f.buffer)[0]
        lat.append(now - b.column("t_start")[0].as_py())
        rows += b.num_rows
        nbytes += len(f.buffer)
    dt = time.perf_counter() - t0
    cons_cpu = time.process_time() - c0
    p.join(30)
    s.close(0)
    ctx.term()
    if sock_dir is not None:
        sock_dir.cleanup()
    first = rows // n
    return {
        "rows_per_s": (rows - first) / dt,
        "bytes_per_s": nbytes * (n - 1) / n / dt,
        "lat": lat,
        "rows_per_batch": first,
        "cpu_ms_per_batch": {"producer": prod_cpu.value / n * 1e3, "consumer": cons_cpu / n * 1e3},
    }


# -- through the broker --------------------------------------------------------------------------


def broker_producer(addr: str, batch_bytes: int, n: int, cpu=None) -> None:
    from broker.client import ProducerClient, new_event_loop

    async def go():
        base = base_batch(batch_bytes)
        prod = ProducerClient(addr, producer_id="bench", timeout_s=60)
        tickets: collections.deque = collections.deque()
        window = asyncio.Semaphore(WINDOW)  # pushes in flight; cheaper than asyncio.wait per batch
        errors: list = []

        def done(fut: asyncio.Future) -> None:
            window.release()
            if fut.cancelled():
                return
            if fut.exception() is not None:
                errors.append(fut.exception())
            else:
                tickets.extend(fut.result().tickets)

        inflight = []
        for i in range(n):
            while not tickets:
                # Replies of pushes in flight bring tickets: wait for those first. Waiting in
                # acquire meanwhile (for WINDOW free slots) would stall while the tickets
                # they bring sit unused here and keep those slots taken.
                if busy := [f for f in inflight if not f.done()]:
                    await asyncio.wait(busy, return_when=asyncio.FIRST_COMPLETED)
                    if errors:
                        raise errors[0]
                else:
                    tickets.extend(await prod.acquire_tickets(IN_FLIGHT, wait_s=5.0, min_groups=WINDOW))
            t = tickets.popleft()
            await window.acquire()
            if errors:
                raise errors[0]
            fut = asyncio.ensure_future(prod.push(stamp(base, f"g{i}", t.step), want_tickets=WINDOW))
            fut.add_done_callback(done)
            inflight.append(fut)
            if i % BURST == BURST - 1:
                await asyncio.sleep(0)  # let this burst go out (as one message) while we go on
            if len(inflight) > 4 * WINDOW:
                inflight = [f for f in inflight if not f.done()]
        for f in inflight:
            await f
        if errors:
            raise errors[0]
        await prod.close()

    c0 = time.process_time()
    with asyncio.Runner(loop_factory=new_event_loop) as r:
        r.run(go())
    if cpu is not None:
        cpu.value = time.process_time() - c0


def broker_run(
    batch_bytes: int, n: int, spool: bool, groups_per_step: int, transport: str = "tcp", broker_tree: Path | None = None
) -> dict:
    """``broker_tree``: run the broker process from that checkout (the clients stay this one's)."""
    from broker.client import ConsumerClient, new_event_loop
    from broker.process import BrokerProcess

    tmp = tempfile.TemporaryDirectory(prefix="bench-spool-")
    sock_dir = tempfile.TemporaryDirectory(prefix="bench-broker-") if transport == "ipc" else None
    g = groups_per_step
    steps = n // g
    k = IN_FLIGHT // g - 1
    opts = dict(
        groups_per_step=g,
        max_staleness=k,
        byte_budget_mb=4096,
        max_message_mb=1024,
        spool_dir=tmp.name if spool else None,
        fsync="never",
    )
    address = f"ipc://{sock_dir.name}/broker.sock" if sock_dir is not None else "tcp://127.0.0.1:0"
    bp = BrokerProcess(address=address, cwd=str(broker_tree) if broker_tree else None, **opts).start()
    fork = mp.get_context("fork")
    prod_cpu = fork.Value("d", 0.0)
    broker_cpu0 = proc_cpu_s(bp.pid)
    p = fork.Process(target=broker_producer, args=(bp.address, batch_bytes, n, prod_cpu))
    p.start()

    # Steps asked ahead hold their leases (acks are deferred to the next request), so with
    # G groups a step at most half the broker's IN_FLIGHT groups may be leased ahead: the
    # producer must still find free slots, or both sides wait for each other (with G = 8 and
    # 16 steps ahead the leases alone would fill all 64).
    prefetch = max(1, min(PREFETCH, (k + 1) // 2))

    async def consume():
        cons = ConsumerClient(bp.address, consumer_id="bench", timeout_s=60)
        lat, rows, t0 = [], 0, None
        ahead = collections.deque(
            asyncio.ensure_future(cons.next_batch(s, wait_s=30)) for s in range(1, min(prefetch, steps) + 1)
        )
        for step in range(1, steps + 1):
            lease = await ahead.popleft()
            if lease is None:
                raise TimeoutError(f"broker bench: no batch for step {step} within 30 s")
            # The ack of this step rides on the next request, sent right away (the
            # prefetch): no round trip of its own.
            await cons.ack(lease.lease_id, defer=True)
            if step + prefetch <= steps:
                ahead.append(asyncio.ensure_future(cons.next_batch(step + prefetch, wait_s=30)))
            now = time.time()
            if t0 is None:  # like raw: count from the first receipt, rows after it
                t0 = time.perf_counter()
            else:
                rows += lease.batch.num_rows
            # one send time per pushed batch (each push is stamped once); a set of a few
            # floats costs about what raw's one as_py() does, np.unique five times that
            lat.extend(now - t for t in set(lease.batch.column("t_start").to_pylist()))
        dt = time.perf_counter() - t0
        await cons.close()  # sends the last deferred acks
        return rows, dt, lat

    try:
        c0 = time.process_time()
        with asyncio.Runner(loop_factory=new_event_loop) as r:
            rows, dt, lat = r.run(consume())
        cons_cpu = time.process_time() - c0
        p.join(60)
        broker_cpu = proc_cpu_s(bp.pid) - broker_cpu0
    finally:
        bp.stop()
        tmp.cleanup()
        if sock_dir is not None:
            sock_dir.cleanup()
    return {
        "rows_per_s": rows / dt,
        "lat": lat,
        "cpu_ms_per_batch": {
            "producer": prod_cpu.value / n * 1e3,
            "broker": broker_cpu / n * 1e3,
            "consumer": cons_cpu / n * 1e3,
        },
    }


def best(runs: list[dict]) -> dict:
    return max(runs, key=lambda r: r["rows_per_s"])


def case(batch_bytes: int, n: int, spool: bool, repeat: int, groups_per_step: int, transport: str = "tcp") -> dict:
    # Raw and broker alternate, so a burst of load from other processes on this shared
    # machine hits both sides alike rather than one whole side.
    raws, brokers = [], []
    for _ in range(repeat):
        raws.append(raw_run(batch_bytes, n, transport))
        brokers.append(broker_run(batch_bytes, n, spool, groups_per_step, transport))
    raw, b = best(raws), best(brokers)
    lat = np.array(b["lat"]) * 1000
    rlat = np.array(raw["lat"]) * 1000
    row_bytes = raw["bytes_per_s"] / raw["rows_per_s"]
    out = {
        "batch_bytes": batch_bytes,
        "spool": spool,
        "transport": transport,
        "batches": n,
        "groups_per_step": groups_per_step,
        "rows_per_batch": raw["rows_per_batch"],
        "rows_per_s": b["rows_per_s"],
        "raw_rows_per_s": raw["rows_per_s"],
        "ratio_vs_raw": b["rows_per_s"] / raw["rows_per_s"],
        "gb_per_s": b["rows_per_s"] * row_bytes / 1e9,
        "raw_gb_per_s": raw["bytes_per_s"] / 1e9,
        "p50_ms": float(np.percentile(lat, 50)),
        "p99_ms": float(np.percentile(lat, 99)),
        "raw_p50_ms": float(np.percentile(rlat, 50)),
        "raw_p99_ms": float(np.percentile(rlat, 99)),
        "runs_rows_per_s": [r["rows_per_s"] for r in brokers],
        "raw_runs_rows_per_s": [r["rows_per_s"] for r in raws],
        "cpu_ms_per_batch": {k: round(v, 3) for k, v in b["cpu_ms_per_batch"].items()},
        "raw_cpu_ms_per_batch": {k: round(v, 3) for k, v in raw["cpu_ms_per_batch"].items()},
        "load_avg_1m": os.getloadavg()[0],
    }
    broker_ms = out["cpu_ms_per_batch"]["broker"]
    out["rows_per_broker_core_s"] = raw["rows_per_batch"] / (broker_ms / 1e3) if broker_ms > 0 else None
    if out["rows_per_broker_core_s"]:
        out["broker_cores_for_1024_gpu_fleet"] = FLEET_1024_SAMPLES_PER_S / out["rows_per_broker_core_s"]
    print(
        f"{batch_bytes >> 10:>6} KiB spool={'on ' if spool else 'off'} broker {out['rows_per_s']:9.0f} rows/s "
        f"{out['gb_per_s']:.2f} GB/s | raw {out['raw_rows_per_s']:9.0f} rows/s {out['raw_gb_per_s']:.2f} GB/s | "
        f"ratio {out['ratio_vs_raw']:.2f} | p50 {out['p50_ms']:.1f} ms p99 {out['p99_ms']:.1f} ms "
        f"(raw {out['raw_p50_ms']:.1f}/{out['raw_p99_ms']:.1f}) | CPU ms/batch "
        f"{sum(out['cpu_ms_per_batch'].values()):.2f} (raw {sum(out['raw_cpu_ms_per_batch'].values()):.2f})",
        flush=True,
    )
    return out


def versus(old_tree: Path, rounds: int, out_json: str | None, batches_64k: int) -> int:
    """This tree's broker process against ``old_tree``'s, the same clients (this tree's), the
    same cases, alternating run by run (``rounds`` each, the first of a pair swapped every
    round), so load from other processes falls on both alike."""
    trees = {"new": None, "old": old_tree.resolve()}
    cases = []
    for size in (64 << 10, 1 << 20):
        n = batches_64k if size == 64 << 10 else max(100, batches_64k // 8)
        for spool in (False, True):
            runs: dict[str, list[dict]] = {"new": [], "old": []}
            for r in range(rounds):
                for name in ("new", "old") if r % 2 == 0 else ("old", "new"):
                    res = broker_run(size, n, spool, 1, "tcp", trees[name])
                    runs[name].append(
                        {
                            "rows_per_s": res["rows_per_s"],
                            "broker_cpu_ms_per_batch": res["cpu_ms_per_batch"]["broker"],
                            "load_avg_1m": os.getloadavg()[0],
                        }
                    )
            new = [x["rows_per_s"] for x in runs["new"]]
            old = [x["rows_per_s"] for x in runs["old"]]
            pair = [a / b for a, b in zip(new, old, strict=True)]
            cpu_new = [x["broker_cpu_ms_per_batch"] for x in runs["new"]]
            cpu_old = [x["broker_cpu_ms_per_batch"] for x in runs["old"]]
            c = {
                "batch_bytes": size,
                "spool": spool,
                "batches": n,
                "runs": runs,
                "rows_per_s_ratio_of_medians": float(np.median(new) / np.median(old)),
                "rows_per_s_ratio_of_bests": max(new) / max(old),
                "pairwise_ratio_min": min(pair),
                "pairwise_ratio_max": max(pair),
                "broker_cpu_ratio_of_medians": float(np.median(cpu_new) / np.median(cpu_old)),
            }
            cases.append(c)
            print(
                f"{size >> 10:>6} KiB spool={'on ' if spool else 'off'} rows/s new {np.median(new):9.0f} old "
                f"{np.median(old):9.0f} (medians; ratio {c['rows_per_s_ratio_of_medians']:.3f}, bests "
                f"{c['rows_per_s_ratio_of_bests']:.3f}, pairs {min(pair):.3f}..{max(pair):.3f}) | broker CPU ms/batch "
                f"new {np.median(cpu_new):.3f} old {np.median(cpu_old):.3f}",
                flush=True,
            )
    result = {
        "versus": str(old_tree),
        "rounds": rounds,
        "clients": "this tree's, for both brokers",
        "cases": cases,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
    }
    if out_json:
        Path(out_json).parent.mkdir(parents=True, exist_ok=True)
        Path(out_json).write_text(json.dumps(result, indent=2))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="two batch sizes, short runs (< 60 s)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument(
        "--repeat",
        type=int,
        default=None,
        help="runs per case, best kept, for raw and broker alike (default: 1 quick, 2 full)",
    )
    ap.add_argument(
        "--transport",
        choices=("tcp", "ipc"),
        default="tcp",
        help="tcp (loopback; the default) or ipc (Unix sockets), for raw and broker alike",
    )
    ap.add_argument(
        "--groups-per-step", type=int, default=1, help="groups (= pushed batches) per learner step (k = 64 // G - 1)"
    )
    ap.add_argument(
        "--validation-only",
        action="store_true",
        help="only the cost of the structural validation per MiB (a few seconds)",
    )
    ap.add_argument("--versus", type=Path, help="another checkout: run the quick bench from both, alternately")
    ap.add_argument("--rounds", type=int, default=5, help="with --versus: runs of each broker per case")
    ap.add_argument("--versus-batches", type=int, default=4000, help="with --versus: 64 KiB batches a run (1 MiB: 1/8)")
    args = ap.parse_args()
    if args.versus is not None:
        return versus(args.versus, args.rounds, args.json, args.versus_batches)
    if not 1 <= args.groups_per_step <= IN_FLIGHT:
        ap.error(f"--groups-per-step must be in 1..{IN_FLIGHT}")
    args.repeat = args.repeat or (1 if args.quick else 2)
    sizes = [64 << 10, 1 << 20] if args.quick else [64 << 10, 256 << 10, 1 << 20, 4 << 20]
    validation = validation_cost([64 << 10, 1 << 20, 4 << 20])
    if args.validation_only:
        validation["machine"] = {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "load_avg_1m": os.getloadavg()[0],
        }
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps({"structural_validation": validation}, indent=2))
        return 0
    volume = (48 << 20) if args.quick else (512 << 20)
    t_start = time.time()
    load_start = os.getloadavg()[0]
    cases = []
    for size in sizes:
        n = int(min(2000 if args.quick else 10_000, max(100, volume // size)))
        n -= n % args.groups_per_step
        for spool in (False, True):
            cases.append(case(size, n, spool, args.repeat, args.groups_per_step, args.transport))
    result = {
        "cases": cases,
        "structural_validation": validation,
        "quick": args.quick,
        "repeat": args.repeat,
        "groups_per_step": args.groups_per_step,
        "transport": args.transport,
        "seconds": time.time() - t_start,
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "load_avg_1m": os.getloadavg()[0],
            "load_avg_1m_at_start": load_start,
        },
    }
    print(f"done in {result['seconds']:.1f} s (load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
