"""The JSON summary of a run (``--summary PATH`` and ``<run_dir>/summary.json``).

Group accounting, from the three places a group can be at the end of a run::

    produced  = groups the broker accepted from the fleet
    consumed  = groups the learner trained on (acked leases)
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
from typing import Any


def build_summary(cfg, job, final: dict[str, Any], *, error: str | None = None) -> dict[str, Any]:
    learner = final.get("learner") or job.snapshot or {}
    fleet = final.get("fleet") or job.snapshot or {}
    broker = final.get("broker") or (job.snapshot or {}).get("broker", {})
    drops = {k: int(v) for k, v in (broker.get("drops") or {}).items() if v}
    broker_dropped = sum(drops.values())
    if fleet.get("groups_reward_failed"):  # never pushed: the fleet dropped them (no made-up rewards)
        drops["reward_error"] = int(fleet["groups_reward_failed"])
    if fleet.get("groups_bad_request"):  # refused by an engine (HTTP 4xx): the request's fault
        drops["bad_request"] = int(fleet["groups_bad_request"])
    produced = broker.get("groups_accepted")
    if produced is None:
        produced = fleet.get("groups_pushed", 0)
    produced = int(produced)
    consumed = int(learner.get("groups_consumed", 0))
    queued = int(broker.get("queued_groups", 0) or 0) + int(broker.get("leased_groups", 0) or 0)
    failed = int(fleet.get("groups_failed", 0))
    lost = produced - consumed - broker_dropped - queued + failed
    rewards = [None if (r is None or (isinstance(r, float) and math.isnan(r))) else round(r, 4)
               for r in learner.get("reward_per_step", [])]
    summary = {
        "steps": int(learner.get("step", 0)),
        "max_staleness": cfg.broker.max_staleness,
        "max_staleness_seen": learner.get("max_staleness_seen"),
        "staleness_hist": learner.get("staleness_hist", {}),
        "bound_violations": learner.get("bound_violations", 0),
        "eval_accuracy_before": job.eval_before,
        "eval_accuracy_after": job.eval_after,
        "eval_history": job.eval_history,
        "reward_per_step": rewards,
        "groups_produced": produced,
        "groups_consumed": consumed,
        "groups_dropped": drops,
        "groups_queued_at_end": queued,
        "groups_lost": lost,
        "groups_requeued": fleet.get("groups_requeued", 0),
        "groups_cancelled_at_shutdown": fleet.get("groups_cancelled", 0),
        "server_deaths": fleet.get("server_deaths", 0),
        "broker_restarts": job.supervisor.restarts if job.supervisor is not None else 0,
        "broker_status_from_spool": bool(broker.get("from_spool")),
        "servers_at_end": len(fleet.get("servers", [])),
        "server_states_at_end": [{k: s.get(k) for k in ("engine_id", "state", "version", "restarts", "groups_done")}
                                 for s in fleet.get("servers", [])],
        "weight_updates": fleet.get("weight_updates", 0),
        "publishes": learner.get("publishes", 0),  # real learner: publishes that reached >= 1 engine
        "last_published_version": learner.get("last_published_version", 0),
        "publish_errors": learner.get("publish_errors", 0),
        "publishes_skipped": learner.get("publishes_skipped", 0),  # steps that changed no weights
        "samples_truncated": fleet.get("samples_truncated", 0),  # finish reason 'length'

        "learner_idle_fraction": learner.get("learner_idle_fraction"),
        "fleet_idle_fraction": fleet.get("fleet_idle_fraction"),
        "tokens_generated": fleet.get("tokens_pushed"),
        "rollout_gpus": job.args.rollout_gpus,
        "learner_gpus": job.args.learner_gpus,
        "learner_world_size": learner.get("world_size", 1),  # ranks that trained (the simulated learner: 1)
        "learner_rank_steps": learner.get("rank_steps"),  # steps each rank applied, rank order (real learner)
        "placement": {"learner": [[s.node_id, list(s.gpu_ids)] for s in job.placement.learner],
                      "servers": len(job.placement.servers)},
        "wall_s": round(_wall(job), 2),
        "simulated": job.simulated,
        "error": error,
    }
    if job.simulated:
        summary["note"] = ("SIMULATED run: engines, rewards and learner steps are simulated; "
                           "no model was trained and accuracy is not measured")
    return summary


def _wall(job) -> float:
    import time

    return time.monotonic() - job.t0
