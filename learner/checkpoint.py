"""Sharded checkpoints (torch.distributed.checkpoint) with exact resume, and Hugging Face export.

A checkpoint folder holds:

* ``dcp/``: model and optimizer state, each rank writing its own shards
  (``torch.distributed.checkpoint``; it can be loaded by another world size);
* ``meta.json``: the policy version, the source's data position, the LR
  scheduler's state and the world size, written by rank 0 last, so a folder
  without it is an incomplete checkpoint and is never picked for resume;
* ``rng/rank{r}.pt``: each rank's torch (and CUDA) RNG state.

:func:`latest` finds the newest complete ``step_XXXXXXXX`` folder of a run.

An HF export is a plain folder (config.json, model.safetensors, the tokenizer
files copied from the source model) that ``AutoModelForCausalLM.from_pretrained``
and the inference engines load. The learner writes ``export/step_XXXXXXXX`` and
then swaps the symlink ``export/latest`` to it (:func:`publish_export`); each
export holds ``fleetrl_version.json`` with its policy version.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

logger = logging.getLogger(__name__)

META = "meta.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "generation_config.json",
)


def step_dir(root: Path, version: int) -> Path:
    return Path(root) / f"step_{version:08d}"


def latest(root: Path) -> Path | None:
    """The newest complete checkpoint under ``root`` (one with ``meta.json``), or None."""
    root = Path(root)
    if not root.is_dir():
        return None
    done = sorted(p for p in root.glob("step_*") if (p / META).exists())
    return done[-1] if done else None


def prune(root: Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` complete checkpoints (incomplete ones newer than those stay)."""
    done = sorted(p for p in Path(root).glob("step_*") if (p / META).exists())
    old = done[:-keep] if keep > 0 else done
    for p in old:
        shutil.rmtree(p, ignore_errors=True)
    return old


def _rng_state(device_is_cuda: bool) -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if device_is_cuda:
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _options(trained_only: bool) -> StateDictOptions | None:
    # LoRA: the frozen base is the model folder's; only the adapters (and their optimizer state) change. Not
    # strict, since the frozen keys are absent by design; dcp.load still fails on a trained key the files lack.
    return StateDictOptions(ignore_frozen_params=True, strict=False) if trained_only else None


def save(
    path: Path,
    model,
    optimizer,
    scheduler,
    extra: dict[str, Any],
    rank: int,
    world_size: int,
    trained_only: bool = False,
) -> None:
    """Collective: every rank writes its shards; rank 0 writes ``meta.json`` after all shards are on disk.
    ``trained_only``: the parameters that require grad only (LoRA adapters)."""
    path.mkdir(parents=True, exist_ok=True)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_options(trained_only))
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path / "dcp"))
    (path / "rng").mkdir(exist_ok=True)
    on_cuda = next(model.parameters()).device.type == "cuda"
    torch.save(_rng_state(on_cuda), path / "rng" / f"rank{rank}.pt")
    dist.barrier()
    if rank == 0:
        meta = {"extra": extra, "scheduler": scheduler.state_dict(), "world_size": world_size}
        tmp = path / (META + ".tmp")
        tmp.write_text(json.dumps(meta, indent=1))
        tmp.rename(path / META)
        logger.info("checkpoint saved: %s", path)
    dist.barrier()


def load(
    path: Path, model, optimizer, scheduler, rank: int, world_size: int, trained_only: bool = False
) -> dict[str, Any]:
    """Collective: restore model, optimizer, scheduler and RNG; returns the saved ``extra``."""
    meta_path = path / META
    if not meta_path.exists():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {META}); it was interrupted while saving")
    meta = json.loads(meta_path.read_text())
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_options(trained_only))
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path / "dcp"))
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
        options=_options(trained_only),
    )
    scheduler.load_state_dict(meta["scheduler"])
    rng_file = path / "rng" / f"rank{rank}.pt"
    if meta["world_size"] == world_size and rng_file.exists():
        rng = torch.load(rng_file, weights_only=True)
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    else:
        logger.warning(
            "checkpoint %s was written by %d ranks, resuming on %d: RNG states not restored",
            path,
            meta["world_size"],
            world_size,
        )
    logger.info("checkpoint loaded: %s (version %s)", path, meta["extra"].get("version"))
    return meta["extra"]


PART_SCHEDULER = "scheduler.json"


def save_part(path: Path, model, optimizer, scheduler, rank: int) -> None:
    """Collective: a second trained module of the same checkpoint (the critic, learner/critic.py) in the
    subfolder ``path``: its shards and schedule. Written before the checkpoint's own :func:`save`, whose
    ``meta.json`` then marks the whole folder, part included, complete."""
    path.mkdir(parents=True, exist_ok=True)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path / "dcp"))
    if rank == 0:
        (path / PART_SCHEDULER).write_text(json.dumps(scheduler.state_dict()))
    dist.barrier()


def load_part(path: Path, model, optimizer, scheduler) -> None:
    """Collective: restore what :func:`save_part` wrote."""
    if not (path / PART_SCHEDULER).exists():
        raise FileNotFoundError(
            f"{path} holds no saved module (no {PART_SCHEDULER}): the checkpoint was written "
            "without it (e.g. by a run without learner.critic)"
        )
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path / "dcp"))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    scheduler.load_state_dict(json.loads((path / PART_SCHEDULER).read_text()))
    logger.info("checkpoint part loaded: %s", path)


EXPORT_VERSION_FILE = "fleetrl_version.json"


def publish_export(root: Path, version: int, keep: int = 2) -> Path:
    """Point ``root/latest`` at ``root/step_XXXXXXXX`` atomically and drop older exports (rank 0 only).

    A reader (a late-joining engine) that resolved ``latest`` before the swap keeps
    a complete folder: the previous export is kept until ``keep`` newer ones exist.
    """
    target = step_dir(root, version)
    (target / EXPORT_VERSION_FILE).write_text(json.dumps({"version": version}))
    tmp = root / f".latest-{version}"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target.name)
    tmp.replace(root / "latest")
    for old in sorted(p for p in root.glob("step_*") if p.is_dir())[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return root / "latest"


def export_hf(out: Path, model, source_dir: str, rank: int, dtype: torch.dtype | None = None, transform=None) -> None:
    """Collective: gather the full state dict to rank 0 and write an HF folder there.

    ``dtype`` casts floating tensors (e.g. bf16 for inference engines); the
    config's ``dtype`` is set to match. Tokenizer files come from ``source_dir``.
    """
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0 and transform is not None:  # e.g. LoRA adapters merged into their base weights
        sd = transform(sd)
    if rank == 0:
        from safetensors.torch import save_file

        out.mkdir(parents=True, exist_ok=True)
        tied = bool(getattr(model.config, "tie_word_embeddings", False))
        tensors = {}
        for name, t in sd.items():
            if tied and name == "lm_head.weight":
                continue  # HF re-ties it at load; safetensors refuses shared storage
            t = t.detach().contiguous()
            if dtype is not None and t.is_floating_point():
                t = t.to(dtype)
            tensors[name] = t
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        cfg = json.loads(model.config.to_json_string(use_diff=True))  # what save_pretrained writes
        cfg["dtype"] = str(dtype or next(iter(tensors.values())).dtype).removeprefix("torch.")
        cfg.pop("torch_dtype", None)
        cfg.pop("_name_or_path", None)
        (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
        src = Path(source_dir)
        for name in TOKENIZER_FILES:
            if (src / name).exists():
                shutil.copy2(src / name, out / name)
        logger.info("HF export written: %s", out)
    dist.barrier()
