"""fleetrl's loader for SGLang's workers (engines/sglang/loader.py), driven as SGLang drives it, on CPU.

SGLang has no CPU build, so the worker here is a plain process that does what SGLang's TP
worker does with an ``/update_weights_from_tensor`` call: unpickle the payload with an
allowlist like SGLang's ``SafeUnpickler`` and call the custom loader with its model. The
group (gloo), the store and the model are real; the publisher side is this process. The
real server is covered by tests/gpu/test_sglang_gpu.py.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.multiprocessing as mp
from sglang_standin import Tiny, decode_payload  # the model and unpickling the stand-in server uses
from sglang_standin import state as make_state

from engines.sglang import loader
from weight_sync import group as wgroup
from weight_sync.messages import GroupInfo
from weight_sync.plan import (
    bucket_fingerprint,
    build_plan,
    combine_fingerprints,
    pack_bucket,
    plan_to_dict,
)

pytestmark = pytest.mark.timeout(120)


def _worker(conn) -> None:
    torch.set_num_threads(1)
    model = Tiny()
    while True:
        msg = conn.recv()
        if msg is None:
            return
        if msg == "dump":
            conn.send({k: v.detach().clone() for k, v in model.state_dict().items()})
            continue
        if msg == "step":  # what SGLang's scheduler does for a batch: call the model's forward
            model.forward(torch.zeros(()))
            conn.send("done")
            continue
        named = decode_payload(msg)
        named = [(n, t.to("cpu")) for n, t in named]  # SGLang's _unwrap_tensor
        loader.fleetrl_loader(model, named)  # never raises: outcomes go to the store
        conn.send("done")


@pytest.fixture()
def worker():
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_worker, args=(child,), daemon=True)
    proc.start()
    yield parent
    parent.send(None)
    proc.join(10)
    if proc.is_alive():
        proc.kill()


def test_payload_passes_an_allowlist_and_names_the_command():
    named = decode_payload(loader.payload("stage", version=3, plan_id="p"))
    assert len(named) == 1 and named[0][0].startswith(loader.PREFIX) and '"version": 3' in named[0][0]
    with pytest.raises(ValueError, match="unknown fleetrl SGLang command"):
        loader.payload("reload")


def test_join_stage_commit_over_a_real_group(worker):
    store = wgroup.host_store("127.0.0.1", 0, 30)
    state = make_state(1)
    plan = build_plan([(k, list(v.shape), v.dtype) for k, v in state.items()], bucket_bytes=200)
    assert len(plan.buckets) > 1
    group = GroupInfo(
        master_addr="127.0.0.1", master_port=store.port, rank_offset=1, world_size=2, backend="gloo", group_epoch=1
    )
    common = {"engine_id": "sgl-test", "timeout_s": 20.0, "store": {"addr": "127.0.0.1", "port": store.port}}
    seq = 0

    def call(cmd, **args):
        nonlocal seq
        seq += 1
        worker.send(loader.payload(cmd, seq=seq, **common, **args))
        return seq

    requests = 0

    def ask(cmd, **args):  # as SGLangClient: a request in the store, for the worker's request thread
        nonlocal seq, requests
        seq, requests = seq + 1, requests + 1
        store.set(loader.request_key(1, 1, requests), loader.request(cmd, engine_id="sgl-test", seq=seq, **args))
        return seq

    def stage(**args):
        return loader.read_outcomes(store, "sgl-test", ask("stage", **args), 1)[0]

    def outcome(s):
        assert worker.poll(30), "the worker did not return from the loader"
        assert worker.recv() == "done"
        return loader.read_outcomes(store, "sgl-test", s, 1)[0]

    s = call(
        "join",
        group={
            "master_addr": "127.0.0.1",
            "master_port": store.port,
            "rank_offset": 1,
            "world_size": 2,
            "group_epoch": 1,
            "backend": "gloo",
        },
        plan=plan_to_dict(plan),
    )
    pg = wgroup.make_group(store, group, 0, 20)  # the publisher's side of the join
    joined = outcome(s)
    assert joined["ok"] and joined["rank"] == 1 and joined["t_exit"] >= joined["t_enter"], joined

    for version, seed in ((1, 1), (2, 2)):  # the second commit replays the recorded copies
        state = make_state(seed)
        staged = stage(version=version, plan_id=plan.plan_id)  # the worker's loop is idle meanwhile
        assert staged["ok"], staged
        prints = []
        for idx in plan.buckets:
            buf = pack_bucket([state[plan.names[i]] for i in idx])
            prints.append(bucket_fingerprint(buf))
            wgroup.broadcast_async(pg, buf).wait()
        s = ask("commit", version=version)
        if version == 1:  # the worker runs it before its next forward, with no call from SGLang
            time.sleep(0.5)  # the request thread has seen it
            worker.send("step")
            assert worker.poll(30) and worker.recv() == "done"
            got = loader.read_outcomes(store, "sgl-test", s, 1)[0]
            assert got.get("between_steps"), got
        else:  # no forward comes (an idle engine): the client falls back to the loader, with the same seq
            worker.send(loader.payload("commit", seq=s, version=version, **common))
            got = outcome(s)
            assert not got.get("between_steps"), got
            time.sleep(0.5)  # the request thread has seen the request too
            worker.send("step")  # a later forward must not commit it again (it would leave an outcome)
            assert worker.poll(30) and worker.recv() == "done"
            assert not store.check([loader.outcome_key("sgl-test", s, 0)])
        assert got["ok"] and got["checksum"] == combine_fingerprints(prints), got
        worker.send("dump")
        held = worker.recv()
        assert torch.equal(held["qkv"], torch.cat([state["q"], state["k"], state["v"]]))
        assert torch.equal(held["norm"][:8], state["norm"]) and held["norm"][8] == 0  # its padding row
        assert got["replayed_buckets"] == (0 if version == 1 else len(plan.buckets))  # recorded, then replayed

    # A commit of a version that was never staged is refused and reported, and the worker lives on.
    s = call("commit", version=7)
    bad = outcome(s)
    assert not bad["ok"] and "commit(v7)" in bad["error"]
    bad = stage(version=8, plan_id="not-the-plan")
    assert not bad["ok"] and "not-the-plan" in bad["error"]
    s = call("stage", version=9, plan_id="not-the-plan")  # the same through SGLang's call path
    bad = outcome(s)
    assert not bad["ok"] and "not-the-plan" in bad["error"]
    wgroup.close_group(pg)


def test_a_missing_outcome_times_out_with_the_worker_named():
    store = wgroup.host_store("127.0.0.1", 0, 30)
    client = wgroup.connect_store("127.0.0.1", store.port, 1.0)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="TP worker 0 left no outcome of call 5"):
        loader.read_outcomes(client, "sgl-x", 5, 1)
    assert time.monotonic() - t0 < 10
