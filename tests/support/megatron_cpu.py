"""One learner rank of megatron-core on CPU (gloo), for the Megatron tests that run without a GPU.

megatron-core assumes CUDA in three places on the engine's path: DDP allocates its gradient buffers on
``torch.cuda.current_device()`` (pointed at the CPU here), every Megatron optimizer allocates flags with
``device='cuda'`` at construction (none is built: these tests take no optimizer step, they compare what DDP
leaves in ``main_grad``), and its core attention forks the CUDA RNG for dropout (0 here: a no-op fork).
Model, DDP and the engine's head code run as they are.

``join_cpu_rank(..., optimizer=True)`` goes further, for the tests that take optimizer steps and checkpoint:
it keeps Megatron's optimizer and lets it build on CPU by redirecting ``device='cuda'`` allocations to the
CPU, answering ``Tensor.type()`` with the ``torch.cuda.*`` names its distributed optimizer checks parameters
against, and making the CUDA stream calls of its gradient buffers no-ops (one stream: nothing to order).
Those are process-wide patches of torch, for a test's own rank processes only.
"""

from __future__ import annotations

import contextlib
import os


def join_cpu_rank(rank: int, world: int, port: int, optimizer: bool = False) -> None:
    """Set this process up as rank ``rank`` of ``world`` (gloo on 127.0.0.1:``port``) with the CPU patches;
    ``optimizer``: Megatron's optimizer is built (on CPU) rather than skipped."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    import megatron.core.optimizer as mopt
    import torch
    from megatron.core import tensor_parallel

    from learner.run import init_distributed

    torch.cuda.current_device = lambda: "cpu"
    if optimizer:
        _optimizer_on_cpu(torch)
    else:
        mopt.get_megatron_optimizer = lambda *_a, **_k: None
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *_a, **_k: contextlib.nullcontext()
    init_distributed("gloo", timeout_s=60)


def _optimizer_on_cpu(torch) -> None:
    import types

    for name in ("tensor", "zeros", "ones", "empty", "full", "zeros_like", "empty_like", "arange"):
        make = getattr(torch, name)

        def on_cpu(*args, _make=make, **kwargs):
            if str(kwargs.get("device", "")).startswith("cuda"):
                kwargs["device"] = "cpu"
            return _make(*args, **kwargs)

        setattr(torch, name, on_cpu)
    tensor_type = torch.Tensor.type

    def cuda_type_name(self, *args, **kwargs):
        name = tensor_type(self, *args, **kwargs)
        if args or kwargs or not isinstance(name, str) or name.startswith("torch.cuda."):
            return name
        return "torch.cuda." + name.removeprefix("torch.")

    torch.Tensor.type = cuda_type_name
    stream = types.SimpleNamespace(wait_event=lambda *_a: None, wait_stream=lambda *_a: None, synchronize=lambda: None)
    torch.cuda.current_stream = lambda *_a, **_k: stream
    torch.cuda.synchronize = lambda *_a, **_k: None
    torch.cuda.stream = lambda *_a, **_k: contextlib.nullcontext()
