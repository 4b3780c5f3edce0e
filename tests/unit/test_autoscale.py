"""The autoscaler's decisions, driven with synthetic observations and times (it has no clock)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_fleet.autoscale import Autoscaler, Observation
from rollout_fleet.config import AutoscaleConfig

CFG = AutoscaleConfig(enabled=True, min=2, max=6, step=2, window_s=10, sustain_s=5, cooldown_s=30)


def _run(a: Autoscaler, servers: int, *, wait: float, idle: float, fill: float, t0: float, t1: float,
         dt: float = 1.0, totals: list[float] | None = None):
    """Observe from t0 to t1 with constant rates; returns (decisions, servers, totals) carried out."""
    w = (totals or [0.0])[0]
    out, t = [], t0
    while t <= t1:
        d = a.observe(t, Observation(servers=servers, learner_wait_s=w, inflight_groups=round((1 - idle) * servers * 4), slots=servers * 4,
                                     queued_groups=int(fill * 24), queue_capacity_groups=24))
        if d is not None:
            out.append(d)
            servers = d.target
        w, t = w + wait * dt, t + dt
    return out, servers, [w]


def test_off_by_default_and_never_decides():
    assert not AutoscaleConfig().enabled
    a = Autoscaler(AutoscaleConfig())
    assert _run(a, 1, wait=1.0, idle=0.0, fill=0.0, t0=0, t1=300)[0] == []


def test_a_starving_learner_adds_after_sustain_then_cools_down_and_stops_at_max():
    a = Autoscaler(CFG)
    ds, servers, _ = _run(a, 2, wait=0.9, idle=0.0, fill=0.0, t0=0, t1=200)
    assert [d.action for d in ds] == ["add", "add"] and servers == 6  # 2 -> 4 -> 6 (max)
    # first rate after half a window (5 s), then held for sustain_s (5 s)
    assert ds[0].at == pytest.approx(10.0)
    assert ds[1].at - ds[0].at >= CFG.cooldown_s
    assert "learner waited 90%" in ds[0].reason and ds[0].servers_before == 2 and ds[0].target == 4


def test_a_full_queue_and_an_idle_fleet_drain_down_to_min():
    a = Autoscaler(CFG)
    ds, servers, _ = _run(a, 6, wait=0.0, idle=0.6, fill=1.0, t0=0, t1=200)
    assert [d.action for d in ds] == ["drain", "drain"] and servers == 2
    assert "queue 100% full" in ds[0].reason and "fleet idle 58%" in ds[0].reason  # 6 servers x 4 slots, round(0.4 * 24) = 10 in flight


def test_inside_the_hysteresis_band_nothing_happens():
    a = Autoscaler(CFG)
    # waits more than down_wait (no drain) but less than up_wait (no add), with a full queue and idle fleet
    assert _run(a, 4, wait=0.2, idle=0.6, fill=1.0, t0=0, t1=500)[0] == []
    # a condition that breaks before sustain_s resets: 4 s of starving, 4 s fine, repeatedly
    b = Autoscaler(AutoscaleConfig(enabled=True, min=1, max=8, window_s=2, sustain_s=5, cooldown_s=0))
    totals, t = None, 0.0
    for _ in range(20):
        ds, _, totals = _run(b, 3, wait=1.0, idle=0.0, fill=0.0, t0=t, t1=t + 3, totals=totals)
        assert ds == []
        ds, _, totals = _run(b, 3, wait=0.0, idle=0.0, fill=0.0, t0=t + 4, t1=t + 7, totals=totals)
        assert ds == []
        t += 8


def test_below_min_adds_without_waiting_for_a_rate():
    a = Autoscaler(CFG)
    d = a.observe(0.0, Observation(servers=0, learner_wait_s=0, inflight_groups=0, slots=0, queued_groups=0,
                                   queue_capacity_groups=24))
    assert d is not None and d.action == "add" and d.target == 2 and "< autoscale.min 2" in d.reason


def test_bad_bands_are_refused():
    with pytest.raises(ValueError, match="min=5 > max=2"):
        AutoscaleConfig(min=5, max=2)
    with pytest.raises(ValueError, match="hysteresis band"):
        AutoscaleConfig(up_wait=0.1, down_wait=0.2)
    with pytest.raises(ValueError, match="time went backwards"):
        a = Autoscaler(CFG)
        obs = Observation(servers=3, learner_wait_s=0, inflight_groups=0, slots=12, queued_groups=0,
                          queue_capacity_groups=1)
        a.observe(5.0, obs)
        a.observe(4.0, obs)


phase = st.tuples(st.floats(0, 1), st.floats(0, 1), st.floats(0, 1), st.integers(1, 40))


@settings(max_examples=150, deadline=None)
@given(st.lists(phase, min_size=1, max_size=12), st.integers(0, 9))
def test_decisions_stay_in_bounds_are_spaced_and_follow_their_rule(phases, start):
    a = Autoscaler(CFG)
    servers, t, totals = start, 0.0, [0.0]
    for wait, idle, fill, length in phases:
        ds, servers, totals = _run(a, servers, wait=wait, idle=idle, fill=fill, t0=t, t1=t + length, totals=totals)
        t += length + 1
    for prev, d in zip(a.decisions, a.decisions[1:], strict=False):
        assert d.at - prev.at >= CFG.cooldown_s
    for d in a.decisions:
        assert d.reason
        if d.action == "add":
            assert d.servers_before < d.target <= CFG.max or d.target == CFG.min
            assert d.servers_before < CFG.min or d.wait >= CFG.up_wait
        else:
            assert CFG.min <= d.target < d.servers_before
            assert d.fill >= CFG.down_fill and d.idle >= CFG.down_idle and d.wait <= CFG.down_wait
