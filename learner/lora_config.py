"""``learner.lora``: train low-rank adapters instead of the whole model (no torch import; learner/lora.py acts on it)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from core.configbase import ConfigModel

# The linear layers of a decoder block that ``target_modules: all-linear`` means in peft's sense: every
# nn.Linear inside the model except the output layer. Listed names are matched against a module's last name.
ALL_LINEAR = "all-linear"

MEGATRON_REFUSED = (
    "learner.lora with learner.engine=megatron: megatron-core ships no LoRA for its GPTModel (its PEFT lives in "
    "NeMo / Megatron-Bridge, which fleetrl does not depend on), so the Megatron learner cannot freeze a base and "
    "train adapters; use learner.engine=fsdp for LoRA"
)


class LoraConfig(ConfigModel):
    rank: int = Field(
        gt=0,
        le=1024,
        description="adapter rank r (verl lora_rank); vLLM serves ranks 1, 8, 16, 32, "
        "64, 128, 256, 320, 512 (rollout servers get --max-lora-rank rounded up to one of those)",
    )
    alpha: float = Field(gt=0, description="scaling numerator: the update is (alpha / rank) * B @ A (verl lora_alpha)")
    target_modules: Literal["all-linear"] | list[str] = Field(
        ALL_LINEAR,
        description="'all-linear' (every nn.Linear but the output layer) or module names matched "
        "against the last part of a module's path, e.g. [q_proj, v_proj] (verl target_modules)",
    )
    exclude_modules: list[str] = Field(
        default_factory=list,
        description="module names (last path part) or full dotted paths left without an adapter (verl exclude_modules)",
    )
    dropout: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="dropout on the adapter's input; 0 keeps the proximal and "
        "training passes scoring alike (the learner forces model dropout to 0 for that reason)",
    )
    adapter_path: str | None = Field(
        None,
        description="start from this peft adapter folder (adapter_config.json + "
        "adapter_model.safetensors) instead of B = 0 (verl lora_adapter_path)",
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="storage (and optimizer) dtype of the adapter weights; the frozen base stays in the "
        "learner's fp32 master copy, bf16 compute on GPU as for full fine-tuning",
    )

    @field_validator("target_modules")
    @classmethod
    def _targets(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("learner.lora.target_modules is an empty list; give module names or 'all-linear'")
        return v


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest ``--max-lora-rank`` vLLM accepts that holds ``rank`` (vLLM takes only a fixed set)."""
    for r in (1, 8, 16, 32, 64, 128, 256, 320, 512):
        if rank <= r:
            return r
    raise ValueError(f"learner.lora.rank={rank} exceeds vLLM's largest --max-lora-rank (512)")
