"""The JSON summary of a run (``--summary PATH`` and ``<run_dir>/summary.json``).

Group accounting, from the three places a group can be at the end of a run::

    produced  = groups the broker accepted from the fleet
    consumed  = groups the learner trained on (acked leases; the broker's ack count if the
                learner died and gave no final status)
    dropped   = groups the broker refused to hand out, by reason (e.g. ``stale``)
    queued    = groups still waiting in the broker, or leased and not acked, at shutdown
    lost      = produced - consumed - dropped - queued      (must be 0)
              + groups the fleet gave up on after retries (``groups_failed``)

Groups whose reward could not be computed are dropped by the fleet before the broker
(``groups_dropped["reward_error"]``): dropped with a reason, not lost.

Groups whose generation was still running at shutdown never reached the broker; they
are reported as ``groups_cancelled_at_shutdown`` and are not a loss (their tickets were
simply never used).
"""

from __future__ import annotations

import math
import time
from typing import Any

import msgspec

from engines.base import model_sampling_defaults
from launch.snapshot import BrokerView
from learner.status import LearnerStatus
from rollout_fleet.status import FleetStatus


def build_summary(cfg, job, final: dict[str, Any], *, error: str | None = None) -> dict[str, Any]:
    snap = job.snapshot
    learner = (
        msgspec.convert(final["learner"], LearnerStatus)
        if final.get("learner")
        else snap.learner
        if snap is not None
        else LearnerStatus()
    )
    fleet = (
        msgspec.convert(final["fleet"], FleetStatus)
        if final.get("fleet")
        else snap.fleet
        if snap is not None
        else FleetStatus()
    )
    broker = (
        msgspec.convert(final["broker"], BrokerView)
        if final.get("broker")
        else snap.broker
        if snap is not None
        else None
    )
    drops = {k: int(v) for k, v in (broker.drops if broker is not None else {}).items() if v}
    broker_dropped = sum(drops.values())
    if fleet.groups_reward_failed:  # never pushed: the fleet dropped them (no made-up rewards)
        drops["reward_error"] = fleet.groups_reward_failed
    if fleet.groups_filtered:  # DAPO dynamic sampling: uniform groups never pushed (regenerated on their ticket)
        drops["filtered_uniform"] = fleet.groups_filtered
    if fleet.groups_bad_request:  # refused by an engine (HTTP 4xx): the request's fault
        drops["bad_request"] = fleet.groups_bad_request
    for reason, n in fleet.env_errors.items():  # multi-turn: an episode's environment failed, named
        drops[f"env_{reason}" if not reason.startswith("env_") else reason] = n
    produced = broker.groups_accepted if broker is not None else fleet.groups_pushed
    # the learner's own count at its end; a learner that died mid-run gave none, and its last
    # snapshot lags the broker's acks by a step or so: the broker's ack count is the record then
    consumed = learner.groups_consumed if final.get("learner") or broker is None else broker.groups_acked
    queued = broker.queued_groups + broker.leased_groups if broker is not None else 0
    failed = fleet.groups_failed
    lost = produced - consumed - broker_dropped - queued + failed
    rewards = [
        None if (r is None or (isinstance(r, float) and math.isnan(r))) else round(r, 4)
        for r in learner.reward_per_step
    ]
    try:
        ignored = model_sampling_defaults(cfg.model.path)
    except ValueError as exc:
        ignored = {"unreadable": str(exc)}
    summary = {
        "steps": learner.step,
        "learner_settings": learner.settings,  # every "auto" of the learner config as resolved (learner/fastpath.py)
        "model_generation_config_not_applied": ignored,
        "max_staleness": cfg.broker.max_staleness,
        "max_staleness_seen": learner.max_staleness_seen,
        "staleness_hist": learner.staleness_hist,
        "bound_violations": learner.bound_violations,
        "eval_accuracy_before": job.eval_before,
        "eval_accuracy_after": job.eval_after,
        "eval_history": job.eval_history,
        "reward_per_step": rewards,
        "groups_produced": produced,
        "groups_consumed": consumed,
        "groups_dropped": drops,
        "groups_queued_at_end": queued,
        "groups_lost": lost,
        "groups_requeued": fleet.groups_requeued,
        "groups_cancelled_at_shutdown": fleet.groups_cancelled,
        "episode_ends": fleet.episode_ends,  # multi-turn (rollout.env): done / max_turns / max_tokens
        "episode_turns": fleet.turns,
        "server_deaths": fleet.server_deaths,
        "server_stalls": fleet.server_stalls,  # alive but answering nothing (rollout.stall_timeout_s)
        "servers_kept_generating": fleet.servers_kept_generating,  # silent, but their token count rose
        "broker_restarts": job.supervisor.restarts if job.supervisor is not None else 0,
        "broker_status_from_spool": broker is not None and broker.from_spool,
        "servers_at_end": len(fleet.servers),
        "server_states_at_end": [
            {
                "engine_id": s.engine_id,
                "state": str(s.state),
                "version": s.version,
                "restarts": s.restarts,
                "groups_done": s.groups_done,
            }
            for s in fleet.servers
        ],
        "weight_updates": fleet.weight_updates,
        "publishes": learner.publishes,  # real learner: publishes that reached >= 1 engine
        "last_published_version": learner.last_published_version,
        "publish_errors": learner.publish_errors,
        "publishes_skipped": learner.publishes_skipped,  # steps that changed no weights
        "samples_truncated": fleet.samples_truncated,  # finish reason 'length'
        # DAPO (rollout.filter_groups): groups scored per group pushed; 1.0 without dynamic sampling
        "groups_generated": fleet.groups_generated,
        "generation_per_pushed_group": (
            round(fleet.groups_generated / fleet.groups_pushed, 4) if fleet.groups_pushed else None
        ),
        "samples_overlong_penalised": fleet.samples_overlong_penalised,
        "learner_idle_fraction": learner.learner_idle_fraction,
        "fleet_idle_fraction": fleet.fleet_idle_fraction,
        "tokens_generated": fleet.tokens_pushed,
        "rollout_gpus": job.args.rollout_gpus,
        "learner_gpus": job.args.learner_gpus,
        "reward_gpus": job.args.reward_gpus,
        "reward_model": fleet.reward_model,  # reward.model: calls, failures by reason, per-server rates and latency
        "reward_servers": job.rewards.describe() if job.rewards is not None else [],
        "proxy": {"url": fleet.proxy_url, **fleet.proxy} if fleet.proxy_url else None,
        "learner_world_size": learner.world_size,  # ranks that trained (the simulated learner: 1)
        "learner_rank_steps": learner.rank_steps,  # steps each rank applied, rank order (real learner)
        "placement": {
            "learner": [[s.node_id, list(s.gpu_ids)] for s in job.placement.plan.learner],
            "servers": len(job.placement.plan.servers),
        },
        "wall_s": round(_wall(job), 2),
        "simulated": job.simulated,
        "stopped_on_request": job.stop_requested,  # `launch/cluster.py stop`: ended before run.max_steps
        "scale_starts": job.scaler.events,  # servers started by `scale`: ids, seconds, ok / error
        "error": error,
    }
    summary["mode"] = cfg.colocate.label()  # colocated-sync | shared-async | disaggregated
    if cfg.colocate.synchronous:
        summary["colocated"] = job.colocated
    if cfg.colocate.shared_async:
        summary["memory_split"] = job.placement.memory_split
    if not job.simulated:
        from launch.busy import busy_fractions, read_steps

        try:  # a measurement: its failure must not cost the run its summary
            summary["busy"] = busy_fractions(
                read_steps(job.run_dir, since_unix=time.time() - _wall(job)), getattr(job, "fleet_busy", {}) or {}
            )
        except (OSError, ValueError, KeyError, TypeError) as exc:
            summary["busy"] = {"error": f"{type(exc).__name__}: {exc}"}
    if job.simulated:
        summary["note"] = (
            "SIMULATED run: engines, rewards and learner steps are simulated; "
            "no model was trained and accuracy is not measured"
        )
    return summary


def _wall(job) -> float:
    return time.monotonic() - job.t0
