"""The fleet's autoscaler: a pure decision object (no clock, no I/O: every call takes ``now``).

It reads three signals the job already has, each over a sliding window (so one noisy sample cannot
move it):

* ``wait``: the fraction of wall time the learner spent waiting for batches (the rate of its
  cumulative ``learner_wait_s``);
* ``idle``: the mean unused fraction of the fleet's group slots (``max_inflight_groups`` per live
  server) over the window: groups are spread over every server, so "servers with nothing to do"
  would read 0 while a fleet twice too large runs at half its slots;
* ``fill``: how full the broker's queue is, queued groups over what the staleness bound lets it
  hold besides the step the learner is training on (``groups_per_step * max(1, max_staleness)``).

Rules, with hysteresis (separate thresholds up and down, each condition must hold for
``sustain_s``) and a ``cooldown_s`` after every action:

* grow by ``step`` when ``wait >= up_wait``: the learner starves, more servers make more data;
* drain ``step`` when ``fill >= down_fill`` and ``idle >= down_idle`` and ``wait <= down_wait``:
  the queue is full and the fleet idles, servers are wasted;
* below ``min`` (servers lost) grow without waiting for a rate; never above ``max`` nor below ``min``.

Every decision carries its reason (the windowed signals and the rule); the driver logs it, carries it
out through ``scale`` and keeps it in the run's summary. :class:`Autoscaler` never calls ``scale``
itself, so its tests drive it with synthetic observations and times.

Example::

    a = Autoscaler(AutoscaleConfig(enabled=True, min=1, max=8))
    d = a.observe(now=12.0, obs=Observation(servers=2, learner_wait_s=9.1, inflight_groups=32, slots=32,
                                            queued_groups=0, queue_capacity_groups=24))
    if d is not None: scale_to(d.target)   # d.reason says why
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Literal

from rollout_fleet.config import AutoscaleConfig


@dataclass(frozen=True, slots=True)
class Observation:
    servers: int  # live servers (healthy, starting or restarting)
    learner_wait_s: float  # cumulative
    inflight_groups: int  # groups in flight on the fleet, now
    slots: int  # groups the fleet may hold in flight (live servers x max_inflight_groups)
    queued_groups: int
    queue_capacity_groups: int


@dataclass(frozen=True, slots=True)
class Decision:
    at: float
    action: Literal["add", "drain"]
    servers_before: int
    target: int
    reason: str
    wait: float | None
    idle: float | None
    fill: float


class Autoscaler:
    def __init__(self, cfg: AutoscaleConfig) -> None:
        self.cfg = cfg
        self._hist: deque[tuple[float, float, float]] = deque()  # (now, learner_wait_s, idle fraction)
        self._up_since: float | None = None
        self._down_since: float | None = None
        self._last_action: float | None = None
        self.decisions: list[Decision] = []

    def _rates(self, now: float, obs: Observation) -> tuple[float | None, float | None]:
        if self._hist and now < self._hist[-1][0]:
            raise ValueError(f"autoscaler: time went backwards ({now} after {self._hist[-1][0]})")
        self._hist.append((now, obs.learner_wait_s, 1.0 - obs.inflight_groups / max(1, obs.slots)))
        while len(self._hist) > 2 and now - self._hist[1][0] >= self.cfg.window_s:
            self._hist.popleft()
        t0, w0, _ = self._hist[0]
        span = now - t0
        if span < self.cfg.window_s * 0.5:  # too little history to judge a rate
            return None, None
        idle = sum(x for _, _, x in self._hist) / len(self._hist)
        return min(1.0, max(0.0, (obs.learner_wait_s - w0) / span)), min(1.0, max(0.0, idle))

    def observe(self, now: float, obs: Observation) -> Decision | None:
        """Feed one observation; returns the decision to carry out now, or None."""
        c = self.cfg
        wait, idle = self._rates(now, obs)
        fill = min(1.0, obs.queued_groups / max(1, obs.queue_capacity_groups))
        if not c.enabled:
            return None
        cooling = self._last_action is not None and now - self._last_action < c.cooldown_s
        if obs.servers < c.min and not cooling:
            return self._decide(now, "add", obs.servers, c.min, wait, idle, fill,
                                f"{obs.servers} live servers < autoscale.min {c.min}")
        if wait is None:
            return None
        up = wait >= c.up_wait and obs.servers < c.max
        down = fill >= c.down_fill and idle >= c.down_idle and wait <= c.down_wait and obs.servers > c.min
        self._up_since = (self._up_since if self._up_since is not None else now) if up else None
        self._down_since = (self._down_since if self._down_since is not None else now) if down else None
        if cooling:
            return None
        if up and now - self._up_since >= c.sustain_s:
            target = min(c.max, obs.servers + c.step)
            return self._decide(now, "add", obs.servers, target, wait, idle, fill,
                                f"learner waited {wait:.0%} of the last {c.window_s:.0f} s "
                                f"(>= up_wait {c.up_wait:.0%}) for {now - self._up_since:.0f} s")
        if down and now - self._down_since >= c.sustain_s:
            target = max(c.min, obs.servers - c.step)
            return self._decide(now, "drain", obs.servers, target, wait, idle, fill,
                                f"queue {fill:.0%} full (>= down_fill {c.down_fill:.0%}), fleet idle {idle:.0%} "
                                f"(>= down_idle {c.down_idle:.0%}), learner waited {wait:.0%} "
                                f"(<= down_wait {c.down_wait:.0%}) for {now - self._down_since:.0f} s")
        return None

    def _decide(self, now, action, before, target, wait, idle, fill, reason) -> Decision:
        d = Decision(at=now, action=action, servers_before=before, target=target, reason=reason, wait=wait,
                     idle=idle, fill=fill)
        self.decisions.append(d)
        self._last_action = now
        self._up_since = self._down_since = None  # a condition must hold afresh after an action
        self._hist.clear()  # and be measured on the new fleet
        return d
