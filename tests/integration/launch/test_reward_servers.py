"""``--reward-gpus`` on CPU through launch/cluster.py: the launcher starts a real vLLM CPU server with the
tiny model as the judge, hands its URL to the fleet's judge client, and stops it at the end; the same
run starts the OpenAI-compatible proxy (``rollout.proxy``), which a stock ``openai`` client calls while
the run goes on.

The tiny model is no grader, so the judge's "verdict" is the first digit of its answer to
``<response>+0=`` and each digit has a reward no Python reward function of the run gives
(0.05, 0.15, ..., 0.95): a reward of that set in the broker's spool came from the judge.
One run, one vLLM start each for the policy and the judge (they start side by side).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from procs import alive, descendants

REPO = Path(__file__).resolve().parents[3]
SCORES = {str(d): round(0.05 + 0.1 * d, 2) for d in range(10)}
pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


@pytest.fixture(scope="module")
def judged_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("judge")
    judge = {
        "kind": "judge",
        "model": "tiny-judge",
        "template": "{response}+0=",
        "verdict": r"(\d)",
        "scores": SCORES,
        "max_tokens": 4,
        "timeout_s": 30,
        "server": {"max_model_len": 64, "enforce_eager": True},
    }
    cmd = [
        sys.executable,
        "launch/cluster.py",
        "--rollout-gpus",
        "0",
        "--learner-gpus",
        "0",
        "--reward-gpus",
        "1",
        "--recipe",
        "tiny",
        "--max-steps",
        "3",
        "--run-dir",
        str(run_dir),
        "--no-live",
        "--summary",
        str(run_dir / "out.json"),
        "run.eval_samples=0",
        f"reward.model={json.dumps(judge)}",
        "rollout.proxy={port: 0, max_tokens: 4}",
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    proxy_seen = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if "OpenAI-compatible proxy:" in line:
                proxy_seen.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    children: set[int] = set()
    answer = None
    try:
        while proc.poll() is None:
            children |= descendants(proc.pid)
            if proxy_seen.is_set() and answer is None:  # the run goes on: call its proxy like any agent would
                import openai

                url = re.search(r"OpenAI-compatible proxy: (\S+)/v1", "".join(lines)).group(1)
                client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=60.0, max_retries=0)
                answer = client.chat.completions.create(
                    model="tiny-adder", max_tokens=4, temperature=0.0, messages=[{"role": "user", "content": "12+35="}]
                )
            time.sleep(0.5)
        reader.join(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    wall = time.monotonic() - t0
    time.sleep(2.0)
    left = alive(children)
    out = "".join(lines)
    summary_path = run_dir / "out.json"
    return {
        "rc": proc.returncode,
        "out": out,
        "run_dir": run_dir,
        "answer": answer,
        "left": left,
        "wall_s": wall,
        "summary": json.loads(summary_path.read_text()) if summary_path.exists() else None,
    }


def test_the_judge_server_scored_and_its_rewards_reached_the_broker(judged_run):
    r = judged_run
    assert r["rc"] == 0, r["out"][-3000:]
    s = r["summary"]
    assert s["steps"] == 3 and s["reward_gpus"] == 1
    (srv,) = s["reward_servers"]
    assert srv["engine"] == "vllm" and srv["served_model_name"] == "tiny-judge" and srv["pid"]
    assert f"reward server 0 (vllm, serving 'tiny-judge'): {srv['url']}" in r["out"]
    rm = s["reward_model"]
    assert rm["calls_ok"] > 0, rm
    per = rm["servers"][srv["url"]]
    assert per["requests_ok"] == rm["calls_ok"] and per["latency_s_mean"] > 0 and per["latency_s_p95"] > 0

    from broker.spool import read_segments

    batches, _ = read_segments(r["run_dir"] / "spool")
    rewards = [x for b in batches for x in b.column("reward").to_pylist()]
    assert rewards, "the broker spooled no trajectories"
    judge_values = set(SCORES.values())
    assert all(round(x, 2) in judge_values for x in rewards), sorted(set(rewards))[:20]
    assert len(rewards) <= rm["calls_ok"]  # one judge answer per sample (failed groups never pushed)


def test_the_proxy_served_an_openai_client_during_the_run(judged_run):
    r = judged_run
    assert r["answer"] is not None, "the proxy's address was never printed"
    assert r["answer"].choices[0].message.content is not None and r["answer"].usage.completion_tokens >= 1
    proxy = r["summary"]["proxy"]
    assert proxy["url"].startswith("http://127.0.0.1:")
    assert proxy["proxy/requests"] >= 1 and proxy["proxy/unrecorded_requests"] >= 1


def test_nothing_outlives_the_run(judged_run):
    r = judged_run
    assert not psutil.pid_exists(r["summary"]["reward_servers"][0]["pid"])
    assert r["left"] == [], r["left"]
