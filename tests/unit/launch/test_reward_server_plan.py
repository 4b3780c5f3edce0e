"""``--reward-gpus``: placement, the dry-run plan, config errors at start, and the reward-model client over
several servers (balancing, failover, per-server rates and latency, readiness) on real local sockets."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
from aiohttp import web

from core.configbase import ConfigError
from launch.cluster import resolve_config, run_parser
from launch.config import load_run_config
from launch.dry_run import described_nodes, plan
from launch.monitor import format_status
from launch.placement import NodeGPUs, PlacementError, plan_placement
from launch.snapshot import JobSnapshot
from learner.status import LearnerStatus
from rollout_fleet.envs.agent_worker import resolve_agent
from rollout_fleet.reward_models import JudgeClient, RewardModelError
from rollout_fleet.status import FleetStatus

REPO = Path(__file__).resolve().parents[3]
JUDGE = "reward.model={kind: judge, model: j}"
pytestmark = pytest.mark.timeout(60)


def test_reward_servers_get_their_own_gpus_after_the_rollout_servers_tp_inside_a_node():
    p = plan_placement([NodeGPUs("a", 4), NodeGPUs("b", 4)], learner_gpus=4, rollout_gpus=2, reward_gpus=2, reward_tp=2)
    assert [(s.node_id, s.gpu_ids) for s in p.rewards] == [("b", (2, 3))]
    used = p.all_gpus()
    assert len(used) == len(set(used)) == 8 and p.reward_gpus() == 2
    with pytest.raises(PlacementError, match="1 reward server.*TP 2 do not fit"):  # 1 + 1 free, not 2 in one node
        plan_placement([NodeGPUs("a", 3), NodeGPUs("b", 3)], learner_gpus=1, rollout_gpus=1, reward_gpus=4, reward_tp=2)
    with pytest.raises(PlacementError, match="--reward-gpus 3 is not a multiple"):
        plan_placement([NodeGPUs("a", 8)], learner_gpus=1, rollout_gpus=1, reward_gpus=3, reward_tp=2)
    with pytest.raises(PlacementError, match=r"\+ 2 reward GPUs = 6, but the cluster has 4"):
        plan_placement([NodeGPUs("a", 4)], learner_gpus=2, rollout_gpus=2, reward_gpus=2)


def test_dry_run_shows_reward_servers_on_gpus_and_on_cpu_and_the_proxy():
    cfg = load_run_config(
        "tiny",
        ["reward.model={kind: judge, model: j, server: {tensor_parallel_size: 2}}", "rollout.proxy={port: 8100}"],
    )
    out = plan(cfg, described_nodes("4,4"), {}, rollout_gpus=2, learner_gpus=2, reward_gpus=4, address=None)
    assert [(s["node"], s["gpus"]) for s in out["reward_servers"]] == [("n1", [0, 1]), ("n1", [2, 3])]
    assert out["proxy"].startswith("127.0.0.1:8100")
    cpu = plan(
        load_run_config("tiny", [JUDGE]),
        described_nodes("0"),
        {},
        rollout_gpus=0,
        learner_gpus=0,
        reward_gpus=2,
        address=None,
    )
    assert [s["node"] for s in cpu["reward_servers"]] == ["driver's node (CPU)"] * 2
    p = subprocess.run(
        [
            sys.executable,
            "launch/cluster.py",
            "--dry-run",
            "--nodes",
            "8",
            "--rollout-gpus",
            "2",
            "--learner-gpus",
            "2",
            "--reward-gpus",
            "1",
            JUDGE,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0, p.stderr
    assert "reward server 0   on n0: GPUs [4] (vllm, " in p.stdout


def _resolve(*argv: str):
    return resolve_config(run_parser().parse_args(list(argv)))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--reward-gpus", "1"], "--reward-gpus 1 starts reward servers, but reward.model is not set"),
        ([JUDGE], "reward.model is set but has no server: give reward.model.url"),
        (
            ["--reward-gpus", "1", "reward.model={kind: judge, model: j, url: 'http://10.0.0.5:8001'}"],
            "either attach to running reward servers .url. or let the launcher start them",
        ),
        (
            ["--reward-gpus", "1", "reward.model={kind: judge, model: j, server: {engine: sglang}}"],
            "engine=sglang needs GPUs",
        ),
        (
            [
                "--rollout-gpus",
                "2",
                "--learner-gpus",
                "2",
                "--reward-gpus",
                "3",
                "reward.model={kind: judge, model: j, server: {tensor_parallel_size: 2}}",
            ],
            "--reward-gpus 3 is not a multiple",
        ),
        (["--reward-gpus", "-1", JUDGE], "--reward-gpus must be >= 0"),
        (
            ["--reward-gpus", "1", "reward.model={kind: judge, model: j, server: {model_path: models/none}}"],
            "reward.model.server.model_path: model.path 'models/none'",
        ),
        (
            ["--recipe", "agents-tiny", "reward.model={kind: judge, model: j, url: 'http://h:1'}"],
            "rollout.env scores every episode itself",
        ),
        (["reward.model={kind: judge, model: j, url: 'http://h:1', urls: ['http://h:2']}"], "give one of them"),
        (["reward.model={kind: judge, model: j, url: 'http://h:1', verdict: 'VERDICT'}"], "has no group"),
        (
            ["reward.model={kind: classifier, model: rm, url: 'http://h:1', verdict_from: logprobs}"],
            "verdict_from=logprobs is a judge's setting",
        ),
        (
            ["reward.model={kind: judge, model: j, url: 'http://h:1', verdict_from: logprobs, top_logprobs: 21}"],
            "top_logprobs",
        ),
        (["reward.model={kind: classifier, model: rm, url: 'http://h:1', endpoint: classify, label: -1}"], "label"),
        (["rollout.proxy={agent: 'not a name'}"], "is not 'package.module:function'"),
        (
            ["reward.model={kind: judge, model: j, url: 'http://h:1', template: '{question} {answer}'}"],
            r"must contain \{response\}.*it has \['answer', 'question'\]",
        ),
    ],
)
def test_config_errors_at_start(argv, message):
    with pytest.raises((ConfigError, ValueError), match=message):
        _resolve(*argv)


def test_a_good_reward_config_resolves():
    cfg = _resolve("--reward-gpus", "2", JUDGE)
    assert cfg.reward.model.all_urls() == [] and cfg.reward.model.server.engine == "vllm"
    assert _resolve("reward.model={kind: judge, model: j, url: 'http://h:1/'}").reward.model.all_urls() == [
        "http://h:1/"
    ]


class Judges:
    """Two small aiohttp servers in vLLM's chat format: ``good`` answers CORRECT after ``delay``; ``bad`` 503s."""

    async def __aenter__(self):
        self.hits = {"good": 0, "bad": 0}
        self.runners, self.urls = [], {}
        for name in ("good", "bad"):

            async def chat(request, name=name):
                self.hits[name] += 1
                if name == "bad":
                    return web.json_response({"error": "busy"}, status=503)
                await asyncio.sleep(0.02)
                return web.json_response({"choices": [{"message": {"content": "VERDICT: CORRECT"}}]})

            async def health(request, name=name):
                return web.Response(status=200 if name == "good" else 503)

            app = web.Application()
            app.router.add_post("/v1/chat/completions", chat)
            app.router.add_get("/health", health)
            runner = web.AppRunner(app)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            self.runners.append(runner)
            self.urls[name] = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc):
        for r in self.runners:
            await r.cleanup()


def test_several_servers_balanced_a_failing_one_is_retried_elsewhere_and_counted_per_server():
    async def main():
        async with Judges() as j:
            judge = JudgeClient([j.urls["good"], j.urls["bad"]], model="j", timeout_s=5, retries=1, backoff_s=0.0)
            scores = await asyncio.gather(*(judge.score(question="q", response="r") for _ in range(8)))
            with pytest.raises(RewardModelError, match=r"did not answer /health within 1.5 s"):
                await judge.wait_ready(1.5)  # the 'bad' one never turns healthy
            ready = JudgeClient(j.urls["good"], model="j", timeout_s=5, retries=0)
            await ready.wait_ready(5.0)
            await judge.close()
            await ready.close()
            return judge, scores, j.hits, j.urls

    judge, scores, hits, urls = asyncio.run(main())
    assert scores == [1.0] * 8 and judge.calls_ok == 8 and judge.calls_failed == 0
    assert hits["bad"] >= 1 and hits["good"] == 8  # every 503 went on to the good server
    st = judge.status()["servers"]
    assert st[urls["good"]]["requests_ok"] == 8 and st[urls["good"]]["latency_s_mean"] >= 0.02
    assert st[urls["good"]]["requests_per_s"] > 0 and st[urls["good"]]["inflight"] == 0
    assert st[urls["bad"]]["failures"] == {"http_status": hits["bad"]} and st[urls["bad"]]["requests_ok"] == 0


def test_status_and_live_view_show_reward_servers_and_the_proxy():
    rm = {
        "calls_ok": 5,
        "calls_failed": 1,
        "failures": {"timeout": 2},
        "calls_per_s": 3.0,
        "servers": {
            "http://10.0.0.5:8001": {
                "requests_ok": 5,
                "failures": {"timeout": 2},
                "inflight": 1,
                "requests_per_s": 2.5,
                "latency_s_mean": 0.2,
                "latency_s_p50": 0.2,
                "latency_s_p95": 0.4,
            }
        },
    }
    snap = JobSnapshot(
        fleet=FleetStatus(reward_model=rm, proxy_url="http://127.0.0.1:9000", proxy={"proxy/requests": 7}),
        learner=LearnerStatus(),
        max_steps=3,
        max_staleness=2,
        simulated=False,
        wall_s=1.0,
    )
    text = format_status(json.loads(json.dumps(snap.to_wire())))
    assert "reward server http://10.0.0.5:8001: 2.50 req/s, 5 ok, failures {'timeout': 2}, latency mean 0.200 s" in text
    assert "OpenAI proxy: http://127.0.0.1:9000/v1" in text and "7 requests" in text
    from rich.console import Console

    from launch.monitor import Monitor

    console = Console(record=True, width=200)
    console.print(Monitor.render(type("M", (), {"simulated": False})(), snap))
    view = console.export_text()
    assert "reward server http://10.0.0.5:8001" in view and "OpenAI proxy" in view


def test_agent_is_resolved_by_name_and_must_be_async():
    assert resolve_agent("asyncio:sleep") is asyncio.sleep
    with pytest.raises(ValueError, match="ModuleNotFoundError"):
        resolve_agent("no_such_module:agent")
    with pytest.raises(ValueError, match="must be an async function"):
        resolve_agent("json:dumps")
