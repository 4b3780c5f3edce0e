"""Run ``python -m broker`` as a child process: start, wait until it answers, stop.

Used by the launcher and the tests. Example::

    with BrokerProcess(spool_dir="/tmp/spool", max_staleness=1, groups_per_step=4) as bp:
        prod = ProducerClient(bp.address, producer_id="w0")   # real port, not 0
        ...
    # stopped: SIGTERM, then SIGKILL after stop_timeout_s
"""

from __future__ import annotations

import logging
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from broker.client import ping

log = logging.getLogger(__name__)


def _die_with_parent() -> None:
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _preexec(die_with_parent: bool, own_group: bool):
    def run() -> None:
        if own_group:
            os.setpgrp()
        if die_with_parent:
            _die_with_parent()

    return run


def make_curve_keys(directory: str | os.PathLike) -> Path:
    """server.key(_secret), client.key(_secret), and clients/client.key (the allowed list); secrets 0600."""
    from core.network import make_curve_keys as make

    return make(directory)


class BrokerProcess:
    def __init__(
        self,
        *,
        address: str = "tcp://127.0.0.1:0",
        startup_timeout_s: float = 30.0,
        stop_timeout_s: float = 10.0,
        env: dict | None = None,
        cwd: str | None = None,
        die_with_parent: bool = True,
        own_process_group: bool = True,
        **options,
    ) -> None:
        """``options`` are BrokerConfig fields (``spool_dir=..., max_staleness=...``).

        ``die_with_parent``: the broker gets SIGTERM when the process that started it dies
        (Linux), so a crashed test or launcher never leaves a broker behind. Linux ties this
        to the *thread* that called start(): start it from a long-lived thread, or pass False.

        ``own_process_group``: the broker leads a process group of its own, so a terminal's Ctrl-C
        (SIGINT to the foreground group) reaches only the process that started it, which stops it
        when it is done with it: a launcher's clean stop still needs the broker (the learner's last
        step acks, then checkpoints)."""
        self.die_with_parent = die_with_parent and sys.platform.startswith("linux")
        self.own_process_group = own_process_group
        self.requested_address = address
        self.options = options
        self.startup_timeout_s = startup_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.env = env
        self.cwd = cwd or str(Path(__file__).resolve().parent.parent)
        self.proc: subprocess.Popen | None = None
        self.address: str | None = None
        self.metrics_port: int | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self) -> "BrokerProcess":
        cmd = [sys.executable, "-m", "broker", "--address", self.requested_address]
        for k, v in self.options.items():
            if v is not None:
                cmd += ["--" + k.replace("_", "-"), str(v)]
        env = dict(os.environ if self.env is None else self.env)
        env["PYTHONPATH"] = self.cwd + os.pathsep + env.get("PYTHONPATH", "")
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            cwd=self.cwd,
            env=env,
            preexec_fn=_preexec(self.die_with_parent, self.own_process_group)
            if self.die_with_parent or self.own_process_group
            else None,
        )
        deadline = time.monotonic() + self.startup_timeout_s
        buf = b""  # raw reads: a buffered readline could hide a second line from select()
        assert self.proc.stdout is not None  # stdout=PIPE
        fd = self.proc.stdout.fileno()
        while self.address is None or ("metrics_port" in self.options and self.metrics_port is None):
            left = deadline - time.monotonic()
            if left <= 0 or self.proc.poll() is not None:
                self.kill()
                raise RuntimeError(
                    f"broker did not start within {self.startup_timeout_s:.0f}s "
                    f"(exit code {self.proc.returncode}); command: {' '.join(cmd)}"
                )
            ready, _, _ = select.select([fd], [], [], min(left, 0.5))
            if ready:
                buf += os.read(fd, 4096)
                for line in buf.decode(errors="replace").splitlines():
                    if line.startswith("BROKER_ADDRESS "):
                        self.address = line.split()[1]
                    elif line.startswith("BROKER_METRICS_PORT "):
                        self.metrics_port = int(line.split()[1])
        if not ping(
            self.address,
            timeout_s=max(1.0, deadline - time.monotonic()),
            curve_keys_dir=self.options.get("curve_keys_dir"),
        ):
            self.kill()
            raise RuntimeError(f"broker at {self.address} bound but does not answer")
        log.info("broker pid %d at %s", self.proc.pid, self.address)
        return self

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL after ``stop_timeout_s``; returns the exit code."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(self.stop_timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("broker pid %d ignored SIGTERM; killing", self.proc.pid)
            self.kill()
        self._close_pipe()
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL (the crash the spool must survive)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._close_pipe()

    def _close_pipe(self) -> None:
        if self.proc is not None and self.proc.stdout is not None and not self.proc.stdout.closed:
            self.proc.stdout.close()

    def __enter__(self) -> "BrokerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
