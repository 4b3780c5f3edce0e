"""learner/fastpath.py: every ``auto`` of the learner config resolves as documented, on CPU and on a made-up
GPU (a plain DeviceProps, no CUDA needed); explicit settings win; the auto micro-batch budget follows free
memory and refuses clearly; its memory model agrees with the peaks bench/learner.py measured."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from core.configbase import ConfigError
from learner.config import LearnerConfig
from learner.fastpath import (
    AC_BELOW_TOKENS,
    CPU_MICRO_BATCH_TOKENS,
    GIB,
    MAX_AUTO_TOKENS,
    MIN_AUTO_TOKENS,
    DeviceProps,
    MemoryPlan,
    ModelShape,
    choose_micro_batch,
    memory_estimate,
    micro_batch_budget,
    resolve_fast_path,
)
from learner.status import LearnerStatus

# Qwen2-0.5B and -1.5B config.json sizes (the shapes bench/learner.py builds)
QWEN2_05B = dict(
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    tie_word_embeddings=True,
)
QWEN2_15B = dict(QWEN2_05B, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12)
S05, S15 = ModelShape.from_hf(QWEN2_05B), ModelShape.from_hf(QWEN2_15B)
CPU = DeviceProps(type="cpu")
# an 80 GB H100 as a fresh process sees it (CUDA context taken)
H100 = DeviceProps(
    type="cuda",
    free_bytes=int(78.6 * GIB),
    total_bytes=int(79.2 * GIB),
    name="NVIDIA H100 80GB HBM3",
    capability=(9, 0),
)
H200 = DeviceProps(
    type="cuda", free_bytes=int(139.0 * GIB), total_bytes=int(139.8 * GIB), name="NVIDIA H200", capability=(9, 0)
)
OLD = {
    "logprobs": "full",
    "attn_implementation": "sdpa",
    "fused_optimizer": "off",
    "meta_init": "off",
    "compile_blocks": False,
    "micro_batch_tokens": 8192,
    "activation_checkpointing": False,
}


def cfg(**over) -> LearnerConfig:
    return LearnerConfig.model_validate({"loss": {"correction": "tis"}, **over})


def test_parameter_counts_match_the_published_sizes():
    # Qwen2-0.5B: 494M parameters (tied head), Qwen2-1.5B: 1.54B
    assert abs(S05.params - 494.0e6) < 1e6 and abs(S15.params - 1543.7e6) < 2e6


@pytest.mark.parametrize("engine", ["fsdp", "megatron"])
def test_cpu_defaults_are_the_plain_path(engine):
    s = resolve_fast_path(cfg(engine=engine), CPU)
    assert (s.chunked_logprobs, s.fused_optimizer, s.meta_init, s.compile_blocks, s.activation_checkpointing) == (
        False,
        False,
        False,
        False,
        False,
    )
    assert s.attn_implementation == ("sdpa" if engine == "fsdp" else "masked")
    assert s.micro_batch_tokens == CPU_MICRO_BATCH_TOKENS and s.root_dtype == "float32" and s.device == "cpu"


def test_gpu_defaults_take_every_fast_path():
    s = resolve_fast_path(cfg(), H100, S05)
    assert (s.chunked_logprobs, s.varlen, s.fused_optimizer, s.meta_init, s.compile_blocks) == (True,) * 5
    assert s.root_dtype == "bfloat16" and not s.activation_checkpointing
    assert s.micro_batch_tokens == 32768  # the best budget measured at this shape (issue 21)
    assert "78.6 GiB free" in s.micro_batch_source and "H100" in s.device and "sm90" in s.device
    # the bigger shape gets half the rows on the same card, the bigger card the cap
    assert resolve_fast_path(cfg(), H100, S15).micro_batch_tokens == 16384
    assert resolve_fast_path(cfg(), H200, S15).micro_batch_tokens == MAX_AUTO_TOKENS


def test_megatron_gpu_defaults():
    s = resolve_fast_path(cfg(engine="megatron"), H100, S05)
    assert (s.varlen, s.chunked_logprobs, s.fused_optimizer, s.compile_blocks) == (True,) * 4
    assert not s.meta_init and s.micro_batch_tokens >= 16384
    # varlen needs PP=1; the chunked head TP=1 (auto falls back; explicit chunked is a config error)
    pp2 = resolve_fast_path(cfg(engine="megatron", megatron={"pipeline_model_parallel_size": 2}), H100, S05, 2)
    assert pp2.attn_implementation == "masked" and pp2.chunked_logprobs
    tp2 = resolve_fast_path(cfg(engine="megatron", megatron={"tensor_model_parallel_size": 2}), H100, S05, 2)
    assert tp2.varlen and not tp2.chunked_logprobs and tp2.root_dtype == "float32"


def test_explicit_settings_win_on_gpu():
    s = resolve_fast_path(cfg(**OLD), H100, S05)
    assert (s.chunked_logprobs, s.varlen, s.fused_optimizer, s.meta_init, s.compile_blocks) == (False,) * 5
    assert (s.micro_batch_tokens, s.activation_checkpointing, s.micro_batch_source) == (8192, False, "config")
    assert s.root_dtype == "float32"  # the full-logits head keeps the fp32 root
    on = resolve_fast_path(cfg(compile_blocks="on", activation_checkpointing=True, micro_batch_tokens=1000), CPU)
    assert on.compile_blocks and on.activation_checkpointing and on.micro_batch_tokens == 1000
    # an explicit budget with checkpointing auto: on only when the budget would not fit without it
    assert not resolve_fast_path(cfg(micro_batch_tokens=16384), H100, S05).activation_checkpointing
    assert resolve_fast_path(cfg(micro_batch_tokens=131072), H100, S05).activation_checkpointing
    assert not resolve_fast_path(cfg(micro_batch_tokens=131072), CPU).activation_checkpointing


def test_varlen_on_cpu_is_refused_and_config_values_are_checked():
    with pytest.raises(ValueError, match="varlen needs a GPU"):
        resolve_fast_path(cfg(attn_implementation="varlen"), CPU)
    for key, bad in (
        ("micro_batch_tokens", 8),
        ("micro_batch_tokens", "big"),
        ("compile_blocks", "sometimes"),
        ("activation_checkpointing", "maybe"),
    ):
        with pytest.raises((ValueError, ConfigError), match=key):
            cfg(**{key: bad})


def test_gpu_auto_needs_the_model_shape():
    with pytest.raises(ValueError, match="shape"):
        resolve_fast_path(cfg(), H100, None)


@pytest.mark.parametrize("shape", [S05, S15], ids=["0.5b", "1.5b"])
@pytest.mark.parametrize(
    "plan",
    [MemoryPlan(), MemoryPlan(compiled=False, root_fp32=True), MemoryPlan(shards=4), MemoryPlan(engine="megatron")],
    ids=["fsdp", "eager", "fsdp4", "megatron"],
)
def test_budget_is_monotone_in_free_memory(shape, plan):
    for ac in (False, True):
        budgets = [micro_batch_budget(g * GIB, shape, plan, ac) for g in range(4, 200)]
        assert budgets == sorted(budgets), ac
        assert set(budgets) <= {0} | {MIN_AUTO_TOKENS << k for k in range(8)} and max(budgets) == MAX_AUTO_TOKENS
        # and every budget given is estimated to fit: free less the reserve holds the estimated peak
        for g, b in zip(range(4, 200), budgets, strict=True):
            if b:
                assert memory_estimate(b, shape, plan, ac)["total"] <= 0.9 * g * GIB - 3 * GIB


def test_checkpointing_only_when_the_budget_without_it_is_small():
    for g in range(36, 200):  # below ~35 GB free the 1.5B state alone does not fit (the next test)
        tokens, ac, why = choose_micro_batch(g * GIB, S15, MemoryPlan())
        plain = micro_batch_budget(g * GIB, S15, MemoryPlan(), False)
        assert ac == (plain < AC_BELOW_TOKENS and tokens > plain), g
        assert tokens == (micro_batch_budget(g * GIB, S15, MemoryPlan(), True) if ac else plain)
        assert ("checkpointing on" in why) == ac
    assert choose_micro_batch(40 * GIB, S15, MemoryPlan())[1]  # a 40 GB card: 1.5B trains with recompute


def test_refuses_when_even_the_minimum_does_not_fit():
    with pytest.raises(ValueError, match=r"even 2048 tokens do not fit: 20\.0 GiB free") as e:
        resolve_fast_path(cfg(), DeviceProps(type="cuda", free_bytes=20 * GIB, total_bytes=24 * GIB), S15)
    assert "param_offload" in str(e.value) and "micro_batch_tokens" in str(e.value)
    # offloading the state to the CPU is what makes it fit
    off = resolve_fast_path(cfg(param_offload=True), DeviceProps(type="cuda", free_bytes=20 * GIB), S15)
    assert off.micro_batch_tokens >= MIN_AUTO_TOKENS


def test_memory_model_agrees_with_measured_peaks():
    """The FSDP peaks bench/learner.py recorded on one H200 (issue 21; fp32 root then): the estimate must
    not fall below 0.97 of a measured peak (an under-estimate is an OOM) nor waste more than 40% (recompute
    is the loosest part: its saved inputs are budgeted with slack)."""
    data = json.loads((Path(__file__).parents[3] / "bench/results/learner_issue21.json").read_text())
    checked = 0
    for c in data["cases"]:
        if c["engine"] != "fsdp" or not c.get("peak_mem_gib") or c["variant"] not in ("fused", "meta", "compile", "ac"):
            continue
        shape = S15 if "1.5b" in c["model"] else S05
        est = memory_estimate(
            c["micro_batch_tokens"],
            shape,
            MemoryPlan(compiled=c["variant"] == "compile", root_fp32=True),
            c["variant"] == "ac",
        )
        ratio = est["total"] / GIB / c["peak_mem_gib"]
        assert 0.97 <= ratio <= (1.4 if c["variant"] == "ac" else 1.1), (c["variant"], c["micro_batch_tokens"], ratio)
        checked += 1
    assert checked >= 8


def test_settings_reach_the_status_record():
    s = resolve_fast_path(cfg(), H100, S05)
    st = msgspec.convert(msgspec.to_builtins(LearnerStatus(settings=s.as_dict())), LearnerStatus)
    assert st.settings["micro_batch_tokens"] == 32768 and st.settings["compile_blocks"] is True
    assert s.describe().startswith("learner settings: engine=fsdp")


def test_memory_dependent_choices_can_wait_for_the_first_step():
    """size_now=False (the FSDP engine at build): what depends on GPU memory stays pending, nothing else."""
    s = resolve_fast_path(cfg(), DeviceProps(type="cuda", free_bytes=GIB), S15, size_now=False)  # would not fit now
    assert s.pending and s.micro_batch_tokens == 0 and not s.activation_checkpointing and s.compile_blocks
    given = resolve_fast_path(cfg(micro_batch_tokens=4096), H100, S05, size_now=False)
    assert given.pending and given.micro_batch_tokens == 4096  # checkpointing auto still waits
    fixed = resolve_fast_path(cfg(micro_batch_tokens=4096, activation_checkpointing=True), H100, S05, size_now=False)
    assert not fixed.pending and fixed.activation_checkpointing
    assert not resolve_fast_path(cfg(), CPU, size_now=False).pending
    # settled later with the memory the learner can train in (its own held memory counted as free)
    assert resolve_fast_path(cfg(), H100, S05).micro_batch_tokens == 32768


def test_compile_auto_needs_a_kernel_compiler():
    no_triton = DeviceProps(type="cuda", free_bytes=H100.free_bytes, total_bytes=H100.total_bytes, compiler=False)
    s = resolve_fast_path(cfg(), no_triton, S05)
    assert not s.compile_blocks and not s.fused_head and s.chunked_logprobs  # eager layers, the rest as usual
    assert resolve_fast_path(cfg(compile_blocks=True), no_triton, S05).compile_blocks  # asked for: tried anyway
