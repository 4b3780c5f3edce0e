"""LoRA on the FSDP2 learner, two real gloo ranks (forked) on the tiny Qwen2: training moves only the adapters,
the optimizer holds only theirs, a checkpoint holds only them and a resume restores them bit for bit, and the
exports (peft folder, merged HF weights) agree with what the learner computes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from learner_testkit import make_batches, make_tiny_model, run_procs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # 3 s on a quiet box, 15-25 s on the loaded one
STEPS = 2


def _rank(rank: int, world_size: int, port: int, kw: dict) -> None:
    import os

    from learner import checkpoint as ckpt
    from learner import lora
    from learner.config import LearnerConfig
    from learner.fsdp import FSDPEngine
    from learner.loop import Learner
    from learner.run import init_distributed
    from learner.source import InProcessSource

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    init_distributed("gloo", timeout_s=120)

    def config(meta_init: str) -> LearnerConfig:
        return LearnerConfig.model_validate(
            {
                "loss": {"correction": "decoupled", "kl_coef": 0.01},
                "micro_batch_tokens": 64,
                "logprob_probe_tolerance": None,
                "checkpoint_every": STEPS,
                "optim": {"lr": 1e-2, "weight_decay": 0.01},
                "meta_init": meta_init,
                "lora": {"rank": 4, "alpha": 8, "exclude_modules": ["down_proj"], "dtype": kw["dtype"]},
            }
        )

    cfg = config("off")
    engine = FSDPEngine(cfg, kw["model"], total_steps=STEPS + 1, seed=0)
    base0 = {n: t.clone() for n, t in engine.model.state_dict().items() if not lora.is_adapter_name(n)}
    base0 = {n: (t.full_tensor() if hasattr(t, "full_tensor") else t) for n, t in base0.items()}
    ad0 = {n: t.clone() for n, t in lora.adapter_tensors(engine.model)}
    source = InProcessSource(make_batches(STEPS, seed=1)) if rank == 0 else None
    ckpt_dir = Path(kw["tmp"]) / "ckpt"
    learner = Learner(
        engine, cfg, source=source, max_steps=STEPS, checkpoint_dir=ckpt_dir, export_root=Path(kw["tmp"]) / "export"
    )
    history = learner.run()
    base1 = {n: t for n, t in engine.model.state_dict().items() if not lora.is_adapter_name(n)}
    base1 = {n: (t.full_tensor() if hasattr(t, "full_tensor") else t) for n, t in base1.items()}
    ad1 = {n: t.clone() for n, t in lora.adapter_tensors(engine.model)}
    merged = {n: t.clone() for n, t in engine.full_tensors()}
    n_opt_state = len(engine.optimizer.state)
    no_ref_copy = engine.ref_model is None  # the KL reference is the base with the adapters off
    n_adapter = len(lora.adapter_parameters(engine.model))
    exported = learner.export()

    # A fresh learner (other seed: other initial A; meta-device build) resumes from the checkpoint.
    engine2 = FSDPEngine(config("on"), kw["model"], total_steps=STEPS + 1, seed=7)
    ad_fresh = {n: t.clone() for n, t in lora.adapter_tensors(engine2.model)}
    resumed = engine2.load_checkpoint(ckpt.latest(ckpt_dir))["version"] == STEPS
    ad2 = {n: t for n, t in lora.adapter_tensors(engine2.model)}
    opt_equal = all(
        torch.equal(engine.optimizer.state[p1][k], engine2.optimizer.state[p2][k])
        for (_, p1), (_, p2) in zip(
            lora.adapter_parameters(engine.model), lora.adapter_parameters(engine2.model), strict=True
        )
        for k in ("exp_avg", "exp_avg_sq")
    )
    if rank == 0:
        from safetensors.torch import load_file

        from learner.lora import PEFT_PREFIX

        folder = Path(exported) / "adapter"
        peft = load_file(str(folder / "adapter_model.safetensors"))
        hf = load_file(str(Path(exported) / "model.safetensors"))
        import torch.distributed.checkpoint as dcp

        stored = dcp.FileSystemReader(str(ckpt.latest(ckpt_dir) / "dcp")).read_metadata().state_dict_metadata
        model_keys = [k.removeprefix("model.") for k in stored if k.startswith("model.")]
        result = {
            "base_unchanged": all(torch.equal(base0[n], base1[n]) for n in base0),
            "a_changed": all(not torch.equal(ad0[n], ad1[n]) for n in ad0 if ".lora_A." in n),
            "b_changed": all(not torch.equal(ad0[n], ad1[n]) for n in ad0 if ".lora_B." in n),
            "b_started_zero": all(not ad0[n].any() for n in ad0 if ".lora_B." in n),
            "n_adapter": n_adapter,
            "n_opt_state": n_opt_state,
            "no_ref_copy": no_ref_copy,
            "kl": [h.get("learner/loss_kl") for h in history],
            "excluded": not any("down_proj" in n for n in ad0),
            "resumed": resumed,
            "fresh_differs": any(not torch.equal(ad_fresh[n], ad1[n]) for n in ad1),
            "resume_bit_exact": all(torch.equal(ad1[n], ad2[n]) for n in ad1),
            "opt_bit_exact": opt_equal,
            "peft_equal": sorted(peft) == sorted(ad1) and all(torch.equal(peft[n], ad1[n]) for n in ad1),
            "merged_equal": all(torch.equal(hf[n], merged[n]) for n in merged if n in hf),
            "merged_moved": sum(not torch.equal(merged[n], base1[n]) for n in merged),
            "ckpt_model_keys": sorted(model_keys),
            "adapter_keys": sorted(n.removeprefix(PEFT_PREFIX) for n in ad1),
            "peft_prefix_ok": all(n.startswith(PEFT_PREFIX) for n in peft),
        }
        Path(kw["out"]).write_text(json.dumps(result))
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # bf16: each adapter its own FSDP unit
def test_lora_trains_only_adapters_and_resumes_bit_exact(tmp_path, dtype):
    model = make_tiny_model(tmp_path / "tiny")
    out = tmp_path / "result.json"
    run_procs(_rank, 2, {"model": str(model), "tmp": str(tmp_path), "out": str(out), "dtype": dtype}, 240, "fork")
    r = json.loads(out.read_text())
    assert r["base_unchanged"] and r["b_started_zero"] and r["a_changed"] and r["b_changed"], r
    # KL to the base: zero at step 1 (B = 0: the policy is the base), positive once the adapters moved.
    assert r["no_ref_copy"] and r["kl"][0] == 0 and r["kl"][1] > 0, r["kl"]
    assert r["excluded"] and r["n_opt_state"] == r["n_adapter"] == 2 * 2 * 6  # 2 layers x 6 linears x (A, B)
    assert r["resumed"] and r["fresh_differs"] and r["resume_bit_exact"] and r["opt_bit_exact"], r
    assert r["peft_prefix_ok"] and r["peft_equal"] and r["merged_equal"], r
    assert r["merged_moved"] == 2 * 6  # exactly the adapted linears' weights differ from the base
    # The checkpoint's model part is the adapters alone: the frozen base is the model folder's.
    assert r["ckpt_model_keys"] == r["adapter_keys"]
