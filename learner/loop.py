"""The learner's training loop: one step batch in, one policy version out.

Dataflow of step ``s = v + 1`` (``v``: the current policy version)::

    rank 0: source.next_batch(s) --Arrow IPC bytes, uint8 broadcast--> every rank
    every rank: plan_mini_batches (advantages, whole groups into ppo mini-batches, rank split,
                                   packed micro-batches)
                engine.prepare_logprobs on every mini-batch (proximal / reference, no grad,
                                   all before the first optimizer step)
                [kl_reward: the KL penalty into the advantages, or, with gae, into the token rewards]
                [advantage=gae: critic.prepare, values + GAE on every mini-batch: learner/critic.py]
                [first step after start: logprob_probe.check, engine vs learner on fresh tokens]
                ppo_epochs x engine.train_step per mini-batch (accumulate, clip, AdamW;
                                   the LR schedule once per step batch)  -> version s
                                  (skipped in the critic's warm-up steps)
                [critic.train: the value loss over the same mini-batches]
                publish(s, engine)            (collective; rank 0 sends the weights)
    rank 0: source.report_version(s)
    every rank: on_metrics(s, metrics)  (the step's record: rank 0 writes it)
    every rank: checkpoint every N steps (before the ack)
    rank 0: source.ack(lease)
    every rank: on_committed(s)         (where a requested stop is taken: learner.run.StopRun)

Invariants: a batch is acked only after its step is applied, published and,
when due, checkpointed, so a learner that dies mid-step gets the same data again
from the broker (at-least-once into the step; the checkpoint decides which step
is redone). A step's record is written before its commit (checkpoint, ack): a
learner killed between the two redoes a step whose record the re-run replaces,
where the other order could leave a checkpointed step with no record (its metrics
and its groups missing from the run's counts).

Ranks never disagree about the batch: only rank 0 talks to the
source and the others receive its exact bytes. If rank 0 cannot get a batch
(timeout, source exhausted), it broadcasts a stop mark and every rank raises
the same error instead of hanging in a collective.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
import torch.distributed as dist

from broker.schema import oldest_versions
from learner import checkpoint as ckpt
from learner import correction, kl_reward, logprob_probe
from learner.busy import StepTimer
from learner.config import LearnerConfig
from learner.engine import TrainingEngine
from learner.losses import finalize_metrics
from learner.minibatch import combine_steps, epoch_orders, plan_mini_batches
from learner.source import BatchSource

logger = logging.getLogger(__name__)

# Called on every rank after each optimizer step (and once after a resume) with the new version;
# it must drain engine.iter_full_params() on every rank (the gathers are collectives).
PublishHook = Callable[[int, TrainingEngine], None]
# Called on every rank instead of the publish hook when a step applied no optimizer update (every
# group uniform, or a non-finite gradient): the engines' weights are already those of the new version.
UnchangedHook = Callable[[int], None]
MetricsHook = Callable[[int, dict[str, float]], None]
CommittedHook = Callable[[int], None]
# Called on every rank once step s's batch is in, before any compute (colocated mode: rank 0 puts the
# engines to sleep there, so the learner has the devices to itself).
BatchHook = Callable[[int], None]
IdleHook = Callable[[], bool]


def publisher_hook(publisher, dtype: torch.dtype | None = None) -> PublishHook:
    """Adapt ``weight_sync.publisher.Publisher`` (built on every rank) to the loop's hook.

    Build its plan with ``weight_sync.plan.build_plan(engine.param_plan(dtype), bucket_bytes)``
    so names, shapes and dtypes match what :meth:`TrainingEngine.full_tensors` yields.
    """

    def publish(version: int, engine: TrainingEngine) -> None:
        publisher.publish(version, engine.full_tensors(dtype))

    return publish


_STOP = -1
_CATCH_UP = -2  # rank 0 waits for a batch while an engine lacks the current weights: every rank publishes


class _CatchUp(Exception):
    """Rank 0's wait for a batch is cut short to bring an engine up to the current weights."""


def share_batch(
    batch: pa.RecordBatch | None, device: torch.device, error: str = "", catch_up: bool = False
) -> pa.RecordBatch | None:
    """Broadcast rank 0's record batch to every rank as Arrow IPC bytes (no pickle).

    Rank 0 passes the batch (or None with ``error`` to make every rank raise; or ``catch_up``, for
    which every rank returns None: no batch yet, publish the current weights first).
    """
    rank = dist.get_rank()
    if rank == 0:
        if catch_up:
            payload = np.zeros(0, dtype=np.uint8)
            header = torch.tensor([_CATCH_UP, 0], dtype=torch.int64)
        elif batch is None:
            payload = np.frombuffer(error.encode()[:4096] or b"stop", dtype=np.uint8)
            header = torch.tensor([_STOP, payload.size], dtype=torch.int64)
        else:
            sink = pa.BufferOutputStream()
            with pa.ipc.new_stream(sink, batch.schema) as w:
                w.write_batch(batch)
            payload = np.frombuffer(sink.getvalue(), dtype=np.uint8)
            header = torch.tensor([1, payload.size], dtype=torch.int64)
    else:
        header = torch.zeros(2, dtype=torch.int64)
    header = header.to(device)
    dist.broadcast(header, src=0)
    kind, size = (int(x) for x in header.tolist())
    buf = (
        torch.from_numpy(payload.copy()).to(device)
        if rank == 0
        else torch.empty(size, dtype=torch.uint8, device=device)
    )
    dist.broadcast(buf, src=0)
    data = buf.cpu().numpy().tobytes()
    if kind == _STOP:
        raise TimeoutError(f"learner rank 0 got no batch: {data.decode(errors='replace')}")
    if kind == _CATCH_UP:
        return None
    if rank == 0:
        return batch
    return pa.ipc.open_stream(pa.py_buffer(data)).read_next_batch()


class Learner:
    """Runs steps ``version + 1 .. max_steps`` on one rank (every rank runs one)."""

    def __init__(
        self,
        engine: TrainingEngine,
        cfg: LearnerConfig,
        *,
        source: BatchSource | None,
        max_steps: int,
        checkpoint_dir: Path | None = None,
        export_root: Path | None = None,
        publish: PublishHook | None = None,
        on_metrics: MetricsHook | None = None,
        batch_timeout_s: float | None = None,
        engine_dtype: str = "auto",
        on_unchanged: UnchangedHook | None = None,
        on_batch: BatchHook | None = None,
        needs_weights: IdleHook | None = None,
        idle_poll_s: float = 10.0,
        on_committed: CommittedHook | None = None,
        critic=None,
    ) -> None:
        """``engine_dtype``: the engines' ``model.dtype``, which sets the log-prob probe's tolerance when
        ``learner.logprob_probe_tolerance`` is ``auto`` (learner/logprob_probe.py).

        ``needs_weights`` (rank 0): asked every ``idle_poll_s`` while no batch comes; True when an engine
        joined that holds no current weights. Every rank then publishes the current version again and
        waits on: a fleet whose servers were all replaced (late joiners at version 0, no shared disk for
        the export) cannot make the next step's groups, which are bounded by the staleness limit, until
        the next publish, which waits for them.

        ``on_metrics(step, metrics)`` runs before the step's checkpoint and ack, ``on_committed(step)``
        after them: a hook that stops the run (:class:`learner.run.StopRun`) belongs in the latter.

        ``critic``: PPO's value model (:class:`learner.critic.Critic`) with ``learner.loss.advantage=gae``."""
        if engine.rank == 0 and source is None:
            raise ValueError("learner rank 0 needs a BatchSource")
        self.engine, self.cfg, self.source = engine, cfg, source
        if (critic is None) != (cfg.loss.advantage != "gae"):
            raise ValueError("learner.loss.advantage=gae and a critic go together: pass critic= exactly when gae")
        self.critic = critic
        kr = cfg.kl_reward
        self.kl_ctl = kl_reward.KLController(kr.type, kr.coef, kr.target_kl, kr.horizon) if kr.enable else None
        self.max_steps = max_steps
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir else None
        self.export_root = Path(export_root) if export_root else None
        self.publish = publish
        self.on_unchanged = on_unchanged
        self.on_batch = on_batch
        self.publishes_skipped = 0
        self.on_metrics = on_metrics
        self.on_committed = on_committed
        self.commit_s = 0.0  # the previous step's checkpoint, export and ack (after its record)
        self.batch_timeout_s = batch_timeout_s
        self.needs_weights, self.idle_poll_s = needs_weights, idle_poll_s
        self.catch_up_publishes = 0
        self.version = 0
        self.probed = False  # the engine-vs-learner log-prob check runs on the first step after start
        self.probe_tolerance = logprob_probe.resolve_tolerance(cfg.logprob_probe_tolerance, engine_dtype)
        self.history: list[dict[str, float]] = []

    def resume(self) -> bool:
        """Load the newest complete checkpoint (if any); every rank must call it."""
        if self.checkpoint_dir is None:
            return False
        # Rank 0 decides (by version number), so all ranks load the same folder even if one is being written.
        path = ckpt.latest(self.checkpoint_dir) if self.engine.rank == 0 else None
        found = torch.tensor([int(path.name.removeprefix("step_")) if path else -1], device=self.engine.device)
        dist.broadcast(found, src=0)
        if int(found) < 0:
            return False
        path = ckpt.step_dir(self.checkpoint_dir, int(found))
        extra = self.engine.load_checkpoint(path)
        if self.critic is not None:
            self.critic.load(path / "critic")
        self.version = int(extra["version"])
        if self.engine.rank == 0 and extra.get("source_position") is not None and hasattr(self.source, "restore"):
            self.source.restore(extra["source_position"])
        if self.kl_ctl is not None and extra.get("kl_reward_coef") is not None:  # the adaptive coefficient
            self.kl_ctl.value = float(extra["kl_reward_coef"])
        logger.info("resumed at policy version %d from %s", self.version, path)
        return True

    def _pull(self, step: int):
        deadline = None if self.batch_timeout_s is None else time.monotonic() + self.batch_timeout_s
        while True:
            lease, batch, error, catch_up = None, None, "", False
            if self.engine.rank == 0:
                try:
                    sb = self._next_batch(step, deadline)
                    if sb.step != step:
                        raise ValueError(f"source returned the batch of step {sb.step} for step {step}")
                    lease, batch = sb.lease_id, sb.batch
                except _CatchUp:
                    catch_up = True
                except (TimeoutError, ValueError) as exc:
                    error = f"step {step}: {exc}"
            batch = share_batch(batch, self.engine.device, error, catch_up)
            if batch is not None:
                return lease, batch
            self.catch_up_publishes += 1
            if self.engine.rank == 0:
                logger.info("step %d: no batch yet and an engine lacks v%d: publishing it again", step, self.version)
            self.publish(self.version, self.engine)

    def _next_batch(self, step: int, deadline: float | None):
        """Rank 0: the source's batch for ``step``; :class:`_CatchUp` when an engine needs the weights first."""
        watch = self.needs_weights is not None and self.publish is not None and self.version > 0
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            wait = left if not watch else self.idle_poll_s if left is None else min(left, self.idle_poll_s)
            try:
                return self.source.next_batch(step, timeout_s=wait)
            except TimeoutError as exc:
                if not watch:
                    raise
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"no batch within {self.batch_timeout_s:.0f} s in all; the last wait: {exc}"
                    ) from None
            if self.needs_weights():
                raise _CatchUp

    def save(self) -> None:
        if self.checkpoint_dir is None:
            raise ValueError("no checkpoint_dir configured")
        pos = self.source.position() if self.engine.rank == 0 and hasattr(self.source, "position") else None
        path = ckpt.step_dir(self.checkpoint_dir, self.version)
        if self.critic is not None:  # before the actor's meta.json, which marks the folder complete
            self.critic.save(path / "critic")
        self.engine.save_checkpoint(
            path,
            {
                "version": self.version,
                "source_position": pos,
                "kl_reward_coef": self.kl_ctl.value if self.kl_ctl is not None else None,
            },
        )
        if self.engine.rank == 0:
            ckpt.prune(self.checkpoint_dir, self.cfg.keep_checkpoints)

    def export(self) -> Path | None:
        """Write ``export_root/step_XXXXXXXX`` and point ``export_root/latest`` at it; returns ``latest``."""
        if self.export_root is None:
            return None
        dtype = torch.bfloat16 if self.cfg.export_dtype == "bfloat16" else torch.float32
        self.engine.export_hf(ckpt.step_dir(self.export_root, self.version), dtype=dtype)
        if self.engine.rank == 0:
            ckpt.publish_export(self.export_root, self.version)
        dist.barrier()
        return self.export_root / "latest"

    def step(self) -> dict[str, float]:
        step = self.version + 1
        t0 = time.perf_counter()
        lease, batch = self._pull(step)
        t_pull = time.perf_counter() - t0
        if self.on_batch is not None:
            self.on_batch(step)
        t_train_wall = time.time()  # unix seconds, comparable with the samples' t_start / t_end
        timer = StepTimer()  # the step's compute, host and CUDA clocks (learner/busy.py)
        plans, stats = plan_mini_batches(
            batch,
            groups_per_mini=self.cfg.ppo_mini_batch_size,
            rank=self.engine.data_rank,
            world_size=self.engine.data_world_size,
            micro_batch_tokens=self.engine.micro_batch_tokens,
            advantage=self.cfg.loss.advantage,
            drop_uniform=self.cfg.loss.drop_uniform_groups,
            aggregation=self.cfg.loss.effective_aggregation,
            learner_version=self.version,
            mask_truncated=self.cfg.loss.mask_truncated,
            loss_scale_factor=self.cfg.loss.loss_scale_factor,
            uniform_in_mean=self.cfg.loss.uniform_groups_in_mean,
        )
        t1 = time.perf_counter()
        for plan in plans:  # every proximal log-prob before the first optimizer step: the trust region's anchor
            self.engine.prepare_logprobs(plan)
        penalties = None
        if self.kl_ctl is not None and self.critic is not None:  # KL in the token rewards GAE reads
            penalties, kl_m = kl_reward.gae_penalties(
                batch, plans, estimator=self.cfg.kl_reward.estimator, controller=self.kl_ctl
            )
            stats.update(kl_m)
        elif self.kl_ctl is not None:  # KL in the reward: advantages again, from token rewards (learner/kl_reward.py)
            stats.update(
                kl_reward.apply(
                    batch,
                    plans,
                    advantage=self.cfg.loss.advantage,
                    drop_uniform=self.cfg.loss.drop_uniform_groups,
                    estimator=self.cfg.kl_reward.estimator,
                    controller=self.kl_ctl,
                )
            )
        critic_m = self.critic.prepare(plans, self.cfg.loss.gamma, self.cfg.loss.lam, penalties) if self.critic else {}
        if (
            self.cfg.rollout_correction.enable and self.cfg.loss.correction == "decoupled"
        ):  # IS weights and rejection from prox vs behaviour (learner/correction.py)
            stats.update(
                correction.apply(
                    plans,
                    self.cfg.rollout_correction,
                    aggregation=self.cfg.loss.effective_aggregation,
                    loss_scale_factor=self.cfg.loss.loss_scale_factor,
                )
            )
        t_prep = time.perf_counter() - t1
        probe = None
        if not self.probed and self.probe_tolerance is not None:
            probe = logprob_probe.check(self.engine, plans, self.probe_tolerance)
            self.probed = probe is not None  # no fresh token yet: try again next step
        orders = epoch_orders(len(plans), self.cfg.ppo_epochs, step)
        n_opt = sum(len(o) for o in orders)
        parts = []
        warm_up = self.critic is not None and step <= self.critic.warmup_steps  # the critic alone learns
        for order in orders if not warm_up else []:
            for k in order:
                parts.append(self.engine.train_step(plans[k], step_scheduler=len(parts) == n_opt - 1))
        if self.critic is not None:
            critic_m.update(self.critic.train(plans, step))
        m = finalize_metrics(combine_steps(parts)) if parts else {"optimizer_steps": 0.0, "step_skipped": 1.0}
        m.update(probe or {})
        self.version = step
        t2 = time.perf_counter()
        busy = timer.stop()
        # weights unchanged only if every optimizer step of the batch was skipped; the decision is
        # identical on every rank (the same plans; grad norms are all-reduced)
        unchanged = all(p.get("step_skipped", 0.0) for p in parts) and self.on_unchanged is not None
        if unchanged:
            self.publishes_skipped += 1
            self.on_unchanged(self.version)
        elif self.publish is not None:
            self.publish(self.version, self.engine)
        t_pub = time.perf_counter() - t2
        t_train_end_wall = time.time()
        if self.engine.rank == 0:
            self.source.report_version(self.version)
        stale = step - 1 - oldest_versions(batch)
        metrics = {f"learner/{k}": v for k, v in m.items()}
        metrics.update({f"learner/batch_{k}": v for k, v in stats.items()})
        metrics.update(busy)
        metrics.update(critic_m)
        metrics.update(
            {
                "learner/version": float(self.version),
                "learner/staleness_max_versions": float(stale.max()),
                "learner/staleness_mean_versions": float(stale.mean()),
                "learner/pull_seconds": t_pull,
                "learner/proximal_seconds": t_prep,
                "learner/publish_seconds": t_pub,
                # the previous step's checkpoint and HF export, when due: a step's record is written before
                # its own commit (module docstring); summed over a run the steps' totals still cover it all
                "learner/checkpoint_seconds": self.commit_s,
                "learner/publish_skipped": float(unchanged),
                "learner/total_step_seconds": time.perf_counter() - t0 + self.commit_s,
                # the step's training window (after the batch hook, through the publish) and its samples'
                # generation window, in unix seconds: colocated mode's invariant is that they never overlap
                "learner/train_start_unix": t_train_wall,
                "learner/train_end_unix": t_train_end_wall,
                "learner/gen_start_min_unix": float(pc.min(batch.column("t_start")).as_py()),
                "learner/gen_end_max_unix": float(pc.max(batch.column("t_end")).as_py()),
                "learner/prompt_tokens": float(pc.sum(pc.list_value_length(batch.column("prompt_ids"))).as_py()),
                "learner/response_tokens": float(pc.sum(pc.list_value_length(batch.column("response_ids"))).as_py()),
                "learner/samples": float(batch.num_rows),
            }
        )
        self.history.append(metrics)
        if self.engine.rank == 0:
            g = lambda k: metrics.get(k, float("nan"))  # noqa: E731 (a critic warm-up step has no actor loss)
            logger.info(
                "step %d: loss %.5f reward %.3f clip %.3f mismatch_kl %.2e fresh_mismatch_kl %.2e "
                "grad_norm %.3f opt_steps %d (%.2fs)",
                step,
                g("learner/loss_total"),
                g("learner/batch_reward_mean"),
                g("learner/clip_frac"),
                g("learner/mismatch_kl_k3"),
                g("learner/mismatch_kl_k3_fresh"),
                g("learner/grad_norm"),
                int(metrics["learner/optimizer_steps"]),
                metrics["learner/total_step_seconds"],
            )
        if self.on_metrics is not None:
            self.on_metrics(step, metrics)
        self._commit(step, lease)
        if self.on_committed is not None:
            self.on_committed(step)
        return metrics

    def _commit(self, step: int, lease: str | None) -> None:
        """The step's checkpoint and export when due, then its ack: after this the step is never redone."""
        t = time.perf_counter()
        if self.checkpoint_dir is not None and self.cfg.checkpoint_every and step % self.cfg.checkpoint_every == 0:
            self.save()
        if self.cfg.export_every and step % self.cfg.export_every == 0:
            self.export()
        if self.engine.rank == 0:
            self.source.ack(lease)
        self.commit_s = time.perf_counter() - t

    def run(self) -> list[dict[str, Any]]:
        if self.version > 0 and self.publish is not None:
            self.publish(self.version, self.engine)  # engines started from the base model: bring them up to date
        while self.version < self.max_steps:
            self.step()
        if self.checkpoint_dir is not None and self.cfg.checkpoint_every and self.version % self.cfg.checkpoint_every:
            self.save()
        self.export()
        return self.history
