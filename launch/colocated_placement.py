"""Placement of colocated mode (``launch/cluster.py --gpus N``): learner rank i and server i on GPU i.

The learner's placement group has one bundle per GPU, as in disaggregated mode; the servers get no
bundle of their own: before the learner's rank actors take their bundles, a probe task in bundle i
asks Ray which physical GPU it holds, and server i is started on exactly that one
(``CUDA_VISIBLE_DEVICES``). Learner and server then share it in turns (core/colocate_config.py).
"""

from __future__ import annotations

import logging

from launch.placement import Placement, Slot, bundles, plan_placement

log = logging.getLogger(__name__)


def place_colocated(job, ray, gpus: int) -> None:
    """Fill ``job.placement``, ``job.placement.pgs['learner']`` and ``job.placement.server_slots`` for ``gpus`` shared GPUs."""
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    tp = job.cfg.rollout.tensor_parallel_size
    if tp != 1:
        raise ValueError(
            f"colocated mode runs one server per GPU beside one learner rank: "
            f"rollout.tensor_parallel_size must be 1, got {tp}"
        )
    if job.cfg.learner.engine != "fsdp":
        raise ValueError(f"colocated mode runs learner.engine 'fsdp', got {job.cfg.learner.engine!r}")
    nodes, job.placement.pin = job.placement.nodes(ray)
    plan = plan_placement(nodes, learner_gpus=gpus, rollout_gpus=0)
    slots = [Slot(s.node_id, (g,)) for s in plan.learner for g in s.gpu_ids]
    pg = job.placement.pgs["learner"] = placement_group(
        bundles(slots, job.placement.pin), strategy="PACK", name="fleetrl-learner"
    )
    job.placement.wait_pgs(ray, [pg])

    @ray.remote(num_cpus=0)
    def bundle_gpus() -> list:
        return [str(g) for g in ray.get_gpu_ids()]

    refs = [
        bundle_gpus.options(
            num_gpus=1, scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)
        ).remote()
        for i in range(len(slots))
    ]
    servers = []
    for i, (slot, ref) in enumerate(zip(slots, refs, strict=True)):
        ids = job._get(ref, 60.0, f"GPU id of colocated bundle {i}")
        servers.append(Slot(slot.node_id, tuple(int(g) if g.isdigit() else g for g in ids)))
        job.placement.server_slots[i] = servers[-1]
    job.placement.plan = Placement(learner=plan.learner, servers=servers)
    log.info("colocated: learner rank i and server i share GPU i: %s", [list(s.gpu_ids) for s in servers])
    if job.cfg.colocate.shared_async:  # both resident at once: the split must fit before anything starts
        from launch.shared_gpu import gpu_memory_totals, gpu_split

        probe = ray.remote(num_cpus=0)(gpu_memory_totals)
        totals = [
            job._get(
                probe.options(
                    num_gpus=1, scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)
                ).remote([str(g) for g in s.gpu_ids]),
                60.0,
                f"GPU memory of colocated bundle {i}",
            )
            for i, s in enumerate(servers)
        ]
        job.placement.memory_split = gpu_split(
            job.cfg, [(f"GPU {s.gpu_ids[0]}", t[0] if t else None) for s, t in zip(servers, totals, strict=True)]
        )
