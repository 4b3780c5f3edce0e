"""The fleet's status records: what the fleet actor answers to ``status`` and ``stop``.

Declared msgspec Structs (``forbid_unknown_fields``): a field the producer or a reader misspells is
an error, not a silent 0. They cross the Ray boundary as plain data (``msgspec.to_builtins``) and
are read back with ``msgspec.convert(data, FleetStatus)`` (see ``launch.snapshot``).
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec


class ServerState(enum.StrEnum):
    """Where a server is in the fleet controller's life cycle."""

    STARTING = "starting"  # being started (scale); takes work once it answers and is in the fleet
    HEALTHY = "healthy"  # takes work
    DRAINING = "draining"  # finishing its groups before removal (scale down)
    DEAD = "dead"  # failed its health probes, or stalled; its groups were re-queued
    RESTARTING = "restarting"  # being restarted by the factory
    REMOVED = "removed"  # gone from the fleet


def engine_name(engine: str, index: int) -> str:
    """The id the fleet gives server ``index`` of ``rollout.engine`` (``vllm-3``, ``sim-3``)."""
    return f"{'sim' if engine == 'simulated' else engine}-{index}"


class ServerStatus(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    engine_id: str
    index: int
    state: ServerState
    version: int
    simulated: bool
    outstanding_tokens: int
    inflight_groups: int
    groups_done: int
    tokens_done: int
    restarts: int
    pid: int | None
    tok_per_s: float
    silent_s: float = 0.0  # with requests in flight since its last answer (the stall detector's clock)


class WorkerStatus(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The rollout worker's counters."""

    groups_started: int = 0
    groups_pushed: int = 0
    groups_failed: int = 0
    groups_inflight: int = 0
    groups_cancelled: int = 0
    groups_reward_failed: int = 0
    groups_bad_request: int = 0  # refused by an engine (HTTP 4xx): dropped with a reason, not lost
    samples_truncated: int = 0  # finish reason 'length': cut at max_tokens
    samples_nonfinite_logprob: int = 0  # samples whose behaviour log-probs were not finite
    groups_resampled_nonfinite: int = 0  # groups generated again on the same ticket for that
    prompts_requeued_nonfinite: int = 0  # prompts put back after a resample failed too
    tickets_reused_after_drop: int = 0  # a given-up group's ticket carried the next prompt instead of expiring
    samples_pushed: int = 0
    tokens_pushed: int = 0
    mean_reward: float | None = None
    idle_s: float = 0.0
    # DAPO (rollout_fleet/shaping.py): groups scored, uniform groups filtered by dynamic sampling (never pushed),
    # uniform ones pushed after max_num_gen_batches tries, samples that got an overlong penalty
    groups_generated: int = 0
    groups_filtered: int = 0
    groups_filter_exhausted: int = 0
    samples_overlong_penalised: int = 0
    # multi-turn episodes (rollout.env): groups dropped by the reason of their failing episode, how
    # episodes ended (done / max_turns / max_tokens), model turns pushed
    env_errors: dict[str, int] = {}
    episode_ends: dict[str, int] = {}
    turns: int = 0
    # reward.model: the judge / reward-model client's calls, failed attempts by reason, calls per second
    reward_model: dict[str, Any] | None = None


class FleetStatus(WorkerStatus, kw_only=True, forbid_unknown_fields=True):
    """The fleet actor's answer: the worker's counters, the controller's servers and weight updates
    (the controller fills those, see ``FleetController.status``), and the service's rates."""

    version: int = 0
    servers: list[ServerStatus] = []
    groups_requeued: int = 0
    server_deaths: int = 0  # found dead: process gone, or health_failures failed probes
    server_stalls: int = 0  # alive but answering nothing for rollout.stall_timeout_s (taken out as a dead one)
    # silent servers kept because their generated-token count rose (long responses decoding), once per silence
    servers_kept_generating: int = 0
    weight_updates: int = 0
    weight_update_s: float = 0.0
    simulated: bool = False
    tok_per_s: float | None = None
    fleet_idle_fraction: float = 0.0
    healthy_servers: int = 0
    proxy_url: str | None = None  # rollout.proxy: where the OpenAI-compatible proxy serves
    proxy: dict[str, int] = {}  # its counters (proxy/requests, proxy/history_restarts, ...)
