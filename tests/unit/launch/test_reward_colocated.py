"""Colocated reward servers (``reward.model.server.colocated``): a judge on each GPU the learner and the rollout
servers share (``--gpus N``), or one CPU server with ``--colocate``: its actor's placement, the job's reward
handle, and the config errors at start. CPU only, no Ray cluster (the options are Ray's plain objects)."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from ray.util.scheduling_strategies import (
    NodeAffinitySchedulingStrategy,
    PlacementGroupSchedulingStrategy,
)

from core.configbase import ConfigError
from launch.cluster import resolve_config, run_parser
from launch.placement import Slot
from launch.reward_servers import actor_options, colocated_slots, place_reward_servers, server_spec

pytestmark = pytest.mark.timeout(60)
A, B, HERE = "a1" * 28, "b2" * 28, "c3" * 28  # node ids: Ray checks their hex form
SHARED = "reward.model={kind: judge, model: j, server: {colocated: true, gpu_memory_utilization: 0.1}}"


def _resolve(*argv: str):
    return resolve_config(run_parser().parse_args(list(argv)))


def test_a_colocated_reward_server_takes_no_gpu_of_rays_and_names_its_shared_gpu():
    slots = colocated_slots({1: Slot(B, (5,)), 0: Slot(A, (3,))})
    assert slots == [Slot(A, (3,)), Slot(B, (5,))]  # reward i beside server i (and learner rank i)
    for i, (node, gpu) in enumerate(((A, "3"), (B, "5"))):
        opts, gpus = actor_options(slots, [], i, shared=True, here=HERE)
        assert opts["num_gpus"] == 0 and gpus == [gpu]  # learner rank i's bundle holds the GPU: none asked of Ray
        st = opts["scheduling_strategy"]
        assert isinstance(st, NodeAffinitySchedulingStrategy) and st.node_id == node and not st.soft


def test_own_gpu_and_cpu_reward_servers_keep_their_placement():
    pg = object()
    opts, gpus = actor_options([Slot("n", (2, 3))], [pg], 0, shared=False, here=HERE)
    assert (
        opts["num_gpus"] == 2
        and gpus == []
        and isinstance(opts["scheduling_strategy"], PlacementGroupSchedulingStrategy)
    )
    opts, gpus = actor_options([], [], 0, shared=False, here=HERE)  # CPU: the driver's node
    assert opts["scheduling_strategy"].node_id == HERE and "num_gpus" not in opts and gpus == []
    opts, gpus = actor_options([], [], 0, shared=True, here=HERE)  # --colocate on CPU: one CPU server there
    assert opts["scheduling_strategy"].node_id == HERE and gpus == []


def test_the_job_gets_shared_reward_servers_without_placement_groups(tmp_path: Path):
    cfg = _resolve("--gpus", "1", SHARED, "rollout.gpu_memory_utilization=0.4")
    job = SimpleNamespace(
        cfg=cfg, run_dir=tmp_path, args=SimpleNamespace(reward_gpus=0), placement=SimpleNamespace(pgs={})
    )
    place_reward_servers(job, [Slot(A, (0,))], {A: "node:10.0.0.1"})
    assert job.rewards.shared and job.rewards.count == 1 and job.rewards.pgs == [] and job.placement.pgs == {}
    spec = server_spec(cfg, 0)
    assert spec["gpu_memory_utilization"] == 0.1
    cpu = _resolve("--colocate", SHARED)
    job = SimpleNamespace(cfg=cpu, run_dir=tmp_path, args=SimpleNamespace(reward_gpus=0), pgs={})
    place_reward_servers(job, [], {})
    assert job.rewards.shared and job.rewards.count == 1 and job.rewards.slots == []


@pytest.mark.parametrize(
    "argv, message",
    [
        ([SHARED], "colocated=true shares the colocated GPUs: it needs --gpus N"),
        (["--gpus", "1", "--reward-gpus", "1", SHARED], "drop --reward-gpus"),
        (
            ["--gpus", "1", "reward.model={kind: judge, model: j, server: {colocated: true}}"],
            r"\+ reward.model.server.gpu_memory_utilization 0.85 > 0.9",
        ),
        (
            ["--gpus", "1", "reward.model={kind: judge, model: j, server: {colocated: true, tensor_parallel_size: 2}}"],
            "engine vllm, tensor_parallel_size 1",
        ),
        (
            ["--gpus", "1", "--reward-gpus", "1", "reward.model={kind: judge, model: j}"],
            "--reward-gpus is for the disaggregated mode.*reward.model.server.colocated=true",
        ),
    ],
)
def test_colocated_reward_config_errors(argv, message):
    with pytest.raises((ConfigError, ValueError), match=message):
        _resolve(*argv)


def test_the_judge_sends_extra_body_fields_and_reads_the_chosen_verdict():
    import asyncio

    from aiohttp import web

    from rollout_fleet.reward_models import JudgeClient

    seen = []

    async def main():
        async def chat(request):
            body = await request.json()
            seen.append(body)
            choice = body.get("structured_outputs", {}).get("choice", ["no verdict"])[0]
            return web.json_response({"choices": [{"message": {"content": choice}}]})

        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        try:
            judge = JudgeClient(
                url,
                model="j",
                verdict=re.compile("(YES|NO)"),
                scores={"YES": 1.0, "NO": 0.0},
                retries=0,
                extra_body={"structured_outputs": {"choice": ["YES", "NO"]}},
            )
            r = await judge.score(question="q", response="42", reference="42")
            await judge.close()
            return r
        finally:
            await runner.cleanup()

    assert asyncio.run(main()) == 1.0
    assert seen[0]["structured_outputs"] == {"choice": ["YES", "NO"]} and seen[0]["model"] == "j"
