"""SGLang engine pieces that run without SGLang (no SGLang build runs on CPU).

* the version gate names the supported range;
* the publisher's side of the update group meets a peer that builds its side exactly
  as SGLang's ``init_custom_process_group`` does (tcp rendezvous, ``PrefixStore(group_name)``,
  torch's ``_new_process_group_helper``), over gloo here; on GPU the same key layout
  carries NCCL (tests/gpu/test_sglang_gpu.py).
"""

from __future__ import annotations

import datetime
import multiprocessing as mp

import pytest

from engines.sglang.server import (
    SGLangServer,
    SGLangServerArgs,
    check_sglang_version,
    compat_args,
)
from weight_sync.sglang_group import sglang_group_name

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("version", ["0.5.16", "0.5.23", "0.5.20.post1"])
def test_supported_versions_pass(version):
    assert str(check_sglang_version(version)) == version


@pytest.mark.parametrize("version", ["0.5.10", "0.4.9", "0.6.0"])
def test_unsupported_versions_fail_naming_the_range(version):
    with pytest.raises(ValueError, match=r"sglang >= 0\.5\.16, < 0\.6"):
        check_sglang_version(version)


def test_command_carries_assignment_and_version_flags():
    srv = SGLangServer(SGLangServerArgs(model="m", gpus=[3], port=1234, radix_cache=False))
    cmd = srv.command(check_sglang_version("0.5.16"))
    assert cmd[cmd.index("--port") + 1] == "1234" and "--skip-tokenizer-init" in cmd
    assert "--disable-radix-cache" in cmd and all(f in cmd for f in compat_args(check_sglang_version("0.5.16")))
    env = srv.environment()
    assert env["CUDA_VISIBLE_DEVICES"] == "3" and env["NCCL_CUMEM_ENABLE"] == "0"
    assert "--enable-memory-saver" not in cmd
    saver = SGLangServer(SGLangServerArgs(model="m", gpus=[3], port=1234, memory_saver=True))
    assert "--enable-memory-saver" in saver.command(check_sglang_version("0.5.16"))
    with pytest.raises(ValueError, match="tensor_parallel_size=2"):
        SGLangServerArgs(model="m", gpus=[0], port=1, tensor_parallel_size=2)


def test_sglang_reports_post_temperature_logprobs_even_if_the_environment_says_otherwise():
    srv = SGLangServer(SGLangServerArgs(model="m", gpus=[0], port=1, env={"SGLANG_RETURN_ORIGINAL_LOGPROB": "1"}))
    assert srv.environment()["SGLANG_RETURN_ORIGINAL_LOGPROB"] == "false"


def _sglang_like_worker(port: int, group_name: str, q) -> None:
    """What SGLang 0.5.16/0.5.23 do in ModelRunner.init_weights_update_group (utils.common), over gloo."""
    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import (
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    try:
        timeout = datetime.timedelta(seconds=120)
        store, rank, world = next(rendezvous(f"tcp://127.0.0.1:{port}", 1, 2, timeout=timeout))
        store.set_timeout(timeout)
        store = PrefixStore(group_name, store)
        pg, _ = _new_process_group_helper(
            world, rank, [], dist.Backend("gloo"), store, group_name=group_name, backend_options=None, timeout=timeout
        )
        _world.pg_group_ranks[pg] = {i: i for i in range(world)}
        t = torch.zeros(5)
        dist.broadcast(t, src=0, group=pg)
        q.put(t.tolist())
    except Exception as e:  # noqa: BLE001 - reported to the test
        q.put(f"{type(e).__name__}: {e}")


@pytest.mark.slow  # spawns a torch process (tens of seconds on a loaded 2-core machine)
def test_publisher_group_meets_sglangs_own_group_construction():
    import torch

    from weight_sync.group import broadcast_async, close_group, host_store
    from weight_sync.messages import GroupInfo
    from weight_sync.sglang_group import publisher_group

    store = host_store("127.0.0.1", 0, 120)
    group = GroupInfo(
        master_addr="127.0.0.1", master_port=store.port, rank_offset=1, world_size=2, backend="gloo", group_epoch=7
    )
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_sglang_like_worker, args=(store.port, sglang_group_name(7), q), daemon=True)
    proc.start()
    pg = publisher_group(store, group, 120)  # gloo connects in the constructor: the join (spawn is slow here)
    try:
        broadcast_async(pg, torch.arange(5, dtype=torch.float32) + 0.5).wait(datetime.timedelta(seconds=120))
        assert q.get(timeout=60) == [0.5, 1.5, 2.5, 3.5, 4.5]
    finally:
        close_group(pg)
        proc.join(10)
        if proc.is_alive():
            proc.kill()
