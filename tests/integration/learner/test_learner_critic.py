"""PPO with a critic on 2 real FSDP CPU ranks (gloo, forked processes) with the tiny Qwen2: GAE advantages,
a critic warm-up step, checkpoint and resume of actor + critic, the critic's metrics through the sink.

One uninterrupted 4-step run checkpoints at steps 2 and 4; a fresh pair of processes resumes from a copy of
the step-2 checkpoint alone and must reproduce steps 3 and 4 bit for bit: step 3's values come from the
restored critic weights, its critic update from the restored AdamW moments and schedule (a fresh AdamW's
first step is ~lr * sign(g), a different update), and step 4's values and losses show that update.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch
from learner_testkit import (
    join_gloo,
    make_batches,
    make_tiny_model,
    ppo_critic_config,
    read_batches,
    run_procs,
    write_batches,
)

STEPS = 4
pytestmark = pytest.mark.timeout(240)


def _rank(rank: int, world_size: int, port: int, kw: dict) -> None:

    from learner.config import LearnerConfig
    from learner.critic import Critic
    from learner.fsdp import FSDPEngine
    from learner.loop import Learner
    from learner.source import InProcessSource

    join_gloo(rank, world_size, port)
    cfg = LearnerConfig.model_validate(ppo_critic_config())
    engine = FSDPEngine(cfg, kw["model"], total_steps=STEPS, seed=0)
    critic = Critic(cfg, kw["model"], total_steps=STEPS, seed=0, engine=engine)
    source = None
    if rank == 0:
        source = InProcessSource(read_batches(kw["data"]))
    published: list[int] = []

    def publish(version: int, eng) -> None:
        for _ in eng.iter_full_params(1 << 16):
            pass
        published.append(version)

    learner = Learner(
        engine,
        cfg,
        source=source,
        max_steps=STEPS,
        checkpoint_dir=Path(kw["ckpt"]),
        publish=publish,
        on_unchanged=lambda v: published.append(-v),
        critic=critic,
    )
    resumed = learner.resume()
    history = learner.run()
    if rank == 0:
        import urllib.request

        from learner.metrics_sink import ENDPOINT, MetricsSink

        sink = MetricsSink(kw["out"], start_step=history[0]["learner/version"], tensorboard=True, prometheus=True)
        for h in history:
            sink.write(int(h["learner/version"]), h, None)
        # the learner's Prometheus endpoint as a scraper reads it (the last step's gauges)
        url = json.loads(Path(kw["out"], ENDPOINT).read_text())["learner"]
        with urllib.request.urlopen(url, timeout=10) as r:
            Path(kw["out"], "prometheus.txt").write_bytes(r.read())
        sink.close()
    Path(kw["out"], f"rank{rank}.json").write_text(
        json.dumps({"history": history, "resumed": resumed, "published": published})
    )
    torch.distributed.destroy_process_group()


def _run(d: Path, name: str, model: Path, data: Path, ckpt: Path) -> list[dict]:
    # spawn: a rank forked from a pytest process that has run many tests before (threads, thread pools)
    # hung past its 200 s once, after tests/unit in a fresh clone
    out = d / name
    out.mkdir()
    run_procs(
        _rank,
        2,
        dict(model=str(model), data=str(data), out=str(out), ckpt=str(ckpt)),
        timeout=200,
        start_method="spawn",
    )
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("critic")
    model = make_tiny_model(d / "model")
    # 4 prompts x 2 samples a step; n >= 1 is legal for GAE, the group only decides the mini-batch split
    data = write_batches(d / "data.arrow", make_batches(STEPS, groups=4, group_size=2))
    straight = _run(d, "straight", model, data, d / "ckpt")
    shutil.copytree(d / "ckpt" / "step_00000002", d / "ckpt_resume" / "step_00000002")
    resumed = _run(d, "resumed", model, data, d / "ckpt_resume")
    return {"dir": d, "straight": straight, "resumed": resumed}


CRITIC_KEYS = (
    "critic/vf_loss",
    "critic/vf_clipfrac",
    "critic/vpred_mean",
    "critic/grad_norm",
    "critic/lr",
    "critic/vf_explained_var",
    "critic/values_mean",
    "critic/returns_mean",
    "critic/advantages_mean",
)


def test_critic_warm_up_then_ppo_steps(runs):
    h = runs["straight"][0]["history"]
    assert [int(x["learner/version"]) for x in h] == [1, 2, 3, 4]
    # step 1 is the critic's warm-up: no actor optimizer step, the engines relabelled (no publish)
    assert h[0]["learner/optimizer_steps"] == 0 and "learner/loss_total" not in h[0]
    assert runs["straight"][0]["published"] == [-1, 2, 3, 4]
    assert all(x["learner/optimizer_steps"] == 2 for x in h[1:])  # 4 groups, 2 per mini-batch
    for x in h:
        for k in CRITIC_KEYS:
            assert k in x and x[k] == x[k], (k, x.get(k))  # present and not NaN
        assert x["critic/optimizer_steps"] == 2 and x["critic/grad_norm"] > 0
    # the critic learns: its loss on fresh batches falls from the random head's
    assert h[-1]["critic/vf_loss"] < h[0]["critic/vf_loss"], [x["critic/vf_loss"] for x in h]
    # every rank reports the same (all-reduced) numbers
    for a, b in zip(h, runs["straight"][1]["history"], strict=True):
        assert {k: a[k] for k in CRITIC_KEYS} == {k: b[k] for k in CRITIC_KEYS}


def test_resume_gives_the_same_next_steps(runs):
    straight, resumed = runs["straight"][0], runs["resumed"][0]
    assert resumed["resumed"] and [int(x["learner/version"]) for x in resumed["history"]] == [3, 4]
    assert (runs["dir"] / "ckpt" / "step_00000002" / "critic" / "scheduler.json").exists()
    keys = CRITIC_KEYS + ("learner/loss_total", "learner/grad_norm", "learner/lr")
    # Same process count, same data, the actor's and the critic's weights, AdamW moments and schedules
    # restored from fp32 tensors as saved: the continuation is bit-identical, so no tolerance.
    for a, b in zip(straight["history"][2:], resumed["history"], strict=True):
        assert {k: b[k] for k in keys} == {k: a[k] for k in keys}


def test_critic_metrics_reach_the_sink(runs):
    rows = [
        json.loads(line) for line in (runs["dir"] / "straight" / "metrics" / "learner.jsonl").read_text().splitlines()
    ]
    steps = [r for r in rows if "metrics" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for r in steps:
        assert set(CRITIC_KEYS) <= set(r["metrics"])
    assert any((runs["dir"] / "straight" / "tensorboard" / "learner").iterdir())


def test_critic_metrics_reach_every_sink(runs, tmp_path, monkeypatch):
    """The critic's metrics (verl's names) from the real run above, through the same writers a run uses:
    TensorBoard and Prometheus from the learner's sink (learner/metrics_sink.py), W&B from the driver's
    Monitor reading the learner's lines (launch/monitor.py, offline; the record file read back). The live
    view's critic row: tests/unit/learner/test_learner_gae.py::test_live_view_shows_the_critic."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests.integration.launch.test_wandb_logging import history as wandb_history
    from tests.integration.launch.test_wandb_logging import read_wandb_records

    out = runs["dir"] / "straight"
    want = {int(h["learner/version"]): h for h in runs["straight"][0]["history"]}
    acc = EventAccumulator(str(out / "tensorboard" / "learner"), size_guidance={"scalars": 0})
    acc.Reload()
    for k in CRITIC_KEYS:  # TensorBoard keeps float32: 1e-6 relative covers its rounding (2^-24 ~ 6e-8)
        assert [e.step for e in acc.Scalars(k)] == list(want), k
        assert [e.value for e in acc.Scalars(k)] == pytest.approx([want[s][k] for s in want], rel=1e-6), k
    prom = {
        ln.split()[0]: float(ln.split()[1])
        for ln in (out / "prometheus.txt").read_text().splitlines()
        if ln.startswith("fleetrl_step_critic_")
    }
    for k in CRITIC_KEYS:  # a gauge per metric, holding the last step's value (the text format keeps float64)
        name = "fleetrl_step_" + k.replace("/", "_")
        assert prom[name] == want[4][k], name

    pytest.importorskip("wandb")
    from launch.monitor import Monitor, WandbConfig, WandbWriter
    from launch.snapshot import FleetStatus, JobSnapshot
    from learner.status import LearnerStatus

    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    run_dir = tmp_path / "run"
    shutil.copytree(out / "metrics", run_dir / "metrics")  # the learner's lines, as the driver finds them
    writer = WandbWriter(WandbConfig(project="fleetrl-test", mode="offline"), run_dir, simulated=False, run_config={})
    mon = Monitor(
        run_dir, simulated=False, tensorboard=False, live=False, prometheus=False, wandb=writer, learner_rows_from=0
    )
    mon.update(
        JobSnapshot(
            fleet=FleetStatus(),
            learner=LearnerStatus(step=4),
            max_steps=4,
            max_staleness=2,
            simulated=False,
            wall_s=1.0,
        )
    )
    mon.close()
    # W&B's service process writes the offline file; finish() can return before the last records reach the
    # disk (seen once in a longer pytest session): read until the four steps are there, 30 s at most
    deadline = time.monotonic() + 30.0
    while True:
        logs = list(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
        rows = [r for r in wandb_history(read_wandb_records(logs[0])) if "critic/vf_loss" in r] if logs else []
        if len(rows) >= 4 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(logs) == 1, logs
    assert [int(r["_step"]) for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert {k: r[k] for k in CRITIC_KEYS} == {k: want[int(r["_step"])][k] for k in CRITIC_KEYS}  # JSON floats
