"""Ulysses SP pieces that need no process group: the row slicing, the key/value head replication, the
block-causal mask, and the layout checks of the config and of ``--learner-gpus`` / ``cpu_processes``.
The multi-rank equivalence (loss and gradients against SP=1) is tests/integration/learner/test_learner_ulysses.py.
"""

from __future__ import annotations

import pytest
import torch

from broker.schema import Trajectory, to_record_batch
from core.configbase import ConfigError
from learner import ulysses
from learner.batch import plan_step
from learner.config import LearnerConfig, MegatronConfig

LOSS = {"correction": "decoupled"}


def _batch(shapes):
    trajs = []
    for i, (p, r) in enumerate(shapes):
        trajs.append(
            Trajectory(
                traj_id=f"t{i}",
                group_id=f"g{i // 2}",
                sample_index=i % 2,
                group_size=2,
                step=1,
                prompt_ids=[3 + (7 * i + j) % 50 for j in range(p)],
                response_ids=[5 + (3 * i + j) % 40 for j in range(r)],
                behaviour_logprobs=[-1.0 - 0.01 * j for j in range(r)],
                segment_starts=[0],
                segment_versions=[0],
                reward=float(i % 2),
                finish_reason="stop",
                engine_id="e",
                data_source="s",
            )
        )
    return to_record_batch(trajs)


def _row(shapes):
    plan = plan_step(
        _batch(shapes),
        rank=0,
        world_size=1,
        micro_batch_tokens=10_000,
        advantage="mean",
        drop_uniform=False,
        aggregation="token",
    )
    assert len(plan.micro_batches) == 1
    return plan.micro_batches[0]


# one-token sequence (prompt 1 + response 1), uneven lengths; 3 + 9 + 1 + 6 = 19 input tokens
SHAPES = [(2, 2), (4, 6), (1, 1), (3, 4)]


@pytest.mark.parametrize("sp", [2, 3, 4])
def test_slices_cover_every_token_once(sp):
    whole = _row(SHAPES)
    n = whole.n_tokens
    pad = (-n) % sp
    slices = [ulysses.shard_micro_batch(_row(SHAPES), r, sp) for r in range(sp)]
    t = (n + pad) // sp
    assert all(s.n_tokens == t for s in slices)
    ids = torch.cat([s.input_ids for s in slices], dim=1)
    pos = torch.cat([s.position_ids for s in slices], dim=1)
    assert torch.equal(ids[:, :n], whole.input_ids) and torch.equal(pos[:, :n], whole.position_ids)
    assert torch.equal(pos[0, n:], torch.arange(pad))  # the dummy sequence restarts at 0: its own segment
    # every response token on exactly one slice, in order, with all its per-token values
    glob = torch.cat([s.target_index + r * t for r, s in enumerate(slices)])
    assert torch.equal(glob, whole.target_index)
    for name in ("targets", "behaviour_logp", "advantages", "weights", "fresh"):
        assert torch.equal(torch.cat([getattr(s, name) for s in slices]), getattr(whole, name)), name
    for s in slices:  # the whole padded row's segments, as attention sees it after the exchange
        assert s.cu_seqlens.tolist() == whole.cu_seqlens.tolist() + ([n + pad] if pad else [])
        assert s.max_seqlen == max(whole.max_seqlen, pad)


def test_slicing_is_idempotent_and_refuses_another_layout():
    mb = ulysses.shard_micro_batch(_row(SHAPES), 1, 2)
    before = mb.target_index.clone()
    assert ulysses.shard_micro_batch(mb, 1, 2) is mb and torch.equal(mb.target_index, before)
    with pytest.raises(RuntimeError, match="already sliced"):
        ulysses.shard_micro_batch(mb, 0, 2)


def test_block_causal_mask():
    m = ulysses.block_causal_mask(torch.tensor([0, 2, 3, 5], dtype=torch.int32), torch.device("cpu"))
    want = torch.tensor(
        [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 0, 1, 0], [0, 0, 0, 1, 1]], dtype=torch.bool
    )
    assert torch.equal(m, want)


@pytest.mark.parametrize(
    ("heads", "kv", "sp", "rep"),
    [(4, 2, 2, 1), (4, 2, 4, 2), (8, 1, 4, 4), (12, 4, 6, 3), (28, 4, 7, 7), (14, 2, 1, 1)],
)
def test_kv_repeat(heads, kv, sp, rep):
    assert ulysses.kv_repeat(heads, kv, sp) == rep


def test_kv_repeat_refuses_heads_that_do_not_split():
    with pytest.raises(ValueError, match="does not divide the model's 6 attention heads"):
        ulysses.kv_repeat(6, 2, 4)


@pytest.mark.parametrize(("heads", "kv", "sp"), [(4, 2, 2), (4, 2, 4), (8, 1, 4), (12, 4, 6)])
def test_head_split_with_repeated_kv_is_gqa_attention(heads, kv, sp):
    """What the SP ranks compute between the two all-to-alls (each on heads/sp query heads and its share of the
    repeated key/value heads), put back together, equals grouped-query attention over all heads."""
    torch.manual_seed(0)
    cu = torch.tensor([0, 3, 4, 9], dtype=torch.int32)
    t, d = 9, 8
    q, k, v = torch.randn(1, heads, t, d), torch.randn(1, kv, t, d), torch.randn(1, kv, t, d)
    want = ulysses._sdpa_full(q, k, v, cu, d**-0.5, 0.0)  # GQA: each query head on its own key/value group
    rep = ulysses.kv_repeat(heads, kv, sp)
    k2, v2 = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    hq, hk = heads // sp, k2.shape[1] // sp
    parts = [
        ulysses._sdpa_full(
            q[:, j * hq : (j + 1) * hq], k2[:, j * hk : (j + 1) * hk], v2[:, j * hk : (j + 1) * hk], cu, d**-0.5, 0.0
        )
        for j in range(sp)
    ]
    # same kernel on the same per-head operands: fp32 differences come only from batching heads differently
    torch.testing.assert_close(torch.cat(parts, dim=2), want, rtol=1e-6, atol=1e-6)


def test_config_layout_checks():
    lc = LearnerConfig(loss=LOSS, sequence_parallel_size=3)
    with pytest.raises(ConfigError) as e:
        lc.check_sequence_parallel(4, {"num_attention_heads": 4})
    assert "does not divide the learner's 4 ranks" in str(e.value) and "4 attention heads" in str(e.value)
    LearnerConfig(loss=LOSS, sequence_parallel_size=2).check_sequence_parallel(4, {"num_attention_heads": 4})
    with pytest.raises(ValueError, match="FSDP engine's Ulysses"):
        LearnerConfig(loss=LOSS, engine="megatron", sequence_parallel_size=2)
    with pytest.raises(ValueError, match="not 'eager'"):
        LearnerConfig(loss=LOSS, attn_implementation="eager", sequence_parallel_size=2)
    with pytest.raises(ValueError, match="TransformerEngine"):
        MegatronConfig(context_parallel_size=2)


def test_launcher_refuses_a_layout_that_does_not_divide():
    from launch.cluster import resolve_config, run_parser

    with pytest.raises(ConfigError, match="sequence_parallel_size=2 does not divide the learner's 3 ranks"):
        resolve_config(
            run_parser().parse_args(["--recipe", "tiny", "learner.cpu_processes=3", "learner.sequence_parallel_size=2"])
        )
    with pytest.raises(ConfigError, match="sequence_parallel_size=3 does not divide the model's 4 attention heads"):
        resolve_config(
            run_parser().parse_args(["--recipe", "tiny", "learner.cpu_processes=3", "learner.sequence_parallel_size=3"])
        )
    cfg = resolve_config(
        run_parser().parse_args(["--recipe", "tiny", "learner.cpu_processes=4", "learner.sequence_parallel_size=2"])
    )
    assert cfg.learner.sequence_parallel_size == 2
