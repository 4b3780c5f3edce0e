"""The launcher's view of the broker: its typed status reply in the terms the job uses (:class:`BrokerView`).

``lost`` accounting (see :mod:`launch.summary`) needs the groups the broker accepted, still
holds (queued or leased) and dropped by reason; ``duplicate`` drops are retried pushes of a
group already accepted, not groups, so they are reported apart.
"""

from __future__ import annotations

from typing import Any

import msgspec

from broker import protocol as P
from broker.client import status_reply
from launch.snapshot import BrokerView


def view(reply: P.StatusReply) -> BrokerView:
    st = reply.status
    drops = dict(reply.drops)
    duplicates = int(drops.pop("duplicate", 0))
    return BrokerView(
        version=int(st.get("broker/version", 0)),
        queued_groups=int(st.get("broker/queue_depth_groups", 0)),
        leased_groups=int(st.get("broker/leased_groups", 0)),
        queue_bytes=int(st.get("broker/queue_depth_bytes", 0)),
        outstanding_tickets=int(st.get("broker/outstanding_tickets", 0)),
        groups_accepted=int(st.get("broker/produced_groups_total", 0)),
        groups_acked=int(st.get("broker/acked_groups_total", 0)),
        redelivered_groups=int(st.get("broker/redelivered_groups_total", 0)),
        tickets_expired=int(st.get("broker/tickets_expired_total", 0)),
        produce_groups_per_s=st.get("broker/produce_groups_per_s"),
        consume_groups_per_s=st.get("broker/consume_groups_per_s"),
        drops={k: int(v) for k, v in drops.items() if v},
        duplicate_pushes=duplicates,
        errors=dict(reply.errors),
        engine_lag=dict(reply.engine_lag),
        staleness_hist=dict(reply.staleness_hist),
        stale_drop_lengths=dict(reply.stale_drop_lengths),
    )


def flatten(raw: dict[str, Any]) -> dict[str, Any]:
    """:func:`view` of ``broker.client.get_status``'s plain data, as plain data."""
    reply = P.StatusReply(
        status=raw.get("status", {}),
        drops=raw.get("drops", {}),
        errors=raw.get("errors", {}),
        engine_lag=raw.get("engine_lag", {}),
        staleness_hist=raw.get("staleness_hist", {}),
        stale_drop_lengths=raw.get("stale_drop_lengths", {}),
    )
    return msgspec.to_builtins(view(reply))


def broker_status(address: str, timeout_s: float = 5.0, curve_keys_dir: str | None = None) -> BrokerView:
    return view(status_reply(address, timeout_s=timeout_s, curve_keys_dir=curve_keys_dir))
