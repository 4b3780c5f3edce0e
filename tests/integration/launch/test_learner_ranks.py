"""A learner of two gloo ranks as Ray actors (launch.learner_ranks.LearnerRanks) on a real broker.

No fleet and no vLLM: a producer thread answers the broker's tickets with synthetic groups
in the tiny model's vocabulary, and two real FSDP ranks train on them. Checks that both
ranks train every step (rank 1 gets its batches from rank 0), that a stop reaches every
rank, and that a rank killed with SIGKILL fails the job with a message naming it.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from procs import alive

REPO = Path(__file__).resolve().parents[3]
VOCAB = 128  # models/tiny-adder
pytestmark = [pytest.mark.timeout(300)]


def _group(ticket, group_size: int, rng: np.random.Generator):
    from broker.schema import Trajectory, to_record_batch

    gid = f"s{ticket.step}-{ticket.ticket_id}"
    prompt = rng.integers(3, VOCAB, size=6).tolist()
    rows = []
    for i in range(group_size):
        n = int(rng.integers(2, 9))
        rows.append(
            Trajectory(
                traj_id=f"{gid}/{i}",
                group_id=gid,
                sample_index=i,
                group_size=group_size,
                step=int(ticket.step),
                prompt_ids=prompt,
                response_ids=rng.integers(3, VOCAB, size=n).tolist(),
                behaviour_logprobs=(-4.8 + rng.normal(0, 0.2, size=n)).clip(max=0).tolist(),
                segment_starts=[0],
                segment_versions=[max(0, int(ticket.step) - 1)],
                reward=float(i % 2),
                finish_reason="stop",
                engine_id="test-producer",
                data_source="synthetic",
            )
        )
    return to_record_batch(rows)


class _Producer(threading.Thread):
    """Plays the fleet: every ticket the broker grants becomes one pushed group."""

    def __init__(self, address: str, group_size: int) -> None:
        super().__init__(daemon=True)
        self.address, self.group_size = address, group_size
        self.halt = threading.Event()
        self.pushed = 0

    def run(self) -> None:
        from broker.client import SyncProducer

        rng = np.random.default_rng(0)
        prod = SyncProducer(self.address, producer_id="test-producer", timeout_s=10)
        try:
            while not self.halt.is_set():
                for t in prod.acquire_tickets(4, 0.2):
                    prod.push(_group(t, self.group_size, rng))
                    self.pushed += 1
        finally:
            prod.close()


@pytest.fixture(scope="module")
def ray_local():
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


def _start(ray_local, tmp_path: Path, steps: int):
    from broker.process import BrokerProcess
    from launch.config import load_run_config
    from launch.learner_ranks import LearnerRanks

    cfg = load_run_config(
        "tiny",
        [
            f"run.max_steps={steps}",
            f"run.run_dir={tmp_path}",
            "broker.groups_per_step=2",
            "broker.max_staleness=1",
            "learner.cpu_processes=2",
            "learner.export_every=0",
            "rollout.request_timeout_s=120",
            "learner.logprob_probe_tolerance=null",
        ],
    )  # synthetic behaviour log-probs
    broker = BrokerProcess(groups_per_step=2, max_staleness=1).start()
    producer = _Producer(broker.address, group_size=4)
    producer.start()
    ranks = LearnerRanks.start(
        cfg.model_dump(mode="json"), broker.address, str(tmp_path), None, n=cfg.learner.cpu_processes
    )
    return broker, producer, ranks


def _end(broker, producer, ranks) -> list[int]:
    pids = [i["pid"] for i in ranks.infos]
    ranks.kill()
    producer.halt.set()
    producer.join(30)
    broker.stop()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and alive(pids):
        time.sleep(0.5)
    return alive(pids)


def test_two_ranks_train_every_step_and_stop_together(ray_local, tmp_path):
    steps = 3
    broker, producer, ranks = _start(ray_local, tmp_path, steps)
    try:
        deadline = time.monotonic() + 240
        while not ranks.poll(1.0):
            assert time.monotonic() < deadline, "two learner ranks did not finish 3 steps in 240 s"
        final = ranks.stop(30)
    finally:
        left = _end(broker, producer, ranks)
    assert final["world_size"] == 2 and final["rank"] == 0
    assert final["rank_steps"] == [steps, steps]
    assert final["groups_consumed"] == steps * 2 and final["error"] is None
    assert len(final["reward_per_step"]) == steps
    # what every "auto" of the learner config became (learner/fastpath.py), for the summary: CPU keeps the plain path
    assert final["settings"]["device"] == "cpu" and final["settings"]["compile_blocks"] is False
    assert (tmp_path / "logs" / "learner-rank1.log").read_text().count("rank 1/2 up") == 1
    assert (tmp_path / "export" / "latest" / "config.json").exists()  # the final export: a collective of both
    assert not left, f"learner rank processes still alive: {left}"


@pytest.mark.parametrize("victim", [1, 0])
def test_a_killed_rank_fails_the_job_naming_it(ray_local, tmp_path, victim):
    """Rank 1's death is seen by ``poll``; rank 0's usually first by the status call the driver makes
    every half second (``live_status``): either way the job fails naming the dead rank and its pid."""
    from launch.learner_ranks import RankFailed

    broker, producer, ranks = _start(ray_local, tmp_path, steps=1000)
    try:
        deadline = time.monotonic() + 240
        while ranks.status(30)["step"] < 1:  # both ranks are in the training loop
            assert not ranks.poll(0.5) and time.monotonic() < deadline, "the learner never finished a step"
        pid = ranks.infos[victim]["pid"]
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(RankFailed, match=rf"learner rank {victim} \(pid {pid}\) died"):
            deadline = time.monotonic() + 60
            while True:  # the driver's loop: status, then poll
                ranks.live_status(30)
                assert not ranks.poll(0.5) and time.monotonic() < deadline, f"rank {victim}'s death not seen in 60 s"
        if victim == 1:
            final = ranks.stop(30)  # rank 0 still answers (it may be blocked in a collective with rank 1)
            assert final["rank_steps"][1] is None
    finally:
        left = _end(broker, producer, ranks)
    assert not left, f"learner rank processes still alive: {left}"
