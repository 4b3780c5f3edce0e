"""The LoRA calls fleetrl's SGLang clients make, against a recording stand-in of SGLang 0.5.16's HTTP routes
(SGLang has no CPU build; the real server is tests/gpu/test_sglang_lora_gpu.py), the server arguments, and the
LoRA bench's refusals.

The stand-in answers as sglang/srt/entrypoints/http_server.py does: ``/load_lora_adapter`` and
``/unload_lora_adapter`` a ``LoRAUpdateOutput`` (``success``, ``error_message``) with 200, or 400 on failure (a
name loaded twice, an unknown name); ``/update_weight_version`` and ``/update_weights_from_disk`` ``success`` and
``message``.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
from bench_module import load_bench
from json_http import json_http_server

from core.http_client import EngineError
from engines.sglang.lora import sglang_lora_server_args, sglang_lora_slots
from engines.sglang.weights import SGLangWeightClient

REPO = Path(__file__).resolve().parents[3]


class _SGLangLoRA:
    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []
        self.loaded: dict[str, str] = {}
        self.version = "default"

    def post(self, path: str, body: dict) -> tuple[dict, int]:
        self.calls.append((path, body))
        if path == "/load_lora_adapter":
            if body["lora_name"] in self.loaded:
                return {"success": False, "error_message": f"{body['lora_name']} is already loaded"}, 400
            self.loaded[body["lora_name"]] = body["lora_path"]
            return {"success": True, "error_message": None, "loaded_adapters": dict(self.loaded)}, 200
        if path == "/unload_lora_adapter":
            if self.loaded.pop(body["lora_name"], None) is None:
                return {"success": False, "error_message": f"LoRA with name {body['lora_name']} does not exist"}, 400
            return {"success": True, "error_message": None, "loaded_adapters": dict(self.loaded)}, 200
        if path == "/update_weight_version":
            self.version = body["new_version"]
            return {"success": True, "message": "ok", "new_version": body["new_version"]}, 200
        if path == "/update_weights_from_disk":
            self.version = body.get("weight_version") or self.version
            return {"success": True, "message": "Succeeded", "num_paused_requests": 0}, 200
        return {"detail": "Not Found"}, 404


@pytest.fixture()
def sglang():
    fake = _SGLangLoRA()
    with json_http_server(lambda method, path, body: fake.post(path, body)) as url:
        fake.url = url
        yield fake


async def _with(client, coro):
    try:
        return await coro
    finally:
        await client.close()


def test_adapter_versions_load_label_and_unload_two_back(sglang):
    c = SGLangWeightClient("s0", sglang.url, adapter_prefix="policy", timeout_s=10)
    for v in (1, 2, 3):
        steps = asyncio.run(_with(c, c.load_adapter(f"/a/v{v}", v)))
        assert set(steps) == {"load_adapter", "label_version", "unload_old"}
    assert sglang.calls[:2] == [
        ("/load_lora_adapter", {"lora_name": "policy-v1", "lora_path": "/a/v1"}),
        ("/update_weight_version", {"new_version": "1", "abort_all_requests": False}),
    ]
    assert ("/unload_lora_adapter", {"lora_name": "policy-v1"}) == sglang.calls[-1]
    assert set(sglang.loaded) == {"policy-v2", "policy-v3"} and sglang.version == "3"
    # a name loaded twice: SGLang's 400 carries its message into the error
    with pytest.raises(EngineError, match="already loaded"):
        asyncio.run(_with(c, c.load_adapter("/a/v3", 3)))
    # v-2 not loaded here (a server that joined late): no error
    sglang.loaded.pop("policy-v3")
    asyncio.run(_with(c, c.load_adapter("/a/v5", 5)))
    assert set(sglang.loaded) == {"policy-v2", "policy-v5"}


def test_export_goes_to_the_adapter_only_with_the_prefix(sglang):
    lora = SGLangWeightClient("s0", sglang.url, adapter_prefix="policy", timeout_s=10)
    asyncio.run(_with(lora, lora.load_weights_from_path("/run/export/", 4)))
    assert sglang.calls[0] == ("/load_lora_adapter", {"lora_name": "policy-v4", "lora_path": "/run/export/adapter"})
    assert not any(p == "/update_weights_from_disk" for p, _ in sglang.calls)
    sglang.calls.clear()
    full = SGLangWeightClient("s0-full", sglang.url, timeout_s=10)  # the bench's full path: no prefix
    asyncio.run(_with(full, full.load_weights_from_path("/run/export", 5)))
    assert sglang.calls == [
        ("/update_weights_from_disk", {"model_path": "/run/export", "weight_version": "5", "flush_cache": True})
    ]
    with pytest.raises(ValueError, match="adapter_prefix"):
        asyncio.run(_with(full, full.load_adapter("/a/v1", 1)))


def test_server_args_meet_sglangs_checks():
    args = sglang_lora_server_args(64)
    val = lambda flag: args[args.index(flag) + 1]  # noqa: E731
    assert "--enable-lora" in args and val("--max-lora-rank") == "64"
    i = args.index("--lora-target-modules")
    assert args[i + 1 : i + 8] == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    # check_lora_server_args: max_loaded_loras >= max_loras_per_batch; the base takes a per-batch slot
    assert int(val("--max-loaded-loras")) >= int(val("--max-loras-per-batch")) == 3  # base, v-1, v
    assert int(val("--max-loaded-loras")) >= 3  # v-2, v-1 and v between a load and the unload of v-2
    three = sglang_lora_server_args(64, versions=3)  # broker.max_staleness 2: v-2..v run at once
    assert (
        three[three.index("--max-loras-per-batch") + 1] == "4" and three[three.index("--max-loaded-loras") + 1] == "4"
    )
    assert sglang_lora_slots(3) == (4, 4)
    with pytest.raises(ValueError, match="at least 2"):
        sglang_lora_slots(1)
    assert sglang_lora_server_args(8, ["all"])[4:6] == ["all", "--max-loras-per-batch"]
    for bad, match in ((0, "rank"), (-3, "rank")):
        with pytest.raises(ValueError, match=match):
            sglang_lora_server_args(bad)
    for mods in ([], ["all", "q_proj"], ["--max-loras-per-batch"]):
        with pytest.raises(ValueError, match="target module"):
            sglang_lora_server_args(8, mods)


def _bench():
    return load_bench("bench/lora_publish.py", "bench_lora_publish")


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--engine", "sglang", "--cpu"], "SGLang has no CPU build"),
        (["--engine", "tgi"], "invalid choice"),
        (["--gpu-memory-utilization", "1.5", "--cpu"], r"must be in \(0, 1\)"),
    ],
)
def test_lora_bench_refuses_what_cannot_run(argv, match, capsys):
    with pytest.raises(SystemExit) as e:
        _bench().main(argv)
    assert e.value.code == 2
    import re

    assert re.search(match, capsys.readouterr().err)
    assert "sglang" not in sys.modules  # the bench and the clients do not import SGLang (the server does)


def test_a_wider_window_keeps_three_versions_and_a_skipping_server_unloads_its_last(sglang):
    c = SGLangWeightClient("s0", sglang.url, adapter_prefix="policy", adapter_versions=3, timeout_s=10)
    for v in (1, 2, 3, 4):
        asyncio.run(_with(c, c.load_adapter(f"/a/v{v}", v)))
    assert set(sglang.loaded) == {"policy-v2", "policy-v3", "policy-v4"}  # v1 left the window at v4
    asyncio.run(_with(c, c.load_adapter("/a/v9", 9)))  # a server that missed v5..v8: its v4 is out of the window
    assert set(sglang.loaded) == {"policy-v2", "policy-v3", "policy-v9"}
    assert [b["lora_name"] for p, b in sglang.calls if p == "/unload_lora_adapter"] == [
        "policy-v1",
        "policy-v4",
        "policy-v6",
    ]
    with pytest.raises(ValueError, match="adapter_versions"):
        SGLangWeightClient("s1", sglang.url, adapter_prefix="policy", adapter_versions=1)


def test_a_lora_sglang_fleet_starts_its_servers_for_adapters_and_the_learner_publishes_them(tmp_path):
    from engines.registry import weight_client
    from engines.sglang.factory import SGLangFactory
    from launch.config import load_run_config
    from weight_sync.adapter_publisher import adapter_publish

    cfg = load_run_config("tiny-lora", ["rollout.engine=sglang", "broker.max_staleness=2", "learner.lora.rank=8"])
    assert adapter_publish(cfg)
    factory = SGLangFactory(cfg, tmp_path, {0: (None, [0])})
    extra = factory._args(0).extra_args
    val = lambda flag: extra[extra.index(flag) + 1]  # noqa: E731
    assert "--enable-lora" in extra and val("--max-lora-rank") == "8" and val("--max-loras-per-batch") == "4"
    client = factory.client(0, "http://127.0.0.1:1")  # requests name the version's adapter
    assert client.adapter_prefix == "policy" and client.adapter_versions == 3
    pub = weight_client(cfg, "nccl", "sglang-0", "http://127.0.0.1:1")
    assert pub.adapter_prefix == "policy" and pub.adapter_versions == 3
    # colocated, or without LoRA: the weights as before, no LoRA flags
    for overrides in (
        ["rollout.engine=sglang", "colocate.enabled=true", "broker.max_staleness=0"],
        ["rollout.engine=sglang"],
    ):
        plain = load_run_config("tiny-lora" if "colocate.enabled=true" in overrides else "tiny", overrides)
        assert not adapter_publish(plain)
        assert "--enable-lora" not in SGLangFactory(plain, tmp_path, {0: (None, [0])})._args(0).extra_args
        assert weight_client(plain, "nccl", "sglang-0", "http://127.0.0.1:1").adapter_prefix is None
