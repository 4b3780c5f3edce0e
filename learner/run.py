"""Starting a learner rank: process group from the environment, engine, resume, loop.

The launcher runs one process per learner rank with the usual torch.distributed
environment (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``) and either calls :func:`run_learner` or runs::

    python -m learner --config RUN_DIR/config/run.yaml [--replay trajectories.arrow]

Example (in-process, e.g. a Ray actor)::

    init_distributed()
    history = run_learner(cfg, source=broker_client, publish=publisher.publish)
"""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist
from pydantic import ConfigDict

from core.configbase import ConfigModel, ModelConfig, RunKeys, build
from learner.config import LearnerConfig
from learner.engine import TrainingEngine
from learner.loop import (
    BatchHook,
    CommittedHook,
    IdleHook,
    Learner,
    MetricsHook,
    PublishHook,
    UnchangedHook,
)
from learner.source import BatchSource, InProcessSource

logger = logging.getLogger(__name__)


class _RunPart(Protocol):
    @property
    def seed(self) -> int: ...
    @property
    def max_steps(self) -> int: ...
    @property
    def run_dir(self) -> str: ...


class LearnerRunLike(Protocol):
    """What :func:`run_learner` reads of the run config (``launch.config.RunConfig`` and
    :class:`LearnerRunConfig` are two)."""

    @property
    def model(self) -> ModelConfig: ...
    @property
    def learner(self) -> LearnerConfig: ...
    @property
    def run(self) -> _RunPart: ...


class _RunKeys(RunKeys):
    """The keys of the ``run`` section a rank reads (the launcher validated the whole section)."""

    model_config = ConfigDict(extra="ignore", frozen=True, validate_default=True)


class LearnerRunConfig(ConfigModel):
    """A learner rank's part of the launcher's ``run.yaml``: the other sections are not its business."""

    model_config = ConfigDict(extra="ignore", frozen=True, validate_default=True)
    model: ModelConfig
    learner: LearnerConfig
    run: _RunKeys = _RunKeys()


class StopRun(Exception):
    """Raised from the ``on_committed`` hook on every rank at the same step (after that step's ack): the
    run stops there, checkpointed and exported (:func:`run_learner`), so a re-run continues from that step."""


def init_distributed(backend: str = "auto", timeout_s: float = 600.0) -> tuple[int, int]:
    """Initialise the default process group from the environment; returns (rank, world_size).

    ``auto`` picks NCCL when CUDA is available, gloo otherwise. A collective that
    waits longer than ``timeout_s`` raises instead of hanging forever.
    """
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE") if k not in os.environ]
    if missing:
        raise RuntimeError(f"learner process needs the torch.distributed environment; missing {missing}")
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    kw = {}
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        kw["device_id"] = torch.device("cuda", local)  # binds the communicator to this GPU (barrier, eager init)
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s), **kw)
    return dist.get_rank(), dist.get_world_size()


def make_engine(lc, model_path: str, *, total_steps: int, seed: int):
    """The training engine ``learner.engine`` names (fsdp | megatron), on this rank."""
    if lc.engine == "fsdp":
        from learner.fsdp import FSDPEngine

        return FSDPEngine(lc, model_path, total_steps=total_steps, seed=seed)
    if lc.engine == "megatron":
        from learner.megatron.engine import MegatronEngine, import_megatron

        import_megatron()  # a clear "pip install fleetrl[megatron]" before anything else happens
        return MegatronEngine(lc, model_path, total_steps=total_steps, seed=seed)
    raise ValueError(f"unknown learner.engine {lc.engine!r}; expected 'fsdp' or 'megatron'")


def run_learner(
    cfg: LearnerRunLike,
    *,
    source: BatchSource | None,
    publish: PublishHook | None = None,
    on_metrics: MetricsHook | None = None,
    batch_timeout_s: float | None = None,
    on_unchanged: UnchangedHook | None = None,
    on_batch: BatchHook | None = None,
    needs_weights: IdleHook | None = None,
    on_committed: CommittedHook | None = None,
    on_engine: Callable[[TrainingEngine], None] | None = None,
) -> list[dict]:
    """Train ``cfg.run.max_steps`` steps (resuming if a checkpoint exists) on this rank.

    ``cfg`` is the run config (see :class:`LearnerRunLike`); the process group must be initialised
    (:func:`init_distributed`). Rank 0 needs ``source``; other ranks may pass None. ``on_engine`` sees the
    engine once it is built (its resolved ``settings`` go into the run's summary).
    Checkpoints go to ``learner.checkpoint_dir`` (default ``RUN_DIR/checkpoints``),
    HF exports to ``RUN_DIR/export/step_XXXXXXXX`` with the symlink ``RUN_DIR/export/latest``. Returns the per-step metrics.
    """
    lc = cfg.learner
    torch.manual_seed(cfg.run.seed)
    run_dir = Path(cfg.run.run_dir)
    engine = make_engine(lc, cfg.model.path, total_steps=cfg.run.max_steps, seed=cfg.run.seed)
    if on_engine is not None:
        on_engine(engine)
    critic = None
    if lc.critic is not None:
        if lc.engine == "megatron":
            from learner.megatron.critic import MegatronCritic as Critic
        else:
            from learner.critic import Critic

        critic = Critic(lc, cfg.model.path, total_steps=cfg.run.max_steps, seed=cfg.run.seed, engine=engine)
    learner = Learner(
        engine,
        lc,
        source=source,
        max_steps=cfg.run.max_steps,
        checkpoint_dir=Path(lc.checkpoint_dir) if lc.checkpoint_dir else run_dir / "checkpoints",
        export_root=run_dir / "export",
        publish=publish,
        on_metrics=on_metrics,
        batch_timeout_s=batch_timeout_s,
        engine_dtype=cfg.model.dtype,
        on_unchanged=on_unchanged,
        on_batch=on_batch,
        needs_weights=needs_weights,
        on_committed=on_committed,
        critic=critic,
    )
    if lc.resume:
        learner.resume()
    try:
        return learner.run()
    except StopRun:
        from learner import checkpoint as ckpt

        done = learner.checkpoint_dir is not None and ckpt.latest(learner.checkpoint_dir)
        if (
            learner.checkpoint_dir is not None
            and lc.checkpoint_every
            and (not done or done.name != ckpt.step_dir(learner.checkpoint_dir, learner.version).name)
        ):
            learner.save()
        learner.export()
        logger.info("stopped at version %d: checkpoint and export written", learner.version)
        raise


def main(argv: list[str] | None = None) -> None:
    import argparse

    import pyarrow as pa
    import yaml

    ap = argparse.ArgumentParser(prog="python -m learner", description="Run one learner rank.")
    ap.add_argument("--config", required=True, help="RUN_DIR/config/run.yaml written by the launcher")
    ap.add_argument("--replay", help="Arrow IPC file of trajectories, one record batch per step (offline training)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cfg = build(LearnerRunConfig, yaml.safe_load(Path(args.config).read_text()))
    rank, _ = init_distributed()
    source = None
    if rank == 0:
        if not args.replay:
            raise SystemExit("no batch source: pass --replay FILE (the broker client is wired by the launcher)")
        with pa.ipc.open_file(args.replay) as f:
            source = InProcessSource([f.get_batch(i) for i in range(f.num_record_batches)])
    try:
        run_learner(cfg, source=source)
    finally:
        dist.destroy_process_group()
