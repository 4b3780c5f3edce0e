"""The learner's status record: what rank 0 (or the simulated learner) answers to ``status``.

A declared msgspec Struct (``forbid_unknown_fields``): a misspelt field is an error at either end,
not a silent 0. It crosses the Ray boundary as plain data (``msgspec.to_builtins``) and is read back
with ``msgspec.convert(data, LearnerStatus)`` (see ``launch.snapshot``).
"""

from __future__ import annotations

import msgspec


class LearnerStatus(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    simulated: bool = False
    step: int = 0  # the policy version: optimizer steps applied
    rank: int = 0
    world_size: int = 1  # ranks that train (0 until the real learner's process group is up)
    learner_wait_s: float = 0.0  # seconds spent waiting for batches
    learner_idle_fraction: float = 0.0
    groups_consumed: int = 0
    samples_consumed: int = 0  # the simulated learner counts samples
    reward: float | None = None  # mean reward of the last step's batch
    reward_per_step: list[float] = []
    staleness_hist: dict[str, int] = {}  # staleness in versions -> samples consumed
    max_staleness_seen: int = 0
    bound_violations: int = 0
    publish_s: float = 0.0
    publishes: int = 0  # publishes that reached at least one engine
    last_published_version: int = 0
    publish_errors: int = 0
    publishes_skipped: int = 0  # steps that changed no weights: engines relabelled, nothing published
    done: bool = False
    error: str | None = None
    # PPO (learner.critic): the last step's value loss and explained variance (learner/critic.py)
    critic_vf_loss: float | None = None
    critic_explained_var: float | None = None
    rank_steps: list[int | None] | None = None  # steps each rank applied, in rank order (set at stop)
    settings: dict[str, str | int | bool] | None = None  # the learner's resolved fast path (learner/fastpath.py)
