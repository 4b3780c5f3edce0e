"""The learner's rank actors: thin ``@ray.remote`` wrappers of :class:`learner.rank.LearnerRank`, and
the composition the learner does not know about (the fleet actor's handle as a :class:`learner.rank.FleetView`).

The rank logic (training loop, publisher, membership, the stop all-reduce) is ``learner/rank.py``;
the actor builds it inside its own process, so the driver never imports torch. How the driver
orders ranks by node and GPU and what it passes each is :meth:`LearnerRanks.start`.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import ray

from core.configbase import build
from core.http_client import free_port
from core.network import write_curve_keys
from launch.config import RunConfig
from launch.monitor import setup_logging
from launch.netsetup import curve_key_data, exports_reachable, node_host, spans_hosts

log = logging.getLogger(__name__)


class RankFailed(RuntimeError):
    """A learner rank raised or its process died; the message names the rank."""


class _RayFleet:
    """The fleet actor's handle as the rank's :class:`learner.rank.FleetView`."""

    def __init__(self, handle, timeout_s: float = 600.0) -> None:
        self.handle = handle
        self.timeout_s = timeout_s  # colocated release / wake (a wake may run a due evaluation)

    def server_urls(self) -> dict[str, str]:
        return ray.get(self.handle.server_urls.remote(), timeout=30)

    def engines_updated(self, engine_ids: list[str], version: int, relabel: bool = False) -> None:
        self.handle.engines_updated.remote(engine_ids, version, relabel)

    def set_latest_export(self, version: int, path: str) -> None:
        self.handle.set_latest_export.remote(version, path)

    def release(self, step: int) -> dict[str, float]:
        return ray.get(self.handle.colocated_release.remote(step), timeout=self.timeout_s)

    def wake(self, version: int, phase: str) -> dict[str, float]:
        return ray.get(self.handle.colocated_wake.remote(version, phase), timeout=self.timeout_s)


@ray.remote(num_cpus=0, max_restarts=0, max_concurrency=4)
class LearnerActor:
    """One rank in its own Ray worker process; ``cfg_data`` is the run config as plain data."""

    def __init__(
        self,
        cfg_data: dict[str, Any],
        broker_address: str,
        run_dir: str,
        fleet,
        curve_keys: dict[str, bytes] | None = None,
    ) -> None:
        from learner.rank import (
            LearnerRank,  # here, in the rank's process: torch stays out of the driver
        )

        cfg = build(RunConfig, cfg_data)
        if curve_keys is not None:  # this node may not see the driver's run directory
            write_curve_keys(cfg.broker.curve_keys_dir, curve_keys)
        if spans_hosts(cfg):  # rank 0's publisher hosts the weight-sync store on this node
            cfg = cfg.model_copy(
                update={"weight_sync": cfg.weight_sync.model_copy(update={"master_addr": node_host(cfg)})}
            )
        self.run_dir = Path(run_dir)
        wait = cfg.colocate.timeout_s * 2 + 600.0  # sleep/wake, plus a due evaluation at the wake
        self.rank = LearnerRank(
            cfg,
            broker_address,
            run_dir,
            None if fleet is None else _RayFleet(fleet, wait),
            exports_shared=exports_reachable(cfg),
        )

    def set_rank(self, rank: int) -> None:
        self.rank.set_rank(rank)
        setup_logging(self.run_dir, "learner" if rank == 0 else f"learner-rank{rank}", simulated=False)

    def node_info(self) -> dict[str, Any]:
        """Where this actor runs: node IP, the GPUs Ray gave it, its pid (no CUDA call: devices are set later)."""
        return {"ip": ray.util.get_node_ip_address(), "gpus": [str(g) for g in ray.get_gpu_ids()], "pid": os.getpid()}

    def free_port(self) -> int:
        return free_port("")  # every interface: ranks on other nodes connect to it

    def run(self, env: dict[str, str]) -> dict[str, Any]:
        return self.rank.run(env)

    def stop(self) -> None:
        self.rank.stop()

    def status(self) -> dict[str, Any]:
        return self.rank.status()


class LearnerRanks:
    """The learner's rank actors, started, watched and stopped together; rank 0 speaks for them.

    Example::

        ranks = LearnerRanks.start(cfg_data, broker_address, run_dir, fleet, n=2)
        while not ranks.poll(0.5): ...      # raises RankFailed naming a failed rank
        final = ranks.stop(30.0); ranks.kill()
    """

    def __init__(self, actors: list, infos: list[dict[str, Any]]) -> None:
        self.actors = actors
        self.infos = infos
        self.refs: list = []
        self._finished: set[int] = set()

    @property
    def rank0(self):
        return self.actors[0]

    @classmethod
    def start(
        cls,
        cfg_data: dict[str, Any],
        broker_address: str,
        run_dir: str,
        fleet,
        *,
        n: int,
        placement_group=None,
        gpus_per_rank: int = 0,
        timeout_s: float = 180.0,
        curve_keys: dict[str, bytes] | None = None,
    ) -> LearnerRanks:
        """Start ``n`` rank actors (bundle ``i`` of ``placement_group`` each, when given) and their run.

        ``timeout_s`` bounds the actors' start (a process that imports torch): on two CPU cores shared with
        two vLLM servers it took over 60 s once (CI, 2026-12-03)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if n < 1:
            raise ValueError(f"a learner needs at least one rank, got {n}")
        actors = []
        for i in range(n):
            opts: dict[str, Any] = {"num_gpus": gpus_per_rank}
            if placement_group is not None:
                opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    placement_group, placement_group_bundle_index=i
                )
            actors.append(LearnerActor.options(**opts).remote(cfg_data, broker_address, run_dir, fleet, curve_keys))
        try:
            infos = ray.get([a.node_info.remote() for a in actors], timeout=timeout_s)
        except Exception as exc:
            for a in actors:
                ray.kill(a)
            if isinstance(exc, ray.exceptions.GetTimeoutError):
                raise TimeoutError(
                    f"learner: {n} rank actor(s) did not start within {timeout_s:.0f} s (placed but "
                    f"not answering; a machine too loaded, or a rank stuck importing)"
                ) from None
            raise
        # rank order: by node (rank 0's node first, as placed), then GPU id, so a node's ranks are contiguous
        nodes = list(dict.fromkeys(info["ip"] for info in infos))
        order = sorted(
            range(n),
            key=lambda i: (nodes.index(infos[i]["ip"]), [int(g) if g.isdigit() else g for g in infos[i]["gpus"]], i),
        )
        ordered = cls([actors[i] for i in order], [infos[i] for i in order])
        ordered._launch(timeout_s)
        return ordered

    def _launch(self, timeout_s: float) -> None:
        n = len(self.actors)
        ray.get([a.set_rank.remote(r) for r, a in enumerate(self.actors)], timeout=timeout_s)
        master = self.infos[0]["ip"] if n > 1 else "127.0.0.1"
        port = ray.get(self.rank0.free_port.remote(), timeout=timeout_s)
        node_gpus: dict[str, list[str]] = {}
        for info in self.infos:
            node_gpus.setdefault(info["ip"], []).extend(info["gpus"])
        for rank, (actor, info) in enumerate(zip(self.actors, self.infos, strict=True)):
            peers = [i for i in self.infos if i["ip"] == info["ip"]]
            env = {
                "MASTER_ADDR": master,
                "MASTER_PORT": str(port),
                "RANK": str(rank),
                "WORLD_SIZE": str(n),
                "LOCAL_RANK": str(peers.index(info)),
                "LOCAL_WORLD_SIZE": str(len(peers)),
            }
            if info["gpus"]:
                # every learner GPU of the node visible (NCCL finds its peers over NVLink); this rank's is LOCAL_RANK
                env["CUDA_VISIBLE_DEVICES"] = ",".join(node_gpus[info["ip"]])
                env["LOCAL_RANK"] = str(node_gpus[info["ip"]].index(info["gpus"][0]))
            self.refs.append(actor.run.remote(env))
        log.info("learner: %d rank(s) started (master %s:%d; pids %s)", n, master, port, [i["pid"] for i in self.infos])

    def poll(self, timeout_s: float) -> bool:
        """True once every rank has finished; raises :class:`RankFailed` naming the failed rank(s).

        When one rank dies its peers fail too (their collectives break), often before Ray has
        reported the death: after the first failure the other ranks get a few seconds to report,
        and ranks that died are named first, as the cause.
        """
        done, _ = ray.wait(self.refs, num_returns=len(self.refs), timeout=timeout_s)
        failures = self._check(done)
        if failures:
            time.sleep(2.0)  # a killed worker is reported a moment after its peers see the broken connection
            done, _ = ray.wait(self.refs, num_returns=len(self.refs), timeout=3.0)
            failures.update(self._check(done))
            died = sorted(r for r, (kind, _) in failures.items() if kind == "died")
            first = died or sorted(failures)
            rest = [r for r in sorted(failures) if r not in first]
            msg = "; ".join(failures[r][1] for r in first)
            if rest:
                msg += " (then " + "; ".join(failures[r][1] for r in rest) + ")"
            raise RankFailed(msg)
        return len(self._finished) == len(self.refs)

    def _check(self, done: list) -> dict[int, tuple[str, str]]:
        failures: dict[int, tuple[str, str]] = {}
        for ref in done:
            rank = self.refs.index(ref)
            if rank in self._finished:
                continue
            try:
                ray.get(ref, timeout=30)
            except ray.exceptions.RayActorError as exc:
                failures[rank] = (
                    "died",
                    f"learner rank {rank} (pid {self.infos[rank]['pid']}) died: "
                    f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}",
                )
                continue
            except ray.exceptions.RayTaskError as exc:
                cause = exc.cause if getattr(exc, "cause", None) is not None else exc
                failures[rank] = ("raised", f"learner rank {rank} failed: {type(cause).__name__}: {cause}")
                continue
            self._finished.add(rank)
        return failures

    def status(self, timeout_s: float) -> dict[str, Any]:
        return ray.get(self.rank0.status.remote(), timeout=timeout_s)

    def live_status(self, timeout_s: float) -> dict[str, Any]:
        """Rank 0's status while the job runs; raises :class:`RankFailed` when rank 0 is dead or mute.

        The driver asks for it every half second, so a killed rank 0 is often seen here before
        its run has reported the death: :meth:`poll` gets a few seconds to name the failure with
        the rest of it, and rank 0's death is named even when Ray reports nothing more in that time.
        """
        try:
            return self.status(timeout_s)
        except ray.exceptions.RayActorError:
            self.poll(5.0)
            raise RankFailed(f"learner rank 0 (pid {self.infos[0]['pid']}) died") from None
        except ray.exceptions.GetTimeoutError:
            raise RankFailed(
                f"learner rank 0 (pid {self.infos[0]['pid']}) gave no status within {timeout_s:.0f} s"
            ) from None

    def request_stop(self) -> None:
        """Ask every rank to stop after its current step (fire and forget: :meth:`poll` sees them finish)."""
        for a in self.actors:
            a.stop.remote()

    def stop(self, timeout_s: float) -> dict[str, Any]:
        """Ask every rank to stop after its step; rank 0's status plus every live rank's step."""
        self.request_stop()
        # the ranks finish their step, then checkpoint and export (learner.run.StopRun) before they return
        ray.wait(self.refs, num_returns=len(self.refs), timeout=4 * timeout_s)
        st = self.status(timeout_s)
        steps = []
        for a in self.actors:
            try:
                steps.append(ray.get(a.status.remote(), timeout=timeout_s)["step"])
            except Exception:  # a dead rank has no step to report
                steps.append(None)
        return {**st, "rank_steps": steps}

    def kill(self) -> None:
        for a in self.actors:
            try:
                ray.kill(a)
            except Exception as exc:
                log.warning("shutdown: kill learner rank actor: %s", exc)


def start_learner(job) -> tuple[LearnerRanks, float | None]:
    """Evaluate the initial policy through the fleet, then start the learner's ranks."""
    t = time.monotonic()
    n = job.cfg.run.eval_samples if job.cfg.run.eval_before_train else 0
    before = job._get(job.fleet.evaluate.remote(n), 600, "eval before")
    log.info(
        "eval accuracy before training: %s (%.1f s)",
        "skipped (run.eval_samples=0 or run.eval_before_train=false)" if before is None else f"{before:.3f}",
        time.monotonic() - t,
    )
    gpus = job.placement.plan.learner_gpus()
    ranks = LearnerRanks.start(
        job.cfg.model_dump(mode="json"),
        job.broker.address,
        str(job.run_dir),
        job.fleet,
        n=gpus or job.cfg.learner.cpu_processes,
        placement_group=job.placement.pgs.get("learner"),
        gpus_per_rank=1 if gpus else 0,
        curve_keys=curve_key_data(job.cfg),
    )
    return ranks, before
