"""SGLang (TP=1, GPU 1) through fleetrl's SGLang clients: log-probs vs the learner's forward, before and
after an NCCL publish from this process (the learner, GPU 0).

One server for the module. The publish uses fleetrl's plan and bucket packing, and
the SGLang side of the group from weight_sync.sglang_group (the store prefixes
SGLang's workers use); every bucket is one /update_weights_from_distributed call
with load_format='flattened_bucket'. Timings go to $FLEETRL_GPU_RESULTS (jsonl) when set.
"""

from __future__ import annotations

import asyncio
import os
import random
import time

import pytest
from gpu_helpers import Reference, check_logprobs, record

from core.http_client import free_port

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]


def _record(what: str, **kw) -> None:
    record("sglang", what, **kw)


@pytest.fixture(scope="module")
def server(qwen_checkpoints, loop, tmp_path_factory):
    import torch

    from engines.sglang.server import SGLangServer, SGLangServerArgs

    if torch.cuda.device_count() < 2:
        pytest.fail("the SGLang GPU test needs 2 GPUs (engine on GPU 1, learner on GPU 0)")
    v0, _, _, _ = qwen_checkpoints
    log_path = os.environ.get("FLEETRL_SGLANG_LOG") or str(tmp_path_factory.mktemp("sglang") / "server.log")
    srv = SGLangServer(
        SGLangServerArgs(
            model=str(v0),
            gpus=[1],
            port=free_port(),
            mem_fraction_static=0.5,
            max_running_requests=128,
            log_path=log_path,
        )
    )
    t0 = time.monotonic()
    loop.run_until_complete(srv.start(timeout_s=600))
    _record("startup", seconds=time.monotonic() - t0, version=str(srv.version), command=srv.command(srv.version))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server, loop):
    c = server.generation_client("sglang-0")
    yield c
    loop.run_until_complete(c.close())


def _group(client, loop, prompt):
    from engines.base import SamplingParams

    return loop.run_until_complete(client.generate(prompt, SamplingParams(n=4, max_tokens=32, temperature=1.0)))


def _check(samples, prompt, ref_same, ref_other, label):
    check_logprobs("sglang", samples, prompt, ref_same, ref_other, label)


def test_generate_logprobs_match_learner(client, loop, qwen_checkpoints):
    _, _, s0, s1 = qwen_checkpoints
    prompt = random.Random(0).sample(range(1000, 100000), 16)
    samples = _group(client, loop, prompt)
    assert len(samples) == 4
    assert all(s.finish_reason in ("length", "stop") for s in samples)
    assert len({tuple(s.token_ids) for s in samples}) > 1, "n samples of a group must differ at temperature 1"
    ref0, ref1 = Reference(s0), Reference(s1)
    _check(samples, prompt, ref0, ref1, "generate_v0")


def test_nccl_publish_from_learner_then_logprobs_match_new_weights(server, client, loop, qwen_checkpoints):
    import torch

    from weight_sync import group as wgroup
    from weight_sync.messages import GroupInfo
    from weight_sync.plan import build_plan, pack_bucket
    from weight_sync.sglang_group import publisher_group, publisher_nccl_env

    for k, v in publisher_nccl_env().items():  # must match the server's before our first NCCL call
        os.environ[k] = v
    _, _, s0, s1 = qwen_checkpoints
    torch.cuda.set_device(0)
    learner = {k: v.to("cuda:0") for k, v in s1.items()}
    plan = build_plan([(n, list(t.shape), t.dtype) for n, t in learner.items()], 256 << 20)
    store = wgroup.host_store("127.0.0.1", 0, 60)
    group = GroupInfo(
        master_addr="127.0.0.1", master_port=store.port, rank_offset=1, world_size=2, backend="nccl", group_epoch=1
    )
    weights = server.weight_client("sglang-0-weights")  # the learner's side; `client` generates

    async def join():
        fut = asyncio.ensure_future(weights.init_weight_transfer(group, plan))
        pg = await asyncio.to_thread(publisher_group, store, group, 60)
        await fut
        return pg

    pg = loop.run_until_complete(join())

    def broadcast_all():
        for idx in plan.buckets:
            buf = pack_bucket([learner[plan.names[i]] for i in idx])
            wgroup.broadcast_async(pg, buf).wait()
        torch.cuda.synchronize()

    async def update(version: int, mode: str):
        t0 = time.perf_counter()
        await weights.pause(mode)
        t_paused = time.perf_counter()
        bcast = asyncio.ensure_future(asyncio.to_thread(broadcast_all))
        await weights.update_weights(version, plan.plan_id)
        await bcast
        await weights.reset_prefix_cache()
        await weights.resume()
        client.record_version(version)
        t1 = time.perf_counter()
        return t1 - t0, t1 - t_paused

    try:
        first, _ = loop.run_until_complete(update(1, "abort"))  # includes NCCL communicator creation
        learner = {k: v.to("cuda:0") for k, v in s0.items()}  # publish back to v0, then to v1 again: timed
        times = [loop.run_until_complete(update(2, "wait"))]
        learner = {k: v.to("cuda:0") for k, v in s1.items()}
        times.append(loop.run_until_complete(update(3, "wait")))
        _record(
            "nccl_update",
            bytes=sum(t.numel() * t.element_size() for t in learner.values()),
            buckets=len(plan.buckets),
            first_s=first,
            pause_to_resume_s=[t[0] for t in times],
            after_pause_s=[t[1] for t in times],
        )
        assert weights.weight_version == 3 and client.weight_version == 3
        prompt = random.Random(1).sample(range(1000, 100000), 16)
        samples = _group(client, loop, prompt)
        _check(samples, prompt, Reference(s1), Reference(s0), "generate_after_publish_v1")
    finally:
        wgroup.close_group(pg)
        loop.run_until_complete(weights.close())


@pytest.mark.parametrize("between_steps", [False, True], ids=["freeze", "between-steps"])
def test_staged_publish_while_generating(server, client, loop, qwen_checkpoints, between_steps):
    """weight_sync.staging on SGLang: fleetrl's loader in the server's worker receives while the engine
    generates (the stage goes to a thread in the worker); the engine is held only for the commit's freeze.
    Log-probs then match the new weights."""
    import torch

    from engines.base import SamplingParams
    from weight_sync.config import WeightSyncConfig
    from weight_sync.plan import build_plan
    from weight_sync.publisher import Publisher
    from weight_sync.sglang_group import publisher_nccl_env

    for k, v in publisher_nccl_env().items():
        os.environ[k] = v
    _, _, s0, s1 = qwen_checkpoints
    torch.cuda.set_device(0)
    states = [{k: v.to("cuda:0") for k, v in s.items()} for s in (s0, s1)]
    plan = build_plan([(n, list(t.shape), t.dtype) for n, t in states[1].items()], 256 << 20)
    staged = server.weight_client(
        f"sglang-staged-{int(between_steps)}",
        staging=True,  # on the publisher's RPC loop
        between_steps=between_steps,
    )
    pub = Publisher(
        WeightSyncConfig(backend="nccl", nccl_impl="torch", staging=True, timeout_s=120.0),
        plan,
        rank=0,
        engines=[staged],
        device="cuda:0",
    )
    versions = list(range(1, 6))  # v1 (group creation, copy-plan recording) = s1, then s0, s1, s0, s1
    steps, reports = [], []

    def publish_all():
        for v in versions:
            reports.append(pub.publish(v, iter(states[v % 2].items())))
            steps.append(dict(staged.last_update_steps))

    async def load(done: asyncio.Event):
        n = 0
        while not done.is_set():
            await asyncio.gather(
                *(
                    client.generate(
                        random.Random(n + i).sample(range(1000, 100000), 16),
                        SamplingParams(n=2, max_tokens=48, temperature=1.0),
                    )
                    for i in range(4)
                )
            )
            n += 4
        return n

    async def run():
        done = asyncio.Event()
        gen = asyncio.ensure_future(load(done))
        try:
            await asyncio.to_thread(publish_all)
        finally:
            done.set()
        return await gen

    try:
        groups = loop.run_until_complete(run())
        timed = steps[1:]
        _record(
            "staged_update",
            between_steps_asked=between_steps,
            bytes=reports[-1].bytes,
            buckets=len(plan.buckets),
            generated_groups=groups,
            publish_s=[r.seconds for r in reports[1:]],
            unavailable_s=[s["unavailable_s"] for s in timed],
            stage_s=[s["stage"] for s in timed],
            commit_held_s=[s["commit_held"] for s in timed],
            commit_in_engine_s=[s["commit_in_engine"] for s in timed],
            laps={
                k: [s.get(k) for s in timed]
                for k in (
                    "commit_between_steps_s",
                    "commit_pause_s",
                    "commit_call_s",
                    "commit_to_loader_s",
                    "commit_from_loader_s",
                    "commit_continue_s",
                    "commit_wait_s",
                    "commit_checksum_s",
                    "commit_load_s",
                )
            },
            replayed=[s["commit_replayed"] for s in timed],
            between_steps=[s["commit_between_steps"] for s in timed],
            first=steps[0],
        )
        assert all(r.checksum and r.per_engine_checksums[staged.engine_id] == r.checksum for r in reports)
        assert all(s["commit_replayed"] == len(plan.buckets) for s in timed), timed
        assert groups > 0
        assert all(s["commit_between_steps"] == between_steps for s in timed), timed
        prompt = random.Random(7).sample(range(1000, 100000), 16)
        samples = _group(client, loop, prompt)
        _check(samples, prompt, Reference(s1), Reference(s0), "generate_after_staged_publish_v5")
    finally:
        pub.close()
