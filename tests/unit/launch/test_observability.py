"""The pieces behind "see the run" on their own (fast): the learner's per-step sink read back with
TensorBoard's own reader (a resumed run continues the curve), the spool rewind replayed by the real
broker state, the report's PNGs, and the Grafana board's queries parsed."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from tests.support.broker_groups import make_groups

REPO = Path(__file__).resolve().parents[3]


def _batch(step: int, groups: list[str], version: int):
    b = make_groups(groups, step=step, version=version, group_size=2, resp_len=4)
    return b


def _read_tb(logdir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "histograms": 0, "tensors": 0})
    acc.Reload()
    return acc


def test_sink_writes_every_metric_and_a_resume_replaces_the_redone_steps(tmp_path):
    from learner.metrics_sink import EVERY_STEP, MetricsSink, effective_rows

    base = {k: 0.5 for k in EVERY_STEP if k.startswith("learner/")}
    sink = MetricsSink(tmp_path, start_step=1, prometheus=False, samples_every=2)
    for s in (1, 2, 3):  # the "dead" run got to step 3; its checkpoint is at 2
        sink.write(s, {**base, "learner/loss_total": float(s)}, _batch(s, [f"a{s}", f"b{s}"], s - 1))
    sink.close()
    sink = MetricsSink(tmp_path, start_step=3, prometheus=False, samples_every=2)
    for s in (3, 4):
        sink.write(s, {**base, "learner/loss_total": 10.0 + s}, _batch(s, [f"c{s}", f"d{s}"], s - 1))
    sink.close()
    acc = _read_tb(tmp_path / "tensorboard" / "learner")
    for tag in EVERY_STEP + ("rollout/reward_mean_addition",):
        assert [e.step for e in acc.Scalars(tag)] == [1, 2, 3, 4], tag
    # the resumed run's step 3 replaced the dead run's (TensorBoard purges at the START mark)
    assert [e.value for e in acc.Scalars("learner/loss_total")] == [1.0, 2.0, 13.0, 14.0]
    assert [e.step for e in acc.Histograms("learner/staleness_versions")] == [1, 2, 3, 4]
    assert sorted({e.step for e in acc.Tensors("rollout/samples")}) == [2, 4]
    rows = effective_rows(tmp_path)
    assert list(rows) == [1, 2, 3, 4] and rows[3]["groups"] == ["c3", "d3"]
    assert rows[4]["metrics"]["rollout/response_length_mean_tokens"] == 4.0
    assert rows[4]["staleness_hist"] == {"0": 4}


def test_rewind_hands_out_again_what_the_checkpoint_lacks(tmp_path):
    from broker.rewind import DROP_REASON, rewind
    from broker.spool import Spool
    from broker.state import BrokerState

    sp = Spool(tmp_path, fsync="never")
    sp.recover()
    for s in (1, 2, 3, 4):
        sp.on_accept(make_groups([f"g{s}"], step=s, version=s - 1))
    sp.on_accept(make_groups(["late"], step=5, version=4))  # g4 and this: sampled after the checkpoint
    sp.on_lease("L1", 1, "learner", ["g1"])
    sp.on_ack("L1", 1, ["g1"])
    sp.on_version(1)  # noqa: E702
    sp.on_lease("L2", 2, "learner", ["g2"])  # checkpointed at 2, killed before the ack
    sp.on_lease("L3", 3, "learner", ["g3"])
    sp.on_ack("L3", 3, ["g3"])
    sp.on_version(3)  # noqa: E702
    sp.close()
    report = rewind(tmp_path, version=2)
    assert report == {"acks_undone": 1, "open_leases_acked": 1, "future_groups_dropped": 2}
    rec = Spool(tmp_path).recover()
    st = BrokerState(
        max_staleness=2, groups_per_step=1, lease_timeout_s=60, ticket_timeout_s=60, byte_budget_bytes=1 << 30
    )
    st.restore(rec.batches, rec.records, now=0.0)
    assert st.version == 1  # the last version record at or before the checkpoint
    assert sorted(st.pending) == ["g3"]  # g3 is trained again; g1, g2 are in the checkpoint
    assert st.counters.drops[DROP_REASON] == 2  # g4 and late: weights the resumed learner never had


def test_report_writes_pngs(tmp_path):
    from launch.report import PLOTS, build_report
    from learner.metrics_sink import EVERY_STEP, MetricsSink

    sink = MetricsSink(tmp_path, start_step=1, prometheus=False, tensorboard=False)
    for s in range(1, 6):
        sink.write(s, {k: 0.1 * s for k in EVERY_STEP if k.startswith("learner/")}, _batch(s, [f"g{s}"], max(0, s - 2)))
    sink.close()
    (tmp_path / "metrics" / "driver.jsonl").write_text(
        "\n".join(
            json.dumps(
                {
                    "time": 1e9 + i,
                    "step": i,
                    "tokens_per_s": 100.0 + i,
                    "fleet_idle_fraction": 0.1,
                    "learner_idle_fraction": 0.5,
                    "eval_accuracy": 0.4 if i > 2 else None,
                }
            )
            for i in range(6)
        )
        + "\n"
    )
    paths = build_report(tmp_path)
    for name in PLOTS:
        data = (tmp_path / "report" / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, name
    assert "steps: 1..5" in (tmp_path / "report" / "report.md").read_text()
    assert len(paths) == len(PLOTS) + 1


PROMQL_WORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "and",
    "or",
    "unless",
    "offset",
    "le",
}


def dashboard_series(path: Path = REPO / "docs" / "grafana" / "fleetrl.json") -> set[str]:
    """Every series name the board's PromQL queries read (functions, keywords, labels and ranges left out)."""
    board = json.loads(path.read_text())
    names = set()
    for panel in board["panels"]:
        assert panel["targets"], panel["title"]
        for t in panel["targets"]:
            expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]", "", t["expr"])
            expr = re.sub(r"\b(by|without)\s*\([^)]*\)", "", expr)
            for m in re.finditer(r"\b[A-Za-z_:][A-Za-z0-9_:]*\b(?!\s*\()", expr):
                word = m.group(0)
                if word not in PROMQL_WORDS and not re.fullmatch(r"[0-9.e]+", word):
                    names.add(word)
    return names


def test_dashboard_parses_and_names_series():
    names = dashboard_series()
    assert {
        "broker_engine_version_lag",
        "fleetrl_rollout_tokens_per_s",
        "fleetrl_step_learner_time_publish_seconds",
        "fleetrl_step_rollout_reward_mean",
        "broker_staleness_versions_bucket",
    } <= names
    assert all(n.startswith(("broker_", "fleetrl_")) for n in names), names  # no function or label taken for one


@pytest.mark.parametrize("lo,hi", [(0.0, 1.0), (3.0, 3.0), (-0.02, 0.5), (0, 1234.0)])
def test_ticks_cover_the_range(lo, hi):
    from launch.plot import nice_ticks

    t = nice_ticks(lo, hi)
    assert 2 <= len(t) <= 12 and all(np.diff(t) > 0)


def test_a_rerun_ends_the_engine_group_a_killed_driver_left(tmp_path):
    """The server's leader is gone (as after a kill -9 of the driver) but its child lives on."""
    import os
    import signal
    import subprocess
    import time

    from launch.resume import _members, end_leftovers

    env = {**os.environ, "VLLM_RPC_BASE_PATH": str(tmp_path / "vllm-0" / "tmp")}  # as a real server's
    leader = subprocess.Popen(
        ["sh", "-c", "sleep 300 & echo $!; wait"], env=env, stdout=subprocess.PIPE, start_new_session=True, text=True
    )
    child = int(leader.stdout.readline())
    # `$!` is known as soon as the shell forks: wait for the child to have become `sleep` (mid-exec its
    # /proc environ reads empty, and end_leftovers would rightly not count it as this run's; seen in CI)
    deadline = time.monotonic() + 10
    while b"sleep" not in Path(f"/proc/{child}/cmdline").read_bytes() and time.monotonic() < deadline:
        time.sleep(0.01)
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "pids.json").write_text(json.dumps({"driver": 999999999, "engines": [leader.pid]}))
    os.kill(leader.pid, signal.SIGKILL)
    leader.wait()
    try:
        assert _members(leader.pid) == [child]
        assert end_leftovers(tmp_path) == [child]
        deadline = time.monotonic() + 10
        while _members(leader.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _members(leader.pid)
    finally:
        try:
            os.killpg(leader.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
