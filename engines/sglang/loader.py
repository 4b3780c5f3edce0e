"""fleetrl's weight receiver inside SGLang's TP workers: staged updates through SGLang's custom-loader hook.

SGLang (0.5.16 and newer) runs a function named by ``--custom-weight-loader`` in
every TP worker when ``/update_weights_from_tensor`` gives its import path as
``load_format``: ``fn(model, named_tensors)``, called by the scheduler between two
batches. The SGLang server fleetrl starts registers :func:`fleetrl_loader`, and
:class:`engines.sglang.weights.SGLangWeightClient` uses it as a remote procedure:
the single named tensor's *name* carries a command (``fleetrl:`` + JSON), the
tensor is a one-byte placeholder (SGLang unpickles the payload with an allowlist
that admits torch tensors; nothing else travels that way)::

    join(group, plan)   this worker joins fleetrl's weight group (rank rank_offset + tp_rank)
                        through a weight_sync.receiver.WeightReceiver, as vLLM's workers do
    stage(v, plan_id)   post the receives of v into standing buffers (the client asks for it
                        through the store instead, see below; this form is for tests and tools)
    commit(v)           wait (bounded) for the staged receives, checksum, copy into the model
                        unless the forward hook already did (the loader's copies are recorded
                        once, then replayed: weight_sync.copy_plan)
    leave()             leave the group

The stage does not go through SGLang's scheduler: ``join`` starts a thread in each
worker that takes requests from fleetrl's TCP store (:func:`request_key`), and a stage
is posted by that thread while the engine generates. The commit runs in the loader,
inside an ``in_place`` pause (SGLang freezes the running batch without retracting it),
or, with TP=1 and an engine that is not paused (``SGLangWeightClient(between_steps=True)``, the
default; run on 2 H200s with SGLang 0.5.16), without any SGLang call: the request thread leaves it
pending and the model's forward, which ``join`` wraps, runs it before the next batch,
in the scheduler's own thread. An engine that runs no forward then (idle, or decoding
from CUDA graphs only) gets it through the loader after a short wait; TP > 1 engines
always do, as their ranks must switch weights at the same step.

Outcomes: SGLang drops the loader's return value and an exception would end its
scheduler, so every command catches its error and writes its outcome (JSON: ok,
checksum, timings, or the error) to fleetrl's TCP store, the one the publisher
hosts for the group, under :func:`outcome_key`; the client reads it after the call.
"""

from __future__ import annotations

import base64
import datetime
import functools
import json
import logging
import pickle
import threading
import time
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from weight_sync.copy_plan import CopyPlanLoader

log = logging.getLogger(__name__)

LOADER = "engines.sglang.loader.fleetrl_loader"  # the --custom-weight-loader / load_format value
PREFIX = "fleetrl:"
COMMANDS = ("join", "stage", "commit", "leave")


def payload(cmd: str, **args: Any) -> str:
    """The base64 ``serialized_named_tensors`` entry (one per TP rank) carrying ``cmd`` and ``args``."""
    if cmd not in COMMANDS:
        raise ValueError(f"unknown fleetrl SGLang command {cmd!r}; expected one of {COMMANDS}")
    named = [(PREFIX + json.dumps({"cmd": cmd, **args}), torch.zeros(1, dtype=torch.uint8))]
    return base64.b64encode(pickle.dumps(named)).decode()


def outcome_key(engine_id: str, seq: int, tp_rank: int) -> str:
    return f"fleetrl/sglang/{engine_id}/call{seq}/tp{tp_rank}"


def request_key(group_epoch: int, rank_offset: int, n: int) -> str:
    """Where the client leaves its ``n``-th request (from 1) since this engine joined epoch ``group_epoch``."""
    return f"fleetrl/sglang/epoch{group_epoch}/engine{rank_offset}/request{n}"


def request(cmd: str, **args: Any) -> str:
    if cmd not in ("stage", "commit"):
        raise ValueError(f"only stage and commit go through the store, not {cmd!r}")
    return json.dumps({"cmd": cmd, **args})


def read_outcomes(store, engine_id: str, seq: int, tp_size: int) -> list[dict]:
    """Every TP worker's outcome of call ``seq`` (blocking, bounded by the store's timeout)."""
    out = []
    for r in range(tp_size):
        key = outcome_key(engine_id, seq, r)
        try:
            raw = store.get(key)
        except Exception as e:  # noqa: BLE001 - torch raises DistStoreError/RuntimeError on timeout
            raise TimeoutError(f"SGLang engine {engine_id}: TP worker {r} left no outcome of call {seq}: {e}") from e
        out.append(json.loads(raw))
        try:
            store.delete_key(key)
        except Exception:  # noqa: BLE001 - a leftover key of a few bytes is harmless
            pass
    return out


class _Requests(threading.Thread):
    """Takes the client's stage and commit requests from fleetrl's store (:func:`request_key`), in a thread
    of its own, so that neither goes through SGLang's scheduler:

    - stage: post the receives (``WeightReceiver.stage``) and leave the outcome under :func:`outcome_key`;
    - commit: mark it pending; the model's forward, wrapped at join, runs it before the next batch (the
      scheduler thread, between two steps) and leaves the outcome. With TP > 1 the client never asks
      this way (each rank would meet it at its own step); it calls the loader inside a pause instead.

    The scheduler thread touches the receiver only in a commit or a join, never during a stage: the
    client asks for one thing at a time."""

    def __init__(self, worker: _Worker, group, timeout_s: float) -> None:
        super().__init__(name=f"fleetrl-requests-epoch{group.group_epoch}", daemon=True)
        self.worker, self.group, self.timeout_s = worker, group, timeout_s
        self.stopped = threading.Event()

    def run(self) -> None:
        from weight_sync import group as wgroup

        if self.worker.receiver.device.type == "cuda":
            torch.cuda.set_device(self.worker.receiver.device)
        store = wgroup.connect_store(self.group.master_addr, self.group.master_port, self.timeout_s)
        n, failing_since = 0, None
        while not self.stopped.is_set():
            key = request_key(self.group.group_epoch, self.group.rank_offset, n + 1)
            t0 = time.monotonic()
            try:
                store.wait([key], datetime.timedelta(seconds=1))  # a bounded wait, to look at `stopped` again
                cmd = json.loads(store.get(key))
            except Exception as e:  # noqa: BLE001 - not asked yet (a timeout), or the store is gone
                if time.monotonic() - t0 >= 0.9:  # the wait ran out: nobody asked
                    failing_since = None
                    continue
                failing_since = failing_since or t0
                if time.monotonic() - failing_since > self.timeout_s:  # the publisher is gone; a new join starts anew
                    log.warning("fleetrl requests: store unreachable for %.0fs, stopping: %s", self.timeout_s, e)
                    return
                self.stopped.wait(0.05)
                continue
            failing_since = None
            n += 1
            if cmd["cmd"] == "commit":
                self.worker.pending = cmd  # the next forward runs it
                continue
            try:
                outcome = {"ok": True, **(self.worker.run(None, cmd) or {})}  # (None only for commits)
            except Exception as e:  # noqa: BLE001 - reported to the client, which names this engine
                log.exception("fleetrl requests: stage %d failed", n)
                outcome = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            store.set(outcome_key(str(cmd["engine_id"]), int(cmd["seq"]), self.worker.tp_rank), json.dumps(outcome))


class _Worker:
    """The fleetrl side of one SGLang TP worker process."""

    def __init__(self) -> None:
        from weight_sync.receiver import WeightReceiver

        self.tp_rank = _tp_rank()
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        self.receiver = WeightReceiver("sglang", device=device)
        self.store: Any = None  # the publisher's torch TCPStore (requests in, outcomes out)
        self.store_at: tuple[str, int] | None = None
        self.copy_loader: CopyPlanLoader | None = None
        self.model = None
        self.requests: _Requests | None = None
        self.pending: dict | None = None  # a commit request for the next forward
        self.committed_seq = -1  # the request seq of the last commit run
        self.lock = threading.Lock()  # one commit at a time: the forward hook or the loader

    def run(self, model, cmd: dict) -> dict | None:
        """The outcome of ``cmd``; None where there is nothing to report (its outcome is in the store already)."""
        what = cmd["cmd"]
        if what == "join":
            return self.join(model, cmd)
        if what == "leave":
            self.receiver.leave()
            return {}
        if what == "stage":
            t0 = time.perf_counter()
            self.receiver.stage(int(cmd["version"]), str(cmd["plan_id"]))
            return {"stage_s": time.perf_counter() - t0}
        if what == "commit":
            with self.lock:
                if int(cmd["seq"]) == self.committed_seq:
                    return None  # the forward hook ran it and left its outcome
                self.pending = None
                self.committed_seq = int(cmd["seq"])
                return self.commit(model, int(cmd["version"]))
        raise ValueError(f"unknown command {what!r}")

    def hook(self, model) -> None:
        """Wrap ``model.forward`` so that a pending commit runs before the next batch's forward."""
        if getattr(model, "_fleetrl_hooked", False):
            return
        inner = model.forward

        @functools.wraps(inner)  # SGLang inspects forward's signature (pp_proxy_tensors)
        def forward(*args, **kwargs):
            if self.pending is not None:
                self.commit_pending(model)
            return inner(*args, **kwargs)

        model.forward = forward
        model._fleetrl_hooked = True

    def commit_pending(self, model) -> None:
        with self.lock:
            cmd, self.pending = self.pending, None
            if cmd is None or int(cmd["seq"]) == self.committed_seq:
                return
            self.committed_seq = int(cmd["seq"])
            try:
                outcome = {"ok": True, **self.commit(model, int(cmd["version"])), "between_steps": True}
            except Exception as e:  # noqa: BLE001 - reported; an exception here would fail SGLang's batch
                log.exception("fleetrl: commit of v%s before a forward failed", cmd.get("version"))
                outcome = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        self.store.set(outcome_key(str(cmd["engine_id"]), int(cmd["seq"]), self.tp_rank), json.dumps(outcome))

    def join(self, model, cmd: dict) -> dict:
        from weight_sync.messages import GroupInfo
        from weight_sync.plan import plan_from_dict

        g = cmd["group"]
        group = GroupInfo(
            master_addr=g["master_addr"],
            master_port=int(g["master_port"]),
            rank_offset=int(g["rank_offset"]),
            world_size=int(g["world_size"]),
            backend=str(g.get("backend", "nccl")),  # gloo: the CPU tests
            group_epoch=int(g["group_epoch"]),
        )
        if self.requests is not None:  # the previous epoch's
            self.requests.stopped.set()
            self.requests = None
        self.pending = None
        self.receiver.engine_id = str(cmd["engine_id"])
        self.receiver.join(
            group, plan_from_dict(cmd["plan"]), group.rank_offset + self.tp_rank, float(cmd["timeout_s"])
        )
        if self.model is not model:
            self.copy_loader, self.model = None, model
        self.hook(model)
        self.requests = _Requests(self, group, float(cmd["timeout_s"]))
        self.requests.start()
        return {"rank": group.rank_offset + self.tp_rank}

    def commit(self, model, version: int) -> dict:
        t0 = time.perf_counter()
        plan = self.receiver.plan
        if plan is None:
            raise RuntimeError(f"commit of v{version} before this worker joined a weight-sync group")
        if self.copy_loader is None or self.model is not model:
            from weight_sync.copy_plan import CopyPlanLoader

            self.copy_loader, self.model = CopyPlanLoader(model, model.load_weights), model
        loader = self.copy_loader
        replayed = loader.replayed
        loader.start_commit(len(plan.buckets))
        checksum = self.receiver.commit(version, loader.load)
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the next batch must see every copy, whatever stream it runs on
        return {
            "checksum": checksum,
            "version": version,
            "commit_s": time.perf_counter() - t0,
            "commit_parts": self.receiver.last_commit_parts,
            "replayed_buckets": loader.replayed - replayed,
        }


_WORKER: _Worker | None = None


def _tp_rank() -> int:
    try:
        from sglang.srt.distributed import get_tensor_model_parallel_rank
    except ImportError:  # outside SGLang (unit tests drive the loader in a plain process)
        return 0
    return int(get_tensor_model_parallel_rank())


def _connect(cmd: dict):
    from weight_sync import group as wgroup

    s = cmd["store"]
    return wgroup.connect_store(s["addr"], int(s["port"]), float(cmd.get("timeout_s", 60.0)))


def fleetrl_loader(model, named_tensors) -> None:
    """SGLang's ``custom_loader(model, named_tensors)``: run one fleetrl command in this TP worker."""
    global _WORKER
    if len(named_tensors) != 1 or not str(named_tensors[0][0]).startswith(PREFIX):
        # Not a fleetrl call: a plain tensor update routed here by mistake. Load nothing, say so.
        log.error("fleetrl loader got %d tensors that are not a fleetrl command; nothing loaded", len(named_tensors))
        return
    t_enter = time.perf_counter()  # CLOCK_MONOTONIC: the client on the same host can place it on its timeline
    cmd = json.loads(named_tensors[0][0][len(PREFIX) :])
    try:
        if _WORKER is None:
            _WORKER = _Worker()
        worker = _WORKER
        at = (cmd["store"]["addr"], int(cmd["store"]["port"]))
        if worker.store_at != at:  # the first call, or a new publisher
            worker.store, worker.store_at = _connect(cmd), at
    except Exception as e:  # noqa: BLE001 - without a store there is no way to report: the client times out
        log.exception("fleetrl loader: cannot reach the weight-sync store for %s: %s", cmd.get("cmd"), e)
        return
    try:
        result = worker.run(model, cmd)
        if result is None:
            return  # nothing to do: the outcome is there already
        outcome = {"ok": True, **result}
    except Exception as e:  # noqa: BLE001 - an exception here would end SGLang's scheduler: report it instead
        log.exception("fleetrl loader: %s failed", cmd.get("cmd"))
        outcome = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    outcome.update(t_enter=t_enter, t_exit=time.perf_counter())
    worker.store.set(outcome_key(str(cmd["engine_id"]), int(cmd["seq"]), worker.tp_rank), json.dumps(outcome))
