"""Checkpoint and resume of the Megatron engine with Megatron's distributed checkpointing.

A checkpoint folder holds the same completion marker and RNG files as the FSDP engine's
(learner/checkpoint.py), so ``learner.checkpoint.latest`` and the loop's resume logic apply unchanged:

* ``mcore/``: ``megatron.core.dist_checkpointing`` of ``{"model": GPTModel.sharded_state_dict(),
  "optimizer": optimizer.sharded_state_dict(...)}`` (every rank writes its shards; Megatron can
  reshard it on load);
* ``meta.json``: extra (policy version, data position), the LR schedule position, TP/PP/world size,
  written by rank 0 last;
* ``rng/rank{r}.pt``: torch, CUDA and Megatron's tensor-parallel RNG tracker states.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from learner.checkpoint import META

logger = logging.getLogger(__name__)


# megatron-core 0.19's default layout for the distributed optimizer ('fully_sharded_model_space',
# deprecated) builds ShardedTensors with flattened_range, which its own dist_checkpointing then
# rejects (seen on 2 H200s, DP=2). 'dp_reshardable' saves each rank's buffers in parallel and
# reshards along DP only, which is what a resumed learner of the same TP x PP needs.
_OPTIM_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


def prime_optimizer_state(optimizer) -> None:
    """Give a fresh Megatron optimizer zero Adam states at step 0 before a checkpoint is loaded into it.

    megatron-core 0.19's distributed optimizer builds the state dict it loads into from ``state_dict()``, which,
    with torch's Adam (no Apex or TransformerEngine, as on the GPU machine), reads every parameter state's
    ``step`` and asserts there is exactly one value; a process that has not stepped yet has no states, and
    the resume failed there (``assert len(steps) == 1``, first seen in tests/gpu/test_megatron_critic_gpu.py;
    the engine's own resume test loads into an engine that had stepped). The zeros are overwritten by the
    load. A no-op for an optimizer that already has state."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if inner is None or len(inner.state) > 0:
            continue
        init = getattr(opt, "init_state_fn", None)
        if init is not None:
            init(inner, getattr(opt, "config", None))
        for group in inner.param_groups:
            for p in group["params"]:
                inner.state[p].setdefault("step", torch.tensor(0.0, dtype=torch.float32))


def _inner_optimizers(optimizer) -> list:
    return [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer]) if getattr(o, "optimizer", None)]


def adam_steps(optimizer) -> list[float | None]:
    """Each inner optimizer's step count (torch's Adam keeps it in every parameter's state, Apex's and
    TransformerEngine's in the parameter groups); None for one that has not stepped."""
    out: list[float | None] = []
    for inner in _inner_optimizers(optimizer):
        steps = {float(st["step"]) for st in inner.state.values() if "step" in st}
        steps = steps or {float(g["step"]) for g in inner.param_groups if "step" in g}
        if len(steps) > 1:
            raise RuntimeError(f"the optimizer's parameters disagree on their step count: {sorted(steps)}")
        out.append(steps.pop() if steps else None)
    return out


def restore_adam_steps(optimizer, steps: list[float | None]) -> None:
    """Set the step counts :func:`adam_steps` recorded at save time, after a load.

    megatron-core 0.19.2's ``dp_reshardable`` load restores the Adam moments and main weights but not torch's
    per-parameter ``step``: the parameter-state copy writes back the value the optimizer held before the load
    (0 in a fresh process), so the bias correction of the first update after a resume was that of step 1
    (found by a CPU run of actor + critic, resumed in a fresh process: every moment equal, every step 0)."""
    inners = _inner_optimizers(optimizer)
    if len(steps) != len(inners):
        raise ValueError(f"checkpoint has step counts for {len(steps)} optimizers, this learner has {len(inners)}")
    for inner, step in zip(inners, steps, strict=True):
        if step is None:
            continue
        for st in inner.state.values():
            if "step" in st:
                st["step"] = torch.tensor(step, dtype=torch.float32, device=st["step"].device)
        for g in inner.param_groups:
            if "step" in g:
                g["step"] = type(g["step"])(step)


def _sharded(model_sd: dict, optimizer, is_loading: bool) -> dict:
    return {
        "model": model_sd,
        "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=_OPTIM_METADATA),
    }


def save_model_and_optimizer(model_sd: dict, optimizer, folder: Path) -> None:
    """Collective: a model's sharded state (``model_sd``) and its optimizer's, as Megatron's distributed
    checkpoint in ``folder`` (the actor's ``mcore/``, the critic's ``critic/mcore/``)."""
    from megatron.core import dist_checkpointing

    from learner.megatron import patches

    patches.apply()  # no multiprocessing.Manager server per rank (see patches.py)
    dist_checkpointing.save(_sharded(model_sd, optimizer, is_loading=False), str(folder))


def load_model_and_optimizer(gpt, model_sd: dict, optimizer, folder: Path, steps: list[float | None] | None) -> None:
    """Collective: what :func:`save_model_and_optimizer` wrote in ``folder``, into ``gpt`` (``model_sd`` its
    sharded state) and ``optimizer``; ``steps``: the Adam step counts saved beside it (:func:`adam_steps`; None
    for a checkpoint from before they were saved: warned, not restored)."""
    from megatron.core import dist_checkpointing

    prime_optimizer_state(optimizer)
    loaded = dist_checkpointing.load(_sharded(model_sd, optimizer, is_loading=True), str(folder))
    # No autograd while copying into parameters and optimizer state (megatron-core's dp_reshardable load
    # copies into views of fp32 parameters that require grad, which autograd refuses outside no_grad).
    with torch.no_grad():
        gpt.load_state_dict(loaded["model"], strict=False)
        optimizer.load_state_dict(loaded["optimizer"])
    if steps is None:
        logger.warning("%s predates saved Adam step counts: the optimizer's step count is not restored", folder)
    else:
        restore_adam_steps(optimizer, steps)


def _rng(engine) -> dict:
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if engine.device.type == "cuda":
        from megatron.core import tensor_parallel

        state["cuda"] = torch.cuda.get_rng_state()
        state["tracker"] = tensor_parallel.get_cuda_rng_tracker().get_states()
    return state


def save(engine, path: Path, extra: dict[str, Any]) -> None:
    """Collective: every rank writes its shards; rank 0 writes ``meta.json`` after all are on disk."""
    if engine.rank == 0:
        (path / "mcore").mkdir(parents=True, exist_ok=True)
        (path / "rng").mkdir(exist_ok=True)
    dist.barrier()
    save_model_and_optimizer(engine.gpt.sharded_state_dict(), engine.optimizer, path / "mcore")
    torch.save(_rng(engine), path / "rng" / f"rank{engine.rank}.pt")
    dist.barrier()
    if engine.rank == 0:
        meta = {
            "extra": extra,
            "steps_taken": engine.steps_taken,
            "adam_steps": adam_steps(engine.optimizer),
            "world_size": engine.world_size,
            "tp": engine.tp,
            "pp": engine.pp,
            "engine": "megatron",
        }
        tmp = path / (META + ".tmp")
        tmp.write_text(json.dumps(meta, indent=1))
        tmp.rename(path / META)
        logger.info("Megatron checkpoint saved: %s", path)
    dist.barrier()


def load(engine, path: Path) -> dict[str, Any]:
    """Collective: restore model, optimizer (incl. fp32 main weights), schedule position and RNG."""
    meta_path = path / META
    if not meta_path.exists():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {META}); it was interrupted while saving")
    meta = json.loads(meta_path.read_text())
    if meta.get("engine") != "megatron":
        raise ValueError(
            f"{path} was written by learner.engine={meta.get('engine', 'fsdp')!r}, not megatron; "
            "FSDP and Megatron checkpoints are not interchangeable (start from its HF export)"
        )
    load_model_and_optimizer(
        engine.gpt, engine.gpt.sharded_state_dict(), engine.optimizer, path / "mcore", meta.get("adam_steps")
    )
    engine.steps_taken = int(meta["steps_taken"])
    rng_file = path / "rng" / f"rank{engine.rank}.pt"
    same_layout = (meta["world_size"], meta["tp"], meta["pp"]) == (engine.world_size, engine.tp, engine.pp)
    if same_layout and rng_file.exists():
        rng = torch.load(rng_file, weights_only=False)
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and engine.device.type == "cuda":
            from megatron.core import tensor_parallel

            torch.cuda.set_rng_state(rng["cuda"])
            tensor_parallel.get_cuda_rng_tracker().set_states(rng["tracker"])
    else:
        logger.warning(
            "checkpoint %s has another layout (world %s tp %s pp %s): RNG states not restored",
            path,
            meta["world_size"],
            meta["tp"],
            meta["pp"],
        )
    logger.info("Megatron checkpoint loaded: %s (version %s)", path, meta["extra"].get("version"))
    return meta["extra"]
