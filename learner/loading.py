"""Build a transformers causal LM on the meta device and fill each rank's FSDP2 shards from safetensors.

The plain load (``AutoModelForCausalLM.from_pretrained(..., dtype=float32)``) materialises the whole
model in fp32 in host memory on every rank before sharding: 4 bytes x parameters per rank (32 GB for an
8B model, 256 GB for 8 ranks on a node). Here the model is created on ``meta`` (no storage), sharded with
``fully_shard``, moved to its device empty (``to_empty``: each rank allocates only its shard), and each
shard is read from the safetensors files as the rows it owns (``safe_open(...).get_slice``: only those
bytes are read), cast to the parameter's dtype on the way in. Host memory per rank is then the shard plus
one tensor slice at a time, never the model.

Guarantees: every parameter and persistent buffer is written from the file (a name the file lacks is an
error naming it, except a tied weight that shares its storage with one that was written); the
non-persistent buffers a meta model cannot hold (RoPE frequencies) are rebuilt by constructing their
module again from its config; the result equals the plain load's shards bit for bit for fp32 files
(tests/unit/learner/test_loading.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor


def meta_model(path: str | Path, attn_implementation: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The model of ``path``'s config.json with every parameter on the meta device, in ``dtype``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    return model


def _files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        return sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model folder {str(path)!r} has no *.safetensors files")
    return files


def _local_rows(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(the writable local tensor, index of its first row in the full tensor)."""
    if not isinstance(t, DTensor):
        return t.data, 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    local = t._local_tensor  # the storage itself (to_local() returns an autograd view)
    if tuple(local.shape) != tuple(shape):
        raise RuntimeError(f"local shard shape {tuple(local.shape)} != expected {tuple(shape)}")
    if any(o != 0 for o in offset[1:]):
        raise NotImplementedError(f"only row (dim-0) sharding is supported, got offset {offset}")
    return local, (int(offset[0]) if offset else 0)


def _rebuild_nonpersistent_buffers(model: torch.nn.Module, device: torch.device) -> None:
    for mod_name, mod in model.named_modules():
        names = [n for n in mod._non_persistent_buffers_set if getattr(mod, n, None) is not None]
        if not names:
            continue
        if not hasattr(mod, "config"):
            raise NotImplementedError(
                f"cannot rebuild non-persistent buffers {names} of {mod_name or 'the model'} "
                f"({type(mod).__name__} has no config to construct it from)"
            )
        fresh = type(mod)(mod.config)  # small modules (rotary embeddings): built on the host, then copied
        for n in names:
            setattr(mod, n, getattr(fresh, n).to(device))


def load_shards(model: torch.nn.Module, path: str | Path, device: torch.device, skip=None) -> dict[str, int]:
    """Allocate ``model``'s (already ``fully_shard``-ed, meta) shards on ``device`` and fill them from ``path``;
    parameters whose name ``skip(name)`` accepts (LoRA adapters) are allocated but left for the caller to fill.

    Returns ``{"tensors": n, "bytes_read": b}`` (bytes of this rank's slices as stored in the files).
    """
    from safetensors import safe_open

    path = Path(path)
    model.to_empty(device=device)
    _rebuild_nonpersistent_buffers(model, device)
    where: dict[str, Path] = {}
    for f in _files(path):
        with safe_open(str(f), framework="pt") as h:
            where.update({k: f for k in h.keys()})  # noqa: SIM118 - safe_open handles are not mappings
    targets = {n: p for n, p in model.named_parameters() if skip is None or not skip(n)}
    targets.update((n, b) for n, b in model.named_buffers() if n.rsplit(".", 1)[-1] not in _nonpersistent(model, n))
    written: set[int] = set()
    pending: dict[Path, list[str]] = {}
    missing = []
    for name in targets:
        if name in where:
            pending.setdefault(where[name], []).append(name)
        else:
            missing.append(name)
    n_bytes = 0
    for f, names in pending.items():
        with safe_open(str(f), framework="pt", device="cpu") as h:
            for name in names:
                t = targets[name]
                local, start = _local_rows(t)
                full_shape = tuple(h.get_slice(name).get_shape())
                if full_shape != tuple(t.shape):
                    raise ValueError(f"{name}: file shape {full_shape} != model shape {tuple(t.shape)}")
                rows = local.shape[0] if local.dim() else 0
                piece = h.get_slice(name)[start : start + rows] if local.dim() else h.get_tensor(name)
                n_bytes += piece.numel() * piece.element_size()
                with torch.no_grad():
                    local.copy_(piece.to(local.device).to(local.dtype))
                written.add(id(t))
    # A name absent from the file is fine only for a tied weight whose storage was written under another name.
    tied = {id(p) for p in model.parameters()}
    really_missing = [n for n in missing if not (id(targets[n]) in written and id(targets[n]) in tied)]
    if really_missing:
        raise KeyError(
            f"{str(path)!r} lacks tensors the model needs: {really_missing[:5]}"
            f"{' ...' if len(really_missing) > 5 else ''}"
        )
    return {"tensors": len(written), "bytes_read": n_bytes}


def _nonpersistent(model: torch.nn.Module, buffer_name: str) -> set[str]:
    mod = model.get_submodule(buffer_name.rsplit(".", 1)[0]) if "." in buffer_name else model
    return set(mod._non_persistent_buffers_set)
