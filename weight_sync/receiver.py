"""The receiving side of weight sync, and a standalone receiver process built on it.

:class:`WeightReceiver` is the logic every fleetrl receiver shares (the vLLM
gloo backend, the local engine, this module's standalone server): join the
group of an epoch with the announced plan, then per publish receive each
bucket into one of a few standing buffers, hand its tensors to ``load`` while the
next buckets are already being received, and return the checksum of the bytes.

Dataflow of one publish, receiver side::

    post recv(0), recv(1) -> [recv(1) || load(0)], post recv(2) -> [recv(2) || load(1)] ... -> checksum
                             ^ two receives stay posted, so the wire never idles while we load

On CUDA the host queues all of that on the device at once (each load waits on the
stream for its receive, and the bucket's fingerprint runs beside the load on a
second stream) and then waits, bucket by bucket and bounded, for the receives;
the checksum's copy to the host comes after the last load.

Group acks (the epoch's ``GroupInfo.group_acks``): the publish ends with an
all-gather of every rank's per-bucket fingerprints, queued behind the last load.
The publisher takes its completion as every receiver's ack and compares the rows;
each receiver compares its own row with the publisher's and its RPC answer (the
checksum) follows, off the publish's critical path.

Staged publish (``weight_sync.staging``): the receives go into a standing
copy of the model's bytes while the engine keeps generating; only the copy into
the model waits for a gap between engine steps::

    stage(v):  post recv(0..n-1) into the staging buffers, return at once   (engine keeps serving)
    ...        the publisher broadcasts; the receives complete in the background
    commit(v): wait for them (bounded) -> checksum -> load bucket by bucket  (the only pause)

The staging buffers (the model's size on the engine's device) are allocated at
the first stage of a plan and reused; the plan is fixed, so that is once.

Guarantees: every wait is bounded by the group timeout; on any failure the
group is torn down (so the publisher learns at once) and the error names the
engine, the step and the bucket. A receiver never holds a half-joined group: a
new ``join`` always replaces the old one, and drops a staged publish with it.

Standalone process (tests, CPU): ``python -m weight_sync.receiver --engine-id r0
--port 0 --port-file F [--init PATH]`` serves the typed HTTP control channel of
:mod:`weight_sync.receiver_client` over a dict of tensors.
"""

from __future__ import annotations

import argparse
import logging
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import msgspec
import torch

from core.http_client import EngineErrorCode
from weight_sync import group as wgroup
from weight_sync import messages as m
from weight_sync.messages import GroupInfo, WeightPlan
from weight_sync.plan import (
    bucket_fingerprint,
    combine_fingerprints,
    fingerprints_checksum,
    unpack_bucket,
    validate_plan,
)

log = logging.getLogger(__name__)

LoadFn = Callable[[list[tuple[str, torch.Tensor]]], None]


class ReceiveError(RuntimeError):
    """A publish failed on this receiver at ``step``; ``code`` says whether the group's transport broke
    (a receive or the acks: a broken peer fails every receiver there) or our own work after it."""

    def __init__(self, message: str, step: str) -> None:
        super().__init__(message)
        self.step = step
        self.code = (
            EngineErrorCode.TRANSPORT if step.startswith(("receive bucket", "acknowledge")) else EngineErrorCode.LOAD
        )


class WeightReceiver:
    """Joins weight-sync groups and receives publishes for one engine worker."""

    def __init__(self, engine_id: str, device: str | torch.device = "cpu") -> None:
        self.engine_id = engine_id
        self.device = torch.device(device)
        self.pg: Any = None  # the joined epoch's torch ProcessGroup (gloo or NCCL); None between epochs
        self.plan: WeightPlan | None = None
        self.group: GroupInfo | None = None
        self.timeout_s = 60.0
        self.depth = 2  # receives posted ahead: the wire stays busy while one bucket loads
        self.last_checksum = ""
        self._sizes: list[int] = []  # bytes per bucket of the joined plan
        self._ring: list[torch.Tensor] = []  # depth + 1 standing receive buffers of the joined plan
        self._views: dict[tuple[int, int], list[tuple[str, torch.Tensor]]] = {}  # (address, bucket) -> tensors
        self._staging: tuple[str, list[torch.Tensor]] | None = None  # (plan id, one buffer per bucket)
        self._staged: tuple[int, list] | None = None  # (version, receive works) of the posted stage
        self._abandoned: list[tuple[object, list]] = []  # groups left with receives still posted
        self._fp_stream: torch.cuda.Stream | None = None  # CUDA: where the fingerprints run, beside the loads
        self.last_commit_parts: dict[str, float] = {}
        self.timeline: list[tuple[str, float]] = []  # (event, time.perf_counter()) of the last receive

    def join(self, group: GroupInfo, plan: WeightPlan, rank: int, timeout_s: float) -> None:
        validate_plan(plan)
        self.leave()
        t0 = time.perf_counter()
        try:
            store = wgroup.connect_store(group.master_addr, group.master_port, timeout_s)
            self.pg = wgroup.make_group(store, group, rank, timeout_s)
        except Exception as e:
            raise RuntimeError(
                f"engine {self.engine_id}: joining weight-sync epoch {group.group_epoch} as rank {rank} "
                f"of {group.world_size} at {group.master_addr}:{group.master_port} failed: {e}"
            ) from e
        if self.plan is None or self.plan.plan_id != plan.plan_id:
            self._sizes, self._ring, self._views = plan.bucket_bytes(), [], {}
        self.plan, self.group, self.timeout_s = plan, group, timeout_s
        log.info(
            "engine %s joined weight-sync epoch %d as rank %d/%d in %.2fs",
            self.engine_id,
            group.group_epoch,
            rank,
            group.world_size,
            time.perf_counter() - t0,
        )

    def leave(self) -> None:
        wgroup.close_group(self.pg)
        if self._staged is not None:
            # Receives still posted in an aborted gloo group end only at its timeout, and dropping the
            # group joins its worker threads: keep it until they are done, so leaving never waits.
            self._abandoned.append((self.pg, self._staged[1]))
        self._abandoned = [(pg, works) for pg, works in self._abandoned if not all(w.is_completed() for w in works)]
        self.pg = None
        self._staged = None

    def _check(self, what: str, version: int, plan_id: str) -> WeightPlan:
        """The joined plan, if ``plan_id`` is it and a group is joined."""
        if self.pg is None or self.plan is None:
            raise RuntimeError(f"engine {self.engine_id}: {what}(v{version}) before joining a weight-sync group")
        if plan_id != self.plan.plan_id:
            raise ValueError(
                f"engine {self.engine_id}: publish uses plan {plan_id!r} but the announced plan is {self.plan.plan_id!r}"
            )
        return self.plan

    def _unpacked(self, buf: torch.Tensor, b: int) -> list[tuple[str, torch.Tensor]]:
        """The named tensors of bucket ``b`` as views of ``buf``; built once per buffer address (the buffers
        are standing, so the per-tensor views are not rebuilt every publish)."""
        key = (buf.data_ptr(), b)
        views = self._views.get(key)
        if views is None:
            if self.plan is None:
                raise RuntimeError(f"engine {self.engine_id}: no weight-sync plan joined")
            views = self._views[key] = unpack_bucket(buf, self.plan, b)
        return views

    def receive(self, version: int, plan_id: str, load: LoadFn) -> str:
        """Receive one publish and load it bucket by bucket; return the checksum of the bytes.

        Buckets land in ``depth + 1`` standing buffers used in turn. Bucket ``b + depth`` is posted into
        the buffer of bucket ``b - 1`` after that one's load was issued: a CUDA collective waits for the
        work already queued on the current stream, and gloo's load is done when it returns.

        On CUDA the host queues the whole publish without waiting: each bucket's load goes on the current
        stream behind its receive (``work.wait()`` orders the stream, not the host), so neither the host's
        reaction to a finished bucket nor the launch of its load sits between the last byte on the wire
        and the last load. The host then waits, bucket by bucket with the per-step timeout, for the
        receives. (A ``load`` that synchronises the host, like a loader reading a value back, waits
        there for its bucket; the group's own timeout, the same ``timeout_s`` in the NCCL watchdog,
        bounds that wait.) On gloo a receive is host work: wait for it, then load.
        """
        self._check("update_weights", version, plan_id)
        if not self._ring:
            self._ring = [
                torch.empty(max(self._sizes), dtype=torch.uint8, device=self.device)
                for _ in range(min(self.depth + 1, len(self._sizes)))
            ]
        if self.device.type == "cuda" and self._fp_stream is None:
            self._fp_stream = torch.cuda.Stream(self.device)
        self.timeline = [("receive", time.perf_counter())]
        run = _ReceiveRun(self, load)
        try:
            run.post_first()
            run.take_all()
            run.queue_ack()
            run.wait_receives()
            run.wait_ack()
        except Exception as e:
            self.leave()  # the publisher and other receivers see the group fail at once
            raise ReceiveError(
                f"engine {self.engine_id}: publish v{version} failed at '{run.step}': {e}", run.step
            ) from e
        self.last_checksum = run.checksum(version)
        self.timeline.append(("checksum", time.perf_counter()))
        return self.last_checksum

    # ---- staged publish -------------------------------------------------------------
    def stage(self, version: int, plan_id: str) -> None:
        """Post every bucket's receive into the staging buffers and return; :meth:`commit` loads them."""
        plan = self._check("stage", version, plan_id)
        if self._staging is None or self._staging[0] != plan.plan_id:
            self._staging = (plan.plan_id, [torch.empty(n, dtype=torch.uint8, device=self.device) for n in self._sizes])
        if self._staged is not None:
            # A stage that was never committed (its publish failed on the learner side) left receives posted
            # in a group that was torn down; a live group would have matched them with this publish's sends.
            raise RuntimeError(
                f"engine {self.engine_id}: stage(v{version}) while v{self._staged[0]} is staged and not committed"
            )
        try:
            works = [wgroup.broadcast_async(self.pg, buf) for buf in self._staging[1]]
        except Exception as e:
            self.leave()
            raise RuntimeError(f"engine {self.engine_id}: posting the receives of v{version} failed: {e}") from e
        self._staged = (version, works)

    def commit(self, version: int, load: LoadFn) -> str:
        """Wait (bounded) for the staged receives of ``version``, then load them; returns the checksum."""
        if self._staged is None or self._staged[0] != version:
            have = None if self._staged is None else self._staged[0]
            raise RuntimeError(f"engine {self.engine_id}: commit(v{version}) but the staged version is {have}")
        _, works = self._staged
        self._staged = None
        assert self._staging is not None  # stage() fills it before it stages anything
        bufs = self._staging[1]
        step, t0 = "receive bucket 0", time.perf_counter()
        try:
            deadline = time.monotonic() + self.timeout_s
            for b, work in enumerate(works):
                step = f"receive bucket {b}/{len(works)}"
                wgroup.wait_work(work, deadline, f"engine {self.engine_id}: {step}")
            t1, step = time.perf_counter(), "checksum"
            self.last_checksum = combine_fingerprints([bucket_fingerprint(buf) for buf in bufs])
            t2 = time.perf_counter()
            for b, buf in enumerate(bufs):
                step = f"load bucket {b}/{len(bufs)}"
                load(self._unpacked(buf, b))
            # where a commit's time goes (the engine is held still for all of it)
            self.last_commit_parts = {"wait_s": t1 - t0, "checksum_s": t2 - t1, "load_s": time.perf_counter() - t2}
        except Exception as e:
            self.leave()
            raise ReceiveError(
                f"engine {self.engine_id}: staged publish v{version} failed at '{step}': {e}", step
            ) from e
        return self.last_checksum


class _ReceiveRun:
    """One unstaged receive, phase by phase (see :meth:`WeightReceiver.receive`): the buckets in
    ``depth + 1`` standing buffers, their fingerprints, and the step being done (named in errors).

    On CUDA (``queued``) :meth:`take_all` only queues work on the streams and :meth:`wait_receives`
    then waits for the receives; on gloo :meth:`take_all` waits for each receive before its load."""

    def __init__(self, rx: WeightReceiver, load: LoadFn) -> None:
        self.rx, self.load = rx, load
        self.pg, self.sizes, self.slots, self.depth = rx.pg, rx._sizes, rx.depth + 1, rx.depth
        self.queued = rx.device.type == "cuda"
        self.main = torch.cuda.current_stream(rx.device) if self.queued else None
        self.side = rx._fp_stream if self.queued else None  # fingerprints run here, beside the loads
        self.prints: list[torch.Tensor] = []
        self.works: list = []  # the receive of bucket b is works[b]
        self.ack = None
        self.step = "receive bucket 0"
        self.mark = rx.timeline.append
        self.deadline = 0.0

    def post(self, b: int) -> None:
        self.works.append(wgroup.broadcast_async(self.pg, self.rx._ring[b % self.slots][: self.sizes[b]]))

    def wait(self, b: int) -> None:
        """Wait for bucket ``b``'s receive within the per-step limit, then start the next step's."""
        wgroup.wait_work(
            self.works[b],
            self.deadline,
            f"engine {self.rx.engine_id}: receive bucket {b}/{len(self.sizes)}",
            max_sleep_s=5e-5,
        )
        self.mark((f"bucket{b}_received", time.perf_counter()))
        self.deadline = time.monotonic() + self.rx.timeout_s  # the limit is per step, not per publish

    def post_first(self) -> None:
        for b in range(min(self.depth, len(self.sizes))):
            self.post(b)
        self.mark(("posted", time.perf_counter()))
        self.deadline = time.monotonic() + self.rx.timeout_s

    def take_all(self) -> None:
        """Each bucket: its receive (waited for on gloo, ordered on the stream on CUDA), the next receive
        posted into the slot before it, its load and its fingerprint."""
        sizes, side = self.sizes, self.side
        main: Any = self.main  # a CUDA stream whenever side is one (both exist only when queued)
        for b in range(len(sizes)):
            self.step = f"receive bucket {b}/{len(sizes)}"
            if self.queued:
                self.works[b].wait()  # the stream waits for the bucket; the host goes on
            else:
                self.wait(b)
            if b + self.depth < len(sizes):
                if side is not None:
                    main.wait_stream(side)  # the slot's last fingerprint is read before the receive reuses it
                self.post(b + self.depth)  # keep `depth` receives posted while this bucket loads
            self.step = f"load bucket {b}/{len(sizes)}"
            buf = self.rx._ring[b % self.slots][: sizes[b]]
            if side is None:
                self.load(self.rx._unpacked(buf, b))
                self.prints.append(bucket_fingerprint(buf))
                self.mark((f"bucket{b}_loaded", time.perf_counter()))
            else:
                # The fingerprint of the received bytes on a second stream, beside the load (both read the
                # bucket; after the last bucket that shortens the publish's tail).
                side.wait_stream(main)  # after this bucket's receive
                with torch.cuda.stream(side):
                    self.prints.append(bucket_fingerprint(buf))
                self.load(self.rx._unpacked(buf, b))
        if side is not None:
            main.wait_stream(side)  # the acks and the checksum follow every load and every fingerprint

    def queue_ack(self) -> None:
        """Group acks (this epoch ends each unstaged publish with the ack all-gather): our fingerprints
        all-gathered with the publisher's. On CUDA it is queued behind the last load and the last
        fingerprint, so the publisher learns "loaded, and these bytes" without waiting for this host or
        the RPC's answer."""
        group = self.rx.group
        assert group is not None  # a receive runs only inside a joined epoch (_check)
        if not group.group_acks:
            return
        self.step = "acknowledge (group)"
        self.mine = torch.stack(self.prints)
        self.gathered = torch.empty(
            (group.world_size, *self.mine.shape), dtype=self.mine.dtype, device=self.mine.device
        )
        self.ack = wgroup.all_gather_async(self.pg, self.gathered, self.mine)

    def wait_receives(self) -> None:
        if not self.queued:
            return  # waited for one by one in take_all
        self.mark(("queued", time.perf_counter()))
        for b in range(len(self.sizes)):
            self.step = f"receive bucket {b}/{len(self.sizes)}"
            self.wait(b)

    def wait_ack(self) -> None:
        if self.ack is None:
            return
        self.step = "acknowledge (group)"
        wgroup.wait_work(self.ack, self.deadline, f"engine {self.rx.engine_id}: {self.step}", max_sleep_s=5e-5)
        self.mark(("acked", time.perf_counter()))

    def checksum(self, version: int) -> str:
        if self.ack is None:
            return combine_fingerprints(self.prints)  # on CUDA: returns once the queued loads are done
        mine, theirs = fingerprints_checksum(self.mine), fingerprints_checksum(self.gathered[0])
        self.rx.last_checksum = mine
        if theirs != mine:
            # The publisher sees the same mismatch in the gathered rows and drops this engine.
            raise RuntimeError(
                f"engine {self.rx.engine_id}: publish v{version}: checksum mismatch in the group acks: "
                f"the received bytes' {mine}, the publisher's {theirs}"
            )
        return mine


class ReceiverState:
    """A model as a dict of tensors behind the standalone server."""

    def __init__(self, engine_id: str, corrupt: str | None = None) -> None:
        self.receiver = WeightReceiver(engine_id)
        self.tensors: dict[str, torch.Tensor] = {}
        self.version = -1
        self.lock = threading.Lock()  # one weight operation at a time
        self.corrupt = corrupt  # fault injection for tests: flip a bit of this tensor as it arrives

    def load(self, pairs: list[tuple[str, torch.Tensor]]) -> None:
        for name, t in pairs:
            if name == self.corrupt:
                t.view(-1).view(torch.uint8)[0] ^= 1  # in the received bucket itself, as a bad transfer would
            self.tensors[name] = t.clone()  # views of the bucket buffer must not outlive it

    def load_path(self, path: str) -> None:
        import pathlib

        from safetensors.torch import load_file

        p = pathlib.Path(path)
        files = sorted(p.glob("*.safetensors")) if p.is_dir() else [p]
        if not files:
            raise FileNotFoundError(f"no *.safetensors under {path}")
        for f in files:
            self.tensors.update(load_file(str(f)))


def _handler(state: ReceiverState):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: a publish's request goes out on an open connection

        def log_message(self, fmt, *args):  # route http.server's access log to logging
            log.debug("receiver http: " + fmt, *args)

        def _reply(self, reply: m.Reply, code: int = 200) -> None:
            body = msgspec.json.encode(reply)
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path == "/health":
                self._reply(m.Reply(ok=True, version=state.version))
            else:
                self._reply(m.Reply(ok=False, error=f"unknown path {self.path}"), 404)

        def do_POST(self):
            raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            routes = {
                "/init_weight_transfer": m.InitTransfer,
                "/update_weights": m.UpdateWeights,
                "/stage_weights": m.StageWeights,
                "/commit_weights": m.CommitWeights,
                "/load_weights_from_path": m.LoadFromPath,
                "/dump": m.DumpState,
            }
            if self.path not in routes:
                return self._reply(m.Reply(ok=False, error=f"unknown path {self.path}"), 404)
            try:
                msg = msgspec.json.decode(raw, type=routes[self.path])
            except msgspec.ValidationError as e:
                return self._reply(m.Reply(ok=False, error=f"bad {self.path} message: {e}"), 400)
            try:
                with state.lock:
                    reply = self._dispatch(msg)
            except Exception as e:  # noqa: BLE001 - reported to the caller, who names this engine
                log.exception("receiver %s: %s failed", state.receiver.engine_id, self.path)
                return self._reply(m.Reply(ok=False, error=str(e), code=str(getattr(e, "code", ""))), 500)
            self._reply(reply)

        def _dispatch(self, msg) -> m.Reply:
            if isinstance(msg, m.InitTransfer):
                group = msg.group
                state.receiver.join(group, msg.plan, group.rank_offset, msg.timeout_s)
                return m.Reply(ok=True, version=state.version)
            if isinstance(msg, m.UpdateWeights):
                checksum = state.receiver.receive(msg.version, msg.plan_id, state.load)
                state.version = msg.version
                return m.Reply(ok=True, checksum=checksum, version=msg.version)
            if isinstance(msg, m.StageWeights):
                state.receiver.stage(msg.version, msg.plan_id)
                return m.Reply(ok=True, version=state.version)
            if isinstance(msg, m.CommitWeights):
                checksum = state.receiver.commit(msg.version, state.load)
                state.version = msg.version
                return m.Reply(ok=True, checksum=checksum, version=msg.version)
            if isinstance(msg, m.LoadFromPath):
                state.load_path(msg.path)
                state.version = msg.version
                return m.Reply(ok=True, version=msg.version)
            from safetensors.torch import save_file

            save_file({k: v.contiguous() for k, v in state.tensors.items()}, msg.path)
            return m.Reply(ok=True, version=state.version)

    return Handler


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="fleetrl standalone weight receiver (a dict of tensors)")
    ap.add_argument("--engine-id", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--port-file", help="write the bound port here once serving")
    ap.add_argument("--init", help="safetensors file or HF folder to load first")
    ap.add_argument(
        "--corrupt-tensor",
        metavar="NAME",
        help="tests only: flip one bit of this tensor in every publish received (checksums must catch it)",
    )
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s receiver[{args.engine_id}] %(levelname)s %(message)s")
    torch.set_num_threads(1)
    state = ReceiverState(args.engine_id, corrupt=args.corrupt_tensor)
    if args.init:
        state.load_path(args.init)
        state.version = 0
    server = ThreadingHTTPServer((args.host, args.port), _handler(state))
    server.daemon_threads = True
    if args.port_file:
        with open(args.port_file + ".tmp", "w") as f:
            f.write(str(server.server_address[1]))
        import os

        os.replace(args.port_file + ".tmp", args.port_file)
    log.info("serving on %s:%d", args.host, server.server_address[1])
    server.serve_forever()


if __name__ == "__main__":
    main()
