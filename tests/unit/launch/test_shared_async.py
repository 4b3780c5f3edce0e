"""Shared asynchronous mode (colocate.mode=async): flags, config checks, the memory split, busy fractions."""

from __future__ import annotations

import json
import struct

import pytest

from core.configbase import ConfigError
from core.shared_gpu import GiB, ModelShape, check_memory_split, learner_memory, model_shape
from launch.busy import busy_fractions, intersect, length, union
from launch.cluster import resolve_config, run_parser
from launch.config import load_run_config
from launch.shared_gpu import host_split
from rollout_fleet.busy import BusyClock

ASYNC = ["colocate.enabled=true", "colocate.mode=async", "weight_sync.backend=gloo"]


def _args(*argv):
    return resolve_config(run_parser().parse_args(list(argv)))


def test_async_flag_selects_shared_async_and_keeps_the_recipes_bound():
    cfg = _args("--colocate", "--async", "--recipe", "tiny")
    assert cfg.colocate.shared_async and not cfg.colocate.synchronous
    assert cfg.broker.max_staleness == 2  # the tiny recipe's k, not forced to 0
    assert cfg.colocate.label() == "shared-async" and cfg.colocate.sleep_level(cuda=True) == 0
    sync = _args("--colocate", "--recipe", "tiny")
    assert sync.colocate.label() == "colocated-sync" and sync.broker.max_staleness == 0
    assert _args("--recipe", "tiny").colocate.label() == "disaggregated"
    with pytest.raises(ConfigError, match="--async shares the devices"):
        _args("--async", "--recipe", "tiny")


@pytest.mark.parametrize(
    "bad, says",
    [
        ("broker.max_staleness=0", "broker.max_staleness=0"),
        ("colocate.sleep=level1", "never sleep"),
        ("weight_sync.staging=true", "weight_sync.staging"),
        ("weight_sync.backend=nccl", "NCCL between two processes"),
    ],
)
def test_async_config_refuses_what_does_not_fit(bad, says):
    with pytest.raises(ConfigError, match=says):
        load_run_config("tiny", [*ASYNC, bad])


def test_async_keeps_the_correction_rules_of_the_disaggregated_mode():
    with pytest.raises(ConfigError, match="correction='none' is only legal"):
        load_run_config("tiny", [*ASYNC, "learner.loss.correction=none"])
    cfg = load_run_config(
        "tiny", [*ASYNC, "broker.max_staleness=1", "rollout.weight_update=inflight", "learner.loss.correction=tis"]
    )
    assert cfg.rollout.weight_update == "inflight" and cfg.broker.max_staleness == 1


def test_memory_split_refuses_a_split_that_cannot_fit_naming_the_numbers():
    ok = check_memory_split(
        device="GPU 0", total_bytes=80 * GiB, engine_fraction=0.5, learner_bytes=20 * GiB, headroom=0.05
    )
    assert ok.learner_fraction == pytest.approx(0.25)  # 20 / 80 exactly
    assert ok.describe()["free_fraction"] == pytest.approx(0.25, abs=1e-4)  # rounded to 4 places
    with pytest.raises(ValueError) as e:
        check_memory_split(
            device="GPU 0", total_bytes=80 * GiB, engine_fraction=0.8, learner_bytes=20 * GiB, headroom=0.05
        )
    msg = str(e.value)
    assert "engine 0.80" in msg and "20.00 GiB" in msg and "0.25 of 80.0 GiB" in msg and "1.10 > 1" in msg
    assert "<= 0.70" in msg  # the engine fraction that would fit
    with pytest.raises(ValueError, match="the learner alone does not fit"):
        check_memory_split(device="GPU 0", total_bytes=8 * GiB, engine_fraction=0.1, learner_bytes=9 * GiB)
    with pytest.raises(ValueError, match="must be in"):
        check_memory_split(device="GPU 0", total_bytes=8 * GiB, engine_fraction=1.5, learner_bytes=1)


def test_learner_memory_estimate_parts(tmp_path):
    shape = ModelShape(params=100_000_000, hidden=512, layers=10, vocab=1000)
    m = learner_memory(shape, micro_batch_tokens=1000, logprob_chunk=100)
    assert m.states == 1_600_000_000 and m.compute_copy == 200_000_000
    assert m.logits == 3 * 4 * 100 * 1000  # chunked: one chunk of rows
    two = learner_memory(shape, world_size=2, micro_batch_tokens=1000, logprob_chunk=100)
    assert two.states == m.states // 2  # FSDP shards the states
    ckpt = learner_memory(shape, micro_batch_tokens=1000, activation_checkpointing=True)
    assert ckpt.activations < m.activations
    # the tiny model's shape from its own folder: params counted from the safetensors header
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"hidden_size": 8, "num_hidden_layers": 2, "vocab_size": 16}))
    header = json.dumps(
        {
            "a": {"dtype": "F32", "shape": [16, 8], "data_offsets": [0, 512]},
            "b": {"dtype": "F32", "shape": [8], "data_offsets": [512, 544]},
        }
    ).encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(544))
    assert model_shape(folder) == ModelShape(params=136, hidden=8, layers=2, vocab=16)


def test_host_split_on_cpu_checks_the_hosts_memory():
    cfg = load_run_config("tiny", ASYNC)
    (split,) = host_split(cfg, total_bytes=64 * GiB)
    assert split["device"] == "host (CPU)" and split["engine_fraction"] + split["learner_fraction"] < 1
    with pytest.raises(ValueError, match="cannot fit"):
        host_split(cfg, total_bytes=2 * GiB)  # one server's 1 GiB KV cache + overhead alone fill it


def test_busy_clock_merges_nested_and_back_to_back_requests():
    now = [0.0]
    c = BusyClock(clock=lambda: now[0])
    c.enter()
    now[0] = 1.0
    c.enter()
    now[0] = 2.0
    c.exit()
    now[0] = 3.0
    c.exit()  # 0..3 busy
    c.enter()
    now[0] = 5.0
    c.exit()  # starts when the last ended: one stretch
    now[0] = 7.0
    c.enter()
    now[0] = 8.0
    assert c.snapshot() == [(0.0, 5.0), (7.0, 8.0)] and c.busy_s() == 6.0
    c.exit()
    with pytest.raises(RuntimeError):
        c.exit()


def test_busy_fractions_from_steps_and_engine_intervals():
    assert union([(0, 2), (1, 3), (5, 6)]) == [(0, 3), (5, 6)] and length([(0, 2), (1, 3)]) == 3
    assert intersect([(0, 4)], [(1, 2), (3, 6)]) == [(1, 2), (3, 4)]
    # the learner ran from t=100 to t=110: two steps computing 2 s each at 102 and 106
    steps = [
        {"step": 1, "t0_unix": 100.0, "t_unix": 105.0, "train_start_unix": 102.0, "compute_seconds": 2.0},
        {"step": 2, "t0_unix": 100.0, "t_unix": 110.0, "train_start_unix": 106.0, "compute_seconds": 2.0},
    ]
    engines = {"vllm-0": [(95.0, 103.0), (104.0, 107.0)]}  # before the window: clipped
    b = busy_fractions(steps, engines)
    assert b["window_s"] == 10.0 and b["steps_per_s"] == 0.2
    assert b["training_busy_fraction"] == 0.4 and b["training_gpu_busy_fraction"] is None
    assert b["generation_busy_fraction"] == 0.6  # 100..103 and 104..107
    assert b["overlap_fraction"] == 0.2  # 102..103 and 106..107
    gpu = [{**r, "gpu_compute_seconds": 1.5} for r in steps]
    assert busy_fractions(gpu, {})["training_gpu_busy_fraction"] == 0.3
    assert busy_fractions([], engines) is None


def test_bench_shared_cases_and_pmon_parsing():
    import importlib.util
    from pathlib import Path

    bench = Path(__file__).resolve().parents[3] / "bench"
    mods = {}
    for name in ("e2e", "pmon"):
        spec = importlib.util.spec_from_file_location(f"bench_{name}", bench / f"{name}.py")
        mods[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mods[name])
    e2e, pmon = mods["e2e"], mods["pmon"]
    assert e2e.case_args("shared_k2", 1, "decoupled") == [
        "--gpus",
        "1",
        "--async",
        "broker.max_staleness=2",
        "learner.loss.correction=decoupled",
    ]
    assert e2e.case_args("shared_k1", 0, "tis")[:2] == ["--colocate", "--async"]
    with pytest.raises(ValueError, match="unknown case"):
        e2e.case_args("shared_k0", 2, "tis")
    # a pmon file as nvidia-smi writes it: a header, two processes, an idle line
    text = """# gpu         pid   type     sm    mem    enc    dec    jpg    ofa     fb   command
# Idx           #    C/G      %      %      %      %      %      %     MB   name
    0      41000     C     60     20      -      -      -      -   30000   VLLM::EngineCor
    0      42000     C      -      -      -      -      -      -   15000   ray::LearnerAct
    0      41000     C     20      5      -      -      -      -   30000   VLLM::EngineCor
    0      42000     C     70     30      -      -      -      -   15000   ray::LearnerAct
    0          -     -      -      -      -      -      -      -       -   -
"""
    busy = pmon.busy_by_process(pmon.parse(text))
    assert busy["VLLM::EngineCor"] == {"samples": 2, "sm_mean_pct": 40.0, "sm_active_fraction": 1.0, "pids": ["41000"]}
    assert busy["ray::LearnerAct"]["sm_mean_pct"] == 35.0 and busy["ray::LearnerAct"]["sm_active_fraction"] == 0.5


def test_gpu_split_checks_each_gpu_and_records_an_unknown_total():
    from launch.shared_gpu import gpu_split

    cfg = load_run_config("tiny", [*ASYNC, "rollout.gpu_memory_utilization=0.5"])
    (ok,) = gpu_split(cfg, [("GPU 0", 80 * GiB)])
    assert ok["device"] == "GPU 0" and ok["engine_fraction"] == 0.5 and ok["learner_fraction"] < 0.1
    with pytest.raises(ValueError, match=r"GPU 3: shared async mode cannot fit: engine 0.50"):
        gpu_split(cfg, [("GPU 0", 80 * GiB), ("GPU 3", 2 * GiB)])  # 1 GiB context alone is half of it
    skipped, checked = gpu_split(cfg, [("GPU 0", None), ("GPU 1", 80 * GiB)])
    assert "nvidia-smi not found" in skipped["skipped"] and checked["device"] == "GPU 1"
    stated = load_run_config("tiny", [*ASYNC, "rollout.gpu_memory_utilization=0.5", "colocate.learner_memory_gb=45"])
    with pytest.raises(ValueError, match="learner 45.00 GiB"):
        gpu_split(stated, [("GPU 0", 80 * GiB)])
