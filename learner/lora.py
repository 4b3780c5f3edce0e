"""LoRA adapters on a transformers causal LM, named so that the adapter folder is a standard peft one.

Each targeted ``nn.Linear`` keeps its own parameters and names (``...q_proj.weight``, frozen) and gains two
children, ``lora_A`` (rank x in) and ``lora_B`` (out x rank): ``y = W x + b + (alpha / rank) * B A x``. Keeping
the base names unchanged (peft renames them ``base_layer.weight``) leaves sharding, meta-device loading from the
base safetensors, checkpoints and the full-weight publish as they are. The adapter folder written by
:func:`save_adapter` (``adapter_config.json`` + ``adapter_model.safetensors`` with keys
``base_model.model.<module>.lora_A.weight``) is what peft's ``PeftModel.from_pretrained`` and vLLM's
``--enable-lora`` load.

Example::

    names = inject(model, LoraConfig(rank=8, alpha=16))   # base frozen, adapters trainable (B = 0: no change yet)
    init_adapters(model, seed=0)                          # A random (as peft), the same on every rank
    ...train...
    save_adapter("out/adapter", model, cfg, base_model_path="models/tiny-adder", rank=0)
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from learner.loading import _local_rows
from learner.lora_config import ALL_LINEAR, LoraConfig

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


class LoraLinear(nn.Linear):
    """An ``nn.Linear`` with a low-rank update; made by :func:`inject` (class swap, the module keeps its tensors)."""

    lora_A: nn.Linear
    lora_B: nn.Linear
    lora_dropout: nn.Module
    lora_scale: float
    lora_off: bool = False  # set by adapters_off: the base layer alone (the KL reference)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        if self.lora_off:
            return out
        a = self.lora_A.weight
        # bf16 adapters beside an fp32 base (CPU, no mixed-precision policy): compute the branch in its own dtype
        delta = self.lora_B(self.lora_A(self.lora_dropout(x).to(a.dtype)))
        return out + (delta * self.lora_scale).to(out.dtype)


def is_adapter_name(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def target_names(model: nn.Module, cfg: LoraConfig) -> list[str]:
    """Dotted paths of the linear layers that get an adapter (the output layer never does, as in peft)."""
    out_layer = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    wanted = None if cfg.target_modules == ALL_LINEAR else set(cfg.target_modules)
    excluded = set(cfg.exclude_modules)
    names, seen_leaves = [], set()
    for path, m in model.named_modules():
        if not isinstance(m, nn.Linear) or m is out_layer:
            continue
        leaf = path.rsplit(".", 1)[-1]
        seen_leaves.add(leaf)
        if wanted is not None and leaf not in wanted:
            continue
        if leaf in excluded or path in excluded:
            continue
        names.append(path)
    if wanted is not None and (unknown := sorted(wanted - seen_leaves)):
        raise ValueError(
            f"learner.lora.target_modules names {unknown}, which no linear layer of "
            f"{type(model).__name__} has; its linear layers are {sorted(seen_leaves)}"
        )
    if not names:
        raise ValueError(
            f"learner.lora selects no linear layer of {type(model).__name__} (target_modules="
            f"{cfg.target_modules!r}, exclude_modules={cfg.exclude_modules!r})"
        )
    return names


def inject(model: nn.Module, cfg: LoraConfig) -> list[str]:
    """Freeze every parameter of ``model`` and add trainable adapters to the targeted linears; returns their paths.

    Works on real and meta-device models (the adapters are created on the base weight's device; on meta they are
    filled by :func:`init_adapters` after the shards are allocated)."""
    names = target_names(model, cfg)
    model.requires_grad_(False)
    dtype = torch.float32 if cfg.dtype == "float32" else torch.bfloat16
    for path in names:
        m = model.get_submodule(path)
        if type(m) is not nn.Linear:
            raise TypeError(f"{path} is a {type(m).__name__}, not a plain torch.nn.Linear; LoRA wraps only those")
        dev = m.weight.device
        m.lora_A = nn.Linear(m.in_features, cfg.rank, bias=False, device=dev, dtype=dtype)
        m.lora_B = nn.Linear(cfg.rank, m.out_features, bias=False, device=dev, dtype=dtype)
        m.lora_dropout = nn.Dropout(cfg.dropout) if cfg.dropout > 0 else nn.Identity()
        m.lora_scale = cfg.alpha / cfg.rank
        m.__class__ = LoraLinear
    return names


@contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """Inside, ``model`` computes its frozen base exactly: the KL reference without a second copy of the model."""
    mods = [m for m in model.modules() if isinstance(m, LoraLinear)]
    for m in mods:
        m.lora_off = True
    try:
        yield
    finally:
        for m in mods:
            m.lora_off = False


def adapter_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if is_adapter_name(n)]


def _set_full(p: torch.Tensor, full: torch.Tensor) -> None:
    """Write a full tensor into a parameter, sharded (FSDP2 dim-0 shard: this rank's rows) or not."""
    with torch.no_grad():
        if isinstance(p, DTensor):
            local, start = _local_rows(p)
            rows = local.shape[0]
            local.copy_(full[start : start + rows].to(local.dtype))
        else:
            p.copy_(full.to(p.dtype))


def init_adapters(model: nn.Module, seed: int) -> None:
    """A as peft's default (kaiming-uniform with a = sqrt(5), i.e. U(+-1/sqrt(in))), B = 0, so training starts at
    the base model. Each A comes from a generator seeded by ``seed`` and its name: the same on every rank and for
    every sharding, without a collective."""
    for name, p in adapter_parameters(model):
        shape = tuple(p.shape)
        if ".lora_B." in name:
            _set_full(p, torch.zeros(shape))
            continue
        g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        bound = 1.0 / math.sqrt(shape[1])
        _set_full(p, torch.rand(shape, generator=g, dtype=torch.float64).mul_(2 * bound).sub_(bound))


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach()


def adapter_tensors(model: nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(peft key, full tensor) of every adapter weight. Collective under FSDP (one all-gather each): every rank
    drains it in the same order; the tensors are meaningful on every rank."""
    for name, p in adapter_parameters(model):
        t = _full(p)
        yield PEFT_PREFIX + name, t if dtype is None else t.to(dtype)


def peft_config(cfg: LoraConfig, names: list[str], base_model_path: str) -> dict:
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": cfg.rank,
        "lora_alpha": cfg.alpha,
        "lora_dropout": cfg.dropout,
        "target_modules": sorted({n.rsplit(".", 1)[-1] for n in names}),
        "exclude_modules": list(cfg.exclude_modules) or None,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "inference_mode": True,
        "base_model_name_or_path": base_model_path,
    }


def lora_module_names(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, LoraLinear)]


def save_adapter(
    folder: str | Path,
    model: nn.Module,
    cfg: LoraConfig,
    *,
    base_model_path: str,
    rank: int,
    dtype: torch.dtype | None = None,
) -> int:
    """Collective: gather the adapters and (rank 0) write a peft adapter folder; returns the tensor bytes written
    (0 on other ranks). The weights file is written under a temporary name and renamed, so a reader never sees a
    half-written adapter."""
    tensors = {k: v.contiguous().cpu() for k, v in adapter_tensors(model, dtype)}
    if rank != 0:
        return 0
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / ADAPTER_CONFIG).write_text(
        json.dumps(peft_config(cfg, lora_module_names(model), base_model_path), indent=2)
    )
    tmp = folder / (ADAPTER_WEIGHTS + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.rename(folder / ADAPTER_WEIGHTS)
    return sum(t.numel() * t.element_size() for t in tensors.values())


def load_adapter(folder: str | Path, model: nn.Module, cfg: LoraConfig) -> None:
    """Fill the adapters from a peft folder (every rank reads the file; no collective). Raises if its rank,
    alpha or modules differ from ``cfg`` and the model."""
    from safetensors.torch import load_file

    folder = Path(folder)
    if not (folder / ADAPTER_CONFIG).exists() or not (folder / ADAPTER_WEIGHTS).exists():
        raise FileNotFoundError(
            f"learner.lora.adapter_path {str(folder)!r} is not a peft adapter folder "
            f"(expected {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS})"
        )
    meta = json.loads((folder / ADAPTER_CONFIG).read_text())
    if meta.get("r") != cfg.rank or float(meta.get("lora_alpha", -1)) != cfg.alpha:
        raise ValueError(
            f"adapter {str(folder)!r} has r={meta.get('r')}, lora_alpha={meta.get('lora_alpha')}; "
            f"learner.lora has rank={cfg.rank}, alpha={cfg.alpha}"
        )
    # peft also writes keys with the adapter name (".lora_A.default.weight") in memory, never on disk; accept both
    stored = {k.replace(".default.", "."): v for k, v in load_file(str(folder / ADAPTER_WEIGHTS)).items()}
    params = dict(adapter_parameters(model))
    missing = sorted(n for n in params if PEFT_PREFIX + n not in stored)
    extra = sorted(k for k in stored if k.removeprefix(PEFT_PREFIX) not in params)
    if missing or extra:
        raise ValueError(
            f"adapter {str(folder)!r} does not match learner.lora's modules: missing {missing[:4]}, "
            f"unexpected {extra[:4]}"
        )
    for n, p in params.items():
        full = stored[PEFT_PREFIX + n]
        if tuple(full.shape) != tuple(p.shape):
            raise ValueError(f"adapter tensor {n}: shape {tuple(full.shape)} != model's {tuple(p.shape)}")
        _set_full(p, full)


def merged_weight(module: LoraLinear, weight: torch.Tensor) -> torch.Tensor:
    """``weight + scale * B @ A`` in fp32 (``weight`` is the module's full base weight). Collective under FSDP."""
    a, b = _full(module.lora_A.weight).float(), _full(module.lora_B.weight).float()
    return (weight.float() + module.lora_scale * (b @ a)).to(weight.dtype)


def merge_state_dict(sd: dict[str, torch.Tensor], scales: dict[str, float]) -> dict[str, torch.Tensor]:
    """A full state dict with adapters -> the plain model's (``W + scale * B @ A``, adapter keys dropped).
    ``scales``: module path -> alpha / rank."""
    out = {k: v for k, v in sd.items() if not is_adapter_name(k)}
    for path, s in scales.items():
        a, b = sd[f"{path}.lora_A.weight"].float(), sd[f"{path}.lora_B.weight"].float()
        w = sd[f"{path}.weight"]
        out[f"{path}.weight"] = (w.float() + s * (b @ a)).to(w.dtype)
    return out
