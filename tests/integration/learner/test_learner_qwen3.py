"""The FSDP learner on a random tiny Qwen3 (QK-norm) on CPU, and steps that change no weights.

One real gloo rank process: an FSDP2 engine and the training loop on an in-process source. Step 1
trains (QK-norm weights move, the weights are published); step 2's groups are all uniform, so the
optimizer does not step, nothing is published and the loop calls its ``on_unchanged`` hook
instead. The HF export loads back as transformers' ``Qwen3ForCausalLM`` and computes the learner's
log-probs.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.support.learner_testkit import VOCAB, make_batches, run_procs

pytestmark = pytest.mark.timeout(240)


def make_tiny_qwen3(out: Path) -> Path:
    import torch
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_hidden_layers=2,
        intermediate_size=96,
        vocab_size=VOCAB,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():  # random QK-norm weights, so a wrong mapping of them cannot go unnoticed
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(out)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t3")),
        pad_token="t0",
        bos_token="t1",
        eos_token="t2",
        unk_token="t3",
    )
    tok.save_pretrained(out)
    return out


def _uniform(batch):
    import pyarrow as pa

    i = batch.schema.get_field_index("reward")
    cols = list(batch.columns)
    cols[i] = pa.array(np.ones(batch.num_rows), batch.schema.field(i).type)
    return pa.RecordBatch.from_arrays(cols, schema=batch.schema)


def _rank(rank: int, world_size: int, port: int, kw: dict) -> None:
    import os

    import torch

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        OMP_NUM_THREADS="1",
    )
    from learner.batch import MicroBatch
    from learner.config import LearnerConfig
    from learner.engine import packed_forward
    from learner.fsdp import FSDPEngine
    from learner.loop import Learner
    from learner.run import init_distributed
    from learner.source import InProcessSource

    init_distributed("gloo", timeout_s=120)
    cfg = LearnerConfig.model_validate(
        {
            "loss": {"correction": "decoupled"},
            "micro_batch_tokens": 64,
            "optim": {"lr": 1e-2, "grad_clip": 1.0},
            "logprob_probe_tolerance": None,
        }
    )  # synthetic behaviour log-probs
    engine = FSDPEngine(cfg, kw["model"], total_steps=2, seed=0)
    batches = make_batches(2, seed=3)
    batches[1] = _uniform(batches[1])

    def norms() -> dict[str, list[float]]:
        return {
            n: t.float().tolist() for n, t in engine.full_tensors() if n.endswith(("q_norm.weight", "k_norm.weight"))
        }

    published, unchanged, before = [], [], norms()
    learner = Learner(
        engine,
        cfg,
        source=InProcessSource(batches),
        max_steps=2,
        publish=lambda v, e: published.append((v, [n for n, _ in e.full_tensors()])),
        on_unchanged=unchanged.append,
        export_root=Path(kw["out"]) / "export",
    )
    m1 = learner.step()
    after1 = norms()
    m2 = learner.step()
    after2 = norms()
    learner.export()
    # the learner's log-probs of one packed sequence, for the comparison with the exported model
    ids = torch.arange(3, 20, dtype=torch.int64)
    mb = MicroBatch(
        input_ids=ids[:-1].view(1, -1),
        position_ids=torch.arange(len(ids) - 1).view(1, -1),
        target_index=torch.arange(len(ids) - 1),
        targets=ids[1:],
        behaviour_logp=torch.zeros(len(ids) - 1),
        advantages=torch.zeros(len(ids) - 1),
        weights=torch.zeros(len(ids) - 1),
        seq_lens=torch.tensor([len(ids) - 1]),
        fresh=torch.zeros(len(ids) - 1, dtype=torch.bool),
    )
    with torch.no_grad():
        logp, _ = packed_forward(engine.model, mb, 1.0)
    Path(kw["out"], "result.json").write_text(
        json.dumps(
            {
                "published": published,
                "unchanged": unchanged,
                "skipped": [m1["learner/step_skipped"], m2["learner/step_skipped"]],
                "loss1": m1["learner/loss_total"],
                "before": before,
                "after1": after1,
                "after2": after2,
                "publishes_skipped": learner.publishes_skipped,
                "logp": logp.tolist(),
                "ids": ids.tolist(),
            }
        )
    )


def test_fsdp_trains_qwen3_and_skips_the_publish_of_a_step_without_update(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, Qwen3ForCausalLM

    model = make_tiny_qwen3(tmp_path / "qwen3")
    run_procs(_rank, 1, {"model": str(model), "out": str(tmp_path)}, timeout=200, start_method="fork")
    r = json.loads((tmp_path / "result.json").read_text())
    hf_names = list(Qwen3ForCausalLM.from_pretrained(model).state_dict())
    # step 1 trained and published every HF tensor, QK-norms included; step 2 changed nothing
    assert r["skipped"] == [0.0, 1.0] and np.isfinite(r["loss1"])
    assert [v for v, _ in r["published"]] == [1] and r["unchanged"] == [2] and r["publishes_skipped"] == 1
    assert r["published"][0][1] == hf_names
    assert any(r["before"][n] != r["after1"][n] for n in r["before"])  # the QK-norm weights learned
    assert r["after1"] == r["after2"]  # bit-identical: no optimizer step (no momentum, no decay)
    # the export is a transformers Qwen3 that computes the learner's log-probs
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export" / "latest", dtype=torch.float32)
    assert isinstance(exported, Qwen3ForCausalLM)
    ids = torch.tensor([r["ids"]])
    with torch.no_grad():
        ref = torch.log_softmax(exported(ids[:, :-1]).logits.float(), -1)[0].gather(-1, ids[0, 1:, None])[:, 0]
    # same fp32 weights and the same ops; only the order of float sums may differ (SDPA vs packed path)
    assert torch.allclose(torch.tensor(r["logp"]), ref, atol=1e-4)
