"""One learner rank: the training loop on the broker, publishing to the fleet (run by a Ray actor).

The engine is whatever ``learner.engine`` names (FSDP2 or Megatron-core), built by
``learner.run.make_engine`` inside ``run_learner``; publishing goes through the engine interface
(``param_plan`` / ``iter_full_params``), so both engines publish the same HF-named tensors.

:mod:`launch.learner_ranks` wraps :class:`LearnerRank` in a ``@ray.remote`` actor, one per rank,
and hands it a view of the fleet (``fleet``): the learner never imports the fleet. Its client of each
engine server comes from :func:`engines.registry.weight_client`. Ranks and placement::

    GPU (--learner-gpus N):  N actors, one per bundle of the learner's placement group
                             (one GPU each); NCCL
    CPU (--learner-gpus 0):  learner.cpu_processes actors (default 1); gloo

    driver: start the actors -> ask each for its node IP and GPU ids -> order ranks by
            (node, GPU) -> rank 0 picks a free port -> run(env) on every actor with
            MASTER_ADDR/MASTER_PORT (rank 0's node), RANK, WORLD_SIZE, LOCAL_RANK and,
            on GPU, CUDA_VISIBLE_DEVICES = the learner GPUs of that node (so NCCL sees
            its peers; LOCAL_RANK indexes into that list)

Rank 0 alone holds the :class:`learner.broker_source.BrokerSource` and the run's counters (status and
summary); the other ranks get every batch from rank 0 (``learner.loop.share_batch``). Weights go out through
:class:`learner.publishing.RankPublishing` (rank 0's weight-sync group, clients and publish counters; the other
ranks take part in the gathers of each publish), whose membership follows the fleet.

Stop and failure: ``stop()`` sets a flag on every rank; after each step the ranks agree
on it (a MAX all-reduce), so they all leave at the same step. A rank that raises or dies
ends its ``run`` reference with an error; :meth:`launch.learner_ranks.LearnerRanks.poll` turns that
into ``RankFailed`` naming the rank, and the driver's shutdown kills every rank actor
(the others may be blocked in a collective with the dead one).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any, Protocol

import msgspec
import torch
import torch.distributed as dist

from core.colocate_config import ColocateConfig
from learner.broker_source import BrokerSource
from learner.publishing import RankPublishing
from learner.run import LearnerRunLike, StopRun, init_distributed, run_learner
from learner.status import LearnerStatus
from weight_sync.adapter_publisher import adapter_publish
from weight_sync.config import NCCL_ENV, WeightSyncConfig

log = logging.getLogger(__name__)


class _BrokerPart(Protocol):
    @property
    def lease_timeout_s(self) -> float: ...
    @property
    def groups_per_step(self) -> int: ...
    @property
    def max_staleness(self) -> int: ...
    @property
    def curve_keys_dir(self) -> str | None: ...


class _RolloutPart(Protocol):
    @property
    def engine(self) -> str: ...
    @property
    def request_timeout_s(self) -> float: ...


class _RankRunPart(Protocol):
    @property
    def run_dir(self) -> str: ...
    @property
    def tensorboard(self) -> bool: ...
    @property
    def prometheus(self) -> bool: ...


class RankConfig(LearnerRunLike, Protocol):
    """What a rank reads of the run config (``launch.config.RunConfig`` is one)."""

    @property
    def run(self) -> _RankRunPart: ...

    @property
    def weight_sync(self) -> WeightSyncConfig: ...
    @property
    def broker(self) -> _BrokerPart: ...
    @property
    def rollout(self) -> _RolloutPart: ...
    @property
    def colocate(self) -> ColocateConfig: ...


class FleetView(Protocol):
    """The fleet as rank 0 sees it (the launcher adapts the fleet actor's handle)."""

    def server_urls(self) -> dict[str, str]:
        """Engine id -> URL of every healthy server (bounded wait)."""

    def engines_updated(self, engine_ids: list[str], version: int, relabel: bool = False) -> None:
        """Tell the fleet which servers now hold ``version`` (fire and forget); ``relabel``: no weights
        moved (the step changed nothing), the servers' weights already are ``version``'s."""

    def set_latest_export(self, version: int, path: str) -> None:
        """Tell the fleet where the newest HF export is (fire and forget)."""

    def release(self, step: int) -> dict[str, float]:
        """Colocated mode: close the fleet's gate and put its engines to sleep before step ``step``
        trains (blocks until done); seconds and counts of what it did."""

    def wake(self, version: int, phase: str) -> dict[str, float]:
        """Colocated mode: ``phase`` 'weights' wakes the engines' weights (before a publish), 'rest'
        their KV cache, runs a due evaluation and opens the gate (after it); blocks until done."""


class StopRequested(StopRun):
    """The driver asked the learner to stop after the current step."""


def _nccl_env(cfg: RankConfig) -> dict[str, str]:
    """The NCCL settings the learner shares with every engine server of the weight-sync group."""
    return {} if cfg.weight_sync.backend == "gloo" else dict(NCCL_ENV)


class LearnerRank:
    def __init__(
        self, cfg: RankConfig, broker_address: str, run_dir: str, fleet: FleetView | None, exports_shared: bool = True
    ) -> None:
        self.rank = 0
        self.cfg = cfg
        self.broker_address, self.run_dir, self.fleet = broker_address, Path(run_dir), fleet
        self.weights = RankPublishing(cfg, self.run_dir, fleet, exports_shared)  # weights out (learner/publishing.py)
        self._source = None
        self.world_size = 0  # known once the process group is up
        self.version = 0
        self.stop_flag = False
        self.done = False
        self.error: str | None = None
        self.reward_per_step: list[float] = []
        self.staleness_hist: Counter[int] = Counter()
        self.max_staleness_seen = 0
        self.bound_violations = 0
        self.groups_consumed = 0
        self.wait_s = 0.0
        self.sink = None  # rank 0's per-step metrics (learner/metrics_sink.py), opened at its first step
        self.t0 = time.monotonic()
        self.t0_unix = time.time()
        self._colo: dict[str, float] = {}  # colocated mode: sleep / wake seconds of the current step
        self._engine = None  # the training engine, once built (its resolved settings)
        self.critic_last: tuple[float | None, float | None] = (None, None)  # PPO: vf_loss, explained variance

    # -- rendezvous ----------------------------------------------------------------------------------
    def set_rank(self, rank: int) -> None:
        """Ranks are known once every actor is placed (they are ordered by node and GPU)."""
        self.rank = self.weights.rank = rank

    # -- colocated mode (core/colocate_config.py) ----------------------------------------------------------
    def _release(self, step: int) -> None:
        """Every rank calls it with step ``step``'s batch in hand; rank 0 puts the fleet to sleep."""
        self._colo = {}
        if self.rank != 0 or self.fleet is None:
            return
        t0 = time.monotonic()
        rep = self.fleet.release(step)
        self._colo.update({f"colocate/release_{k}": float(v) for k, v in rep.items()})
        self._colo["colocate/release_roundtrip_seconds"] = time.monotonic() - t0

    def _publish_colocated(self, version: int, engine) -> None:
        """Wake the engines' weights, publish into them (one GPU: CUDA IPC; else gloo on the host), wake the rest,
        open the gate."""
        if self.rank != 0 or self.fleet is None:
            self.weights.publish(version, engine)
            return
        if torch.cuda.is_available():  # hand the activations' cached blocks back before the engines reallocate
            torch.cuda.empty_cache()
        t0 = time.monotonic()
        rep = self.fleet.wake(version, "weights")
        t1 = time.monotonic()
        self.weights.publish(version, engine)
        t2 = time.monotonic()
        rep2 = self.fleet.wake(version, "rest")
        self._colo.update({f"colocate/wake_weights_{k}": float(v) for k, v in rep.items()})
        self._colo.update({f"colocate/wake_rest_{k}": float(v) for k, v in rep2.items()})
        # *_seconds from the fleet are the engines' own calls; the round trips include the Ray calls
        # (and, in wake_rest, a due evaluation: wake_rest_eval_seconds)
        self._colo.update(
            {
                "colocate/wake_weights_roundtrip_seconds": t1 - t0,
                "colocate/weight_load_seconds": t2 - t1,
                "colocate/wake_rest_roundtrip_seconds": time.monotonic() - t2,
            }
        )

    def _metrics(self, step: int, m: dict[str, float]) -> None:
        """The step's record (rank 0), written before its checkpoint and ack (learner/loop.py)."""
        self.version = step
        if self.rank == 0:
            self._count(step, m)

    def _committed(self, step: int) -> None:
        """After the step's ack: where a stop asked for on any rank is taken, on every rank."""
        if self._agree_stop():
            raise StopRequested

    def _write_metrics(self, step: int, m: dict[str, float]) -> None:
        if self.sink is None:
            from learner.metrics_sink import MetricsSink

            self.sink = MetricsSink(
                self.run_dir,
                start_step=step,
                tensorboard=self.cfg.run.tensorboard,
                prometheus=self.cfg.run.prometheus,
                model_path=self.cfg.model.path,
                samples_every=self.cfg.learner.log_samples_every,
            )
            self._continue_counts(step)
        held = self.weights.publish_held_s if not m.get("learner/publish_skipped") else 0.0
        self.weights.publish_held_s = 0.0
        batch = self._source.last_batch
        self.sink.write(step, m, batch, {"learner/publish_engine_held_seconds": held})

    def _continue_counts(self, step: int) -> None:
        """A resumed run: the counters (reward curve, staleness, groups) go on from the steps before ``step``."""
        from learner.metrics_sink import effective_rows

        k = self.cfg.broker.max_staleness
        for row in effective_rows(self.run_dir, before=step).values():
            self.reward_per_step.append(float(row["metrics"].get("rollout/reward_mean", float("nan"))))
            self.groups_consumed += len(row["groups"])
            for s, c in row["staleness_hist"].items():
                self.staleness_hist[int(s)] += c
                self.max_staleness_seen = max(self.max_staleness_seen, int(s))
                self.bound_violations += c if int(s) > k else 0

    def _count(self, step: int, m: dict[str, float]) -> None:
        self._write_metrics(step, m)
        if self.cfg.learner.export_every and step % self.cfg.learner.export_every == 0:
            self.weights.exported_version = step
            if (
                self.fleet is not None and self.weights.exports_shared
            ):  # a restarted server loads this before it takes work
                self.fleet.set_latest_export(step, str(self.run_dir / "export" / "latest"))
        self._log_step(step, m)
        self.reward_per_step.append(float(m.get("learner/batch_reward_mean", float("nan"))))
        self.critic_last = (m.get("critic/vf_loss"), m.get("critic/vf_explained_var"))
        self.wait_s += float(m.get("learner/pull_seconds", 0.0))
        self.groups_consumed += self.cfg.broker.groups_per_step
        stale = getattr(self._source, "last_staleness", None)
        if stale is not None and len(stale):
            for s, c in Counter(int(x) for x in stale).items():
                self.staleness_hist[s] += c
            self.max_staleness_seen = max(self.max_staleness_seen, int(max(stale)))
            self.bound_violations += int(sum(1 for x in stale if x > self.cfg.broker.max_staleness))

    def _log_step(self, step: int, m: dict[str, float]) -> None:
        """One line per step in ``<run_dir>/metrics/learner_steps.jsonl`` (bench/e2e.py reads it): the
        step's unix time, its training and generation windows, tokens (sampled, and trained: ``batch_samples_trained``,
        ``batch_response_tokens``, without the uniform groups the loss drops), staleness, mismatch, colocated timings."""
        keys = (
            "learner/total_step_seconds",
            "learner/pull_seconds",
            "learner/publish_seconds",
            "learner/train_start_unix",
            "learner/train_end_unix",
            "learner/gen_start_min_unix",
            "learner/gen_end_max_unix",
            "learner/prompt_tokens",
            "learner/response_tokens",
            "learner/samples",
            "learner/batch_samples_trained",
            "learner/batch_response_tokens",
            "learner/optimizer_steps",
            "learner/staleness_max_versions",
            "learner/staleness_mean_versions",
            "learner/mismatch_kl_k3",
            "learner/mismatch_logp_diff",
            "learner/batch_reward_mean",
            "learner/compute_seconds",
            "learner/gpu_compute_seconds",
            "learner/gpu_max_reserved_gib",
            "learner/compiled_graphs",
        )
        row = {
            "step": step,
            "t_unix": time.time(),
            "t0_unix": self.t0_unix,
            **{k.split("/", 1)[1]: float(m[k]) for k in keys if k in m},
            **self._colo,
        }
        try:
            out = self.run_dir / "metrics"
            out.mkdir(parents=True, exist_ok=True)
            with open(out / "learner_steps.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
        except OSError as exc:  # a full disk must not end the run
            log.warning("learner_steps.jsonl: %s", exc)

    def _agree_stop(self) -> bool:
        """True on every rank if any rank was asked to stop (ranks must leave at the same step)."""
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
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        # Other ranks wait in a collective while rank 0 waits for a batch or for engines during a publish:
        # the collective timeout must outlast both, or they would fail before rank 0 says why.
        coll_timeout = max(600.0, self.cfg.rollout.request_timeout_s + 2 * self.cfg.weight_sync.timeout_s + 60)
        _, self.world_size = init_distributed("gloo" if not torch.cuda.is_available() else "auto", coll_timeout)
        self.weights.world_size = self.world_size
        log.info(
            "learner rank %d/%d up (MASTER %s:%s, LOCAL_RANK %s, CUDA_VISIBLE_DEVICES %s)",
            self.rank,
            self.world_size,
            env["MASTER_ADDR"],
            env["MASTER_PORT"],
            env["LOCAL_RANK"],
            os.environ.get("CUDA_VISIBLE_DEVICES", "-"),
        )
        if self.rank == 0:
            self._source = BrokerSource(
                self.broker_address,
                consumer_id="learner",
                curve_keys_dir=self.cfg.broker.curve_keys_dir,
                lease_timeout_s=self.cfg.broker.lease_timeout_s,
            )
        self.t0, self.t0_unix = time.monotonic(), time.time()
        colo = self.cfg.colocate.synchronous  # shared async (colocate.mode=async) publishes as disaggregated does
        try:
            # colocated: every step publishes (a sleeping engine at level 2 holds no weights to relabel)
            run_learner(
                self.cfg,
                source=self._source,
                publish=self._publish_colocated if colo else self.weights.publish,
                on_metrics=self._metrics,
                on_committed=self._committed,
                batch_timeout_s=self.cfg.rollout.request_timeout_s,
                # adapter publishing: a step without an update still publishes (a relabel alone would
                # make the fleet name an adapter version no server has loaded); it costs an adapter
                on_unchanged=None if colo or adapter_publish(self.cfg) else self.weights.unchanged,
                on_batch=self._release if colo else None,
                needs_weights=None if colo else self.weights.needs_weights,
                on_engine=self._engine_built,
            )
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
            self.weights.close()
            if self.sink is not None:
                self.sink.close()
            dist.destroy_process_group()
        return self.status()

    def _engine_built(self, engine) -> None:
        self._engine = engine  # its settings (what every "auto" became, learner/fastpath.py) go into the record

    def stop(self) -> None:
        self.stop_flag = True

    def status(self) -> dict[str, Any]:
        """:meth:`record` as plain data (the actor's answer)."""
        return msgspec.to_builtins(self.record())

    def record(self) -> LearnerStatus:
        wall = max(1e-9, time.monotonic() - self.t0)
        return LearnerStatus(
            simulated=False,
            step=self.version,
            rank=self.rank,
            world_size=self.world_size,
            learner_wait_s=round(self.wait_s, 3),
            learner_idle_fraction=self.wait_s / wall,
            groups_consumed=self.groups_consumed,
            reward=self.reward_per_step[-1] if self.reward_per_step else None,
            reward_per_step=list(self.reward_per_step),
            staleness_hist={str(k): v for k, v in sorted(self.staleness_hist.items())},
            max_staleness_seen=self.max_staleness_seen,
            bound_violations=self.bound_violations,
            publish_s=round(self.weights.publish_s, 3),
            publishes=self.weights.publishes,
            last_published_version=self.weights.last_published_version,
            publish_errors=self.weights.publish_errors,
            publishes_skipped=self.weights.publishes_skipped,
            settings=self._engine.settings.as_dict() if self._engine is not None else None,
            critic_vf_loss=self.critic_last[0],
            critic_explained_var=self.critic_last[1],
            done=self.done,
            error=self.error,
        )
