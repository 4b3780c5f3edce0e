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
    cfg = Qwen2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                      intermediate_size=128, vocab_size=96, max_position_embeddings=256)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=torch.float32).eval()


def batch(n_groups=3, group_size=3, seed=0):
    rng = np.random.default_rng(seed)
    trajs = []
    for g in range(n_groups):
        prompt = rng.integers(3, 96, size=int(rng.integers(1, 7))).tolist()
        for i in range(group_size):
            n = int(rng.integers(1, 9))
            trajs.append(Trajectory(traj_id=f"g{g}/{i}", group_id=f"g{g}", sample_index=i, group_size=group_size,
                                    step=1, prompt_ids=prompt, response_ids=rng.integers(3, 96, size=n).tolist(),
                                    behaviour_logprobs=[-1.0] * n, reward=float(i == g % group_size)))
    return to_record_batch(trajs)


def unpacked_logprobs(model, prompt, response):
    ids = torch.tensor([list(prompt) + list(response)])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    lp = torch.log_softmax(logits[len(prompt) - 1:-1], -1)
    return lp.gather(-1, torch.tensor(response).view(-1, 1)).squeeze(-1)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_logprobs_equal_unpacked(attn):
    torch.set_num_threads(1)
    model = tiny_qwen2(attn)
    b = batch()
    plan = plan_step(b, rank=0, world_size=1, micro_batch_tokens=10_000, advantage="mean",
                     drop_uniform=False, aggregation="token")
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
    plans = [plan_step(b, rank=r, world_size=world_size, micro_batch_tokens=16, advantage="mean_std",
                       drop_uniform=True, aggregation="token") for r in range(world_size)]
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
    t = Trajectory(traj_id="g/0", group_id="g", sample_index=0, group_size=1, step=1, prompt_ids=[],
                   response_ids=[5], behaviour_logprobs=[-1.0])
    with pytest.raises(ValueError, match="prompt token"):
        plan_step(to_record_batch([t]), rank=0, world_size=1, micro_batch_tokens=16, advantage="mean",
                  drop_uniform=False, aggregation="token")


def test_plan_of_only_uniform_groups_has_nothing_to_train():
    trajs = [Trajectory(traj_id=f"g/{i}", group_id="g", sample_index=i, group_size=2, step=1, prompt_ids=[4, 5],
                        response_ids=[6, 7], behaviour_logprobs=[-1.0, -1.0], reward=1.0) for i in range(2)]
    plan = plan_step(to_record_batch(trajs), rank=0, world_size=2, micro_batch_tokens=16, advantage="mean_std",
                     drop_uniform=True, aggregation="token")
    assert plan.stats["samples_trained"] == 0 and plan.stats["samples_dropped_uniform"] == 2
    (mb,) = plan.micro_batches  # one filler so collectives stay in step
    assert mb.rows == [] and float(mb.weights.sum()) == 0.0


def test_mask_truncated_keeps_truncated_samples_out_of_the_loss_but_in_the_baseline():
    trajs = []
    for i, (reward, finish) in enumerate([(1.0, "stop"), (0.0, "length"), (0.0, "stop"), (1.0, "length")]):
        trajs.append(Trajectory(traj_id=f"g/{i}", group_id="g", sample_index=i, group_size=4, step=1,
                                prompt_ids=[5, 6], response_ids=[7 + i, 8], behaviour_logprobs=[-1.0, -1.0],
                                reward=reward, finish_reason=finish))
    b = to_record_batch(trajs)
    kw = dict(rank=0, world_size=1, micro_batch_tokens=64, advantage="mean", drop_uniform=True, aggregation="token")
    full, masked = plan_step(b, **kw), plan_step(b, mask_truncated=True, **kw)
    assert full.stats["samples_truncated"] == masked.stats["samples_truncated"] == 2
    assert sorted(r for mb in full.micro_batches for r in mb.rows) == [0, 1, 2, 3]
    assert sorted(r for mb in masked.micro_batches for r in mb.rows) == [0, 2]
    # the group's mean (0.5) still counts the truncated samples: the kept ones get +0.5 and -0.5
    adv = {r: float(mb.advantages[j * 2]) for mb in masked.micro_batches for j, r in enumerate(mb.rows)}
    assert adv == {0: 0.5, 2: -0.5}
