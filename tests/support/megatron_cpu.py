"""One learner rank of megatron-core on CPU (gloo), for the Megatron tests that run without a GPU.

megatron-core assumes CUDA in three places on the engine's path: DDP allocates its gradient buffers on
``torch.cuda.current_device()`` (pointed at the CPU here), every Megatron optimizer allocates flags with
``device='cuda'`` at construction (none is built: these tests take no optimizer step, they compare what DDP
leaves in ``main_grad``), and its core attention forks the CUDA RNG for dropout (0 here: a no-op fork).
Model, DDP and the engine's head code run as they are.
"""

from __future__ import annotations

import contextlib
import os


def join_cpu_rank(rank: int, world: int, port: int) -> None:
    """Set this process up as rank ``rank`` of ``world`` (gloo on 127.0.0.1:``port``) with the CPU patches."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    import megatron.core.optimizer as mopt
    import torch
    from megatron.core import tensor_parallel

    from learner.run import init_distributed

    torch.cuda.current_device = lambda: "cpu"
    mopt.get_megatron_optimizer = lambda *_a, **_k: None
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *_a, **_k: contextlib.nullcontext()
    init_distributed("gloo", timeout_s=60)
