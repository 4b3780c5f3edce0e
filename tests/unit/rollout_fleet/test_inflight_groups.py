"""``rollout.max_inflight_groups=auto`` (the default): the launcher fills a GPU server's batch, ceil(max_num_seqs /
n) groups, and keeps 16 on CPU servers; a number given is kept, and anything below one group is refused by name.

With 16 groups of 8 a GPU server decoded 128 sequences where it takes 256 (the smollm2-gpu recipe), so a
synchronous step generated its 32 groups in two waves, each ending on its longest response."""

from __future__ import annotations

import pytest

from core.configbase import ConfigError
from launch.cluster import resolve_config, run_parser
from launch.config import load_run_config


def _resolved(*argv: str) -> int:
    return resolve_config(run_parser().parse_args(list(argv))).rollout.max_inflight_groups


def test_auto_fills_a_gpu_servers_batch_and_keeps_sixteen_on_cpu():
    assert _resolved("--recipe", "tiny") == 16  # CPU servers
    assert _resolved("--recipe", "tiny", "--simulate") == 16  # simulated: no GPU engine
    n = load_run_config("tiny", []).rollout.sampling.n
    assert _resolved("--gpus", "1", "--recipe", "tiny", "rollout.max_num_seqs=256") == -(-256 // n)
    assert _resolved("--rollout-gpus", "2", "--learner-gpus", "1", "--recipe", "tiny", "rollout.sampling.n=5") == 52
    assert _resolved("--gpus", "1", "--recipe", "tiny", "rollout.sampling.n=512") == 1  # n over the batch: one group


def test_a_given_number_is_kept_and_a_bad_one_refused():
    assert _resolved("--gpus", "1", "--recipe", "tiny", "rollout.max_inflight_groups=5") == 5
    with pytest.raises(ConfigError, match="max_inflight_groups"):
        _resolved("--recipe", "tiny", "rollout.max_inflight_groups=0")


def test_an_unresolved_auto_counts_as_cpu():
    rollout = load_run_config("tiny", []).rollout
    assert rollout.max_inflight_groups == "auto" and rollout.inflight_groups() == 16
    assert rollout.inflight_groups(gpu=True) == -(-rollout.max_num_seqs // rollout.sampling.n)
