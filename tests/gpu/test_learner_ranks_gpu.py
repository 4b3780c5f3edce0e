"""The learner's rank actors on GPUs: one Ray actor per bundle of a placement group, NCCL between them.

Run on the GPU machine (2 GPUs): ``pytest -m gpu tests/gpu/test_learner_ranks_gpu.py``.
Same setup as tests/integration/launch/test_learner_ranks.py (real broker, a producer thread in
place of the fleet, models/tiny-adder), with ``num_gpus=1`` per rank.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "integration" / "launch"))
from test_learner_ranks import _Producer  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.mark.timeout(600)
def test_two_gpu_ranks_train_over_nccl(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, found {torch.cuda.device_count()}")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    from broker.process import BrokerProcess
    from launch.config import load_run_config
    from launch.learner_ranks import LearnerRanks

    steps = 3
    cfg = load_run_config(
        "tiny",
        [
            f"run.max_steps={steps}",
            f"run.run_dir={tmp_path}",
            "broker.groups_per_step=2",
            "broker.max_staleness=1",
            "learner.export_every=0",
            "rollout.request_timeout_s=120",
        ],
    )
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    broker = BrokerProcess(groups_per_step=2, max_staleness=1).start()
    producer = _Producer(broker.address, group_size=4)
    producer.start()
    pg = placement_group([{"GPU": 1.0}, {"GPU": 1.0}], strategy="PACK")
    ranks = None
    try:
        ray.get(pg.ready(), timeout=60)
        ranks = LearnerRanks.start(
            cfg.model_dump(mode="json"), broker.address, str(tmp_path), None, n=2, placement_group=pg, gpus_per_rank=1
        )
        deadline = time.monotonic() + 300
        while not ranks.poll(1.0):
            assert time.monotonic() < deadline, "two GPU learner ranks did not finish 3 steps in 300 s"
        final = ranks.stop(30)
    finally:
        if ranks is not None:
            ranks.kill()
        producer.halt.set()
        producer.join(30)
        broker.stop()
        remove_placement_group(pg)
        ray.shutdown()
    assert final["world_size"] == 2 and final["rank_steps"] == [steps, steps], final
    assert sorted(len(i["gpus"]) for i in ranks.infos) == [1, 1]
    assert ranks.infos[0]["gpus"] != ranks.infos[1]["gpus"], ranks.infos  # two GPUs, not one shared
    logs = [(tmp_path / "logs" / name).read_text() for name in ("learner.log", "learner-rank1.log")]
    assert "rank 0/2 up" in logs[0] and "LOCAL_RANK 0" in logs[0]
    assert "rank 1/2 up" in logs[1] and "LOCAL_RANK 1" in logs[1]
    assert "on cuda" in logs[0] and "on cuda" in logs[1]  # the FSDP engine's device line: NCCL, not gloo
