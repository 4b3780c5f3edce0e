"""The control endpoint of a running job: ``status``, ``scale`` and ``stop`` from another terminal.

The driver binds a ZMQ REP socket on the job's host (``network.host``: loopback on one host; a free
port) and writes its address to ``<run_dir>/control.json``; off loopback the socket is a CurveZMQ
server (keys in ``<run_dir>/curve``, named in the file) and a client without the keys is refused; ``launch/cluster.py status|scale --run-dir DIR`` reads the
file and sends one typed request. The file is removed at shutdown, so a stale file
from a crashed run is detected by the pid it carries.

Wire: msgspec JSON, :class:`ControlRequest` in, a JSON object out (``ok`` plus the
answer, or ``ok: false`` and ``error``). No pickle.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, Literal

import msgspec
import zmq

from core.network import curve_client, curve_server

CONTROL_FILE = "control.json"


class ControlError(RuntimeError):
    """The job could not be reached or refused the request; the message says why."""


class ControlRequest(msgspec.Struct, forbid_unknown_fields=True):
    op: Literal["status", "scale", "stop"]
    rollout_gpus: int | None = None


_decoder = msgspec.json.Decoder(ControlRequest)


class ControlServer:
    """Non-blocking REP socket polled from the driver's monitor loop."""

    def __init__(
        self,
        run_dir: Path,
        handler: Callable[[ControlRequest], dict[str, Any]],
        *,
        host: str = "127.0.0.1",
        curve_keys_dir: str | None = None,
    ) -> None:
        # A context of its own: a CurveZMQ authenticator binds the context's one ZAP endpoint, so two servers
        # (or a server closed while its authenticator's socket still lingers) must not share a context.
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._auth = curve_server(self._sock, curve_keys_dir, self._ctx) if curve_keys_dir else None
        port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self.path = Path(run_dir) / CONTROL_FILE
        self.path.write_text(
            json.dumps({"address": self.address, "pid": os.getpid(), "curve_keys_dir": curve_keys_dir})
        )
        self._handler = handler

    def poll(self, timeout_ms: int = 0) -> bool:
        """Answer at most one pending request; True if one was answered."""
        if not self._sock.poll(timeout_ms, zmq.POLLIN):
            return False
        raw = self._sock.recv()
        try:
            req = _decoder.decode(raw)
            answer = {"ok": True, **self._handler(req)}
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            answer = {"ok": False, "error": f"bad control request: {exc}"}
        except Exception as exc:  # the job keeps running; the caller sees why it failed
            answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        self._sock.send(msgspec.json.encode(answer))
        return True

    def close(self) -> None:
        self._sock.close(0)
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()  # every socket of this context is closed: returns at once
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass


def request(run_dir: Path, body: dict[str, Any], *, timeout_s: float = 10.0) -> dict[str, Any]:
    """Send one control request to the job running in ``run_dir``."""
    path = Path(run_dir) / CONTROL_FILE
    if not path.exists():
        raise ControlError(f"no running job in {run_dir} ({path} does not exist)")
    info = json.loads(path.read_text())
    try:
        os.kill(int(info["pid"]), 0)
    except ProcessLookupError:
        raise ControlError(f"the job in {run_dir} (pid {info['pid']}) is not running; {path} is stale") from None
    except PermissionError:
        pass
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    curve_client(sock, info.get("curve_keys_dir"))
    try:
        sock.connect(info["address"])
        sock.send(msgspec.json.encode(body))
        if not sock.poll(int(timeout_s * 1000), zmq.POLLIN):
            raise ControlError(f"job at {info['address']} did not answer '{body.get('op')}' within {timeout_s:.0f} s")
        return json.loads(sock.recv())
    finally:
        sock.close(0)
