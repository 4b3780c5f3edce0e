"""Lag metrics of the broker: one status snapshot, served by the status request and Prometheus.

The server loop rebuilds :func:`snapshot` twice a second (and on every status
request); the Prometheus collector reads the latest snapshot from the HTTP
server's thread, so it never touches the live state. Names follow
``broker/thing_unit``; Prometheus spells the slash as ``_``.
"""

from __future__ import annotations

import bisect
import time
from collections import deque

from prometheus_client import start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import CollectorRegistry

WAIT_BUCKETS = (0.001, 0.005, 0.02, 0.1, 0.5, 1.0, 5.0, 30.0, 120.0)


class Hist:
    """A fixed-bucket histogram (cumulative at export)."""

    def __init__(self, buckets: tuple[float, ...] = WAIT_BUCKETS) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0
        self.n = 0

    def observe(self, x: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, x)] += 1
        self.sum += x
        self.n += 1

    def cumulative(self) -> list[tuple[str, int]]:
        out, acc = [], 0
        for b, c in zip(self.buckets, self.counts[:-1], strict=True):  # counts[-1]: above the last bucket
            acc += c
            out.append((repr(b), acc))
        out.append(("+Inf", acc + self.counts[-1]))
        return out


class Rates:
    """Rates of monotone counters over a sliding window (seconds)."""

    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self.samples: deque[tuple[float, dict[str, int]]] = deque()

    def update(self, now: float, values: dict[str, int]) -> dict[str, float]:
        self.samples.append((now, dict(values)))
        while len(self.samples) > 2 and now - self.samples[1][0] >= self.window_s:
            self.samples.popleft()
        t0, v0 = self.samples[0]
        dt = now - t0
        return {k: (values[k] - v0.get(k, 0)) / dt if dt > 0 else 0.0 for k in values}


def snapshot(server) -> dict:
    """All lag metrics of a running BrokerServer as plain data (the status reply)."""
    st = server.state
    c = st.counters
    now = time.monotonic()
    rates = server.rates.update(
        now,
        {
            "produce_rows": c.produced_rows,
            "produce_groups": c.produced_groups,
            "consume_rows": c.acked_rows,
            "consume_groups": c.acked_groups,
        },
    )
    status = {
        "broker/version": st.version,
        "broker/max_staleness": st.k,
        "broker/groups_per_step": st.G,
        "broker/queue_depth_groups": st.queued_groups,
        "broker/leased_groups": st.leased_groups,
        "broker/queue_depth_bytes": st.pending_bytes,
        "broker/byte_budget_bytes": st.byte_budget,
        "broker/outstanding_tickets": st.outstanding_tickets,
        "broker/produce_rows_per_s": rates["produce_rows"],
        "broker/produce_groups_per_s": rates["produce_groups"],
        "broker/consume_rows_per_s": rates["consume_rows"],
        "broker/consume_groups_per_s": rates["consume_groups"],
        "broker/produced_groups_total": c.produced_groups,
        "broker/produced_rows_total": c.produced_rows,
        "broker/produced_bytes_total": c.produced_bytes,
        "broker/leased_groups_total": c.leased_groups,
        "broker/acked_groups_total": c.acked_groups,
        "broker/acked_rows_total": c.acked_rows,
        "broker/redelivered_groups_total": c.redelivered_groups,
        "broker/late_acks_total": c.late_acks,
        "broker/duplicate_acks_total": c.duplicate_acks,
        "broker/tickets_granted_total": c.tickets_granted,
        "broker/tickets_fulfilled_total": c.tickets_fulfilled,
        "broker/tickets_expired_total": c.tickets_expired,
        "broker/unticketed_groups_total": c.unticketed_groups,
        "broker/ticket_wait_seconds_sum": server.ticket_wait.sum,
        "broker/ticket_wait_seconds_count": server.ticket_wait.n,
        "broker/learner_wait_seconds_sum": server.learner_wait.sum,
        "broker/learner_wait_seconds_count": server.learner_wait.n,
        "broker/spool_bytes_written_total": server.spool.bytes_written if server.spool else 0,
        # the bounds of broker.limits, each with its figure
        "broker/spool_quarantined_total": server.spool.quarantined if server.spool else 0,
        "broker/waiters": len(server.waiters),
        "broker/waiters_evicted_total": server.waiters.limits.evicted,
        "broker/waiters_refused_total": server.waiters.limits.refused,
        "broker/engine_ids": len(st.engine_versions),
        "broker/engine_ids_evicted_total": st.engine_versions.evicted,
        "broker/engine_ids_expired_total": st.engine_versions.expired,
        "broker/log_lines_suppressed_total": server.rlog.suppressed_total,
        "broker/uptime_seconds": now - server.t_start,
    }
    return {
        "status": {k: float(v) for k, v in status.items()},
        "drops": dict(c.drops),
        "errors": dict(server.errors),
        "engine_lag": st.engine_lag(),
        "staleness_hist": {str(s): n for s, n in sorted(c.staleness_hist.items())},
        "stale_drop_lengths": {str(b): n for b, n in sorted(c.stale_drop_lengths.items())},
        "_hist": {
            "ticket_wait": (server.ticket_wait.cumulative(), server.ticket_wait.sum),
            "learner_wait": (server.learner_wait.cumulative(), server.learner_wait.sum),
        },
    }


def _prom(name: str) -> str:
    return name.replace("/", "_")


class SnapshotCollector:
    """Prometheus view of the server's latest snapshot."""

    def __init__(self, server) -> None:
        self.server = server

    def collect(self):
        snap = self.server.latest_snapshot
        if snap is None:
            return
        for key, value in snap["status"].items():
            name = _prom(key)
            if key.endswith(("_sum", "_count")):
                continue  # exported as histograms below
            if key.endswith("_total"):
                yield CounterMetricFamily(name[: -len("_total")], key, value=value)
            else:
                yield GaugeMetricFamily(name, key, value=value)
        for fam, label, data in (
            ("broker_drops", "reason", snap["drops"]),
            ("broker_errors", "code", snap["errors"]),
            ("broker_stale_drop_rows", "length_le", snap["stale_drop_lengths"]),
        ):
            m = CounterMetricFamily(fam, f"{fam.replace('_', '/', 1)} by {label}", labels=[label])
            for lab, v in data.items():
                m.add_metric([lab], v)
            yield m
        lag = GaugeMetricFamily(
            "broker_engine_version_lag", "broker/engine_version_lag (learner - engine)", labels=["engine"]
        )
        for e, v in snap["engine_lag"].items():
            lag.add_metric([e], v)
        yield lag
        hist, acc, total = [], 0, 0.0
        for s, n in snap["staleness_hist"].items():
            acc += n
            total += int(s) * n
            hist.append((s, acc))
        hist.append(("+Inf", acc))
        yield HistogramMetricFamily(
            "broker_staleness_versions",
            "broker/staleness_versions of rows at consumption",
            buckets=hist,
            sum_value=total,
        )
        for name, (buckets, s) in snap["_hist"].items():
            yield HistogramMetricFamily(
                f"broker_{name}_seconds", f"broker/{name}_seconds", buckets=buckets, sum_value=s
            )


def start_metrics_server(server, port: int, addr: str = "127.0.0.1") -> int:
    """Serve /metrics for ``server``; returns the bound port (``port=0`` picks one)."""
    registry = CollectorRegistry()
    registry.register(SnapshotCollector(server))
    httpd, _thread = start_http_server(port, addr=addr, registry=registry)
    server.metrics_httpd = httpd
    return httpd.server_address[1]
