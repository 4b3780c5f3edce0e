"""The launcher's view of the broker: its status reply flattened into the keys the job uses.

``lost`` accounting (see :mod:`launch.summary`) needs the groups the broker accepted, still
holds (queued or leased) and dropped by reason; ``duplicate`` drops are retried pushes of a
group already accepted, not groups, so they are reported apart.
"""

from __future__ import annotations

from typing import Any


def flatten(raw: dict[str, Any]) -> dict[str, Any]:
    st = raw.get("status", {})
    drops = dict(raw.get("drops", {}))
    duplicates = int(drops.pop("duplicate", 0))
    return {
        "version": int(st.get("broker/version", 0)),
        "queued_groups": int(st.get("broker/queue_depth_groups", 0)),
        "leased_groups": int(st.get("broker/leased_groups", 0)),
        "queue_bytes": int(st.get("broker/queue_depth_bytes", 0)),
        "outstanding_tickets": int(st.get("broker/outstanding_tickets", 0)),
        "groups_accepted": int(st.get("broker/produced_groups_total", 0)),
        "groups_acked": int(st.get("broker/acked_groups_total", 0)),
        "redelivered_groups": int(st.get("broker/redelivered_groups_total", 0)),
        "tickets_expired": int(st.get("broker/tickets_expired_total", 0)),
        "produce_groups_per_s": st.get("broker/produce_groups_per_s"),
        "consume_groups_per_s": st.get("broker/consume_groups_per_s"),
        "drops": {k: int(v) for k, v in drops.items() if v},
        "duplicate_pushes": duplicates,
        "errors": dict(raw.get("errors", {})),
        "engine_lag": dict(raw.get("engine_lag", {})),
        "staleness_hist": dict(raw.get("staleness_hist", {})),
    }


def broker_status(address: str, timeout_s: float = 5.0) -> dict[str, Any]:
    from broker.client import get_status

    return flatten(get_status(address, timeout_s=timeout_s))
