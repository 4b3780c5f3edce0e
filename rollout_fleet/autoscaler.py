"""The fleet's autoscaler: a pure decision object (no clock, no I/O: every call takes ``now``).

It reads four signals the job already has, each over a sliding window of ``window_s`` (so one noisy
sample, or the queue's dip each time the learner leases a step's groups, cannot move it):

* ``wait``: the fraction of wall time the learner spent waiting for batches (the rate of its
  cumulative ``learner_wait_s``);
* ``idle``: the mean unused fraction of the fleet's group slots (``max_inflight_groups`` per live
  server): groups are spread over every server, so "servers with nothing to do" would read 0 while
  a fleet twice too large runs at half its slots;
* ``fill``: the mean fill of the broker's queue, queued groups over what the staleness bound lets it
  hold besides the step the learner is training on (``groups_per_step * max(1, max_staleness)``);
* ``groups_per_s``: the rate of the fleet's cumulative pushed groups (what an added server must raise).

Rules, with hysteresis (separate thresholds up and down, each condition must hold for
``sustain_s``) and a ``cooldown_s`` after every action:

* grow by ``step`` when ``wait >= up_wait``: the learner starves, more servers make more data;
* drain ``step`` when ``fill >= down_fill``, ``idle >= down_idle`` and ``wait <= down_wait``: the
  learner, not the fleet, sets the pace; the queue holds data ahead and slots go unused;
* every decision is a trial, judged by what follows, since a fleet's rate is not proportional to its
  size where servers share hardware (CPU servers on the same cores) or the bottleneck is elsewhere:
  an add whose new servers, over the first whole window after the cooldown, raised ``groups_per_s``
  by less than ``min_gain`` of the proportional gain (``step / n``) while the learner still waits
  ``up_wait`` added nothing: it is drained again and the fleet is not grown past its old size for the
  rest of the run (``ceiling``); a drain after which the learner waits ``up_wait`` over that window
  is added back and the fleet not drained below its old size again (``floor``). So a wrong decision
  is undone once, not repeated;
* below ``min`` (servers lost) grow without waiting for a rate; never above ``max`` nor below ``min``.

A window starts afresh after every decision and while servers are starting: a decision is judged on
the fleet it made, not on one whose new servers are still loading (minutes, for a vLLM server).

Every decision carries its reason (the windowed signals and the rule); the driver logs it, carries it
out through ``scale`` and keeps it in the run's summary. :class:`Autoscaler` never calls ``scale``
itself, so its tests drive it with synthetic observations and times.

Example::

    a = Autoscaler(AutoscaleConfig(enabled=True, min=1, max=8))
    d = a.observe(now=12.0, obs=Observation(servers=2, starting=0, learner_wait_s=9.1, inflight_groups=32,
                                            slots=32, queued_groups=0, queue_capacity_groups=24, groups_pushed=410))
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
    starting: int  # of those, servers still starting (they take no work yet)
    learner_wait_s: float  # cumulative
    inflight_groups: int  # groups in flight on the fleet, now
    slots: int  # groups the fleet may hold in flight (live servers x max_inflight_groups)
    queued_groups: int
    queue_capacity_groups: int
    groups_pushed: int  # cumulative groups the fleet pushed to the broker


@dataclass(frozen=True, slots=True)
class Signals:
    """The windowed signals (module docstring), over the last ``span_s`` seconds."""

    wait: float
    idle: float
    fill: float
    groups_per_s: float
    span_s: float


@dataclass(frozen=True, slots=True)
class Decision:
    at: float
    action: Literal["add", "drain"]
    servers_before: int
    target: int
    reason: str
    wait: float | None
    idle: float | None
    fill: float | None
    groups_per_s: float | None


@dataclass(frozen=True, slots=True)
class _Trial:
    action: Literal["add", "drain"]
    before: int  # servers before the decision
    after: int
    groups_per_s: float  # the fleet's rate before it


class Autoscaler:
    def __init__(self, cfg: AutoscaleConfig) -> None:
        self.cfg = cfg
        self._hist: deque[tuple[float, Observation]] = deque()
        self._up_since: float | None = None
        self._down_since: float | None = None
        self._last_action: float | None = None
        self._trial: _Trial | None = None
        self.ceiling = cfg.max  # lowered when an add did not pay
        self.floor = cfg.min  # raised when a drain starved the learner
        self.signals: Signals | None = None  # the last windowed signals (None: too little history)
        self.decisions: list[Decision] = []

    def _window(self, now: float, obs: Observation) -> Signals | None:
        if self._hist and now < self._hist[-1][0]:
            raise ValueError(f"autoscaler: time went backwards ({now} after {self._hist[-1][0]})")
        self._hist.append((now, obs))
        while len(self._hist) > 2 and now - self._hist[1][0] >= self.cfg.window_s:
            self._hist.popleft()
        t0, first = self._hist[0]
        span = now - t0
        if span < self.cfg.window_s * 0.5:  # too little history to judge a rate
            return None
        n = len(self._hist)
        idle = sum(1.0 - o.inflight_groups / max(1, o.slots) for _, o in self._hist) / n
        fill = sum(min(1.0, o.queued_groups / max(1, o.queue_capacity_groups)) for _, o in self._hist) / n
        wait = (obs.learner_wait_s - first.learner_wait_s) / span
        return Signals(
            wait=min(1.0, max(0.0, wait)),
            idle=min(1.0, max(0.0, idle)),
            fill=fill,
            groups_per_s=max(0.0, obs.groups_pushed - first.groups_pushed) / span,
            span_s=span,
        )

    def observe(self, now: float, obs: Observation) -> Decision | None:
        """Feed one observation; returns the decision to carry out now, or None."""
        c = self.cfg
        if obs.starting:  # judged on the fleet it will be: the window starts when they serve
            self._hist.clear()
            self._up_since = self._down_since = None
        s = self.signals = None if obs.starting else self._window(now, obs)
        if not c.enabled:
            return None
        cooling = self._last_action is not None and now - self._last_action < c.cooldown_s
        if obs.servers < c.min and not cooling:
            return self._decide(
                now, "add", obs.servers, c.min, s, f"{obs.servers} live servers < autoscale.min {c.min}"
            )
        if s is None:
            return None
        if self._trial is not None:
            if cooling or s.span_s < c.window_s:  # a trial is judged on a whole window of the grown fleet
                return None
            if (d := self._judge(now, obs, s, self._trial)) is not None:
                return d
        up = s.wait >= c.up_wait and obs.servers < self.ceiling
        k = min(c.step, obs.servers - self.floor)
        down = s.fill >= c.down_fill and s.idle >= c.down_idle and s.wait <= c.down_wait and k > 0
        self._up_since = (self._up_since if self._up_since is not None else now) if up else None
        self._down_since = (self._down_since if self._down_since is not None else now) if down else None
        if cooling:
            return None
        if up and now - self._up_since >= c.sustain_s:
            target = min(self.ceiling, obs.servers + c.step)
            return self._decide(
                now,
                "add",
                obs.servers,
                target,
                s,
                f"learner waited {s.wait:.0%} of the last {s.span_s:.0f} s (>= up_wait {c.up_wait:.0%}) "
                f"for {now - self._up_since:.0f} s; fleet {s.groups_per_s:.2f} groups/s",
                trial=True,
            )
        if down and now - self._down_since >= c.sustain_s:
            return self._decide(
                now,
                "drain",
                obs.servers,
                obs.servers - k,
                s,
                f"queue {s.fill:.0%} full (>= down_fill {c.down_fill:.0%}), fleet idle {s.idle:.0%} "
                f"(>= down_idle {c.down_idle:.0%}), learner waited {s.wait:.0%} "
                f"(<= down_wait {c.down_wait:.0%}) for {now - self._down_since:.0f} s; "
                f"fleet {s.groups_per_s:.2f} groups/s",
                trial=True,
            )
        return None

    def _judge(self, now: float, obs: Observation, s: Signals, t: _Trial) -> Decision | None:
        """The last decision's trial (module docstring): an undo, or None when it stands."""
        self._trial = None
        c = self.cfg
        if s.wait < c.up_wait or obs.servers != t.after:  # the learner does not starve, or the fleet changed
            return None
        if t.action == "drain":
            self.floor = min(self.ceiling, t.before)
            if self.floor <= obs.servers:  # drained from above the ceiling (autoscale.max): none to add back
                return None
            return self._decide(
                now,
                "add",
                obs.servers,
                self.floor,
                s,
                f"after draining {t.before} -> {t.after} servers the learner waited {s.wait:.0%} "
                f"(>= up_wait {c.up_wait:.0%}; fleet {t.groups_per_s:.2f} -> {s.groups_per_s:.2f} "
                f"groups/s): added back, no fewer than {self.floor} servers from now on",
            )
        gain = s.groups_per_s / t.groups_per_s - 1.0 if t.groups_per_s > 0 else float("inf")
        added = t.after - t.before
        if t.before == 0 or gain >= c.min_gain * added / t.before:
            return None
        self.ceiling = max(self.floor, t.before)
        if self.ceiling >= obs.servers:  # grown to no more than the floor: none to drain back
            return None
        return self._decide(
            now,
            "drain",
            obs.servers,
            self.ceiling,
            s,
            f"adding {added} to {t.before} servers raised the fleet's rate {gain:+.0%} "
            f"({t.groups_per_s:.2f} -> {s.groups_per_s:.2f} groups/s; < min_gain {c.min_gain:.0%} "
            f"of +{added / t.before:.0%}) and the learner still waited {s.wait:.0%}: "
            f"drained back, no more than {self.ceiling} servers from now on",
        )

    def _decide(self, now, action, before, target, s: Signals | None, reason, *, trial: bool = False) -> Decision:
        d = Decision(
            at=now,
            action=action,
            servers_before=before,
            target=target,
            reason=reason,
            wait=None if s is None else s.wait,
            idle=None if s is None else s.idle,
            fill=None if s is None else s.fill,
            groups_per_s=None if s is None else s.groups_per_s,
        )
        self.decisions.append(d)
        self._last_action = now
        # an undo, or a decision without a rate (below min), is not judged again
        self._trial = _Trial(action, before, target, s.groups_per_s) if trial and s is not None else None
        self._up_since = self._down_since = None  # a condition must hold afresh after an action
        self._hist.clear()  # and be measured on the new fleet
        return d
