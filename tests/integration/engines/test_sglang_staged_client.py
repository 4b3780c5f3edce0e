"""SGLangWeightClient's staged updates on CPU, against a stand-in of SGLang's server (sglang_standin.py).

The publisher, the client, fleetrl's loader, its group (gloo) and store are the real ones; the
stand-in plays SGLang's HTTP server and scheduler (SGLang has no CPU build; the real server is
tests/gpu/test_sglang_gpu.py). Checked: the bytes arrive and the model holds them; a commit runs
between two batches with ``between_steps`` and through the loader in a freeze without it, or when
no batch runs; a failed commit leaves the engine paused, and the next good one resumes it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from health import wait_healthy  # tests/support (pyproject: pytest pythonpath)
from sglang_standin import state

from core.http_client import EngineError, free_port
from engines.sglang.weights import SGLangWeightClient
from weight_sync.config import WeightSyncConfig
from weight_sync.plan import build_plan
from weight_sync.publisher import Publisher

REPO = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.timeout(180)


@pytest.fixture()
def standin(tmp_path):
    port = free_port()
    log = open(tmp_path / "standin.log", "w")
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "tests" / "support" / "sglang_standin.py"), "--port", str(port)],
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
    )
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc, tmp_path / "standin.log", "the SGLang stand-in")
    yield url
    proc.kill()
    proc.wait(10)


def _held(url: str) -> dict:
    st = httpx.get(url + "/state", timeout=10).json()
    return {
        "paused": st["paused"],
        "forwards": st["forwards"],
        **{k: torch.tensor(v) for k, v in st["tensors"].items()},
    }


def _assert_holds(url: str, state: dict[str, torch.Tensor]) -> None:
    held = _held(url)
    assert torch.equal(held["qkv"], torch.cat([state["q"], state["k"], state["v"]]))
    assert torch.equal(held["norm"][:8], state["norm"]) and held["norm"][8] == 0


@pytest.mark.parametrize("between_steps", [True, False], ids=["between-steps", "freeze"])
def test_staged_publishes_into_a_serving_engine(standin, between_steps):
    states = {v: state(v) for v in range(1, 5)}
    plan = build_plan([(n, list(t.shape), t.dtype) for n, t in states[1].items()], bucket_bytes=200)
    assert len(plan.buckets) > 1
    client = SGLangWeightClient(
        "standin", standin, staging=True, between_steps=between_steps, timeout_s=60, control_timeout_s=30
    )
    pub = Publisher(
        WeightSyncConfig(backend="gloo", staging=True, nccl_impl="torch", timeout_s=30),
        plan,
        rank=0,
        engines=[client],
        device="cpu",
    )
    try:
        httpx.post(standin + "/busy", json={"busy": True}, timeout=10)
        for v in (1, 2):  # the second commit replays the copies recorded by the first
            rep = pub.publish(v, iter(states[v].items()))
            steps = client.last_update_steps
            assert rep.per_engine_checksums == {"standin": rep.checksum}
            assert steps["commit_between_steps"] == float(between_steps), steps
            assert steps["commit_replayed"] == (0 if v == 1 else len(plan.buckets)), steps
            _assert_holds(standin, states[v])
            assert not _held(standin)["paused"]
        httpx.post(standin + "/busy", json={"busy": False}, timeout=10)
        rep = pub.publish(3, iter(states[3].items()))  # idle: no forward to commit before
        assert client.last_update_steps["commit_between_steps"] == 0.0
        _assert_holds(standin, states[3])

        # A commit that fails (nothing staged for v9) leaves the engine paused; the next publish resumes it.
        with pytest.raises(EngineError, match="stays paused"):
            pub.call(client.commit_update(9), 60, "commit of an unstaged version")
        assert _held(standin)["paused"]
        httpx.post(standin + "/busy", json={"busy": True}, timeout=10)
        forwards = _held(standin)["forwards"]
        time.sleep(0.2)
        assert _held(standin)["forwards"] == forwards, "a paused engine ran a batch"
        rep = pub.publish(4, iter(states[4].items()))
        assert rep.per_engine_checksums == {"standin": rep.checksum}
        _assert_holds(standin, states[4])
        assert not _held(standin)["paused"]
    finally:
        pub.close()
