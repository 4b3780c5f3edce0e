"""Shared asynchronous mode (``colocate.mode: async``, ``launch/cluster.py --gpus N --async``): the checks.

Engines and learner are resident on the same devices at once (no sleep); the fleet generates for steps
s+1..s+k while the learner trains step s, under the broker's staleness bound k >= 1; each publish goes
in place (CUDA IPC when every server is on learner rank 0's GPU, gloo on the host otherwise). Placement
is colocated mode's (launch/colocated_placement.py: learner rank i and server i on GPU i); what differs is here:

* :func:`check_shared_async`: the config combinations the mode refuses, by name (launch/config.py);
* :func:`gpu_split` / :func:`host_split`: the memory split, checked before the learner starts
  (core/shared_gpu.py's pure check, fed with the device's total from nvidia-smi, or the host's RAM on CPU).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess

from core.shared_gpu import GiB, ModelShape, check_memory_split, learner_memory, model_shape

log = logging.getLogger(__name__)


def check_shared_async(cfg) -> None:
    """Refuse what shared async mode cannot run, each problem named with its value."""
    bad = []
    k = cfg.broker.max_staleness
    if k < 1:
        bad.append(
            f"broker.max_staleness={k} (shared async overlaps generation of steps s+1..s+k with training "
            "step s: k >= 1; for k = 0 use colocate.mode=sync, where the engines sleep instead of idling)"
        )
    if cfg.rollout.engine != "vllm":
        bad.append(f"rollout.engine={cfg.rollout.engine!r} (shared async mode is wired for vLLM servers only)")
    if cfg.colocate.sleep in ("level1", "level2"):
        bad.append(
            f"colocate.sleep={cfg.colocate.sleep!r} (in shared async mode the engines never sleep: 'auto' or 'off')"
        )
    if cfg.weight_sync.staging:
        bad.append("weight_sync.staging=true (the in-place publish, CUDA IPC or gloo, loads straight into the engine)")
    if cfg.weight_sync.backend == "nccl":
        bad.append(
            "weight_sync.backend='nccl' (NCCL between two processes on one GPU fails; the publish goes by "
            "CUDA IPC or gloo: colocate.weight_transport)"
        )
    if cfg.learner.engine != "fsdp":
        bad.append(f"learner.engine={cfg.learner.engine!r} (shared async mode runs the FSDP learner)")
    if bad:
        raise ValueError("colocate.mode=async does not fit " + "; ".join(bad))


def learner_bytes(cfg, shape: ModelShape, world_size: int, on_gpu: bool) -> int:
    """One device's share of the learner: stated (colocate.learner_memory_gb) or estimated."""
    if cfg.colocate.learner_memory_gb is not None:
        return int(cfg.colocate.learner_memory_gb * GiB)
    lc = cfg.learner
    return learner_memory(
        shape,
        world_size=world_size,
        micro_batch_tokens=lc.micro_batch_tokens,
        activation_checkpointing=lc.activation_checkpointing,
        chunked_logprobs=lc.logprobs != "full",
        logprob_chunk=lc.logprob_chunk,
        reference_on_device=on_gpu and lc.loss.kl_coef > 0 and not lc.reference_offload,
        offload=on_gpu and (lc.param_offload or lc.optimizer_offload),
    ).total


def gpu_memory_totals(ids: list[str]) -> list[int] | None:
    """Total memory (bytes) of each physical GPU id, from nvidia-smi (no CUDA context: this process
    would otherwise hold memory on the GPU it measures); None without nvidia-smi."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    out = []
    for g in ids:
        r = subprocess.run(
            [smi, "--query-gpu=memory.total", "--format=csv,noheader,nounits", "-i", str(g)],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        out.append(int(float(r.stdout.strip().splitlines()[0])) * (1 << 20))  # MiB
    return out


def gpu_split(cfg, gpus: list[tuple[str, int | None]]) -> list[dict]:
    """Check every shared GPU (``(name, total bytes)``): the engine's fraction plus one learner rank. A GPU
    whose total is unknown (None: no nvidia-smi on its node) is recorded as skipped, with the reason."""
    why = "nvidia-smi not found on the GPU's node: the device's total memory is unknown"
    skipped = [{"device": name, "skipped": why} for name, total in gpus if total is None]
    if skipped:
        log.warning("shared async memory split NOT checked on %s: %s", [s["device"] for s in skipped], why)
    known = [(name, total) for name, total in gpus if total is not None]
    if not known:
        return skipped
    shape = model_shape(cfg.model.path)
    need = learner_bytes(cfg, shape, world_size=len(gpus), on_gpu=True)
    rm = cfg.reward.model  # a colocated reward server reserves its own fraction of the same GPU
    engines = cfg.rollout.gpu_memory_utilization + (
        rm.server.gpu_memory_utilization if rm is not None and rm.server.colocated else 0.0
    )
    splits = [
        check_memory_split(
            device=name,
            total_bytes=total,
            engine_fraction=min(1.0, engines),
            learner_bytes=need,
            headroom=cfg.colocate.memory_headroom,
        ).describe()
        for name, total in known
    ]
    for s in splits:
        log.info(
            "shared async memory split on %s: engine %.2f, learner %.2f GiB (%.2f), headroom %.2f",
            s["device"],
            s["engine_fraction"],
            s["learner_bytes"] / GiB,
            s["learner_fraction"],
            s["headroom"],
        )
    return skipped + splits


def host_total_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def host_split(cfg, total_bytes: int | None = None, kvcache_gb: int = 1) -> list[dict]:
    """CPU: servers and learner ranks share the host's RAM. The engine's share is its KV cache
    (VLLM_CPU_KVCACHE_SPACE: ``kvcache_gb``, the server default), its weights and a process's
    overhead, per server; the learner's is every gloo rank's estimate."""
    total = total_bytes if total_bytes is not None else host_total_bytes()
    shape = model_shape(cfg.model.path)
    wbytes = 2 if cfg.model.dtype in ("bfloat16", "float16") else 4
    servers = len(cfg.rollout.urls) or cfg.rollout.servers
    engine = servers * (kvcache_gb * GiB + wbytes * shape.params + GiB)
    ranks = cfg.learner.cpu_processes
    need = ranks * learner_bytes(cfg, shape, world_size=ranks, on_gpu=False)
    split = check_memory_split(
        device="host (CPU)",
        total_bytes=total,
        engine_fraction=min(1.0, engine / total),
        learner_bytes=need,
        headroom=cfg.colocate.memory_headroom,
    ).describe()
    log.info(
        "shared async memory split on the host: engines %.2f, learner %.2f GiB (%.2f)",
        split["engine_fraction"],
        need / GiB,
        split["learner_fraction"],
    )
    return [split]
