"""Where a job's processes run: the placement plan, its Ray placement groups, and the GPUs each server got.

:class:`JobPlacement` is the driver's placement half (``Job.placement``); the driver keeps the lifecycle (start,
loop, evaluation, scaling, shutdown). Placement happens once at start (:meth:`JobPlacement.place`) and again when
the fleet grows or shrinks (launch/fleet_scaling.py: :meth:`add_server_pg`, :meth:`release`)::

    plan     launch.placement.Placement: learner slots, one slot per server, reward slots (the pure plan)
    pgs      "learner" / "server-<i>" / "reward-<i>" -> Ray placement group (one bundle per GPU or server)
    pin      node id -> "node:<ip>" (the custom resource that pins a bundle to its node)
    server_slots  server index -> Slot, with the GPU ids Ray reserved once pinned (pin_server_gpus)
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from launch.placement import NodeGPUs, Placement, Slot, bundles, plan_placement

log = logging.getLogger(__name__)


class JobFailed(RuntimeError):
    """A component of the job failed; the message names it."""


def ray_get(ref, timeout: float, what: str):
    """``ray.get`` bounded by ``timeout``; a timeout or a dead actor is a :class:`JobFailed` naming ``what``."""
    import ray

    try:
        return ray.get(ref, timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        raise JobFailed(f"{what}: no answer within {timeout:.0f} s") from None
    except ray.exceptions.RayActorError as exc:
        raise JobFailed(f"{what}: the actor died ({exc})") from None


class JobPlacement:
    """The placement plan of one job and the Ray resources that hold it (see the module docstring)."""

    def __init__(self, cfg, args, *, simulated: bool, call_timeout_s: float) -> None:
        self.cfg, self.args, self.simulated = cfg, args, simulated
        self.call_timeout_s = call_timeout_s
        self.plan = Placement()
        self.pgs: dict[str, Any] = {}
        self.server_slots: dict[int, Slot] = {}
        self.pin: dict[str, str] = {}
        self.memory_split: list[dict] | None = None  # shared async mode: each device's split (launch/shared_gpu.py)

    # -- the plan ---------------------------------------------------------------------------------
    @staticmethod
    def nodes(ray) -> tuple[list[NodeGPUs], dict[str, str]]:
        nodes, pin = [], {}
        for n in ray.nodes():
            if n.get("Alive"):
                nodes.append(NodeGPUs(n["NodeID"], int(n["Resources"].get("GPU", 0))))
                pin[n["NodeID"]] = f"node:{n['NodeManagerAddress']}"
        return nodes, pin

    def place(self, ray, job) -> None:
        """Plan the job and reserve it: colocated (``--gpus``), CPU, or the two GPU pools. ``job`` is handed to
        the colocated and reward-server placements, which also set up what they start."""
        from ray.util.placement_group import placement_group

        r, lg = self.args.rollout_gpus, self.args.learner_gpus
        if self.args.colocate_gpus:
            from launch.colocated_placement import place_colocated

            place_colocated(job, ray, self.args.colocate_gpus)
            if self.cfg.reward.model is not None and self.cfg.reward.model.server.colocated:
                from launch.reward_servers import colocated_slots, place_reward_servers

                place_reward_servers(job, colocated_slots(self.server_slots), self.pin)  # reward i on GPU i
            return
        if r == 0 and lg == 0:
            if self.cfg.colocate.shared_async:  # checked before the run too (launch/cluster.py); here for the summary
                from launch.shared_gpu import host_split

                self.memory_split = host_split(self.cfg)
            self._reward_servers(job, [], {})  # CPU: --reward-gpus counts servers on the driver's node
            return
        if (r == 0) != (lg == 0):
            raise JobFailed(f"give GPUs to both pools or to neither (got --rollout-gpus {r} --learner-gpus {lg})")
        nodes, self.pin = self.nodes(ray)
        rm = self.cfg.reward.model
        self.plan = plan_placement(
            nodes,
            learner_gpus=lg,
            rollout_gpus=r,
            rollout_tp=self.cfg.rollout.tensor_parallel_size,
            learner_mp=self.cfg.learner.megatron.tensor_model_parallel_size
            if self.cfg.learner.engine == "megatron"
            else 1,
            reward_gpus=self.args.reward_gpus,
            reward_tp=rm.server.tensor_parallel_size if rm is not None else 1,
        )
        # one bundle per learner GPU: one rank actor each (simulated runs keep one bundle per node)
        learner_slots = (
            self.plan.learner
            if self.simulated
            else [Slot(s.node_id, (g,)) for s in self.plan.learner for g in s.gpu_ids]
        )
        self.pgs["learner"] = placement_group(bundles(learner_slots, self.pin), strategy="PACK", name="fleetrl-learner")
        for i, slot in enumerate(self.plan.servers):
            self.add_server_pg(i, slot)
        self._reward_servers(job, self.plan.rewards, self.pin)
        self.wait_pgs(ray, list(self.pgs.values()))
        self.pin_server_gpus(ray, list(self.server_slots))
        log.info(
            "placed learner on %d GPUs (%d nodes), fleet on %d servers x TP %d",
            self.plan.learner_gpus(),
            len(self.plan.learner),
            len(self.plan.servers),
            self.cfg.rollout.tensor_parallel_size,
        )

    def _reward_servers(self, job, slots: list[Slot], pin: dict[str, str]) -> None:
        rm = self.cfg.reward.model
        if self.args.reward_gpus or (rm is not None and rm.server.colocated):  # colocated on CPU: one server
            from launch.reward_servers import place_reward_servers

            place_reward_servers(job, slots, pin)

    def n_servers(self) -> int:
        if self.cfg.rollout.urls:
            return len(self.cfg.rollout.urls)
        return len(self.plan.servers) if self.plan.servers else self.cfg.rollout.servers

    @property
    def server_actors(self) -> bool:
        """vLLM servers on GPUs (real or fake) are each started by an actor in their own bundle.

        Not in colocated mode: there a server shares its GPU with a learner rank, whose bundle holds
        the GPU, so the fleet starts it as a process on the GPU id that bundle got (launch/colocated_placement.py).
        """
        return (
            bool(self.plan.servers)
            and not self.simulated
            and self.cfg.rollout.engine == "vllm"
            and not self.cfg.rollout.urls
            and not self.args.colocate_gpus
        )

    # -- placement groups -------------------------------------------------------------------------
    def add_server_pg(self, index: int, slot: Slot):
        from ray.util.placement_group import placement_group

        pg = placement_group(bundles([slot], self.pin), strategy="STRICT_PACK", name=f"fleetrl-server-{index}")
        self.pgs[f"server-{index}"] = pg
        self.server_slots[index] = slot
        return pg

    @staticmethod
    def wait_pgs(ray, pgs: list, timeout_s: float = 60.0) -> None:
        ready, _ = ray.wait([pg.ready() for pg in pgs], num_returns=len(pgs), timeout=timeout_s)
        if len(ready) != len(pgs):
            raise JobFailed(
                f"{len(pgs) - len(ready)} placement group(s) not ready after {timeout_s:.0f} s: "
                f"the cluster lacks the resources ({ray.available_resources()})"
            )

    def server_pgs(self, indices) -> dict[int, Any] | None:
        return {i: self.pgs[f"server-{i}"] for i in indices} if self.server_actors else None

    def pin_server_gpus(self, ray, indices: list[int]) -> None:
        """Replace each server slot's planned GPU ids by the ids Ray reserved for its bundle.

        The plan numbers GPUs 0..n-1 per node, but Ray picks which physical GPUs a placement
        group's bundle holds; the learner's rank actors get theirs from Ray. A server process is
        not a Ray worker, so a zero-CPU task in its bundle asks Ray which GPUs those are, and the
        server is started with exactly them (CUDA_VISIBLE_DEVICES): never on a learner GPU.
        """
        if self.simulated or not indices or self.server_actors:  # a server actor reads its own ids from Ray
            return
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        @ray.remote(num_cpus=0)
        def bundle_gpus() -> list:
            return [str(g) for g in ray.get_gpu_ids()]

        refs = {
            i: bundle_gpus.options(
                num_gpus=len(self.server_slots[i].gpu_ids),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.pgs[f"server-{i}"], placement_group_bundle_index=0
                ),
            ).remote()
            for i in indices
        }
        for i, ref in refs.items():
            ids = ray_get(ref, self.call_timeout_s * 2, f"GPU ids of server {i}'s bundle")
            slot = self.server_slots[i]
            self.server_slots[i] = Slot(slot.node_id, tuple(int(g) if g.isdigit() else g for g in ids))
            log.info("server %d: Ray bundle GPUs %s (planned %s)", i, ids, list(slot.gpu_ids))

    def release(self, indices: list[int]) -> None:
        from ray.util.placement_group import remove_placement_group

        for i in indices:
            pg = self.pgs.pop(f"server-{i}", None)
            self.server_slots.pop(i, None)
            if pg is not None:
                remove_placement_group(pg)

    # -- the record -------------------------------------------------------------------------------
    def write(self, run_dir: Path, placed: dict[int, dict], rewards: list[dict]) -> None:
        """``<run_dir>/placement.json``: each server's planned node and GPUs, and where its actor really ran
        (``placed``: the fleet's answer), with the reward servers."""
        ips = {nid: res.split(":", 1)[1] for nid, res in self.pin.items()}
        out = {
            "learner": [{"node_ip": ips.get(s.node_id), "gpus": list(s.gpu_ids)} for s in self.plan.learner],
            "servers": {
                str(i): {"planned_node_ip": ips.get(s.node_id), "planned_node_id": s.node_id, **placed.get(i, {})}
                for i, s in self.server_slots.items()
            },
            "reward_servers": rewards,
        }
        (run_dir / "placement.json").write_text(json.dumps(out, indent=2))
