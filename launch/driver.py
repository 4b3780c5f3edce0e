"""The job driver behind ``launch/cluster.py``: Ray, placement, processes, the live view, shutdown.

Dataflow::

    driver (this process)
      |- Ray: local head on 127.0.0.1 (or --address), placement groups per role
      |- network: listeners bind network.host (loopback, or this node's address with --address; CurveZMQ off loopback)
      |- broker process (python -m broker)       <- tickets / batches / acks / status ->
      |- reward servers (--reward-gpus): one actor per judge / reward-model server, in its own bundle
      |- fleet actor   (FleetRunner: controller + rollout workers, the OpenAI proxy), on the driver's node
      |    '- one server actor per vLLM server, in that server's placement-group bundle (its node, its GPUs)
      |- learner actor (SimLearner under --simulate; the training loop otherwise)
      |- control endpoint (ZMQ REP, address in <run_dir>/control.json): status, scale (returns at once;
      |    new servers show as starting: launch/fleet_scaling.py), stop (like a last step: final eval, summary)
      '- monitor: rich view, TensorBoard, Prometheus; JSON summary at the end

Shutdown (Ctrl-C, SIGTERM, a failed component, the last step, or ``stop``): stop the learner, let
servers still starting end, stop the fleet (in-flight groups cancelled, engine servers stopped), stop the broker process,
remove placement groups, shut Ray down (only if this driver started it), close the
control socket and remove its file. Each step has a timeout and runs even if an earlier
one failed, so no process and no port outlive the job.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from core.signals import SignalFlag
from launch import resume
from launch.broker_supervisor import BrokerGone, BrokerSupervisor, end_engine_groups, engine_groups
from launch.config import REPO_ROOT, RunConfig, write_subconfigs
from launch.control import ControlRequest, ControlServer
from launch.fleet_recovery import FleetRecovery
from launch.fleet_scaling import FleetScaler
from launch.job_placement import JobFailed, JobPlacement, ray_get
from launch.monitor import Monitor, setup_logging
from launch.netsetup import check_shared_dir, resolve_network
from launch.observe import Endpoints, LearnerRows
from launch.snapshot import BrokerView, JobSnapshot
from learner.status import LearnerStatus
from rollout_fleet.status import FleetStatus

log = logging.getLogger(__name__)
CALL_TIMEOUT_S = 30.0


@dataclass(frozen=True, kw_only=True, slots=True)
class LaunchOptions:
    """The command line's choices that are not run config (``launch.cluster`` builds it from its flags)."""

    rollout_gpus: int = 0
    learner_gpus: int = 0
    reward_gpus: int = 0  # reward servers for reward.model (launch/reward_servers.py); on CPU: servers
    address: str | None = None  # a Ray cluster to join; None: start a local one
    ray_auth: str | None = None  # "token" | "disabled"; None: token
    simulate: bool = False
    no_live: bool = False
    log_level: str = "INFO"
    summary: str | None = None  # also write the JSON summary here
    colocate_gpus: int | None = (
        None  # colocated mode: learner and fleet share these GPUs (launch/colocated_placement.py)
    )


class Job:
    def __init__(self, cfg: RunConfig, args: LaunchOptions) -> None:
        self.cfg = cfg
        self.args = args
        self.simulated = bool(args.simulate)
        self.run_dir = Path(cfg.run.run_dir).resolve()
        self.t0 = time.monotonic()
        self.started_ray = False
        self.broker = None
        self.supervisor: BrokerSupervisor | None = None  # restarts a dead broker on its spool
        self.engine_pgids: set[int] = set()  # process groups of every engine server seen: ended at shutdown
        self.fleet = None
        self.learner = None  # the simulated learner, or rank 0 of the real one (status, stop)
        self.learner_ranks = None  # launch.learner_ranks.LearnerRanks: every rank of the real learner
        self.run_ref = None  # the simulated learner's run
        # where everything runs: the plan, placement groups, each server's GPUs (launch/job_placement.py)
        self.placement = JobPlacement(cfg, args, simulated=self.simulated, call_timeout_s=CALL_TIMEOUT_S)
        self.control: ControlServer | None = None
        self.monitor: Monitor | None = None
        self.wandb = None  # launch.monitor.WandbWriter until the monitor takes it over
        self.snapshot: JobSnapshot | None = None
        self.eval_before: float | None = None
        self.eval_after: float | None = None
        self.eval_history: list[dict[str, float]] = []  # {"step", "accuracy"} of every evaluation in the run
        self.colocated: dict[str, Any] = {}  # colocated mode's schedule figures (rollout_fleet/colocated_gate.py)
        self.fleet_busy: dict[str, list] = {}  # per engine: when it had a group in flight (launch/busy.py)
        self._eval_ref = None  # the evaluation in flight, if any
        self._eval_step = 0  # learner step at which the last evaluation started
        # Set by the Ctrl-C/SIGTERM handler. The handler also raises KeyboardInterrupt, but a library
        # call that catches it (one CI run went on for 2 minutes after a SIGINT) must not eat the stop.
        self.interrupted = SignalFlag()  # set by the SIGINT/SIGTERM handler: no lock (core/signals.py)
        self.broker_lost = False  # set when the job ends on BrokerGone: the learner cannot finish a step then
        self.elastic = None  # launch.autoscaler_io.Elastic when rollout.autoscale.enabled
        self.rewards = None  # launch.reward_servers.RewardServers with --reward-gpus
        self.resume_version = 0  # the learner checkpoint this launch resumes from (launch.resume.prepare)
        self.learner_rows_from = LearnerRows.size(self.run_dir)  # this launch's learner writes after it
        self.scaler = FleetScaler(self)  # `scale`: targets, placement groups, servers still starting
        self.fleet_recovery = FleetRecovery(self)  # a dead fleet actor: Ray restarts it, this starts it again
        self._fleet_last: dict[str, Any] | None = None  # the fleet's last status (shown while it recovers)
        self.stop_requested = False  # the control endpoint's `stop`: finish like a last step

    # -- start ----------------------------------------------------------------------------------
    def start(self) -> None:
        self._ray_env()  # before `import ray`: Ray reads its auth mode when it is imported
        import ray

        if self.cfg.run.wandb is not None:  # first: a W&B login problem ends the job before anything starts
            from launch.monitor import WandbWriter

            self.wandb = WandbWriter(
                self.cfg.run.wandb, self.run_dir, simulated=self.simulated, run_config=self.cfg.model_dump(mode="json")
            )

        for name, fn in (
            ("ray", lambda: self._init_ray(ray)),
            ("placement", lambda: self.placement.place(ray, self)),
            ("broker", self._start_broker),
            ("reward servers", self._launch_rewards),
            ("fleet", lambda: self._start_fleet(ray)),
            ("learner", lambda: self._start_learner(ray)),
        ):
            t = time.monotonic()
            fn()
            log.info("started %s in %.1f s", name, time.monotonic() - t)
        if self.cfg.rollout.autoscale.enabled:
            from launch.autoscaler_io import Elastic

            self.elastic = Elastic(self)
        self.control = ControlServer(
            self.run_dir, self.handle, host=self.cfg.network.host, curve_keys_dir=self.cfg.broker.curve_keys_dir
        )
        self.monitor = Monitor(
            self.run_dir,
            simulated=self.simulated,
            tensorboard=self.cfg.run.tensorboard,
            live=not self.args.no_live,
            wandb=self.wandb,
            prometheus=self.cfg.run.prometheus,
            host=self.cfg.network.host,
            learner_rows_from=self.learner_rows_from,
        )
        self.wandb = None  # the monitor owns it now (and finishes it)
        self.monitor.wandb_catch_up(self.resume_version)
        self.endpoints = Endpoints(self)  # every Prometheus endpoint, printed and in metrics.json

    def _init_ray(self, ray) -> None:
        """Start a local Ray head, or join ``--address``; token auth is chosen, never inherited.

        A local head listens on every interface (Ray binds ``*``), so it gets token auth
        with a fresh per-job token passed in the environment (``RAY_AUTH_TOKEN``): nothing
        is written to ``~/.ray`` and a stale token there cannot break a later ``--address``
        join. Joining a cluster uses ``--ray-auth`` (default ``token``: the cluster's own
        token from ``~/.ray/auth_token`` or ``RAY_AUTH_TOKEN``).
        """
        local = self.args.address is None
        mode = os.environ["RAY_AUTH_MODE"]
        pypath = os.environ["PYTHONPATH"]
        kw: dict[str, Any] = dict(include_dashboard=False, log_to_driver=False)
        if local:
            gpus = self.args.rollout_gpus + self.args.learner_gpus if self.simulated else None
            for attempt in (1, 2, 3):
                try:
                    ray.init(num_cpus=max(2, os.cpu_count() or 2), num_gpus=gpus, **kw)
                    break
                except Exception as exc:  # Ray waits only 30 s (fixed) for its raylet: a loaded host misses it
                    ray.shutdown()
                    if attempt == 3 or "timed out during startup" not in str(exc):
                        raise
                    log.warning("Ray start attempt %d failed (%s); retrying", attempt, exc)
            self.started_ray = True
        else:
            from core.engine_auth import TOKEN_ENV

            ray.init(
                address=self.args.address,
                runtime_env={"env_vars": {"PYTHONPATH": pypath, TOKEN_ENV: os.environ.get(TOKEN_ENV, "")}},
                **kw,
            )
        log.info(
            "Ray up (%s, auth %s); resources %s", "local" if local else self.args.address, mode, ray.cluster_resources()
        )
        check_shared_dir(ray, self.cfg)

    def _ray_env(self) -> None:
        import secrets

        mode = self.args.ray_auth or "token"
        os.environ["RAY_AUTH_MODE"] = mode
        if self.args.address is None and mode == "token":
            os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
        # a local head's workers inherit the driver's environment: the repo must be importable
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
        os.environ.setdefault("OMP_NUM_THREADS", "1")

    def _launch_rewards(self) -> None:
        if self.rewards is not None:  # they start now; the fleet gets their URLs and waits for them
            from launch.reward_servers import with_urls

            self.cfg = with_urls(self.cfg, self.rewards.launch())

    def _start_broker(self) -> None:
        from broker.process import BrokerProcess

        # the broker reads its own part of the resolved config (written by write_subconfigs)
        self.broker = BrokerProcess(
            address=self.cfg.broker.address,
            config=str(self.run_dir / "config" / "broker.yaml"),
            curve_keys_dir=self.cfg.broker.curve_keys_dir,
        )
        self.broker.start()
        self.supervisor = BrokerSupervisor(self)
        log.info("broker at %s", self.broker.address)

    def _start_fleet(self, ray) -> None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from engines.base import model_sampling_defaults

        ignored = model_sampling_defaults(self.cfg.model.path)
        if ignored:
            log.warning(
                "%s/generation_config.json sets %s; fleetrl does not apply it (every request pins each "
                "sampling field, so training samples log_softmax(z / T), the distribution the learner "
                "scores); rollout.eval_sampling may set top_p/top_k for evaluation",
                self.cfg.model.path,
                ", ".join(f"{k}={v}" for k, v in ignored.items()),
            )

        from launch.netsetup import curve_key_data
        from launch.ray_actors import FleetActor

        # the controller lives with the driver: losing a fleet host must not take the controller with it
        # (hard: a soft affinity once put it on a fleet host, and the host's loss ended the job)
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self.fleet = FleetActor.options(name="fleetrl-fleet", num_cpus=0, scheduling_strategy=here).remote(
            self.cfg.model_dump(mode="json"),
            self.broker.address,
            str(self.run_dir),
            {i: (s.node_id, list(s.gpu_ids)) for i, s in self.placement.server_slots.items()},
            self.placement.server_pgs(self.placement.server_slots),
            curve_key_data(self.cfg),
        )
        n = self.placement.n_servers()
        if self.rewards is not None and self.rewards.shared:
            # on the rollout servers' GPUs: healthy first, so that no two vLLM servers profile one GPU's memory at once
            self.rewards.wait_started(None, self.cfg.reward.model.server.startup_timeout_s + 60)
        started = self.fleet.start.remote(n, list(range(n)))
        try:
            if self.rewards is not None:
                self.rewards.wait_started(started, self.cfg.reward.model.server.startup_timeout_s + 60)
            fleet = ray.get(started, timeout=self.cfg.rollout.startup_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise JobFailed(f"fleet start: no answer within {self.cfg.rollout.startup_timeout_s:.0f} s") from None
        except ray.exceptions.RayActorError as exc:
            # it died while starting (Ray's memory monitor has killed it on a loaded host): Ray restarts it,
            # the recovery starts it again (not as a mid-run restart: no export to catch up to)
            self.fleet_recovery.on_death(exc, initial=True)
            if self.rewards is not None:
                self.rewards.wait_started(None, self.cfg.reward.model.server.startup_timeout_s + 60)
            fleet = self.fleet_recovery.wait(self.cfg.rollout.startup_timeout_s + 180)
        self._write_placement()
        from launch.reward_servers import announce

        announce(self.rewards, fleet)

    def _write_placement(self) -> None:
        """``<run_dir>/placement.json``: each server's planned node and GPUs, and where its actor really ran."""
        if not self.placement.server_actors:
            if self.rewards is not None:
                (self.run_dir / "placement.json").write_text(
                    json.dumps({"reward_servers": self.rewards.describe()}, indent=2)
                )
            return
        placed = self._get(self.fleet.placements.remote(), CALL_TIMEOUT_S, "fleet placements")
        self.placement.write(self.run_dir, placed, self.rewards.describe() if self.rewards is not None else [])

    def _start_learner(self, ray) -> None:
        if not self.simulated:
            from launch.learner_ranks import start_learner

            self.learner_ranks, self.eval_before = start_learner(self)
            self.learner = self.learner_ranks.rank0
            return
        from launch.ray_actors import SimLearnerActor

        self.learner = SimLearnerActor.options(name="fleetrl-sim-learner", num_cpus=0).remote(
            self.broker.address,
            str(self.run_dir),
            self.cfg.rollout.simulated.learner_step_s,
            self.cfg.broker.max_staleness,
            self.fleet,
        )
        self.run_ref = self.learner.run.remote(self.cfg.run.max_steps)

    # -- run ------------------------------------------------------------------------------------
    @staticmethod
    def _get(ref, timeout: float, what: str):
        return ray_get(ref, timeout, what)

    def loop(self) -> None:
        import ray

        while True:
            if self.interrupted.is_set():
                raise KeyboardInterrupt
            if self.learner_ranks is not None:  # raises RankFailed naming a rank that failed or died
                done = self.learner_ranks.poll(0.5)
            else:
                done = bool(ray.wait([self.run_ref], timeout=0.25)[0])
            self.fleet_recovery.poll()  # a fleet actor restarted by Ray is started again
            if self.rewards is not None:
                self.rewards.check()  # restarts a reward server whose process died
            self.snapshot = self.collect()
            self.scaler.poll()  # servers that finished starting (or failed to)
            self._evaluate_every()
            if self.elastic is not None and not done and not self.stop_requested:
                self.elastic.tick(self.snapshot)
            self.monitor.update(self.snapshot)
            self.endpoints.refresh()
            while self.control.poll(0):
                pass
            if done:
                if self.run_ref is not None:
                    self._get(self.run_ref, CALL_TIMEOUT_S, "learner run")  # re-raises a learner failure
                if not self.simulated:
                    # the final evaluation needs a started fleet
                    self.fleet_recovery.wait(self.cfg.rollout.startup_timeout_s + 180)
                    self._get(self.fleet.stop_workers.remote(), 60, "fleet stop workers")
                    self.fleet_busy = self._get(self.fleet.busy_intervals.remote(), CALL_TIMEOUT_S, "fleet busy")
                    if self.cfg.colocate.synchronous:  # its evaluations ran at the wakes, never during training
                        self.colocated = self._get(
                            self.fleet.colocated_summary.remote(), CALL_TIMEOUT_S, "colocated summary"
                        )
                        self.eval_history = list(self.colocated.pop("eval_history", []))
                    self.eval_after = self._get(
                        self.fleet.evaluate.remote(self.cfg.run.eval_samples), 600, "eval after"
                    )
                    if self.eval_after is not None:
                        log.info(
                            "eval accuracy after training: %.3f (before %s)",
                            self.eval_after,
                            "skipped" if self.eval_before is None else f"{self.eval_before:.3f}",
                        )
                return
            if self.supervisor is not None:
                self.supervisor.check()  # restarts a dead broker on its spool, or raises BrokerGone

    def _evaluate_every(self) -> None:
        """Every ``run.eval_every`` learner steps, evaluate on the test set without stopping the run.

        The evaluation shares the fleet with rollouts (greedy, one sample per prompt) and reads
        whatever weights the servers hold while it runs; it is labelled with the learner step
        at which it started. One evaluation at a time: a slow one delays the next, never the run.
        """
        import ray

        every = self.cfg.run.eval_every
        if (
            self.simulated or not every or self.cfg.colocate.synchronous
        ):  # colocated sync: the fleet evaluates at a wake
            return
        if self.fleet_recovery.active:
            return
        if self._eval_ref is not None:
            done, _ = ray.wait([self._eval_ref], timeout=0)
            if not done:
                return
            try:
                acc = self._get(self._eval_ref, CALL_TIMEOUT_S, "periodic eval")
            except JobFailed as exc:  # the fleet died under it (recovered by fleet_recovery): no figure
                log.warning("periodic eval at step %d lost: %s", self._eval_step, exc)
                self._eval_ref = None
                return
            self._eval_ref = None
            if acc is not None:
                self.eval_history.append({"step": self._eval_step, "accuracy": acc})
                log.info("eval accuracy at step %d: %.3f", self._eval_step, acc)
        step = self.snapshot.learner.step if self.snapshot is not None else 0
        if step >= self._eval_step + every and step < self.cfg.run.max_steps and not self.stop_requested:
            self._eval_step = step
            self._eval_ref = self.fleet.evaluate.remote(self.cfg.run.eval_samples)
        if self.eval_history and self.snapshot is not None:
            self.snapshot.eval_accuracy = self.eval_history[-1]["accuracy"]

    def collect(self) -> JobSnapshot:
        if self.learner_ranks is not None:  # a rank 0 found dead here is named (RankFailed), as poll names it
            learner = self.learner_ranks.live_status(CALL_TIMEOUT_S)
        else:
            learner = self._get(self.learner.status.remote(), CALL_TIMEOUT_S, "learner status")
        fleet = self._fleet_status()
        snap = JobSnapshot(
            fleet=msgspec.convert(fleet, FleetStatus),
            learner=msgspec.convert(learner, LearnerStatus),
            broker=self._broker_view(),
            max_steps=self.cfg.run.max_steps,
            max_staleness=self.cfg.broker.max_staleness,
            simulated=self.simulated,
            wall_s=time.monotonic() - self.t0,
            eval_accuracy_before=self.eval_before,
            mode=self.cfg.colocate.label(),
            eval_accuracy=self.eval_history[-1]["accuracy"] if self.eval_history else None,
        )
        self.engine_pgids |= engine_groups(snap.to_wire())
        return snap

    def _fleet_status(self) -> dict[str, Any]:
        """The fleet's status; while the fleet actor is dead or restarting, its last one (its servers shown as
        they were), and a death starts the recovery (launch/fleet_recovery.py)."""
        import ray

        if not self.fleet_recovery.active:
            try:
                st = ray.get(self.fleet.status.remote(), timeout=CALL_TIMEOUT_S)
            except ray.exceptions.GetTimeoutError:
                raise JobFailed(f"fleet status: no answer within {CALL_TIMEOUT_S:.0f} s") from None
            except ray.exceptions.RayActorError as exc:
                self.fleet_recovery.on_death(exc)
            else:
                if st.pop("started_here", True):
                    self._fleet_last = st
                    return st
                # Ray restarted it between two calls (none of ours failed): the new one was never started
                self.fleet_recovery.on_death(RuntimeError("the fleet actor answers unstarted: Ray restarted it"))
        return dict(self._fleet_last or {}, servers=[], healthy_servers=0)

    def _broker_view(self) -> BrokerView | None:
        from launch.broker_view import broker_status

        try:
            return broker_status(self.broker.address, curve_keys_dir=self.cfg.broker.curve_keys_dir)
        except Exception as exc:  # a slow status answer must not end the job
            log.warning("broker status failed: %s", exc)
            return None

    def _broker_status(self) -> dict[str, Any]:
        view = self._broker_view()
        return {} if view is None else msgspec.to_builtins(view)

    # -- control --------------------------------------------------------------------------------
    def handle(self, req: ControlRequest) -> dict[str, Any]:
        if req.op == "status":
            return {**self.collect().to_wire(), "metrics_endpoints": self.endpoints.current}
        if req.op == "stop":
            return self.request_stop()
        if req.rollout_gpus is None:
            raise ValueError("scale needs rollout_gpus")
        return self.scale(req.rollout_gpus)

    def scale(self, rollout_gpus: int) -> dict[str, Any]:
        """Grow (returns at once; the new servers show as ``starting``) or drain the fleet: launch/fleet_scaling.py."""
        return self.scaler.scale(rollout_gpus)

    def request_stop(self) -> dict[str, Any]:
        """End the run as if its last step were now: the learner stops after its current step, then the
        fleet's workers stop, the final evaluation runs and the summary is written (exit status 0)."""
        if not self.stop_requested:
            self.stop_requested = True
            log.warning("stop requested: the learner stops after its current step, then the final evaluation")
            if self.learner_ranks is not None:
                self.learner_ranks.request_stop()
            elif self.learner is not None:
                self.learner.stop.remote()
        return {"stopping": True, "step": self.snapshot.learner.step if self.snapshot is not None else 0}

    # -- shutdown -------------------------------------------------------------------------------
    def shutdown(self) -> dict[str, Any]:
        import ray

        final: dict[str, Any] = {"learner": {}, "fleet": {}, "broker": {}}
        steps = [
            ("learner", lambda: self.learner and self._stop_learner()),
            # servers still starting (scale): let them end, so the fleet's stop stops them too
            ("starting servers", lambda: self.fleet and self.scaler.wait(self.cfg.rollout.startup_timeout_s + 30)),
            # its groups cannot end without the broker: cancelled at once then
            (
                "fleet",
                lambda: (
                    self.fleet
                    and self._get(self.fleet.stop.remote(0.0 if self.broker_lost else 10.0), 60.0, "fleet stop")
                ),
            ),
            ("reward servers", lambda: self.rewards and self.rewards.stop()),
            ("broker", lambda: self.supervisor.final_status() if self.supervisor else {}),
        ]
        for name, fn in steps:
            t = time.monotonic()
            try:
                final[name] = fn() or {}
                log.info("stopped %s in %.1f s", name, time.monotonic() - t)
            except Exception as exc:
                log.error("shutdown: %s: %s", name, exc)
        if self.learner_ranks is not None:
            self.learner_ranks.kill()  # every rank: one may sit in a collective with a dead peer
        for actor in (self.learner, self.fleet):
            if actor is not None and not isinstance(actor, (str, int)):
                try:
                    ray.kill(actor)
                except Exception as exc:
                    log.warning("shutdown: kill actor: %s", exc)
        if self.broker is not None:
            try:
                self.broker.stop()
            except Exception as exc:
                log.error("shutdown: broker process: %s", exc)
        try:  # engines whose fleet did not stop them (a failed job): none may outlive it
            end_engine_groups(self.engine_pgids)
        except Exception as exc:
            log.error("shutdown: ending engine processes: %s", exc)
        if self.control is not None:
            self.control.close()
        if self.monitor is not None:
            self.monitor.close()
        if self.wandb is not None:  # the job failed before the monitor existed
            try:
                self.wandb.close()
            except Exception as exc:
                log.error("shutdown: W&B finish: %s", exc)
        if ray.is_initialized():
            for pg in self.placement.pgs.values():
                try:
                    ray.util.remove_placement_group(pg)
                except Exception:
                    pass
            t = time.monotonic()
            ray.shutdown()
            log.info("Ray shut down in %.1f s", time.monotonic() - t)
        try:  # engine processes of this run no snapshot showed, or whose server was killed: none outlives the job
            from launch.fleet_recovery import engine_groups_of_run

            left = engine_groups_of_run(self.run_dir)
            if left:
                log.warning("shutdown: engine process groups %s of this run were left; ending them", sorted(left))
                end_engine_groups(left)
        except Exception as exc:
            log.error("shutdown: ending this run's engine processes: %s", exc)
        return final

    def _stop_learner(self) -> dict[str, Any]:
        if self.broker_lost:
            # A stop is taken after a committed step, and no step commits without the broker: the ranks would
            # only wait out their broker client's timeout (30 s). They are ended with the other actors below.
            log.warning("the broker is gone: the learner's ranks are ended without waiting for their step")
            return {}
        if self.learner_ranks is not None:
            return self.learner_ranks.stop(CALL_TIMEOUT_S)
        self._get(self.learner.stop.remote(), CALL_TIMEOUT_S, "learner stop")
        return self._get(self.learner.status.remote(), CALL_TIMEOUT_S, "learner status")


def run(cfg: RunConfig, args: LaunchOptions) -> int:
    from launch.summary import build_summary

    run_dir = Path(cfg.run.run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    # every process gets the absolute run directory (Ray workers do not share our cwd)
    cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"run_dir": str(run_dir)})})
    setup_logging(run_dir, "driver", simulated=bool(args.simulate), level=args.log_level, stderr=args.no_live)
    cfg = resume.with_defaults(cfg, run_dir)  # spool in the run dir, Prometheus ports: a re-run continues
    cfg = resolve_network(cfg, args.address, run_dir)  # bind addresses, CurveZMQ keys: before any part is written
    from core.engine_auth import TOKEN_ENV, make_engine_token

    os.environ[TOKEN_ENV] = make_engine_token(run_dir)  # engine HTTP token, inherited by Ray and every server
    resumed = resume.prepare(cfg, run_dir)
    write_subconfigs(cfg, run_dir)
    job = Job(cfg, args)
    job.resume_version = resumed["checkpoint_version"]

    def _interrupt(signum, frame):  # Ctrl-C, and SIGTERM the same clean way
        job.interrupted.set()
        raise KeyboardInterrupt

    old_term = signal.signal(signal.SIGTERM, _interrupt)
    old_int = signal.signal(signal.SIGINT, _interrupt)
    rc, error = 0, None
    try:
        job.start()
        job.loop()
    except KeyboardInterrupt:
        rc, error = 130, "interrupted"
        log.warning("interrupted: shutting down")
    except Exception as exc:
        rc, error = 1, f"{type(exc).__name__}: {exc}"
        job.broker_lost = isinstance(exc, BrokerGone)
        log.exception("job failed")
    finally:
        # a second Ctrl-C must not cut the shutdown short (that is how orphans are made)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        final = job.shutdown()
        signal.signal(signal.SIGTERM, old_term)
        signal.signal(signal.SIGINT, old_int)
    summary = build_summary(cfg, job, final, error=error)
    summary["fleet_restarts"] = job.fleet_recovery.log  # each fleet actor death: when, back after, what was ended
    if job.rewards is not None:
        summary["reward_server_restarts"] = job.rewards.recoveries
    if job.elastic is not None:
        summary["autoscale"] = job.elastic.log
        last = job.snapshot.broker if job.snapshot is not None else None
        summary["engine_lag_at_end"] = last.engine_lag if last is not None else None
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    if args.summary:
        Path(args.summary).parent.mkdir(parents=True, exist_ok=True)
        Path(args.summary).write_text(json.dumps(summary, indent=2))
    print(
        json.dumps(
            {
                k: summary[k]
                for k in (
                    "steps",
                    "max_staleness",
                    "max_staleness_seen",
                    "eval_accuracy_before",
                    "eval_accuracy_after",
                    "groups_lost",
                    "wall_s",
                    "simulated",
                )
            }
        )
    )
    if error:
        print(f"error: {error} (logs in {run_dir / 'logs'})")
    return rc
