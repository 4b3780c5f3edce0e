"""Shared pieces of the learner tests: a tiny real Qwen2 folder, synthetic trajectories, process launching.

Used by the tests and by learner_worker.py (a real learner rank started as a subprocess).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import traceback
from pathlib import Path

import numpy as np

from core.http_client import free_port

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
VOCAB = 96


def make_tiny_model(out: Path, seed: int = 0, tie: bool = False) -> Path:
    """A random 2-layer Qwen2 saved as an HF folder (with a small word-level tokenizer)."""
    import torch
    from tokenizers import Tokenizer, models
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config

    torch.manual_seed(seed)
    cfg = Qwen2Config(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        intermediate_size=128,
        vocab_size=VOCAB,
        max_position_embeddings=256,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(out)
    vocab = {f"t{i}": i for i in range(VOCAB)}
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t3")),
        pad_token="t0",
        bos_token="t1",
        eos_token="t2",
        unk_token="t3",
    )
    tok.save_pretrained(out)
    return out


def join_gloo(rank: int, world_size: int, port: int, timeout_s: float = 120) -> None:
    """One forked test rank: the rendezvous environment, one thread, and the gloo default group."""
    import torch

    from learner.run import init_distributed

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    init_distributed("gloo", timeout_s=timeout_s)


def make_batches(n_steps: int, groups: int = 4, group_size: int = 4, seed: int = 0):
    """Synthetic step batches in the trajectory schema: varied lengths, one all-equal group per step."""
    from broker.schema import Trajectory, to_record_batch

    rng = np.random.default_rng(seed)
    out = []
    for step in range(1, n_steps + 1):
        trajs = []
        for g in range(groups):
            prompt = rng.integers(3, VOCAB, size=int(rng.integers(2, 9))).tolist()
            uniform = g == groups - 1
            for i in range(group_size):
                n = int(rng.integers(1, 12))
                trajs.append(
                    Trajectory(
                        traj_id=f"s{step}g{g}/{i}",
                        group_id=f"s{step}g{g}",
                        sample_index=i,
                        group_size=group_size,
                        step=step,
                        prompt_ids=prompt,
                        response_ids=rng.integers(3, VOCAB, size=n).tolist(),
                        # Near the tiny model's own log-probs (about -log 96 = -4.56), so weights are not all capped.
                        behaviour_logprobs=(-4.56 + rng.normal(0, 0.3, size=n)).clip(max=0).tolist(),
                        segment_starts=[0],
                        segment_versions=[max(0, step - 2)],
                        reward=1.0 if uniform else float(rng.integers(0, 2)) + 0.1 * i,
                        finish_reason="stop",
                        engine_id="test",
                        data_source="synthetic",
                    )
                )
        out.append(to_record_batch(trajs))
    return out


def write_batches(path: Path, batches) -> Path:
    import pyarrow as pa

    with pa.ipc.new_file(str(path), batches[0].schema) as w:
        for b in batches:
            w.write_batch(b)
    return path


def read_batches(path: str | Path) -> list:
    """The step batches :func:`write_batches` wrote, in order."""
    import pyarrow as pa

    with pa.ipc.open_file(str(path)) as f:
        return [f.get_batch(i) for i in range(f.num_record_batches)]


def ppo_critic_config(**extra) -> dict:
    """The learner config of the critic's warm-up and checkpoint/resume tests (FSDP on CPU, Megatron on CPU and
    GPU): GAE with gamma, lam < 1, one critic warm-up step, a checkpoint every 2 steps, two mini-batches of the
    4 groups a step; ``extra`` adds top-level keys (the engine, its layout)."""
    return {
        "loss": {"correction": "decoupled", "advantage": "gae", "gamma": 0.99, "lam": 0.95},
        "critic": {
            "optim": {"lr": 1e-3, "warmup_steps": 1, "schedule": "cosine"},
            "warmup_steps": 1,
            "cliprange_value": 0.2,
        },
        "micro_batch_tokens": 48,
        "checkpoint_every": 2,
        "ppo_mini_batch_size": 2,
        "optim": {"lr": 1e-3, "warmup_steps": 1, "eps": 1e-5},
        "logprob_probe_tolerance": None,
        **extra,
    }


def _rank_main(rank: int, world_size: int, port: int, kw: dict) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        OMP_NUM_THREADS="1",
    )
    logging.basicConfig(level=logging.INFO, format=f"[rank {rank}] %(name)s %(levelname)s %(message)s")
    worker(rank=rank, **kw)


def run_ranks(world_size: int, timeout: float = 120.0, start_method: str = "fork", **kw) -> list[dict]:
    """Run ``world_size`` learner ranks as real processes (gloo) and return each rank's result.

    The processes are forked from the test process, which has torch and
    transformers imported already (a fresh interpreter spends 10-20 s importing
    them on a loaded 2-core machine); each is still a separate process with its
    own process group, model and optimizer, and state crosses only through disk.
    GPU tests pass ``start_method="spawn"`` (CUDA does not survive a fork).
    """
    import torch

    torch.set_num_threads(1)
    run_procs(_rank_main, world_size, kw, timeout, start_method)
    return [json.loads(Path(f"{kw['out']}.rank{r}").read_text()) for r in range(world_size)]


def _exit_when_done(target, rank: int, world_size: int, port: int, kw: dict) -> None:
    """One rank process: run ``target``, print its traceback if it fails, and leave through ``os._exit``
    (exit code 0 or 1), so no atexit hook or stuck non-daemon thread of a half-torn-down process group
    can hang the exit. transformers loads weights on a thread pool unless told not to; in a forked rank those
    threads may meet torch's thread pool as the fork left it, invalid ("Invalid thread pool!", seen once), so
    the ranks load on their own thread."""
    os.environ["HF_DEACTIVATE_ASYNC_LOAD"] = "1"
    try:
        target(rank, world_size, port, kw)
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)
    os._exit(0)


def run_procs(target, world_size: int, kw: dict, timeout: float, start_method: str, extra=()) -> None:
    """Run ``target(rank, world_size, port, kw)`` in ``world_size`` processes that rendezvous on one free
    port; fail naming the ranks that did not finish or exited non-zero. Leftovers (and ``extra``
    processes) are killed on the way out."""
    import multiprocessing as mp

    ctx = mp.get_context(start_method)
    port = free_port()
    procs = [
        ctx.Process(target=_exit_when_done, args=(target, r, world_size, port, kw), daemon=True)
        for r in range(world_size)
    ]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
            if p.exitcode is None:
                raise AssertionError(f"rank pid {p.pid} did not finish within {timeout}s")
        bad = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode != 0]
        if bad:
            raise AssertionError(f"ranks failed (rank, exit code): {bad}; see the captured log")
    finally:
        for p in list(procs) + list(extra):
            if p.is_alive():
                p.kill()
                p.join(5)


def worker(
    *,
    rank: int,
    model: str,
    data: str,
    out: str,
    steps: int,
    total_steps: int | None = None,
    correction: str = "decoupled",
    aggregation: str = "token",
    micro_tokens: int = 64,
    kl_coef: float = 0.0,
    ckpt: str | None = None,
    checkpoint_every: int = 0,
    export: str | None = None,
    dump_at: tuple[int, ...] = (),
    dump_path: str | None = None,
    activation_checkpointing: bool = False,
    backend: str = "gloo",
    mini_batch: int | None = None,
    epochs: int = 1,
    recompute_proximal: bool = False,
    lr: float = 1e-3,
    loss_extra: dict | None = None,
    learner_extra: dict | None = None,
) -> None:
    """One learner rank: FSDP2 engine + loop on an in-process source; writes ``out.rank{r}`` (JSON).

    ``dump_at``: versions whose full weights rank 0 writes to ``dump_path.format(version=v)``
    from inside the publish hook (what a publisher would send).
    """
    import pyarrow as pa
    import torch

    from learner.config import LearnerConfig
    from learner.fsdp import FSDPEngine
    from learner.loop import Learner
    from learner.run import init_distributed
    from learner.source import InProcessSource

    init_distributed(backend, timeout_s=120)
    cfg = LearnerConfig.model_validate(
        {
            "loss": {"correction": correction, "aggregation": aggregation, "kl_coef": kl_coef, **(loss_extra or {})},
            "optim": {
                "lr": lr,
                "warmup_steps": 1,
                "schedule": "cosine",
                "grad_clip": 1.0,
                "weight_decay": 0.01,
                # Adam's first step is ~lr * g / (|g| + eps): with the default 1e-8 a gradient that is zero up
                # to rounding (contributions cancelling inside a GRPO group) becomes a step of random sign.
                # 1e-5 (far below the typical |g| ~ 1e-3 here) keeps the update a smooth function of the
                # gradient, so weights of 1-rank and 2-rank runs can be compared.
                "eps": 1e-5,
            },
            "micro_batch_tokens": micro_tokens,
            "checkpoint_every": checkpoint_every,
            "activation_checkpointing": activation_checkpointing,
            "ppo_mini_batch_size": mini_batch,
            "ppo_epochs": epochs,
            "recompute_proximal": recompute_proximal,
            "logprob_probe_tolerance": None,  # synthetic behaviour log-probs (make_batches), not a model's
            **(learner_extra or {}),
        }
    )
    engine = FSDPEngine(cfg, model, total_steps=total_steps or steps, seed=0)
    # Count executions of one MLP (forward hooks do not fire in checkpoint recomputes, a wrapper does).
    mlp_calls = [0]
    mlp = engine.model.model.layers[0].mlp
    inner = mlp.forward

    def counted(*a, **k):
        mlp_calls[0] += 1
        return inner(*a, **k)

    mlp.forward = counted
    source = None
    if rank == 0:
        with pa.ipc.open_file(data) as f:
            source = InProcessSource([f.get_batch(i) for i in range(f.num_record_batches)])
    published: list[int] = []

    def publish(version: int, eng) -> None:
        # Every rank drains the gathers, as a real publisher must; rank 0 keeps the tensors.
        full = {n: t.clone() for b in eng.iter_full_params(1 << 16) for n, t in b}
        plan = [(n, list(t.shape), t.dtype) for n, t in full.items()]
        if plan != eng.param_plan():
            raise AssertionError("full tensors do not follow param_plan()")
        published.append(version)
        if version in dump_at and rank == 0:
            from safetensors.torch import save_file

            save_file(full, dump_path.format(version=version))

    learner = Learner(
        engine,
        cfg,
        source=source,
        max_steps=steps,
        checkpoint_dir=Path(ckpt) if ckpt else None,
        export_root=Path(export) if export else None,
        publish=publish,
    )
    resumed = learner.resume()
    history = learner.run()
    result = {
        "history": history,
        "version": learner.version,
        "resumed": resumed,
        "published": published,
        "mlp_calls": mlp_calls[0],
        "acked": source.acked_step if source else None,
        "reported": source.versions if source else None,
    }
    Path(f"{out}.rank{rank}").write_text(json.dumps(result))
    torch.distributed.destroy_process_group()
