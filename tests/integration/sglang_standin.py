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

What runs inside is real: a torch model, fleetrl's loader (``weight_sync.sglang_ext``), its group
(gloo) and store. ``/state`` reports the pause flag, forwards run, and the model's tensors.

    python tests/integration/sglang_standin.py --port N
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import pickle
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from weight_sync import sglang_ext

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
    return {"q": torch.randn(4, 8, generator=g), "k": torch.randn(4, 8, generator=g),
            "v": torch.randn(4, 8, generator=g), "norm": torch.randn(8, generator=g)}


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


class Scheduler:
    def __init__(self) -> None:
        self.model = Tiny()
        self.lock = threading.Lock()  # held for a batch, and for a control call between batches
        self.paused = False
        self.busy = False
        self.forwards = 0
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            with self.lock:
                if self.busy and not self.paused:
                    self.model.forward(torch.zeros(()))
                    self.forwards += 1
            time.sleep(0.005)

    def update_from_tensor(self, body: dict) -> dict:
        named = decode_payload(body["serialized_named_tensors"][0])
        if body.get("load_format") != sglang_ext.LOADER:
            return {"success": False, "message": f"Unknown load_format={body.get('load_format')}"}
        with self.lock:
            sglang_ext.fleetrl_loader(self.model, [(n, t.to("cpu")) for n, t in named])
        return {"success": True, "message": "Success"}

    def state(self) -> dict:
        return {"paused": self.paused, "forwards": self.forwards,
                "tensors": {k: v.tolist() for k, v in self.model.state_dict().items()}}


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
            self._reply({"error": self.path}, 404)

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            if self.path == "/pause_generation":
                if body.get("mode") != "in_place":
                    return self._reply({"error": "the stand-in pauses in place only"}, 400)
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
