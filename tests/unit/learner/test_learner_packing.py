"""Packed micro-batches: log-probs equal unpacked forwards; the step plan covers every sample once."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from broker.schema import Trajectory, to_record_batch
from learner.batch import plan_step
from learner.engine import packed_forward


def tiny_qwen2(attn: str):
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    cfg = Qwen2Config(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        intermediate_size=128,
        vocab_size=96,
        max_position_embeddings=256,
    )
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=torch.float32).eval()


def batch(n_groups=3, group_size=3, seed=0):
    rng = np.random.default_rng(seed)
    trajs = []
    for g in range(n_groups):
        prompt = rng.integers(3, 96, size=int(rng.integers(1, 7))).tolist()
        for i in range(group_size):
            n = int(rng.integers(1, 9))
            trajs.append(
                Trajectory(
                    traj_id=f"g{g}/{i}",
                    group_id=f"g{g}",
                    sample_index=i,
                    group_size=group_size,
                    step=1,
                    prompt_ids=prompt,
                    response_ids=rng.integers(3, 96, size=n).tolist(),
                    behaviour_logprobs=[-1.0] * n,
                    reward=float(i == g % group_size),
                )
            )
    return to_record_batch(trajs)


def unpacked_logprobs(model, prompt, response):
    ids = torch.tensor([list(prompt) + list(response)])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    lp = torch.log_softmax(logits[len(prompt) - 1 : -1], -1)
    return lp.gather(-1, torch.tensor(response).view(-1, 1)).squeeze(-1)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_logprobs_equal_unpacked(attn):
    torch.set_num_threads(1)
    model = tiny_qwen2(attn)
    b = batch()
    plan = plan_step(
        b, rank=0, world_size=1, micro_batch_tokens=10_000, advantage="mean", drop_uniform=False, aggregation="token"
    )
    (mb,) = plan.micro_batches
    assert len(mb.rows) == b.num_rows  # everything in one row: the test really packs
    with torch.no_grad():
        packed, entropy = packed_forward(model, mb)
    prompts, responses = b.column("prompt_ids").to_pylist(), b.column("response_ids").to_pylist()
    expected = torch.cat([unpacked_logprobs(model, prompts[i], responses[i]) for i in mb.rows])
    # fp32, same kernels; only the sequence boundaries differ, so agreement is to rounding.
    torch.testing.assert_close(packed, expected, rtol=1e-5, atol=1e-5)
    assert (entropy > 0).all() and (entropy <= np.log(96) + 1e-4).all()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_plan_covers_each_sample_once_with_global_weights(world_size):
    b = batch(n_groups=4, group_size=4, seed=1)
    plans = [
        plan_step(
            b,
            rank=r,
            world_size=world_size,
            micro_batch_tokens=16,
            advantage="mean_std",
            drop_uniform=True,
            aggregation="token",
        )
        for r in range(world_size)
    ]
    counts = {len(p.micro_batches) for p in plans}
    assert len(counts) == 1, "ranks must run the same number of micro-batches (FSDP collectives)"
    rows = sorted(r for p in plans for mb in p.micro_batches for r in mb.rows)
    trained = plans[0].stats["samples_trained"]
    assert len(rows) == len(set(rows)) == trained
    total_w = sum(float(mb.weights.sum()) for p in plans for mb in p.micro_batches)
    assert total_w == pytest.approx(1.0)
    resp_len = np.diff(b.column("response_ids").offsets.to_numpy())
    for p in plans:
        for mb in p.micro_batches:
            if not mb.rows:
                assert float(mb.weights.sum()) == 0.0  # filler micro-batch
                continue
            # one row per micro-batch, positions restart for each sequence, no padding tokens
            assert int((mb.position_ids[0] == 0).sum()) == len(mb.rows)
            assert mb.n_tokens == sum(len(b.column("prompt_ids")[i]) + resp_len[i] - 1 for i in mb.rows)
            assert mb.targets.numel() == sum(resp_len[i] for i in mb.rows)


def test_plan_rejects_a_sample_without_prompt():
    t = Trajectory(
        traj_id="g/0",
        group_id="g",
        sample_index=0,
        group_size=1,
        step=1,
        prompt_ids=[],
        response_ids=[5],
        behaviour_logprobs=[-1.0],
    )
    with pytest.raises(ValueError, match="prompt token"):
        plan_step(
            to_record_batch([t]),
            rank=0,
            world_size=1,
            micro_batch_tokens=16,
            advantage="mean",
            drop_uniform=False,
            aggregation="token",
        )


def test_plan_of_only_uniform_groups_has_nothing_to_train():
    trajs = [
        Trajectory(
            traj_id=f"g/{i}",
            group_id="g",
            sample_index=i,
            group_size=2,
            step=1,
            prompt_ids=[4, 5],
            response_ids=[6, 7],
            behaviour_logprobs=[-1.0, -1.0],
            reward=1.0,
        )
        for i in range(2)
    ]
    plan = plan_step(
        to_record_batch(trajs),
        rank=0,
        world_size=2,
        micro_batch_tokens=16,
        advantage="mean_std",
        drop_uniform=True,
        aggregation="token",
    )
    assert plan.stats["samples_trained"] == 0 and plan.stats["samples_dropped_uniform"] == 2
    (mb,) = plan.micro_batches  # one filler so collectives stay in step
    assert mb.rows == [] and float(mb.weights.sum()) == 0.0


def test_mask_truncated_keeps_truncated_samples_out_of_the_loss_but_in_the_baseline():
    trajs = []
    for i, (reward, finish) in enumerate([(1.0, "stop"), (0.0, "length"), (0.0, "stop"), (1.0, "length")]):
        trajs.append(
            Trajectory(
                traj_id=f"g/{i}",
                group_id="g",
                sample_index=i,
                group_size=4,
                step=1,
                prompt_ids=[5, 6],
                response_ids=[7 + i, 8],
                behaviour_logprobs=[-1.0, -1.0],
                reward=reward,
                finish_reason=finish,
            )
        )
    b = to_record_batch(trajs)
    kw = dict(rank=0, world_size=1, micro_batch_tokens=64, advantage="mean", drop_uniform=True, aggregation="token")
    full, masked = plan_step(b, **kw), plan_step(b, mask_truncated=True, **kw)
    assert full.stats["samples_truncated"] == masked.stats["samples_truncated"] == 2
    assert sorted(r for mb in full.micro_batches for r in mb.rows) == [0, 1, 2, 3]
    assert sorted(r for mb in masked.micro_batches for r in mb.rows) == [0, 2]
    # the group's mean (0.5) still counts the truncated samples: the kept ones get +0.5 and -0.5
    adv = {r: float(mb.advantages[j * 2]) for mb in masked.micro_batches for j, r in enumerate(mb.rows)}
    assert adv == {0: 0.5, 2: -0.5}


def _valued_batch():
    """Groups of different sizes, one uniform (dropped); every response token carries a distinct behaviour
    log-prob (-(row + pos / 100) / 10) and every row a distinct reward, so a value from another row or
    position is seen; segment versions differ per row so ``fresh`` is checked too."""
    trajs, row = [], 0
    for g, rewards in enumerate([[0.0, 1.0, 3.0], [2.0, 2.0], [5.0, 1.0, 0.0, 4.0]]):
        for i, r in enumerate(rewards):
            n = 2 + (row * 3) % 5
            trajs.append(
                Trajectory(
                    traj_id=f"g{g}/{i}",
                    group_id=f"g{g}",
                    sample_index=i,
                    group_size=len(rewards),
                    step=3,
                    prompt_ids=[3 + row, 4],
                    response_ids=[10 + row] * n,
                    behaviour_logprobs=[-(row + p / 100) / 10 for p in range(n)],
                    segment_starts=[0, 1] if row % 2 else [0],
                    segment_versions=[1, 2] if row % 2 else [row % 3 + 0],
                    reward=r,
                )
            )
            row += 1
    return to_record_batch(trajs)


@pytest.mark.parametrize("world_size,budget", [(1, 10_000), (1, 12), (2, 12), (3, 7)])
def test_packed_values_belong_to_their_own_sequence(world_size, budget):
    from learner.losses import group_advantages

    b = _valued_batch()
    rewards = torch.tensor(b.column("reward").to_pylist())
    _, gidx = np.unique(b.column("group_id").to_numpy(zero_copy_only=False), return_inverse=True)
    adv, keep = group_advantages(rewards, torch.from_numpy(gidx), "mean_std", drop_uniform=True)
    behav = b.column("behaviour_logprobs").to_pylist()
    seen = []
    for r in range(world_size):
        plan = plan_step(
            b,
            rank=r,
            world_size=world_size,
            micro_batch_tokens=budget,
            advantage="mean_std",
            drop_uniform=True,
            aggregation="token",
            learner_version=2,
        )
        for mb in plan.micro_batches:
            pos = 0
            for row, n in zip(mb.rows, mb.seq_lens.tolist(), strict=True):
                seen.append(row)
                # exact: copies of the same float32 values, no arithmetic
                assert mb.advantages[pos : pos + n].tolist() == [float(adv[row])] * n, f"advantage of row {row}"
                assert mb.behaviour_logp[pos : pos + n].tolist() == torch.tensor(behav[row]).tolist(), f"row {row}"
                assert mb.targets[pos : pos + n].tolist() == [10 + row] * n
                # odd rows: version 1 then 2 from token 1 on; even rows: version row % 3
                want = [p >= 1 for p in range(n)] if row % 2 else [row % 3 == 2] * n
                assert mb.fresh[pos : pos + n].tolist() == want, f"fresh of row {row}"
                pos += n
            assert pos == mb.targets.numel()
    assert sorted(seen) == [i for i in range(b.num_rows) if keep[i]]
    assert 3 not in seen and 4 not in seen  # the uniform group [2, 2]


def test_mini_batches_hold_whole_groups_with_their_own_weights():
    from learner.minibatch import combine_steps, epoch_orders, group_split, plan_mini_batches

    b = _valued_batch()
    plans, stats = plan_mini_batches(
        b,
        groups_per_mini=1,
        rank=0,
        world_size=1,
        micro_batch_tokens=64,
        advantage="mean_std",
        drop_uniform=True,
        aggregation="token",
    )
    # groups g0 (rows 0-2) and g2 (rows 5-8) are trainable; g1 is uniform and never forms a mini-batch
    assert [sorted(r for mb in p.micro_batches for r in mb.rows) for p in plans] == [[0, 1, 2], [5, 6, 7, 8]]
    for p in plans:  # each optimizer step is a mean over its own mini-batch
        assert sum(float(mb.weights.sum()) for mb in p.micro_batches) == pytest.approx(1.0)
    assert stats["mini_batches"] == 2 and stats["samples_trained"] == 7 and stats["samples"] == 9
    whole, _ = plan_mini_batches(
        b,
        groups_per_mini=None,
        rank=0,
        world_size=1,
        micro_batch_tokens=64,
        advantage="mean_std",
        drop_uniform=True,
        aggregation="token",
    )
    assert len(whole) == 1 and sorted(whole[0].micro_batches[0].rows) == [0, 1, 2, 5, 6, 7, 8]
    # the same advantages either way (computed over the whole step batch)
    adv = {r: float(mb.advantages[0]) for p in plans for mb in p.micro_batches for r in mb.rows[:1]}
    assert adv[0] == float(whole[0].micro_batches[0].advantages[0])
    masks = group_split(b, np.ones(b.num_rows, bool), 2)
    assert [np.flatnonzero(m).tolist() for m in masks] == [[0, 1, 2, 3, 4], [5, 6, 7, 8]]
    assert epoch_orders(3, 2, step=7)[0] == [0, 1, 2] and sorted(epoch_orders(3, 2, step=7)[1]) == [0, 1, 2]
    c = combine_steps(
        [
            {"loss_total": 1.0, "is_weight_max": 2.0, "step_seconds": 1.0, "clip_frac": 0.0},
            {"loss_total": 3.0, "is_weight_max": 1.5, "step_seconds": 2.0, "clip_frac": 0.5},
        ]
    )
    assert c == {
        "loss_total": 2.0,
        "is_weight_max": 2.0,
        "step_seconds": 3.0,
        "clip_frac": 0.25,
        "optimizer_steps": 2.0,
        "clip_frac_last": 0.5,
    }
