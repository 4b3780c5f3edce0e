"""Bounds on everything a peer can make the broker hold or compute, and the helpers that enforce them.

The broker's promise is that no single message ends it and no peer grows its state without
bound. This module holds the numbers and the small structures behind that promise:

* integer ranges: every step, version and count a peer sends fits the int32 arrays the
  state keeps (staleness per row) with room for ``max_staleness``; the tighter, state-
  dependent windows (a push's step within the admission window, a segment version not
  ahead of the learner) are checked in :mod:`broker.state` against these;
* lengths: ids, ack lists, ``Multi`` sizes and header bytes (checked by the typed decoder
  of :mod:`broker.protocol`, so a violation is a ``bad_request`` naming the field);
* waiters per peer and in total (:class:`WaiterLimits`), engine ids with expiry
  (:class:`EngineVersions`), and logging of refusals at a bounded rate with counts
  (:class:`RateLimitedLog`), each with a metric in :mod:`broker.metrics`.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, defaultdict

# Steps and versions stay below this so that ``step - 1 - version`` and ``v + k + 1`` fit an
# int32 for any max_staleness the config allows (<= 1024).
MAX_VERSION = (1 << 31) - 4096
MAX_STEP = MAX_VERSION + 1
MAX_WAIT_S = 600.0  # longest wait a request may ask for; a waiter never outlives it
MAX_ID_CHARS = 256  # producer, consumer, engine and lease ids
MAX_ACKS = 1024  # acks piggybacked on one next_batch
MAX_HEADER_BYTES = 256 << 10  # one request header (a Multi of MAX_MULTI frame counts is ~20 KB)
MAX_TICKETS_PER_REQUEST = 1 << 16

MAX_WAITERS_PER_PEER = 64  # waiting acquire / next_batch requests of one peer (its retries included)
MAX_WAITERS = 2048  # of all peers together (each loop iteration looks at every waiter)
MAX_ENGINES = 4096  # engine ids whose version the broker keeps
ENGINE_TTL_S = 600.0  # an engine id not reported for this long is forgotten
LOG_INTERVAL_S = 10.0  # per key, at most one refusal line in this interval


class RateLimitedLog:
    """At most one log line per key per ``interval_s``; the lines in between are counted and
    the next line that goes out says how many were suppressed. Example::

        rl = RateLimitedLog(logging.getLogger("broker"))
        rl.warning("bad_frame", "refused request %d: %s", req, why)
    """

    def __init__(self, logger: logging.Logger, interval_s: float = LOG_INTERVAL_S, clock=time.monotonic) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self.clock = clock
        self._next: dict[str, float] = {}
        self._held: dict[str, int] = defaultdict(int)
        self.suppressed_total = 0

    def log(self, level: int, key: str, fmt: str, *args, exc_info=None) -> bool:
        """Log now, or count the line as suppressed; True if it was logged."""
        now = self.clock()
        if now < self._next.get(key, 0.0):
            self._held[key] += 1
            self.suppressed_total += 1
            return False
        self._next[key] = now + self.interval_s
        held = self._held.pop(key, 0)
        if held:
            fmt += " (%d similar lines suppressed in the last %.0f s)"
            args = (*args, held, self.interval_s)
        self.logger.log(level, fmt, *args, exc_info=exc_info)
        return True

    def warning(self, key: str, fmt: str, *args) -> bool:
        return self.log(logging.WARNING, key, fmt, *args)

    def error(self, key: str, fmt: str, *args) -> bool:
        return self.log(logging.ERROR, key, fmt, *args)


class EngineVersions:
    """The policy version each engine reported, for at most ``max_engines`` ids; an id not
    reported for ``ttl_s`` is forgotten, and when full the least recently reported one is
    evicted (counted in ``evicted``). Pure: every call takes ``now``."""

    def __init__(self, max_engines: int = MAX_ENGINES, ttl_s: float = ENGINE_TTL_S) -> None:
        self.max_engines = max_engines
        self.ttl_s = ttl_s
        self._v: OrderedDict[str, tuple[int, float]] = OrderedDict()  # least recently reported first
        self.evicted = 0
        self.expired = 0

    def set(self, engine_id: str, version: int, now: float) -> None:
        self._v.pop(engine_id, None)
        self._v[engine_id] = (version, now)
        self.expire(now)
        while len(self._v) > self.max_engines:
            self._v.popitem(last=False)
            self.evicted += 1

    def expire(self, now: float) -> None:
        while self._v:
            _, (_, t) = next(iter(self._v.items()))
            if now - t < self.ttl_s:
                break
            self._v.popitem(last=False)
            self.expired += 1

    def items(self):
        return ((e, v) for e, (v, _) in self._v.items())

    def __len__(self) -> int:
        return len(self._v)

    def __contains__(self, engine_id: str) -> bool:
        return engine_id in self._v

    def __getitem__(self, engine_id: str) -> int:
        return self._v[engine_id][0]


class WaiterLimits:
    """Counts waiting requests per peer, so the server can refuse or evict past the bounds."""

    def __init__(self, per_peer: int = MAX_WAITERS_PER_PEER, total: int = MAX_WAITERS) -> None:
        self.per_peer = per_peer
        self.total = total
        self.evicted = 0  # oldest waiter of a peer answered early to make room for its newest
        self.refused = 0  # refused (busy) because all peers together hold `total`
