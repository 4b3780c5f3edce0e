"""Weights in and out of a Megatron GPTModel: HF safetensors -> local shards, shards -> full HF tensors.

Loading reads only the tensors a rank needs (``safetensors.safe_open``, lazily, per name). Publishing
walks the Megatron parameters in HF order: each one is all-gathered over its tensor-parallel group,
converted to HF names (learner/megatron/convert.py), and, for layers held by a later pipeline stage,
sent point-to-point from that stage's first rank (TP 0, DP 0) to global rank 0, where the publisher
runs. Every rank walks the same list, so the collectives line up.

Example::

    with HFWeights("models/tiny-adder") as hf:
        copy_hf_into(gpt_model, hf, shape, tp=2, tp_rank=1, layer_offset=0)
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
import torch.distributed as dist

from learner.megatron import convert as cv

logger = logging.getLogger(__name__)

_LOCAL_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


class HFWeights(Mapping):
    """Read-only name -> tensor view of an HF folder's safetensors files (single file or sharded index)."""

    def __init__(self, folder: str | Path) -> None:
        from safetensors import safe_open

        folder = Path(folder)
        index = folder / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif (folder / "model.safetensors").exists():
            weight_map = None
        else:
            raise FileNotFoundError(f"{folder} has neither model.safetensors nor model.safetensors.index.json")
        files = sorted(set(weight_map.values())) if weight_map else ["model.safetensors"]
        self._handles = {f: safe_open(str(folder / f), framework="pt") for f in files}
        self._where = weight_map or {k: "model.safetensors" for k in self._handles["model.safetensors"].keys()}

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise KeyError(f"HF checkpoint has no tensor {name!r}")
        return self._handles[self._where[name]].get_tensor(name)

    def __iter__(self):
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def __enter__(self) -> HFWeights:
        return self

    def __exit__(self, *exc) -> None:
        self._handles.clear()


def global_name(local: str, layer_offset: int) -> str:
    """A stage-local Megatron name (layers numbered from 0 on each pipeline stage) with global layer numbers."""
    m = _LOCAL_LAYER.match(local)
    if not m:
        return local
    return f"decoder.layers.{int(m.group(1)) + layer_offset}." + local[m.end() :]


@torch.no_grad()
def copy_hf_into(
    model: torch.nn.Module,
    hf: Mapping[str, torch.Tensor],
    shape: cv.ModelShape,
    *,
    tp: int,
    tp_rank: int,
    layer_offset: int,
) -> None:
    """Overwrite every parameter of this rank's (unwrapped) GPTModel with its shard of the HF weights."""
    seen = 0
    for local, p in model.named_parameters():
        name = global_name(local, layer_offset)
        if name == "output_layer.weight" and shape.tied:
            # Last pipeline stage's copy of the tied embedding (PP > 1).
            name = "embedding.word_embeddings.weight"
        shard = cv.from_hf(name, hf, shape, tp)[tp_rank]
        if tuple(shard.shape) != tuple(p.shape):
            raise ValueError(f"{name}: converted shard {tuple(shard.shape)} != Megatron parameter {tuple(p.shape)}")
        p.copy_(shard.to(p.dtype))
        seen += 1
    logger.debug("loaded %d Megatron parameters from HF weights", seen)


def _stage_of(name: str, shape: cv.ModelShape, pp: int) -> int:
    m = re.match(r"^decoder\.layers\.(\d+)\.", name)
    if m:
        return int(m.group(1)) // (shape.num_layers // pp)
    return 0 if name.startswith("embedding.") else pp - 1


def iter_hf_tensors(engine, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Collective over all ranks: (HF name, full tensor) in HF order, meaningful on global rank 0."""
    from megatron.core import parallel_state as ps

    tp_group = ps.get_tensor_model_parallel_group()
    offset = engine.layers[0]
    params = {global_name(n, offset): p for n, p in engine.gpt.named_parameters()}
    sender = engine.tp_rank == 0 and engine.data_rank == 0
    for mname in cv.megatron_names(engine.shape):
        stage = _stage_of(mname, engine.shape, engine.pp)
        pairs: list[tuple[str, torch.Tensor]] = []
        if stage == engine.pp_rank:
            local = params[mname].detach()
            if engine.tp > 1 and cv.tp_dim(mname) is not None:
                shards = [torch.empty_like(local) for _ in range(engine.tp)]
                dist.all_gather(shards, local.contiguous(), group=tp_group)
            else:
                shards = [local]
            pairs = cv.to_hf(mname, shards, engine.shape)
            if dtype is not None:
                pairs = [(n, t.to(dtype)) for n, t in pairs]
        if engine.pp > 1 and stage != 0:
            if engine.rank == 0:
                src = _stage_global_rank(stage)
                own = dtype or engine.param_plan()[0][2]
                pairs = []
                for n, s in cv.hf_shape_of(mname, engine.shape):
                    buf = torch.empty(s, dtype=own, device=engine.device)
                    dist.recv(buf, src=src)
                    pairs.append((n, buf))
            elif stage == engine.pp_rank and sender:
                for _, t in pairs:
                    dist.send(t.contiguous(), dst=0)
        if not pairs:
            pairs = [(n, torch.empty(0)) for n, _ in cv.hf_shape_of(mname, engine.shape)]
        yield from pairs


def _stage_global_rank(stage: int) -> int:
    """Global rank of (pipeline stage ``stage``, TP rank 0, DP rank 0)."""
    from megatron.core import parallel_state as ps

    ranks = dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())
    # Only called on members of global rank 0's pipeline group (rank 0 itself and the TP 0 / DP 0 senders),
    # whose ranks are listed in stage order.
    return ranks[stage]


def write_hf_export(engine, out: Path, dtype: torch.dtype | None = None) -> None:
    """Collective: rank 0 writes an HF folder (config.json, model.safetensors, tokenizer files)."""
    from learner.checkpoint import TOKENIZER_FILES

    tensors = {}
    for name, t in iter_hf_tensors(engine, dtype):
        if engine.rank == 0:
            tensors[name] = t.detach().to("cpu").contiguous()
    if engine.rank == 0:
        from safetensors.torch import save_file

        out.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        cfg = dict(engine.hf_config)
        cfg["dtype"] = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
        cfg.pop("torch_dtype", None)
        (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
        src = Path(engine.model_path)
        for name in TOKENIZER_FILES:
            if (src / name).exists():
                shutil.copy2(src / name, out / name)
        logger.info("HF export written: %s", out)
    dist.barrier()
