"""The SGLang server process: ``python -m sglang.launch_server`` on given GPUs, its version check and flags.

The clients are :class:`engines.sglang.generation.SGLangGenerationClient` (generation) and
:class:`engines.sglang.weights.SGLangWeightClient` (weights);
:meth:`SGLangServer.generation_client` and :meth:`SGLangServer.weight_client` hand them out. The server runs with ``--skip-tokenizer-init``
(token ids in and out), ``NCCL_CUMEM_ENABLE=0`` (every process of a weight-sync group must agree
on it) and fleetrl's loader as ``--custom-weight-loader`` (staged updates,
:mod:`engines.sglang.loader`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import httpx
from packaging.version import Version

from core.engine_auth import auth_headers, engine_token
from engines.base import EngineError
from weight_sync.config import NCCL_ENV

log = logging.getLogger(__name__)

SGLANG_MIN = Version("0.5.16")  # first release built for torch 2.11; has pause modes and flattened buckets
SGLANG_MAX_TESTED = Version("0.5.23")


def check_sglang_version(version: str) -> Version:
    """Raise a ValueError naming the supported range unless ``version`` is in it."""
    v = Version(version)
    if v < SGLANG_MIN or v.release[:2] != SGLANG_MIN.release[:2]:
        raise ValueError(
            f"sglang {version} is not supported: fleetrl needs sglang >= {SGLANG_MIN}, < 0.6 "
            f"(tested {SGLANG_MIN} with torch 2.11 and the API of {SGLANG_MAX_TESTED}). It relies on "
            "/pause_generation modes, /update_weights_from_distributed with load_format='flattened_bucket' "
            "and input_ids in /generate; install e.g. `pip install sglang==0.5.16` for torch 2.11."
        )
    if v > SGLANG_MAX_TESTED:
        log.warning("sglang %s is newer than the newest version fleetrl was tested with (%s)", v, SGLANG_MAX_TESTED)
    return v


def installed_sglang_version(python: str = sys.executable) -> str:
    """sglang's version in ``python``'s environment, without importing sglang (seconds) there."""
    code = "import importlib.metadata as m; print(m.version('sglang'))"
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        raise EngineError(f"{python} did not report sglang's version within 60s") from None
    if out.returncode != 0:
        raise EngineError(
            f"sglang is not installed for {python}: install sglang>={SGLANG_MIN} "
            f"(`pip install fleetrl[sglang]`); {out.stderr.strip().splitlines()[-1:]}"
        )
    return out.stdout.strip()


@dataclass(kw_only=True, slots=True)
class SGLangServerArgs:
    """How to start one SGLang server. ``gpus`` are physical ids (CUDA_VISIBLE_DEVICES)."""

    model: str
    gpus: list[int]
    port: int
    host: str = "127.0.0.1"
    tensor_parallel_size: int = 1
    mem_fraction_static: float = 0.85
    max_running_requests: int = 256
    dtype: str = "bfloat16"
    seed: int = 0
    radix_cache: bool = True  # off for in-flight ('keep') updates: see SGLangHandle.pause
    python: str = sys.executable
    # SGLang 0.5.16 on H200 died on its first forward without these; see compat_args.
    compat: bool = True
    fleetrl_loader: bool = True  # --custom-weight-loader for staged updates; the server's python must import fleetrl
    skip_tokenizer_init: bool = True  # token ids in and out (the fleet); False: text APIs too (a judge's chat)
    # --enable-memory-saver: weights and KV cache allocated through torch_memory_saver, so that
    # /release_memory_occupation frees them (colocated mode); without it a release succeeds and frees nothing
    memory_saver: bool = False
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    log_path: str | None = None

    def __post_init__(self) -> None:
        if len(self.gpus) != self.tensor_parallel_size:
            raise ValueError(
                f"SGLang server with tensor_parallel_size={self.tensor_parallel_size} "
                f"needs that many GPUs, got gpus={self.gpus}"
            )


def compat_args(version: Version) -> list[str]:
    """Serving flags a given SGLang needs on H200.

    0.5.16: the combination seen to serve (its scheduler died on the first forward with fa3,
    and with triton + no CUDA graph, until both flags were added). Which flag matters is what
    bench/sglang_flags.py measures; it has not run yet, so all are kept.
    """
    if version < Version("0.5.17"):
        return [
            "--disable-overlap-schedule",
            "--skip-server-warmup",
            "--attention-backend",
            "triton",
            "--sampling-backend",
            "pytorch",
            "--disable-cuda-graph",
        ]
    return []


class SGLangServer:
    """One SGLang server process. Example::

    server = SGLangServer(SGLangServerArgs(model="models/qwen", gpus=[1], port=30000))
    await server.start(timeout_s=600)
    client = server.generation_client("sglang-0")
    ...
    server.stop()
    """

    def __init__(self, args: SGLangServerArgs) -> None:
        self.args = args
        self.proc: subprocess.Popen | None = None
        self.version: Version | None = None
        self._log: IO[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.args.host}:{self.args.port}"

    def command(self, version: Version) -> list[str]:
        a = self.args
        cmd = [
            a.python,
            "-m",
            "sglang.launch_server",
            "--model-path",
            a.model,
            "--host",
            a.host,
            "--port",
            str(a.port),
            "--tp-size",
            str(a.tensor_parallel_size),
            "--dtype",
            a.dtype,
            "--mem-fraction-static",
            str(a.mem_fraction_static),
            "--max-running-requests",
            str(a.max_running_requests),
            "--random-seed",
            str(a.seed),
        ]
        if a.skip_tokenizer_init:
            cmd.append("--skip-tokenizer-init")
        if a.fleetrl_loader:  # staged updates (engines/sglang/loader.py); unused otherwise
            from engines.sglang.loader import LOADER

            cmd += ["--custom-weight-loader", LOADER]
        if not a.radix_cache:
            cmd.append("--disable-radix-cache")
        if a.memory_saver:
            cmd.append("--enable-memory-saver")
        if a.compat:
            cmd += compat_args(version)
        if token := engine_token({**os.environ, **a.env}):  # SGLang takes its key on the command line only
            cmd += ["--api-key", token]
        return cmd + list(a.extra_args)

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in self.args.gpus)
        for k, v in NCCL_ENV.items():
            env.setdefault(k, v)
        env.update(self.args.env)
        # SGLang's sampler reports log(softmax(logits / T)) (after temperature, before top-k/top-p, which
        # training refuses): the distribution sampled from, what the learner scores. This switch would make it
        # report the pre-temperature log-probs instead; an inherited setting must not change the meaning.
        if env.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "").lower() in ("1", "true", "yes"):
            log.warning(
                "ignoring SGLANG_RETURN_ORIGINAL_LOGPROB=%s: behaviour log-probs must be post-temperature",
                env["SGLANG_RETURN_ORIGINAL_LOGPROB"],
            )
        env["SGLANG_RETURN_ORIGINAL_LOGPROB"] = "false"
        return env

    async def start(self, timeout_s: float = 600.0) -> None:
        """Check the version, launch, and wait until ``/health`` answers (or raise with the log tail)."""
        self.version = check_sglang_version(await asyncio.to_thread(installed_sglang_version, self.args.python))
        cmd = self.command(self.version)
        log_path = Path(self.args.log_path or f"sglang-{self.args.port}.log")
        self._log = open(log_path, "ab")  # noqa: ASYNC230 (opening a log file does not block)
        log.info("starting sglang %s on GPUs %s: %s", self.version, self.args.gpus, " ".join(cmd))
        self.proc = subprocess.Popen(  # noqa: ASYNC220 (fork+exec, returns at once)
            cmd, env=self.environment(), stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )
        t0 = time.monotonic()
        async with httpx.AsyncClient(timeout=5.0, headers=auth_headers(engine_token(self.environment()))) as http:
            while time.monotonic() - t0 < timeout_s:
                if self.proc.poll() is not None:
                    raise EngineError(
                        f"sglang server on port {self.args.port} exited with {self.proc.returncode} "
                        f"during start; log tail:\n{_tail(log_path)}"
                    )
                try:
                    if (await http.get(self.url + "/health")).status_code == 200:
                        log.info("sglang on port %d healthy after %.0fs", self.args.port, time.monotonic() - t0)
                        return
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(1.0)
        self.stop()
        raise EngineError(
            f"sglang server on port {self.args.port} not healthy within {timeout_s:.0f}s; log tail:\n{_tail(log_path)}"
        )

    def generation_client(self, engine_id: str, **kw):
        """A :class:`engines.sglang.generation.SGLangGenerationClient` of this server."""
        from engines.sglang.generation import SGLangGenerationClient

        return SGLangGenerationClient(engine_id, self.url, radix_cache=self.args.radix_cache, **kw)

    def weight_client(self, engine_id: str, **kw):
        """A :class:`engines.sglang.weights.SGLangWeightClient` of this server."""
        from engines.sglang.weights import SGLangWeightClient

        return SGLangWeightClient(
            engine_id,
            self.url,
            tp_size=self.args.tensor_parallel_size,
            version=str(self.version) if self.version else None,
            radix_cache=self.args.radix_cache,
            **kw,
        )

    def stop(self, timeout_s: float = 30.0) -> None:
        """Terminate the server's process group (it forks schedulers and detokenizers)."""
        if self.proc is not None and self.proc.poll() is None:
            import signal

            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
            except ProcessLookupError:
                pass
        self.proc = None
        if self._log is not None:
            self._log.close()
            self._log = None


def _tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError as e:
        return f"(no log: {e})"
