"""The learner as a Ray actor: the FSDP training loop on the broker, publishing to the fleet.

One rank (CPU demo, or one GPU): it sets up a single-process torch.distributed group,
runs :func:`learner.run.run_learner` with :class:`broker.learner_source.BrokerSource`
and a publish hook that drives :class:`weight_sync.publisher.Publisher`.

Weight-sync membership follows the fleet: before each publish the hook asks the fleet
actor for its healthy servers. A server that vanished (died, drained) leaves the group;
a new or restarted one joins as a late joiner (it loads the latest HF export first,
then joins the rebuilt group and receives the broadcast), so it comes back with current
weights. A failed publish names the engines it blames; the publisher drops them and
the fleet's health checks decide whether they are dead.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections import Counter
from pathlib import Path
from typing import Any

import ray

from launch.configbase import build
from launch.monitor import setup_logging

log = logging.getLogger(__name__)


class StopRequested(Exception):
    """The driver asked the learner to stop after the current step."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@ray.remote(num_cpus=0, max_restarts=0, max_concurrency=4)
class LearnerActor:
    def __init__(self, cfg_data: dict[str, Any], broker_address: str, run_dir: str, fleet) -> None:
        from launch.config import RunConfig

        setup_logging(Path(run_dir), "learner", simulated=False)
        self.cfg = build(RunConfig, cfg_data)
        self.broker_address, self.run_dir, self.fleet = broker_address, Path(run_dir), fleet
        self.pub = None
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
        self.t0 = time.monotonic()

    # -- weights out -------------------------------------------------------------------------------
    def _bucket_bytes(self) -> int:
        return int(self.cfg.weight_sync.bucket_mb * (1 << 20))

    def _sync_members(self) -> None:
        from rollout_fleet.engines.vllm import VLLMClient

        urls = ray.get(self.fleet.server_urls.remote(), timeout=30)
        for eid, client in list(self.pub.engines.items()):
            if urls.get(eid) != client.url:
                log.info("weight sync: %s left the fleet (or moved); removed from the group", eid)
                self.pub.remove_engine(eid)
        export = self.run_dir / "export" / "latest"
        backend = "nccl" if self.pub.backend == "nccl" else "fleetrl_gloo"
        for eid, url in urls.items():
            if eid in self.pub.engines:
                continue
            client = VLLMClient(eid, url, model=self.cfg.model.path, weight_backend=backend,
                                timeout_s=self.cfg.weight_sync.timeout_s,
                                update_pause_mode="wait" if self.cfg.rollout.weight_update == "pause" else "keep")
            if self.exported_version > 0 and export.exists():
                log.info("weight sync: late joiner %s loads export v%d, then joins", eid, self.exported_version)
                self.pub.add_engine(client, str(export), self.exported_version)
            else:
                self.pub.add_engine(client)

    def _publish(self, version: int, engine) -> None:
        from weight_sync.plan import build_plan
        from weight_sync.publisher import Publisher, PublishError

        t0 = time.monotonic()
        if self.pub is None:
            plan = build_plan(engine.param_plan(), self._bucket_bytes())
            self.pub = Publisher(self.cfg.weight_sync, plan, rank=0)
        try:
            self._sync_members()
        except Exception as exc:  # the fleet did not answer: publish to the members we know
            log.warning("weight sync: fleet membership unknown (%s)", exc)
        tensors = (item for bucket in engine.iter_full_params(self._bucket_bytes()) for item in bucket)
        try:
            rep = self.pub.publish(version, tensors)
            log.info("published v%d to %s in %.2fs", version, rep.engines if rep else [], time.monotonic() - t0)
        except PublishError as exc:
            log.error("publish of v%d failed: %s (blamed %s)", version, exc, exc.blamed)
        self.publish_s += time.monotonic() - t0

    def _metrics(self, step: int, m: dict[str, float]) -> None:
        self.version = step
        if self.cfg.learner.export_every and step % self.cfg.learner.export_every == 0:
            self.exported_version = step
            # a server the fleet restarts loads this before it takes work (fire and forget)
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
        if self.stop_flag:
            raise StopRequested

    # -- run -----------------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        import torch
        import torch.distributed as dist

        from broker.learner_source import BrokerSource
        from learner.run import init_distributed, run_learner

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "RANK": "0",
                           "WORLD_SIZE": "1", "LOCAL_RANK": "0"})
        init_distributed("gloo" if not torch.cuda.is_available() else "auto")
        self._source = BrokerSource(self.broker_address, consumer_id="learner",
                                    lease_timeout_s=self.cfg.broker.lease_timeout_s)
        self.t0 = time.monotonic()
        try:
            run_learner(self.cfg, source=self._source, publish=self._publish, on_metrics=self._metrics,
                        batch_timeout_s=self.cfg.rollout.request_timeout_s)
        except StopRequested:
            log.info("learner stopped at version %d on request", self.version)
        except Exception as exc:
            self.error = f"{type(exc).__name__}: {exc}"
            log.exception("learner failed at version %d", self.version)
            raise
        finally:
            self.done = True
            self._source.close()
            if self.pub is not None:
                self.pub.close()
            dist.destroy_process_group()
        return self.status()

    def stop(self) -> None:
        self.stop_flag = True

    def status(self) -> dict[str, Any]:
        wall = max(1e-9, time.monotonic() - self.t0)
        return {"simulated": False, "step": self.version, "learner_wait_s": round(self.wait_s, 3),
                "learner_idle_fraction": self.wait_s / wall, "groups_consumed": self.groups_consumed,
                "reward": self.reward_per_step[-1] if self.reward_per_step else None,
                "reward_per_step": list(self.reward_per_step),
                "staleness_hist": {str(k): v for k, v in sorted(self.staleness_hist.items())},
                "max_staleness_seen": self.max_staleness_seen, "bound_violations": self.bound_violations,
                "publish_s": round(self.publish_s, 3), "done": self.done, "error": self.error}


def start_learner(job) -> tuple[Any, Any, float | None]:
    """Evaluate the initial policy through the fleet, then start the learner actor."""
    t = time.monotonic()
    before = job._get(job.fleet.evaluate.remote(job.cfg.run.eval_samples), 600, "eval before")
    log.info("eval accuracy before training: %.3f (%.1f s)", before, time.monotonic() - t)
    actor = LearnerActor.options(name="fleetrl-learner").remote(
        job.cfg.model_dump(mode="json"), job.broker.address, str(job.run_dir), job.fleet)
    return actor, actor.run.remote(), before
