"""Megatron-core learner backend on 2 GPUs (NCCL): HF round trip, parity with FSDP2, publish from TP=2.

Run on the GPU machine (megatron-core installed, no TE/apex needed)::

    NCCL_NVLS_ENABLE=0 pytest -m gpu -s tests/gpu/test_megatron_gpu.py

Every rank is a spawned process (tests/gpu/megatron_worker.py); results come back through files.
Skipped without CUDA or without megatron-core; fewer than 2 GPUs is a failure where CUDA exists.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO / "tests" / "support"))
import megatron_worker as mw  # noqa: E402
from learner_testkit import make_tiny_model, run_procs  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(150)]

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("megatron.core", reason="needs megatron-core (pip install fleetrl[megatron])")
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("NCCL_CUMEM_ENABLE", "0")


def _two_gpus():
    if torch.cuda.device_count() < 2:
        pytest.fail(f"the Megatron GPU tests need 2 GPUs, found {torch.cuda.device_count()}")


def spawn(target, world: int, kw: dict, timeout: float = 120.0, extra=()) -> list[dict]:
    run_procs(target, world, kw, timeout, "spawn", extra)  # CUDA does not survive a fork
    return [torch.load(kw["out"] + f".rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("megatron_models")
    tiny = mw.bf16_model(REPO / "models" / "tiny-adder", d / "tiny-adder-bf16")
    untied = mw.bf16_model(make_tiny_model(d / "src_untied", seed=3), d / "untied")
    tied = mw.bf16_model(make_tiny_model(d / "src_tied", seed=4, tie=True), d / "tied")
    return {"tiny": tiny, "untied": untied, "tied": tied}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def check_round_trip(models: dict, names: list[str], tmp_path: Path, label: str, **layout) -> None:
    """HF -> Megatron shards (``layout``: tp, pp) -> HF, through ``full_tensors`` and ``export_hf``: bitwise."""
    _two_gpus()
    tmp_path.mkdir(parents=True, exist_ok=True)
    res = spawn(
        mw.megatron_rank,
        2,
        {"models": [str(models[n]) for n in names], **layout, "roundtrip": True, "out": str(tmp_path / "rt")},
    )[0]
    for i, name in enumerate(names):
        hf, full, export = res[f"hf_{i}"], res[f"full_{i}"], res[f"export_{i}"]
        want = {k: v for k, v in hf.items() if k != "lm_head.weight" or "lm_head.weight" in full}
        assert sorted(full) == sorted(want), (name, sorted(set(full) ^ set(want)))
        bad = [k for k in want if full[k].dtype != want[k].dtype or not torch.equal(_bits(full[k]), _bits(want[k]))]
        bad_export = [k for k in want if not torch.equal(_bits(export[k]), _bits(want[k]))]
        print(
            f"{label} round trip {name}: {len(full)} tensors, mismatched {bad}, export mismatched {bad_export}, "
            f"build {res[f'build_s_{i}']:.1f}s"
        )
        assert not bad and not bad_export
    print(f"{label} round trip total {res['total_s']:.1f}s")


def test_hf_megatron_hf_round_trip_tp2_bit_identical(models, tmp_path):
    """tiny-adder (untied, Qwen2 qkv bias, vocab 128 padded to 256) and a tied model: HF -> TP=2 shards -> HF."""
    check_round_trip(models, ["tiny", "tied"], tmp_path, "TP=2", tp=2)


def _compare(ref: dict, got: dict, label: str) -> dict:
    """Gradient and update agreement of a Megatron run with the FSDP reference, printed and returned."""
    g_ref = torch.cat([ref["grads"][k].flatten() for k in sorted(ref["grads"])])
    g_got = torch.cat([got["grads"][k].flatten() for k in sorted(ref["grads"])])
    rel = float((g_got - g_ref).norm() / g_ref.norm())
    cos = float(torch.nn.functional.cosine_similarity(g_got, g_ref, dim=0))
    worst = max(
        ((got["grads"][k] - ref["grads"][k]).norm() / ref["grads"][k].norm().clamp_min(1e-12)).item()
        for k in ref["grads"]
        if ref["grads"][k].norm() > 1e-3 * g_ref.norm() / math.sqrt(len(ref["grads"]))
    )
    upd = max((got["after"][k] - ref["after"][k]).abs().max().item() for k in ref["after"] if k in got["after"])
    m_ref, m_got = ref["metrics"], got["metrics"]
    out = dict(
        grad_rel=rel,
        grad_cos=cos,
        worst_tensor_rel=worst,
        max_weight_diff_after_step=upd,
        loss=(m_ref["loss_total"], m_got["loss_total"]),
        grad_norm=(m_ref["grad_norm"], m_got["grad_norm"]),
        entropy=(m_ref["entropy"], m_got["entropy"]),
    )
    print(f"{label} vs FSDP: " + ", ".join(f"{k}={v}" for k, v in out.items()))
    return out


def test_megatron_tp1_tp2_match_fsdp_loss_and_gradients(models, tmp_path):
    """Same bf16 weights and batch: FSDP2 (1 GPU), Megatron TP=1 (1 GPU), Megatron TP=2 (2 GPUs).

    Tolerances: both compute in bf16 (8 mantissa bits, 2^-9 = 2e-3 relative per rounding) with fp32
    gradient accumulation, through different kernels (transformers sdpa vs Megatron's unfused attention,
    different GEMM splits under TP). Through two layers a log-prob moves by up to ~1e-2 nats, so the loss
    (a weighted mean of ratio x advantage, |A| <~ 1.5) by well under 1e-2 absolute, the entropy (~4.5 nats)
    and the gradient norm by ~1%, and the whole gradient vector by a few % relative. A layout bug (a wrong
    QKV interleave, a gate/up swap, a missing TP reduction, a DP/micro-batch scaling error) gives O(1)
    relative gradient error or a factor in the norm. Updated weights: Adam moves each weight by ~lr = 1e-3
    on the first step, so a sign flip from noise shows as a 2e-3 difference; we allow 3e-3 (+ bf16 rounding
    of the weight itself, ~2^-9 of |w| <~ 0.1 here).
    """
    _two_gpus()
    model = str(models["untied"])
    ref = spawn(mw.fsdp_rank, 1, {"models": [model], "out": str(tmp_path / "fsdp")})[0]
    tp1 = spawn(mw.megatron_rank, 1, {"models": [model], "tp": 1, "grads": True, "out": str(tmp_path / "tp1")})[0]
    tp2 = spawn(mw.megatron_rank, 2, {"models": [model], "tp": 2, "grads": True, "out": str(tmp_path / "tp2")})[0]
    for label, got in (("megatron TP=1", tp1), ("megatron TP=2", tp2)):
        r = _compare(ref, got, label)
        assert r["loss"][1] == pytest.approx(r["loss"][0], abs=5e-3)
        assert r["entropy"][1] == pytest.approx(r["entropy"][0], rel=1e-2)
        assert r["grad_norm"][1] == pytest.approx(r["grad_norm"][0], rel=3e-2)
        assert r["grad_rel"] < 5e-2 and r["grad_cos"] > 0.998
        assert r["max_weight_diff_after_step"] < 3e-3 + 5e-4
    r12 = _compare(tp1, tp2, "megatron TP=2 vs TP=1 (as reference)")
    assert r12["grad_rel"] < 5e-2


def test_sequence_parallel_data_parallel_and_checkpoint_resume(models, tmp_path):
    """TP=2 + sequence parallel vs TP=2 (gradients); DP=2 with the distributed optimizer vs TP=2 (loss, gradient
    norm, weights after the step: a DP scaling error shows as a factor 2 in the norm); then Megatron
    dist_checkpointing save -> step 2 -> load -> step 2 again gives the same step 2."""
    _two_gpus()
    model = str(models["untied"])
    base = spawn(mw.megatron_rank, 2, {"models": [model], "tp": 2, "grads": True, "out": str(tmp_path / "b")})[0]
    sp = spawn(
        mw.megatron_rank, 2, {"models": [model], "tp": 2, "sp": True, "grads": True, "out": str(tmp_path / "sp")}
    )[0]
    r = _compare(base, sp, "megatron TP=2 + sequence parallel (TP=2 as reference)")
    assert r["grad_rel"] < 5e-2 and r["loss"][1] == pytest.approx(r["loss"][0], abs=5e-3)
    dp = spawn(
        mw.megatron_rank, 2, {"models": [model], "tp": 1, "step": True, "ckpt": True, "out": str(tmp_path / "dp")}
    )
    m, mb = dp[0]["metrics"], base["metrics"]
    upd = max((dp[0]["after"][k] - base["after"][k]).abs().max().item() for k in base["after"])
    print(
        f"megatron DP=2 (distributed optimizer) vs TP=2: loss {m['loss_total']} vs {mb['loss_total']}, "
        f"grad_norm {m['grad_norm']} vs {mb['grad_norm']}, max weight diff after step {upd}"
    )
    assert dp[0]["metrics"] == dp[1]["metrics"] or all(
        dp[0]["metrics"][k] == pytest.approx(dp[1]["metrics"][k], rel=1e-6) for k in m if not k.endswith("seconds")
    )
    assert m["loss_total"] == pytest.approx(mb["loss_total"], abs=5e-3)
    assert m["grad_norm"] == pytest.approx(mb["grad_norm"], rel=3e-2)
    assert upd < 3e-3 + 5e-4
    c = dp[0]["ckpt"]
    print(
        f"checkpoint resume: step 2 straight loss {c['straight']['loss_total']} grad_norm "
        f"{c['straight']['grad_norm']}; resumed loss {c['resumed']['loss_total']} grad_norm {c['resumed']['grad_norm']}"
    )
    assert c["extra"] == {"version": 1}
    assert c["resumed"]["loss_total"] == pytest.approx(c["straight"]["loss_total"], abs=1e-6)
    assert c["resumed"]["grad_norm"] == pytest.approx(c["straight"]["grad_norm"], rel=1e-5)


def check_publish_into_receiver(model: Path, tmp_path: Path, label: str, **layout) -> None:
    """Megatron (``layout``: tp, pp) on GPUs 0+1 publishes (NCCL) to a WeightReceiver process on GPU 1: the
    receiver's tensors equal the HF checkpoint bit for bit (version 1) and the learner's gathered state after
    a step (version 2), and its checksum equals the publisher's."""
    _two_gpus()
    tmp_path.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import load_file

    sys.path.insert(0, str(REPO))
    import bench.weight_sync as bws

    with bws.receiver_process("cuda:1") as (parent, rx):
        res = spawn(
            mw.megatron_rank,
            2,
            {"models": [str(model)], **layout, "publish": True, "conn": parent, "out": str(tmp_path / "pub")},
            extra=[rx],
        )[0]
    hf = load_file(str(model / "model.safetensors"))
    for version in (1, 2):
        got = load_file(res[f"dump_{version}"])
        want = hf if version == 1 else res["want_2"]
        nbytes, checksum, per_engine = res[f"report_{version}"]
        assert sorted(got) == sorted(want)
        bad = [k for k in want if not torch.equal(_bits(got[k]), _bits(want[k].to(got[k].dtype)))]
        print(
            f"{label} publish v{version}: {len(got)} tensors, {nbytes} bytes in {res[f'publish_s_{version}']:.3f}s, "
            f"checksum {checksum} receiver {per_engine}, mismatched {bad}"
        )
        assert not bad and per_engine["megatron-rx"] == checksum
    assert any(not torch.equal(res["want_2"][k], hf[k]) for k in hf), "the training step changed no weight"


def test_publish_from_megatron_tp2_into_receiver(models, tmp_path):
    """Megatron TP=2 on GPUs 0+1 publishes (NCCL) to a WeightReceiver process on GPU 1: the receiver's tensors
    equal the HF checkpoint bit for bit (version 1) and the learner's gathered state after a step (version 2)."""
    check_publish_into_receiver(models["tiny"], tmp_path, "megatron TP=2", tp=2)
