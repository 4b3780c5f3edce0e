"""``launch/cluster.py --dry-run``: the placement and the listeners a run would use, nothing started.

The cluster is the one ``--address`` names (its alive nodes and their GPUs, read from Ray) or one
described with ``--nodes 8,8,8,8`` (GPUs per node; node ids ``n0``, ``n1``, ...). Prints which GPUs of
which node the learner and each server get (:func:`launch.placement.plan_placement`, the same
function a run calls), the reward servers (``--reward-gpus``), where each listener (and the proxy) would
bind, and whether CurveZMQ would be on.
"""

from __future__ import annotations

import json
import os
from typing import Any

from core.network import curve_enabled, resolve_host
from launch.placement import NodeGPUs, plan_placement


def described_nodes(spec: str) -> list[NodeGPUs]:
    try:
        counts = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--nodes {spec!r}: expected GPUs per node, comma-separated (e.g. 8,8,8,8)") from None
    if not counts or any(c < 0 for c in counts):
        raise ValueError(f"--nodes {spec!r}: expected one or more GPU counts >= 0")
    return [NodeGPUs(f"n{i}", c) for i, c in enumerate(counts)]


def cluster_nodes(address: str, ray_auth: str | None) -> tuple[list[NodeGPUs], dict[str, str]]:
    """The alive nodes of the Ray cluster at ``address`` (ids and GPUs) and each node's IP."""
    os.environ["RAY_AUTH_MODE"] = ray_auth or "token"  # before `import ray`, as the driver does
    import ray

    ray.init(address=address, include_dashboard=False, log_to_driver=False)
    try:
        nodes, ips = [], {}
        for n in ray.nodes():
            if n.get("Alive"):
                nodes.append(NodeGPUs(n["NodeID"], int(n["Resources"].get("GPU", 0))))
                ips[n["NodeID"]] = n["NodeManagerAddress"]
        return nodes, ips
    finally:
        ray.shutdown()


def plan(
    cfg,
    nodes: list[NodeGPUs],
    ips: dict[str, str],
    *,
    rollout_gpus: int,
    learner_gpus: int,
    address: str | None,
    reward_gpus: int = 0,
) -> dict[str, Any]:
    cpu = rollout_gpus == 0 and learner_gpus == 0  # CPU servers: --reward-gpus counts servers
    rm = cfg.reward.model
    reward_tp = rm.server.tensor_parallel_size if rm is not None else 1
    p = plan_placement(
        nodes,
        learner_gpus=learner_gpus,
        rollout_gpus=rollout_gpus,
        rollout_tp=cfg.rollout.tensor_parallel_size,
        learner_mp=cfg.learner.megatron.tensor_model_parallel_size if cfg.learner.engine == "megatron" else 1,
        reward_gpus=0 if cpu else reward_gpus,
        reward_tp=reward_tp,
    )
    host = resolve_host(cfg.network, address)
    node = lambda nid: ips.get(nid, nid)  # noqa: E731
    return {
        "nodes": [{"node": node(n.node_id), "gpus": n.gpus} for n in nodes],
        "learner": [{"node": node(s.node_id), "gpus": list(s.gpu_ids)} for s in p.learner],
        "servers": [{"server": i, "node": node(s.node_id), "gpus": list(s.gpu_ids)} for i, s in enumerate(p.servers)],
        "reward_servers": [
            {
                "server": i,
                "node": "driver's node (CPU)",
                "gpus": [],
                "engine": rm.server.engine,
                "model": rm.server.model_path or cfg.model.path,
            }
            for i in range(reward_gpus)
        ]
        if cpu and rm is not None
        else [
            {
                "server": i,
                "node": node(s.node_id),
                "gpus": list(s.gpu_ids),
                "engine": rm.server.engine,
                "model": rm.server.model_path or cfg.model.path,
            }
            for i, s in enumerate(p.rewards)
        ],
        "reward_urls": rm.all_urls() if rm is not None else [],
        "proxy": None
        if cfg.rollout.proxy is None
        else f"{host}:{cfg.rollout.proxy.port or 'a free port'} (the fleet's node), agent {cfg.rollout.proxy.agent}",
        "listeners": {
            "driver (broker, control, metrics)": host,
            "engine servers, weight-sync store": "each node's Ray address" if host != "127.0.0.1" else "127.0.0.1",
        },
        "curve_zmq": curve_enabled(cfg.network, host),
        "late_joiners": "export from network.shared_dir"
        if cfg.network.shared_dir
        else ("export from the run directory" if host == "127.0.0.1" else "weights at the next publish (weight sync)"),
    }


def render(out: dict[str, Any]) -> str:
    lines = [
        f"cluster: {len(out['nodes'])} node(s), " + ", ".join(f"{n['node']}: {n['gpus']} GPU" for n in out["nodes"])
    ]
    for s in out["learner"]:
        lines.append(f"learner  on {s['node']}: GPUs {s['gpus']}")
    for s in out["servers"]:
        lines.append(f"server {s['server']:<3} on {s['node']}: GPUs {s['gpus']}")
    for s in out["reward_servers"]:
        lines.append(f"reward server {s['server']:<3} on {s['node']}: GPUs {s['gpus']} ({s['engine']}, {s['model']})")
    for u in out["reward_urls"]:
        lines.append(f"reward server (given): {u}")
    if out["proxy"]:
        lines.append(f"OpenAI-compatible proxy: {out['proxy']}")
    for k, v in out["listeners"].items():
        lines.append(f"bind {k}: {v}")
    lines.append(f"CurveZMQ: {'on' if out['curve_zmq'] else 'off'}; late joiners: {out['late_joiners']}")
    return "\n".join(lines)


def dry_run(cfg, args) -> int:
    if args.nodes:
        nodes, ips = described_nodes(args.nodes), {}
    elif args.address:
        nodes, ips = cluster_nodes(args.address, args.ray_auth)
    else:
        raise ValueError("--dry-run needs --address (the cluster to read) or --nodes (one to describe, e.g. 8,8,8,8)")
    out = plan(
        cfg,
        nodes,
        ips,
        rollout_gpus=args.rollout_gpus,
        learner_gpus=args.learner_gpus,
        address=args.address,
        reward_gpus=args.reward_gpus,
    )
    print(json.dumps(out, indent=2) if args.json_plan else render(out))
    return 0
