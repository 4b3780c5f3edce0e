"""A stand-in for the weight-update surface of an SGLang TP=1 server, for CPU tests of SGLangClient.

SGLang has no CPU build, so this process plays the part of its HTTP server and scheduler for the
calls fleetrl's staged path makes, as SGLang 0.5.16 handles them (``managers/scheduler.py``,
``model_runner_components/weight_updater.py``):

- ``/pause_generation`` with ``mode=in_place``: the scheduler stops running batches, after the
  one in progress; ``/continue_generation`` lets it go on;
- ``/update_weights_from_tensor``: the payload is unpickled with an allowlist and the function
  named by ``load_format`` (registered as a custom weight loader) is called with the model,
  between two batches;
- a "scheduler" thread runs the model's forward every few milliseconds while ``busy`` (a switch
  of this stand-in, ``/busy``) and not paused: the batches the wrapped forward commits before.

And, for colocated mode, the memory release and SGLang's own distributed update over gloo
(``scheduler_update_weights_mixin.py``, ``model_runner.py``):

- ``/release_memory_occupation`` ``{"tags": [...]}`` (null: all): refused while a ``/generate`` runs
  (SGLang asserts ``_is_no_request()`` and its scheduler dies); released weights lose their contents
  (NaN here: torch_memory_saver unmaps them and the resume maps fresh pages);
- ``/resume_memory_occupation``: a tag that is not released fails (SGLang's ``offload_tags.remove``);
- ``/generate`` (``input_ids``, ``n``, ``return_logprob``): the output tokens are a function of the
  model's weights, so a test sees which weights answered; refused while anything is released (SGLang
  would run on unmapped memory);
- ``/init_weights_update_group`` joins a gloo group exactly as SGLang's ``init_custom_process_group``
  does (``PrefixStore(group_name)``, torch's ``_new_process_group_helper``);
  ``/update_weights_from_distributed`` with ``load_format="flattened_bucket"`` receives one uint8
  broadcast per call and loads it (refused while the weights are released).

``GET /calls`` lists the calls in order; ``POST /fail`` ``{"path", "status", "delay_s", "times"}`` makes
the next calls of one path fail or answer late.

What runs inside is real: a torch model, fleetrl's loader (``engines.sglang.loader``), its group
(gloo) and store. ``/state`` reports the pause flag, forwards run, and the model's tensors.

    python tests/support/sglang_standin.py --port N
"""

from __future__ import annotations

import argparse
import base64
import datetime
import io
import json
import pickle
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import (
    PrefixStore,
    _new_process_group_helper,
    _world,
    rendezvous,
)

from engines.sglang import loader
from weight_sync.plan import nbytes, torch_dtype

ALLOWED = ("builtins.", "collections.", "copyreg.", "torch.")  # of SGLang's SafeUnpickler prefixes


class _Unpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if not any((module + ".").startswith(p) for p in ALLOWED):
            raise RuntimeError(f"blocked {module}.{name}")
        return super().find_class(module, name)


def decode_payload(data: str) -> list:
    """A ``serialized_named_tensors`` entry back to its named tensors, as SGLang unpickles it."""
    return _Unpickler(io.BytesIO(base64.b64decode(data))).load()


def state(seed: int) -> dict[str, torch.Tensor]:
    """Random HF-style tensors that :class:`Tiny` loads."""
    g = torch.Generator().manual_seed(seed)
    return {
        "q": torch.randn(4, 8, generator=g),
        "k": torch.randn(4, 8, generator=g),
        "v": torch.randn(4, 8, generator=g),
        "norm": torch.randn(8, generator=g),
    }


class Tiny(torch.nn.Module):
    """Fused q/k/v like SGLang's QKVParallelLinear, and a padded row filled with 0 like its embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Parameter(torch.zeros(12, 8), requires_grad=False)
        self.norm = torch.nn.Parameter(torch.zeros(9), requires_grad=False)

    def forward(self, x):
        return self.qkv.sum() + self.norm.sum() + x

    @torch.no_grad()
    def load_weights(self, pairs):
        for name, t in pairs:
            if name == "norm":
                self.norm.data[:8].copy_(t)
                self.norm.data[8:].fill_(0.0)
            else:
                self.qkv.data.narrow(0, {"q": 0, "k": 4, "v": 8}[name], 4).copy_(t)


MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")  # SGLang's GPU_MEMORY_ALL_TYPES


def join_like_sglang(master_address: str, master_port: int, rank: int, world_size: int, group_name: str, backend: str):
    """What SGLang's ModelRunner.init_weights_update_group does (sglang.srt.utils.init_custom_process_group)."""
    timeout = datetime.timedelta(seconds=60)
    store, rank, world = next(rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(
        world, rank, [], dist.Backend(backend), store, group_name=group_name, backend_options=None, timeout=timeout
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world)}
    return pg


class Scheduler:
    def __init__(self) -> None:
        self.model = Tiny()
        self.lock = threading.Lock()  # held for a batch, and for a control call between batches
        self.paused = False
        self.busy = False
        self.forwards = 0
        self.offloaded: set[str] = set()  # SGLang's offload_tags
        self.running = 0  # /generate requests in progress
        self.generate_s = 0.0  # how long each /generate takes (POST /slow)
        self.calls: list[dict] = []
        self.faults: dict[str, dict] = {}
        self.groups: dict[str, object] = {}
        threading.Thread(target=self._run, daemon=True).start()

    def release(self, tags: list[str] | None) -> tuple[dict, int]:
        if self.running:
            return {"error": "release_memory_occupation should be called only when no ongoing request."}, 500
        tags = list(tags or MEMORY_TAGS)
        self.offloaded.update(tags)
        if "weights" in tags:
            with self.lock, torch.no_grad():
                for t in self.model.parameters():
                    t.fill_(float("nan"))
        return None, 200

    def resume(self, tags: list[str] | None) -> tuple[dict, int]:
        tags = list(tags or MEMORY_TAGS)
        missing = [t for t in tags if t not in self.offloaded]
        if missing:  # SGLang: KeyError in offload_tags.remove, the scheduler dies
            return {"error": f"KeyError: {missing[0]!r}"}, 500
        self.offloaded.difference_update(tags)
        return None, 200

    def generate(self, body: dict) -> tuple[object, int]:
        if self.offloaded:
            return {"error": f"memory released: {sorted(self.offloaded)}"}, 503
        self.running += 1
        try:
            time.sleep(self.generate_s)
            sp = body["sampling_params"]
            sps = sp if isinstance(sp, list) else [sp] * int(sp.get("n", 1))
            with self.lock:
                total = float(self.model.qkv.sum() + self.model.norm.sum())
            if total != total:  # NaN: the weights' pages hold nothing
                return {"error": "generated from released weights"}, 500
            token = int(abs(total) * 1000) % 997
            outs = [
                {
                    "output_ids": [token + i for i in range(p["max_new_tokens"])],
                    "meta_info": {
                        "output_token_logprobs": [[-0.5, token + i, None] for i in range(p["max_new_tokens"])],
                        "finish_reason": {"type": "length"},
                    },
                }
                for p in sps
            ]
            return (outs if len(outs) > 1 else outs[0]), 200
        finally:
            self.running -= 1

    def join(self, body: dict) -> dict:
        pg = join_like_sglang(
            body["master_address"],
            body["master_port"],
            body["rank_offset"],
            body["world_size"],
            body["group_name"],
            body.get("backend", "nccl"),
        )
        self.groups[body["group_name"]] = pg
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    def update_from_distributed(self, body: dict) -> tuple[dict, int]:
        if "weights" in self.offloaded:  # SGLang would write into unmapped pages
            return {"success": False, "message": "weights are released"}, 400
        if body.get("load_format") != "flattened_bucket":
            return {"success": False, "message": "the stand-in takes load_format='flattened_bucket' only"}, 400
        sizes = [nbytes(s, d) for s, d in zip(body["shapes"], body["dtypes"], strict=True)]
        buf = torch.empty(sum(sizes), dtype=torch.uint8)
        dist.broadcast(buf, src=0, group=self.groups[body["group_name"]])
        pairs = [
            (n, part.view(torch_dtype(d)).view(s))
            for n, s, d, part in zip(body["names"], body["shapes"], body["dtypes"], buf.split(sizes), strict=True)
        ]
        with self.lock:
            self.model.load_weights(pairs)
        return {"success": True, "message": "Succeeded to update parameter online."}, 200

    def fault(self, path: str) -> dict | None:
        f = self.faults.get(path)
        if f is None:
            return None
        f["times"] -= 1
        if f["times"] <= 0:
            del self.faults[path]
        return f

    def _run(self) -> None:
        while True:
            with self.lock:
                if self.busy and not self.paused:
                    self.model.forward(torch.zeros(()))
                    self.forwards += 1
            time.sleep(0.005)

    def update_from_tensor(self, body: dict) -> dict:
        named = decode_payload(body["serialized_named_tensors"][0])
        if body.get("load_format") != loader.LOADER:
            return {"success": False, "message": f"Unknown load_format={body.get('load_format')}"}
        with self.lock:
            loader.fleetrl_loader(self.model, [(n, t.to("cpu")) for n, t in named])
        return {"success": True, "message": "Success"}

    def state(self) -> dict:
        return {
            "paused": self.paused,
            "forwards": self.forwards,
            "tensors": {k: v.tolist() for k, v in self.model.state_dict().items()},
        }


def _handler(sched: Scheduler):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, fmt, *args):
            pass

        def _reply(self, obj: dict, code: int = 200) -> None:
            body = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path == "/health":
                return self._reply({})
            if self.path == "/state":
                return self._reply(sched.state())
            if self.path == "/calls":
                return self._reply(sched.calls)
            self._reply({"error": self.path}, 404)

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            if self.path in ("/fail", "/slow"):
                if self.path == "/slow":
                    sched.generate_s = float(body["generate_s"])
                else:
                    sched.faults[body["path"]] = {
                        "status": body.get("status", 200),
                        "delay_s": body.get("delay_s", 0.0),
                        "times": body.get("times", 1),
                    }
                return self._reply({})
            sched.calls.append({"path": self.path, "tags": body.get("tags"), "t": time.monotonic()})
            f = sched.fault(self.path)
            if f is not None:
                time.sleep(f["delay_s"])
                if f["status"] != 200:
                    return self._reply({"error": {"message": f"injected failure of {self.path}"}}, f["status"])
            if self.path == "/release_memory_occupation":
                return self._reply(*sched.release(body.get("tags")))
            if self.path == "/resume_memory_occupation":
                return self._reply(*sched.resume(body.get("tags")))
            if self.path == "/generate":
                return self._reply(*sched.generate(body))
            if self.path == "/init_weights_update_group":
                return self._reply(sched.join(body))
            if self.path == "/update_weights_from_distributed":
                return self._reply(*sched.update_from_distributed(body))
            if self.path == "/pause_generation":
                if body.get("mode") not in ("in_place", "abort"):  # abort: its /generate has none to abort
                    return self._reply({"error": "the stand-in pauses in place or with abort only"}, 400)
                with sched.lock:  # after the batch in progress
                    sched.paused = True
                return self._reply({})
            if self.path == "/continue_generation":
                sched.paused = False
                return self._reply({})
            if self.path == "/busy":
                sched.busy = bool(body["busy"])
                return self._reply({})
            if self.path == "/update_weights_from_tensor":
                if not sched.paused:  # SGLang would wait for every running request under its writer lock
                    return self._reply({"success": False, "message": "not paused"}, 400)
                out = sched.update_from_tensor(body)
                return self._reply(out, 200 if out["success"] else 400)
            self._reply({"error": self.path}, 404)

    return Handler


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    server = ThreadingHTTPServer(("127.0.0.1", args.port), _handler(Scheduler()))
    server.daemon_threads = True
    server.serve_forever()


if __name__ == "__main__":
    main()
