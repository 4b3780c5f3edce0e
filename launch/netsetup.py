"""The job's network, resolved once in the driver: bind addresses, CurveZMQ keys, the shared directory.

:func:`resolve_network` turns ``network.host: auto`` into an address (loopback on one host; with
``--address``, the local address that routes to the Ray head) and rewrites the parts of the run
config that name a listener, so every process reads concrete addresses from its own part:

* ``broker.address``: ``tcp://<host>:0`` (the broker advertises the port it bound);
* ``broker.curve_keys_dir``: ``<run_dir>/curve`` when CurveZMQ is on (keys made here, 0600);
* ``weight_sync.master_addr``: the host (learner rank 0 replaces it by its own node's address);
* ``network.host``: the resolved address (per-node processes bind their Ray node address when it is
  not loopback: :func:`node_host`).

:func:`check_shared_dir` runs once Ray is up: every node must see the same ``network.shared_dir``.
"""

from __future__ import annotations

import logging
import secrets
from pathlib import Path
from typing import Any

from core.network import (
    LOOPBACK,
    curve_enabled,
    is_loopback,
    make_curve_keys,
    read_curve_keys,
    resolve_host,
)
from launch.config import RunConfig

log = logging.getLogger(__name__)
DEFAULT_BROKER = "tcp://127.0.0.1:0"


def resolve_network(cfg: RunConfig, ray_address: str | None, run_dir: Path) -> RunConfig:
    net = cfg.network
    host = resolve_host(net, ray_address)
    if ray_address is not None and is_loopback(host) and net.host == "auto":
        log.warning("network: the Ray head %s is on this host's loopback: listeners stay on loopback", ray_address)
    broker, ws = {}, {}
    if cfg.broker.address == DEFAULT_BROKER and not is_loopback(host):
        broker["address"] = f"tcp://{host}:0"
    if curve_enabled(net, host) and cfg.broker.curve_keys_dir is None:
        keys = run_dir / "curve"
        if not (keys / "server.key_secret").exists():
            make_curve_keys(keys)
        broker["curve_keys_dir"] = str(keys)
    if ws_default(cfg) and not is_loopback(host):
        ws["master_addr"] = host
    if net.shared_dir is not None:
        shared = Path(net.shared_dir).resolve()
        if not shared.is_dir():
            raise ValueError(f"network.shared_dir={net.shared_dir!r} is not a directory on the driver's host")
        if not run_dir.resolve().is_relative_to(shared):
            raise ValueError(
                f"run.run_dir {run_dir} is not inside network.shared_dir {shared}: exports written "
                "there would not be seen by the other nodes; put the run directory on the shared disk"
            )
    log.info(
        "network: listeners bind %s (CurveZMQ %s)",
        host,
        "on" if "curve_keys_dir" in broker or cfg.broker.curve_keys_dir else "off",
    )
    return cfg.model_copy(
        update={
            "network": net.model_copy(update={"host": host}),
            "broker": cfg.broker.model_copy(update=broker),
            "weight_sync": cfg.weight_sync.model_copy(update=ws),
        }
    )


def ws_default(cfg: RunConfig) -> bool:
    return cfg.weight_sync.master_addr == LOOPBACK


def exports_reachable(cfg) -> bool:
    """May a server on another node load the learner's exports from the run directory?"""
    return not spans_hosts(cfg) or cfg.network.shared_dir is not None


def curve_key_data(cfg: RunConfig) -> dict[str, bytes] | None:
    """The key files as data for actors on nodes that do not see the run directory (None: Curve off)."""
    d = cfg.broker.curve_keys_dir
    return None if d is None else read_curve_keys(d)


def spans_hosts(cfg) -> bool:
    """Did the driver resolve ``network.host`` to a non-loopback address (``auto`` unresolved: one host)?"""
    return cfg.network.host != "auto" and not is_loopback(cfg.network.host)


def node_host(cfg) -> str:
    """The address a listener on this node binds: loopback for a one-host job, else the Ray node's address."""
    if not spans_hosts(cfg):
        return LOOPBACK
    import ray

    return ray.util.get_node_ip_address()


def check_shared_dir(ray, cfg: RunConfig, timeout_s: float = 60.0) -> None:
    """Every alive node reads back a token the driver wrote into ``network.shared_dir`` (else a clear error)."""
    if cfg.network.shared_dir is None:
        return
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    token = secrets.token_hex(8)
    probe = Path(cfg.network.shared_dir) / f".fleetrl-shared-{token}"
    probe.write_text(token)

    @ray.remote(num_cpus=0)
    def read(path: str) -> str | None:
        try:
            return Path(path).read_text()
        except OSError:
            return None

    try:
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        refs: dict[str, Any] = {
            n["NodeManagerAddress"]: read.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)
            ).remote(str(probe))
            for n in nodes
        }
        seen = dict(zip(refs, ray.get(list(refs.values()), timeout=timeout_s), strict=True))
    finally:
        probe.unlink(missing_ok=True)
    blind = sorted(ip for ip, got in seen.items() if got != token)
    if blind:
        raise ValueError(
            f"network.shared_dir={cfg.network.shared_dir!r} is not shared: node(s) {blind} do not see "
            "the file the driver wrote there; mount it on every node or unset it"
        )
