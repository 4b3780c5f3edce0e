"""The whole system on 2 GPUs (1 learner, 1 rollout server) for a few steps, once per engine and learner.

``python launch/cluster.py --rollout-gpus 1 --learner-gpus 1 --recipe gpu-tiny --max-steps 3``
as a subprocess with a limit, then its JSON summary: every step done, no group lost, the
staleness bound held, and every step's weights reached the server over NCCL (the
publisher's count and the version the fleet saw on the server).

vLLM and SGLang live in separate install targets on the GPU machine (see
notes/full-system-gpu-runbook.md), so each case is skipped unless its engine is importable.
The learner is FSDP2 (``learner.engine=fsdp``, the recipe's) or Megatron-core TP=1
(``learner.engine=megatron``, case ``vllm-megatron``; needs megatron-core). Output (summary,
logs) stays under $FLEETRL_SYSTEM_OUT/<case> when set (case = engine, or engine-learner).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(480)]

REPO = Path(__file__).resolve().parents[2]
STEPS = 3
LIMIT_S = 360  # measured parts: vLLM eager start ~30-60 s, SGLang ~113 s, steps seconds each


def _need(engine: str, learner: str) -> None:
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs (1 learner, 1 rollout server)")
    for mod in ("ray", engine) + (("megatron", "megatron.core") if learner == "megatron" else ()):
        if importlib.util.find_spec(mod) is None:
            pytest.skip(f"{mod} is not importable here (engines are installed in separate targets)")


def _run_cluster(engine: str, learner: str, out: Path, extra: tuple[str, ...] = ()) -> tuple[int, str, dict | None]:
    summary = out / "summary.json"
    cmd = [
        sys.executable,
        str(REPO / "launch" / "cluster.py"),
        "--rollout-gpus",
        "1",
        "--learner-gpus",
        "1",
        "--recipe",
        "gpu-tiny",
        "--max-steps",
        str(STEPS),
        "--summary",
        str(summary),
        "--no-live",
        "--run-dir",
        str(out / "run"),
        f"rollout.engine={engine}",
        f"learner.engine={learner}",
        *extra,
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    log_path = out / "cluster.log"
    with open(log_path, "wb") as logf:
        # own session: on timeout the driver gets SIGINT (its clean shutdown), then the group SIGKILL
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(LIMIT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
            rc = -1
    text = log_path.read_text(errors="replace")
    return rc, text, json.loads(summary.read_text()) if summary.exists() else None


@pytest.mark.parametrize(
    "engine,learner,staged",
    [
        pytest.param("vllm", "fsdp", False, id="vllm"),
        pytest.param("sglang", "fsdp", False, id="sglang"),
        pytest.param("vllm", "megatron", False, id="vllm-megatron"),  # Megatron-core TP=1 learner on GPU 0
        pytest.param("vllm", "fsdp", True, id="vllm-staged"),  # weight_sync.staging: receives while serving
        pytest.param("sglang", "fsdp", True, id="sglang-staged"),  # through fleetrl's loader in SGLang's worker
    ],
)
def test_full_system_two_gpus(engine, learner, staged, tmp_path):
    _need(engine, learner)
    base = os.environ.get("FLEETRL_SYSTEM_OUT")
    case = (engine if learner == "fsdp" else f"{engine}-{learner}") + ("-staged" if staged else "")
    out = Path(base) / case if base else tmp_path
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    rc, text, s = _run_cluster(engine, learner, out, ("weight_sync.staging=true",) if staged else ())
    wall = time.monotonic() - t0
    print(f"--- {case}: rc {rc} in {wall:.0f} s; tail of the driver's output:")
    print("\n".join(text.splitlines()[-30:]))
    print(f"--- {case} summary:\n{json.dumps(s, indent=2)}")
    assert rc == 0 and s is not None, f"{case}: cluster.py rc={rc} (limit {LIMIT_S} s); logs in {out / 'run'}"
    assert s["error"] is None, s["error"]
    assert s["steps"] == STEPS, s["steps"]
    assert s["learner_gpus"] == 1 and s["rollout_gpus"] == 1 and s["servers_at_end"] == 1
    assert s["groups_lost"] == 0, s
    assert s["groups_consumed"] >= STEPS * 16 - 1, s["groups_consumed"]  # groups_per_step 16 in gpu-tiny
    assert s["max_staleness_seen"] is not None and s["max_staleness_seen"] <= s["max_staleness"], s
    assert s["bound_violations"] == 0, s
    # every step was published into the server over NCCL, and the fleet saw the server at the last version
    assert s["publish_errors"] == 0, s
    assert s["publishes"] == STEPS and s["last_published_version"] == STEPS, s
    assert [st["version"] for st in s["server_states_at_end"]] == [STEPS], s["server_states_at_end"]
    assert s["eval_accuracy_before"] is not None and s["eval_accuracy_after"] is not None
