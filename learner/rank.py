"""The learner as Ray actors, one per rank: the training loop on the broker, publishing to the fleet.

The engine is whatever ``learner.engine`` names (FSDP2 or Megatron-core), built by
``learner.run.make_engine`` inside ``run_learner``; publishing goes through the engine interface
(``param_plan`` / ``iter_full_params``), so both engines publish the same HF-named tensors.

Ranks and placement::

    GPU (--learner-gpus N):  N actors, one per bundle of the learner's placement group
                             (one GPU each); NCCL
    CPU (--learner-gpus 0):  learner.cpu_processes actors (default 1); gloo

    driver: start the actors -> ask each for its node IP and GPU ids -> order ranks by
            (node, GPU) -> rank 0 picks a free port -> run(env) on every actor with
            MASTER_ADDR/MASTER_PORT (rank 0's node), RANK, WORLD_SIZE, LOCAL_RANK and,
            on GPU, CUDA_VISIBLE_DEVICES = the learner GPUs of that node (so NCCL sees
            its peers; LOCAL_RANK indexes into that list)

Rank 0 alone holds the :class:`learner.broker_source.BrokerSource`, the weight-sync
:class:`weight_sync.publisher.Publisher` and the run's counters (status and summary);
the other ranks get every batch from rank 0 (``learner.loop.share_batch``) and take part
in the gathers of each publish by draining ``engine.iter_full_params`` in the same order.

Weight-sync membership follows the fleet: before each publish rank 0 asks the fleet
actor for its healthy servers. A server that vanished (died, drained) leaves the group;
a new or restarted one joins as a late joiner (it loads the latest HF export first,
then joins the rebuilt group and receives the broadcast), so it comes back with current
weights. A failed publish names the engines it blames; the publisher drops them and
the fleet's health checks decide whether they are dead.

Stop and failure: ``stop()`` sets a flag on every rank; after each step the ranks agree
on it (a MAX all-reduce), so they all leave at the same step. A rank that raises or dies
ends its ``run`` reference with an error; :meth:`LearnerRanks.poll` turns that into
:class:`RankFailed` naming the rank, and the driver's shutdown kills every rank actor
(the others may be blocked in a collective with the dead one).
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

import ray

from core.configbase import build
from launch.monitor import setup_logging

log = logging.getLogger(__name__)


class StopRequested(Exception):
    """The driver asked the learner to stop after the current step."""


class RankFailed(RuntimeError):
    """A learner rank raised or its process died; the message names the rank."""


def _nccl_env(cfg) -> dict[str, str]:
    """The NCCL settings the learner shares with every engine server of the weight-sync group."""
    from weight_sync.config import NCCL_ENV

    return {} if cfg.weight_sync.backend == "gloo" else dict(NCCL_ENV)


def publish_client(cfg, backend: str, eid: str, url: str):
    """The publisher's client of one server: its class follows rollout.engine and the weight backend.

    vllm: fleetrl's weight-transfer backend (gloo on CPU, NCCL on GPU), or with nccl_impl 'vllm'
    vLLM's built-in NCCL backend (VLLMNcclClient: the packed settings where the installed vLLM wants
    them); sglang: SGLang's distributed update (NCCL), or with weight_sync.staging fleetrl's loader in
    SGLang's workers (weight_sync/sglang_ext.py).
    """
    engine, ws = cfg.rollout.engine, cfg.weight_sync
    if engine == "sglang":
        from rollout_fleet.sglang_fleet import SGLangPublishClient

        return SGLangPublishClient(eid, url, timeout_s=ws.timeout_s, staging=ws.staging)
    if engine != "vllm":
        raise ValueError(f"the learner publishes to rollout.engine 'vllm' or 'sglang', not {engine!r}")
    kw = dict(model=cfg.model.path, timeout_s=ws.timeout_s,
              update_pause_mode="wait" if cfg.rollout.weight_update == "pause" else "keep")
    if backend == "nccl" and ws.resolved_nccl_impl(engine) == "vllm":
        from rollout_fleet.engines.vllm_nccl import VLLMNcclClient

        return VLLMNcclClient(eid, url, **kw)
    from rollout_fleet.engines.vllm import VLLMClient

    return VLLMClient(eid, url, weight_backend="fleetrl", **kw)


@ray.remote(num_cpus=0, max_restarts=0, max_concurrency=4)
class LearnerActor:
    def __init__(self, cfg_data: dict[str, Any], broker_address: str, run_dir: str, fleet) -> None:
        from launch.config import RunConfig

        self.rank = 0
        self.cfg = build(RunConfig, cfg_data)
        self.broker_address, self.run_dir, self.fleet = broker_address, Path(run_dir), fleet
        self.pub = None
        self._source = None
        self.world_size = 0  # known once the process group is up
        self.version = 0
        self.exported_version = 0
        self.stop_flag = False
        self.done = False
        self.error: str | None = None
        self.reward_per_step: list[float] = []
        self.staleness_hist: Counter[int] = Counter()
        self.max_staleness_seen = 0
        self.bound_violations = 0
        self.groups_consumed = 0
        self.wait_s = 0.0
        self.publish_s = 0.0
        self.publishes = 0  # publishes that reached at least one engine
        self.last_published_version = 0
        self.publish_errors = 0
        self.t0 = time.monotonic()

    # -- rendezvous ----------------------------------------------------------------------------------
    def set_rank(self, rank: int) -> None:
        """Ranks are known once every actor is placed (they are ordered by node and GPU)."""
        self.rank = rank
        setup_logging(self.run_dir, "learner" if rank == 0 else f"learner-rank{rank}", simulated=False)

    def node_info(self) -> dict[str, Any]:
        """Where this actor runs: node IP, the GPUs Ray gave it, its pid (no CUDA call: devices are set later)."""
        return {"ip": ray.util.get_node_ip_address(), "gpus": [str(g) for g in ray.get_gpu_ids()], "pid": os.getpid()}

    def free_port(self) -> int:
        from core.net import free_port

        return free_port("")  # every interface: ranks on other nodes connect to it

    # -- weights out -------------------------------------------------------------------------------
    def _bucket_bytes(self) -> int:
        return int(self.cfg.weight_sync.bucket_mb * (1 << 20))

    def _wire_dtype(self):
        """Publish in the servers' dtype (model.dtype): bf16 servers get bf16, no cast on their side."""
        import torch

        return torch.bfloat16 if self.cfg.model.dtype == "bfloat16" else None

    def _sync_members(self) -> None:
        if self.fleet is None:  # a learner without a fleet (tests): nothing to publish to
            return
        urls = ray.get(self.fleet.server_urls.remote(), timeout=30)
        for eid, client in list(self.pub.engines.items()):
            if urls.get(eid) != client.url:
                log.info("weight sync: %s left the fleet (or moved); removed from the group", eid)
                self.pub.remove_engine(eid)
        export = self.run_dir / "export" / "latest"
        for eid, url in urls.items():
            if eid in self.pub.engines:
                continue
            client = publish_client(self.cfg, self.pub.backend, eid, url)
            if self.exported_version > 0 and export.exists():
                log.info("weight sync: late joiner %s loads export v%d, then joins", eid, self.exported_version)
                self.pub.add_engine(client, str(export), self.exported_version)
            else:
                self.pub.add_engine(client)

    def _new_publisher(self, engine):
        """Rank 0's publisher: on CUDA its buffers live on this rank's GPU; the group kind follows the engine."""
        import torch

        from weight_sync.plan import build_plan
        from weight_sync.publisher import Publisher

        ws = self.cfg.weight_sync
        ws = ws.model_copy(update={"nccl_impl": ws.resolved_nccl_impl(self.cfg.rollout.engine)})
        nccl = ws.backend == "nccl" or (ws.backend == "auto" and torch.cuda.is_available())
        device = f"cuda:{torch.cuda.current_device()}" if nccl else "cpu"
        plan = build_plan(engine.param_plan(self._wire_dtype()), self._bucket_bytes(), ws.tail_bytes(nccl))
        log.info("weight sync: backend %s, nccl_impl %s, device %s, %d bucket(s)",
                 "nccl" if nccl else "gloo", ws.nccl_impl, device, len(plan.buckets))
        return Publisher(ws, plan, rank=0, device=device)

    def _publish(self, version: int, engine) -> None:
        from weight_sync.publisher import PublishError

        t0 = time.monotonic()
        buckets = engine.iter_full_params(self._bucket_bytes(), self._wire_dtype())
        tensors = (item for bucket in buckets for item in bucket)
        if self.rank != 0:  # every gather is a collective: follow rank 0 through the same buckets
            for _ in tensors:
                pass
            return
        if self.pub is None:
            self.pub = self._new_publisher(engine)
        try:
            self._sync_members()
        except Exception as exc:  # the fleet did not answer: publish to the members we know
            log.warning("weight sync: fleet membership unknown (%s)", exc)
        try:
            rep = self.pub.publish(version, tensors)
            log.info("published v%d to %s in %.2fs", version, rep.engines if rep else [], time.monotonic() - t0)
            if rep is not None and rep.engines:
                self.publishes += 1
                self.last_published_version = version
                if self.fleet is not None:
                    # vLLM 0.26 cannot tell the fleet which weights it holds (no /weight_info): we do
                    self.fleet.engines_updated.remote(list(rep.engines), version)
        except PublishError as exc:
            self.publish_errors += 1
            log.error("publish of v%d failed: %s (blamed %s)", version, exc, exc.blamed)
        self.publish_s += time.monotonic() - t0

    def _metrics(self, step: int, m: dict[str, float]) -> None:
        self.version = step
        if self.rank == 0:
            self._count(step, m)
        if self._agree_stop():
            raise StopRequested

    def _count(self, step: int, m: dict[str, float]) -> None:
        if self.cfg.learner.export_every and step % self.cfg.learner.export_every == 0:
            self.exported_version = step
            if self.fleet is not None:  # a server the fleet restarts loads this before it takes work
                self.fleet.set_latest_export.remote(step, str(self.run_dir / "export" / "latest"))
        self.reward_per_step.append(float(m.get("learner/batch_reward_mean", float("nan"))))
        self.wait_s += float(m.get("learner/pull_seconds", 0.0))
        self.groups_consumed += self.cfg.broker.groups_per_step
        stale = getattr(self._source, "last_staleness", None)
        if stale is not None and len(stale):
            for s, c in Counter(int(x) for x in stale).items():
                self.staleness_hist[s] += c
            self.max_staleness_seen = max(self.max_staleness_seen, int(max(stale)))
            self.bound_violations += int(sum(1 for x in stale if x > self.cfg.broker.max_staleness))

    def _agree_stop(self) -> bool:
        """True on every rank if any rank was asked to stop (ranks must leave at the same step)."""
        import torch
        import torch.distributed as dist

        if self.world_size <= 1:
            return self.stop_flag
        dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
        flag = torch.tensor([int(self.stop_flag)], dtype=torch.int32, device=dev)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    # -- run -----------------------------------------------------------------------------------------
    def run(self, env: dict[str, str]) -> dict[str, Any]:
        """Train as one rank; ``env`` is the torch.distributed environment the driver chose."""
        if int(env["RANK"]) != self.rank:
            raise ValueError(f"learner actor of rank {self.rank} was given RANK={env['RANK']}")
        os.environ.update(env)  # before the first CUDA call: CUDA_VISIBLE_DEVICES must be in place
        for k, v in _nccl_env(self.cfg).items():  # before any NCCL call: the engines' side must agree
            os.environ.setdefault(k, v)
        import torch
        import torch.distributed as dist

        from learner.run import init_distributed, run_learner

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        # Other ranks wait in a collective while rank 0 waits for a batch or for engines during a publish:
        # the collective timeout must outlast both, or they would fail before rank 0 says why.
        coll_timeout = max(600.0, self.cfg.rollout.request_timeout_s + 2 * self.cfg.weight_sync.timeout_s + 60)
        _, self.world_size = init_distributed("gloo" if not torch.cuda.is_available() else "auto", coll_timeout)
        log.info("learner rank %d/%d up (MASTER %s:%s, LOCAL_RANK %s, CUDA_VISIBLE_DEVICES %s)", self.rank,
                 self.world_size, env["MASTER_ADDR"], env["MASTER_PORT"], env["LOCAL_RANK"],
                 os.environ.get("CUDA_VISIBLE_DEVICES", "-"))
        if self.rank == 0:
            from learner.broker_source import BrokerSource

            self._source = BrokerSource(self.broker_address, consumer_id="learner",
                                        lease_timeout_s=self.cfg.broker.lease_timeout_s)
        self.t0 = time.monotonic()
        try:
            run_learner(self.cfg, source=self._source, publish=self._publish, on_metrics=self._metrics,
                        batch_timeout_s=self.cfg.rollout.request_timeout_s)
        except StopRequested:
            log.info("learner rank %d stopped at version %d on request", self.rank, self.version)
        except Exception as exc:
            self.error = f"{type(exc).__name__}: {exc}"
            log.exception("learner rank %d failed at version %d", self.rank, self.version)
            raise
        finally:
            self.done = True
            if self._source is not None:
                self._source.close()
            if self.pub is not None:
                self.pub.close()
            dist.destroy_process_group()
        return self.status()

    def stop(self) -> None:
        self.stop_flag = True

    def status(self) -> dict[str, Any]:
        wall = max(1e-9, time.monotonic() - self.t0)
        return {"simulated": False, "step": self.version, "rank": self.rank, "world_size": self.world_size,
                "learner_wait_s": round(self.wait_s, 3),
                "learner_idle_fraction": self.wait_s / wall, "groups_consumed": self.groups_consumed,
                "reward": self.reward_per_step[-1] if self.reward_per_step else None,
                "reward_per_step": list(self.reward_per_step),
                "staleness_hist": {str(k): v for k, v in sorted(self.staleness_hist.items())},
                "max_staleness_seen": self.max_staleness_seen, "bound_violations": self.bound_violations,
                "publish_s": round(self.publish_s, 3), "publishes": self.publishes,
                "last_published_version": self.last_published_version, "publish_errors": self.publish_errors,
                "done": self.done, "error": self.error}


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
    def start(cls, cfg_data: dict[str, Any], broker_address: str, run_dir: str, fleet, *, n: int,
              placement_group=None, gpus_per_rank: int = 0, timeout_s: float = 60.0) -> LearnerRanks:
        """Start ``n`` rank actors (bundle ``i`` of ``placement_group`` each, when given) and their run."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if n < 1:
            raise ValueError(f"a learner needs at least one rank, got {n}")
        actors = []
        for i in range(n):
            opts: dict[str, Any] = {"num_gpus": gpus_per_rank}
            if placement_group is not None:
                opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    placement_group, placement_group_bundle_index=i)
            actors.append(LearnerActor.options(**opts).remote(cfg_data, broker_address, run_dir, fleet))
        try:
            infos = ray.get([a.node_info.remote() for a in actors], timeout=timeout_s)
        except Exception:
            for a in actors:
                ray.kill(a)
            raise
        # rank order: by node (rank 0's node first, as placed), then GPU id, so a node's ranks are contiguous
        nodes = list(dict.fromkeys(info["ip"] for info in infos))
        order = sorted(range(n), key=lambda i: (nodes.index(infos[i]["ip"]),
                                                [int(g) if g.isdigit() else g for g in infos[i]["gpus"]], i))
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
            env = {"MASTER_ADDR": master, "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(n),
                   "LOCAL_RANK": str(peers.index(info)), "LOCAL_WORLD_SIZE": str(len(peers))}
            if info["gpus"]:
                # every learner GPU of the node visible (NCCL finds its peers over NVLink); this rank's is LOCAL_RANK
                env["CUDA_VISIBLE_DEVICES"] = ",".join(node_gpus[info["ip"]])
                env["LOCAL_RANK"] = str(node_gpus[info["ip"]].index(info["gpus"][0]))
            self.refs.append(actor.run.remote(env))
        log.info("learner: %d rank(s) started (master %s:%d; pids %s)", n, master, port,
                 [i["pid"] for i in self.infos])

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
                failures[rank] = ("died", f"learner rank {rank} (pid {self.infos[rank]['pid']}) died: "
                                          f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}")
                continue
            except ray.exceptions.RayTaskError as exc:
                cause = exc.cause if getattr(exc, "cause", None) is not None else exc
                failures[rank] = ("raised", f"learner rank {rank} failed: {type(cause).__name__}: {cause}")
                continue
            self._finished.add(rank)
        return failures

    def status(self, timeout_s: float) -> dict[str, Any]:
        return ray.get(self.rank0.status.remote(), timeout=timeout_s)

    def stop(self, timeout_s: float) -> dict[str, Any]:
        """Ask every rank to stop after its step; rank 0's status plus every live rank's step."""
        for a in self.actors:
            a.stop.remote()
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
    before = job._get(job.fleet.evaluate.remote(job.cfg.run.eval_samples), 600, "eval before")
    log.info("eval accuracy before training: %.3f (%.1f s)", before, time.monotonic() - t)
    gpus = job.placement.learner_gpus()
    ranks = LearnerRanks.start(job.cfg.model_dump(mode="json"), job.broker.address, str(job.run_dir), job.fleet,
                               n=gpus or job.cfg.learner.cpu_processes, placement_group=job.pgs.get("learner"),
                               gpus_per_rank=1 if gpus else 0)
    return ranks, before
