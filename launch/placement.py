"""Placement planning: which GPUs of which node the learner and each rollout server get.

A pure function of the cluster's nodes and the request, so it is tested without Ray.
Rules: the learner and the fleet never share a GPU; a rollout server's tensor-parallel
group lies inside one node (TP traffic needs NVLink, never the network); the learner's
GPUs on each node are a whole number of its model-parallel groups; the learner is packed
onto as few nodes as possible (FSDP all-gathers are cheaper inside a node) and goes first,
rollout servers fill what is left node by node, then reward servers (``--reward-gpus``, their own
TP groups) what is left after them.

Example::

    plan = plan_placement([NodeGPUs("n0", 8), NodeGPUs("n1", 8)], learner_gpus=8, rollout_gpus=8, rollout_tp=2)
    plan.learner   # [Slot(node_id='n0', gpu_ids=(0, ..., 7))]
    plan.servers   # 4 slots of 2 GPUs on n1
"""

from __future__ import annotations

from dataclasses import dataclass, field


class PlacementError(ValueError):
    """The request does not fit the cluster; the message says what is missing."""


@dataclass(frozen=True, slots=True)
class NodeGPUs:
    node_id: str
    gpus: int


@dataclass(frozen=True, slots=True)
class Slot:
    node_id: str
    gpu_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Placement:
    learner: list[Slot] = field(default_factory=list)  # one slot per node the learner spans
    servers: list[Slot] = field(default_factory=list)  # one slot per rollout server (its TP group)
    rewards: list[Slot] = field(default_factory=list)  # one slot per reward server (its TP group)

    def learner_gpus(self) -> int:
        return sum(len(s.gpu_ids) for s in self.learner)

    def rollout_gpus(self) -> int:
        return sum(len(s.gpu_ids) for s in self.servers)

    def reward_gpus(self) -> int:
        return sum(len(s.gpu_ids) for s in self.rewards)

    def all_gpus(self) -> list[tuple[str, int]]:
        return [(s.node_id, g) for s in self.learner + self.servers + self.rewards for g in s.gpu_ids]


def plan_placement(
    nodes: list[NodeGPUs],
    *,
    learner_gpus: int,
    rollout_gpus: int,
    rollout_tp: int = 1,
    learner_mp: int = 1,
    reward_gpus: int = 0,
    reward_tp: int = 1,
) -> Placement:
    """Assign disjoint GPUs; raise :class:`PlacementError` naming the shortfall."""
    if learner_gpus < 0 or rollout_gpus < 0 or reward_gpus < 0:
        raise PlacementError(
            f"GPU counts must be >= 0, got learner {learner_gpus}, rollout {rollout_gpus}, reward {reward_gpus}"
        )
    if rollout_tp < 1 or learner_mp < 1 or reward_tp < 1:
        raise PlacementError(
            f"parallel sizes must be >= 1, got rollout TP {rollout_tp}, learner MP {learner_mp}, reward TP {reward_tp}"
        )
    if reward_gpus % reward_tp:
        raise PlacementError(
            f"--reward-gpus {reward_gpus} is not a multiple of reward.model.server.tensor_parallel_size {reward_tp}"
        )
    if rollout_gpus % rollout_tp:
        raise PlacementError(
            f"--rollout-gpus {rollout_gpus} is not a multiple of rollout.tensor_parallel_size {rollout_tp}"
        )
    if learner_gpus % learner_mp:
        raise PlacementError(
            f"--learner-gpus {learner_gpus} is not a multiple of the learner's model-parallel size {learner_mp}"
        )
    if len({n.node_id for n in nodes}) != len(nodes):
        raise PlacementError(f"duplicate node ids in {[n.node_id for n in nodes]}")
    total = sum(n.gpus for n in nodes)
    if learner_gpus + rollout_gpus + reward_gpus > total:
        extra = f" + {reward_gpus} reward" if reward_gpus else ""
        raise PlacementError(
            f"asked for {learner_gpus} learner + {rollout_gpus} rollout{extra} GPUs = "
            f"{learner_gpus + rollout_gpus + reward_gpus}, "
            f"but the cluster has {total} ({', '.join(f'{n.node_id}: {n.gpus}' for n in nodes) or 'no nodes'})"
        )
    free = {n.node_id: list(range(n.gpus)) for n in nodes}

    # Learner first, on the fullest nodes, in whole model-parallel groups per node.
    learner: list[Slot] = []
    need = learner_gpus
    for node in sorted(nodes, key=lambda n: (-n.gpus, n.node_id)):
        if need == 0:
            break
        take = min(need, (len(free[node.node_id]) // learner_mp) * learner_mp)
        if take:
            learner.append(Slot(node.node_id, tuple(free[node.node_id][:take])))
            free[node.node_id] = free[node.node_id][take:]
            need -= take
    if need:
        raise PlacementError(
            f"the learner needs {learner_gpus} GPUs in groups of {learner_mp} within a node; {need} did not fit"
        )

    servers = _fill(nodes, free, rollout_gpus // rollout_tp, rollout_tp, "rollout", "the learner")
    rewards = _fill(nodes, free, reward_gpus // reward_tp, reward_tp, "reward", "the learner and the rollout servers")
    return Placement(learner=learner, servers=servers, rewards=rewards)


def _fill(nodes: list[NodeGPUs], free: dict[str, list[int]], want: int, tp: int, what: str, after: str) -> list[Slot]:
    """``want`` servers of ``tp`` GPUs each, every TP group inside one node, filling nodes in order."""
    out: list[Slot] = []
    for node in sorted(nodes, key=lambda n: n.node_id):
        ids = free[node.node_id]
        while want and len(ids) >= tp:
            out.append(Slot(node.node_id, tuple(ids[:tp])))
            ids = ids[tp:]
            want -= 1
        free[node.node_id] = ids
    if want:
        left = {k: len(v) for k, v in free.items() if v}
        raise PlacementError(
            f"{want} {what} server(s) of TP {tp} do not fit: a TP group must lie inside one node, "
            f"and the free GPUs per node after {after} are {left or 'none'}"
        )
    return out


def bundles(slots: list[Slot], node_resource: dict[str, str] | None = None) -> list[dict[str, float]]:
    """Ray placement-group bundles for ``slots``; ``node_resource`` pins each to its node.

    Ray gives every node a custom resource ``node:<ip>`` of 1.0; asking a sliver of it
    is how a bundle is pinned to the node the plan chose.
    """
    out = []
    for s in slots:
        b: dict[str, float] = {"GPU": float(len(s.gpu_ids))}
        if node_resource and s.node_id in node_resource:
            b[node_resource[s.node_id]] = 0.001
        out.append(b)
    return out
