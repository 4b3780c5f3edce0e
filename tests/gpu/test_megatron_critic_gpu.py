"""PPO with the Megatron critic (learner/megatron/critic.py) beside the Megatron actor: on one GPU (DP=1), and on
2 GPUs (NCCL; DP=2 with the distributed optimizer, and TP=2) where the machine has them. A critic warm-up step,
PPO steps, a checkpoint/resume of actor + critic.

One uninterrupted 4-step run checkpoints at steps 2 and 4; a fresh pair of processes resumes from a copy of the
step-2 checkpoint alone and must give steps 3 and 4 again: step 3's values come from the restored critic
weights, its critic update from the restored optimizer state and schedule, step 4 shows that update. The CPU
half (values and gradients against transformers' value model) is tests/integration/learner/
test_megatron_critic_cpu.py; megatron-core's optimizer and schedule need CUDA, hence this file.

    NCCL_NVLS_ENABLE=0 pytest -m gpu -s tests/gpu/test_megatron_critic_gpu.py
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO / "tests" / "support"))
import megatron_worker as mw  # noqa: E402
from learner_testkit import (  # noqa: E402
    make_batches,
    make_tiny_model,
    ppo_critic_config,
    read_batches,
    run_procs,
    write_batches,
)

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("megatron.core", reason="needs megatron-core (pip install fleetrl[megatron])")
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("NCCL_CUMEM_ENABLE", "0")

STEPS = 4
KEYS = (
    "critic/values_mean",  # the restored critic's values, before the step's first update
    "critic/vf_loss",
    "critic/vf_clipfrac",
    "critic/vpred_mean",
    "critic/grad_norm",
    "critic/lr",
    "critic/vf_explained_var",
    "critic/returns_mean",
    "critic/advantages_mean",
    "learner/loss_total",
    "learner/grad_norm",
)


def _rank(rank: int, world: int, port: int, kw: dict) -> None:
    import torch.distributed as dist

    from learner.config import LearnerConfig
    from learner.loop import Learner
    from learner.megatron.critic import MegatronCritic
    from learner.megatron.engine import MegatronEngine
    from learner.source import InProcessSource

    torch.cuda.set_device(rank)
    mw._init(rank, world, port)
    cfg = LearnerConfig.model_validate(
        ppo_critic_config(engine="megatron", megatron={"tensor_model_parallel_size": kw["tp"]})
    )
    engine = MegatronEngine(cfg, kw["model"], total_steps=STEPS, seed=0)
    critic = MegatronCritic(cfg, kw["model"], total_steps=STEPS, seed=0, engine=engine)
    values_dtype = []
    value = critic.values

    def record(mb, *, grad=False):
        v = value(mb, grad=grad)
        values_dtype.append(str(v.dtype))
        return v

    critic.values = record
    source = None
    if rank == 0:
        source = InProcessSource(read_batches(kw["data"]))
    published: list[int] = []
    learner = Learner(
        engine,
        cfg,
        source=source,
        max_steps=STEPS,
        checkpoint_dir=Path(kw["ckpt"]),
        publish=lambda v, e: published.append(v),
        on_unchanged=lambda v: published.append(-v),
        critic=critic,
    )
    resumed = learner.resume()
    history = learner.run()
    Path(kw["out"], f"rank{rank}.json").write_text(
        json.dumps(
            {"history": history, "resumed": resumed, "published": published, "dtypes": sorted(set(values_dtype))}
        )
    )
    dist.barrier()
    dist.destroy_process_group()


def _run(d: Path, name: str, model: Path, data: Path, ckpt: Path, world: int, tp: int) -> list[dict]:
    out = d / name
    out.mkdir()
    kw = dict(model=str(model), data=str(data), out=str(out), ckpt=str(ckpt), tp=tp)
    run_procs(_rank, world, kw, 250, "spawn")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.parametrize(("world", "tp"), [(1, 1), (2, 1), (2, 2)], ids=["dp1", "dp2", "tp2"])
def test_megatron_ppo_critic_warm_up_and_resume(tmp_path, world, tp):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, found {torch.cuda.device_count()}")
    model = mw.bf16_model(make_tiny_model(tmp_path / "src", seed=3), tmp_path / "model")
    data = write_batches(tmp_path / "data.arrow", make_batches(STEPS, groups=4, group_size=2))
    straight = _run(tmp_path, "straight", model, data, tmp_path / "ckpt", world, tp)
    shutil.copytree(tmp_path / "ckpt" / "step_00000002", tmp_path / "ckpt_resume" / "step_00000002")
    resumed = _run(tmp_path, "resumed", model, data, tmp_path / "ckpt_resume", world, tp)
    h = straight[0]["history"]
    for x in h:
        print({k: x.get(k) for k in KEYS + ("learner/optimizer_steps", "critic/optimizer_steps")})
    assert straight[0]["dtypes"] == ["torch.float32"]  # values in fp32 from the bf16 model
    assert [int(x["learner/version"]) for x in h] == [1, 2, 3, 4]
    assert h[0]["learner/optimizer_steps"] == 0 and straight[0]["published"] == [-1, 2, 3, 4]  # critic warm-up
    assert all(x["critic/optimizer_steps"] == 2 and x["critic/grad_norm"] > 0 for x in h)
    assert h[-1]["critic/vf_loss"] < h[0]["critic/vf_loss"], [x["critic/vf_loss"] for x in h]
    assert (tmp_path / "ckpt" / "step_00000002" / "critic" / "scheduler.json").exists()
    r = resumed[0]
    assert r["resumed"] and [int(x["learner/version"]) for x in r["history"]] == [3, 4]
    for a, b in zip(h[2:], r["history"], strict=True):  # every metric side by side, for a failure's diagnosis
        for k in sorted(set(a) | set(b)):
            if a.get(k) != b.get(k):
                print(f"step {int(a['learner/version'])} {k}: straight {a.get(k)} resumed {b.get(k)}")
    # Same GPUs, layout and data; weights, optimizer states and schedules restored from the checkpoint: the
    # tolerances of the engine's own resume check (tests/gpu/test_megatron_gpu.py), for GPU kernels whose
    # reductions may not be bitwise repeatable between processes.
    for a, b in zip(h[2:], r["history"], strict=True):
        for k in KEYS:
            assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-6), (k, a[k], b[k])
