"""``learner.loss.uniform_groups_in_mean``: uniform groups skipped, yet counted in the loss's mean, give the
gradient of training them (verl's GRPO without DAPO's filter), on a real (tiny) model's backward pass.

The model is an embedding and a linear head in float64, so "the same gradient" is checked to 1e-12 relative: the
two computations differ only in the order of additions and in terms that are exactly zero (advantage 0).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from core.configbase import ConfigError
from learner.config import LearnerConfig
from learner.losses import LossSettings, mean_share, policy_loss
from learner.minibatch import plan_mini_batches
from tests.support.broker_groups import make_groups

VOCAB = 1000  # make_groups draws token ids below 1000


def _batch() -> pa.RecordBatch:
    """Four groups of 4 (two of them uniform), responses of 5 and 9 tokens, so token and sequence means differ."""
    parts = [
        make_groups(["a", "b"], step=1, version=0, group_size=4, resp_len=5, rng=np.random.default_rng(1)),
        make_groups(["c", "d"], step=1, version=0, group_size=4, resp_len=9, rng=np.random.default_rng(2)),
    ]
    b = pa.Table.from_batches(parts).combine_chunks().to_batches()[0]
    cols = {name: b.column(name) for name in b.schema.names}
    # a: learns, b: uniform 0, c: uniform 1, d: learns
    rewards = [1, 0, 0, 1] + [0] * 4 + [1] * 4 + [0, 1, 1, 1]
    cols["reward"] = pa.array(np.asarray(rewards, np.float32))
    return pa.RecordBatch.from_pydict(cols, schema=b.schema)


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.emb = torch.nn.Parameter(torch.randn(VOCAB, 8, generator=g, dtype=torch.float64) * 0.1)
        self.head = torch.nn.Parameter(torch.randn(8, VOCAB, generator=g, dtype=torch.float64) * 0.1)

    def logp(self, mb) -> torch.Tensor:
        logits = self.emb[mb.input_ids[0]] @ self.head  # [T, V]
        return torch.log_softmax(logits, -1)[mb.target_index, mb.targets]


def _grads(batch, aggregation: str, *, drop: bool, in_mean: bool, mini: int | None) -> list[torch.Tensor]:
    """One flat gradient per optimizer step of the batch (policy moved off the sampler so ratios are not 1)."""
    plans, _ = plan_mini_batches(
        batch,
        groups_per_mini=mini,
        rank=0,
        world_size=1,
        micro_batch_tokens=40,  # several micro-batches a step
        advantage="mean_std",
        drop_uniform=drop,
        aggregation=aggregation,
        learner_version=0,
        loss_scale_factor=9,
        uniform_in_mean=in_mean,
    )
    model, s = Tiny(), LossSettings(correction="none")
    out = []
    for plan in plans:
        model.zero_grad()
        for mb in plan.micro_batches:
            if not mb.rows:
                continue
            logp = model.logp(mb)
            behaviour = logp.detach() + 0.3 * torch.cos(torch.arange(len(logp), dtype=torch.float64))
            loss, _ = policy_loss(
                logp,
                behaviour.float(),
                mb.advantages,
                mb.weights,
                s,
                seq_lens=mb.seq_lens,
                loss_scale=mb.loss_scale,
            )
            loss.backward()
        out.append(torch.cat([model.emb.grad.flatten(), model.head.grad.flatten()]).clone())
    return out


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool((a - b).norm() <= 1e-12 * b.norm())


@pytest.mark.parametrize(
    "aggregation", ["token", "sequence", "token_sum", "seq_mean_token_sum", "seq_mean_token_sum_norm"]
)
def test_skipped_uniform_groups_in_the_mean_give_the_gradient_of_training_them(aggregation):
    batch = _batch()
    (trained,) = _grads(batch, aggregation, drop=False, in_mean=False, mini=None)
    (skipped,) = _grads(batch, aggregation, drop=True, in_mean=True, mini=None)
    assert trained.norm() > 0
    assert _close(skipped, trained), float((skipped - trained).norm() / trained.norm())
    (dropped,) = _grads(batch, aggregation, drop=True, in_mean=False, mini=None)
    if aggregation == "token_sum":  # a sum has no denominator: dropping changes nothing
        assert _close(dropped, trained)
    else:  # fleetrl's plain drop divides by the kept tokens or sequences only: a larger gradient
        assert not _close(dropped, trained) and dropped.norm() > trained.norm()


def test_mini_batches_count_their_own_uniform_groups():
    """Mini-batches of two groups in order a, b | c, d: each mean counts its own uniform group, as verl's split
    of the whole batch would."""
    batch = _batch()
    trained = _grads(batch, "token", drop=False, in_mean=False, mini=2)
    skipped = _grads(batch, "token", drop=True, in_mean=True, mini=2)
    assert len(trained) == len(skipped) == 2
    for a, b in zip(skipped, trained, strict=True):
        assert _close(a, b)


def test_a_mini_batch_of_uniform_groups_alone_is_left_out():
    batch = _batch()
    trained = _grads(batch, "token", drop=False, in_mean=False, mini=1)  # a | b | c | d
    skipped = _grads(batch, "token", drop=True, in_mean=True, mini=1)  # a | d
    assert len(trained) == 4 and len(skipped) == 2
    assert trained[1].norm() < 1e-12 * trained[0].norm() and trained[2].norm() < 1e-12 * trained[0].norm()
    assert _close(skipped[0], trained[0]) and _close(skipped[1], trained[3])


def test_mean_share_by_mode_and_bad_counts():
    assert mean_share("token", 10, 2, 40, 8) == 0.25
    assert mean_share("sequence", 10, 2, 40, 8) == mean_share("seq_mean_token_sum_norm", 10, 2, 40, 8) == 0.25
    assert mean_share("token_sum", 10, 2, 40, 8) == 1.0
    with pytest.raises(ValueError, match="within all"):
        mean_share("token", 41, 2, 40, 8)
    with pytest.raises(ValueError, match="aggregation must be one of"):
        mean_share("tokens", 1, 1, 1, 1)


@pytest.mark.parametrize(
    "extra, reason",
    [
        ({"loss": {"drop_uniform_groups": False}}, "nothing is skipped"),
        ({"loss": {"advantage": "reinforce_plus_plus_baseline"}}, "non-zero advantage"),
        ({"loss": {"entropy_coeff": 0.001}}, "entropy or KL term"),
        ({"loss": {"kl_coef": 0.001}}, "entropy or KL term"),
        ({"kl_reward": {"enable": True}}, "KL in the reward"),
    ],
)
def test_the_config_refuses_where_skipping_would_change_the_gradient(extra, reason):
    base = {"loss": {"correction": "none", "uniform_groups_in_mean": True}}
    LearnerConfig.model_validate(base)  # the plain case is legal
    cfg = {**base, **{k: v for k, v in extra.items() if k != "loss"}}
    cfg["loss"] = {**base["loss"], **extra.get("loss", {})}
    with pytest.raises((ConfigError, ValueError), match=reason):
        LearnerConfig.model_validate(cfg)
