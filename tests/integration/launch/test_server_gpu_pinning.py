"""A rollout server is started on the GPU Ray reserved for its bundle, never on the learner's.

Ray with 2 fake GPUs: the learner's bundle is placed first and one rank actor runs in it;
then the driver's ``_pin_server_gpus`` asks Ray which GPU the server's bundle holds. The two
must differ and together be both GPUs (the plan's numbering alone cannot promise that).
"""

from __future__ import annotations

import argparse

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def test_server_slot_gets_its_bundles_gpu_not_the_learners():
    ray = pytest.importorskip("ray")
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from launch.config import load_run_config
    from launch.driver import Job
    from launch.placement import Slot

    cfg = load_run_config("gpu-tiny", [])
    args = argparse.Namespace(simulate=False, rollout_gpus=1, learner_gpus=1, address=None, no_live=True)
    ray.init(num_cpus=1, num_gpus=2, include_dashboard=False, log_to_driver=False)
    try:
        job = Job(cfg, args)
        job.placement.pin = {}
        learner_pg = placement_group([{"GPU": 1.0}], strategy="PACK")
        ray.get(learner_pg.ready(), timeout=60)

        @ray.remote(num_cpus=0, num_gpus=1)
        def learner_gpus() -> list:
            return [str(g) for g in ray.get_gpu_ids()]

        learner = ray.get(
            learner_gpus.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(learner_pg, placement_group_bundle_index=0)
            ).remote(),
            timeout=60,
        )
        # the plan numbers the server's GPU as the learner's on purpose: pinning must not trust it
        job.placement.add_server_pg(0, Slot("node", (int(learner[0]),)))
        job.placement.wait_pgs(ray, [job.placement.pgs["server-0"]])
        job.placement.pin_server_gpus(ray, [0])
        server = [str(g) for g in job.placement.server_slots[0].gpu_ids]
        assert len(learner) == 1 and len(server) == 1
        assert server != learner and sorted(learner + server) == ["0", "1"], (learner, server)
    finally:
        ray.shutdown()
