"""The GPU full-system run's wiring, checked without a GPU: the gpu-tiny recipe, which client the
learner's publisher uses per engine and backend, and how the fleet starts an SGLang server.

The run itself is tests/gpu/test_full_system_gpu.py (2 GPUs).
"""

from __future__ import annotations

import pytest

from launch.config import load_run_config

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_gpu_tiny_recipe_loads_for_each_engine(engine):
    cfg = load_run_config("gpu-tiny", [f"rollout.engine={engine}"])
    assert cfg.rollout.engine == engine
    assert cfg.model.dtype == "bfloat16" and cfg.weight_sync.backend == "nccl"
    assert cfg.rollout.vllm_server_args == ["--attention-backend", "TRITON_ATTN"]
    assert 3 <= cfg.run.max_steps <= 5


def test_extra_server_args_reach_the_vllm_command(tmp_path):
    from engines.vllm.factory import VLLMFactory

    cfg = load_run_config("gpu-tiny", [])
    server = VLLMFactory(cfg, tmp_path, {0: ("node", [1])})._server(0)
    cmd = server.command()
    i = cmd.index("--attention-backend")
    assert cmd[i + 1] == "TRITON_ATTN"
    assert server.args.env["CUDA_VISIBLE_DEVICES"] == "1" and server.args.env["NCCL_CUMEM_ENABLE"] == "0"


def test_publisher_client_follows_engine_and_backend():
    from engines.registry import weight_client
    from engines.sglang.weights import SGLangPublishClient
    from engines.vllm.nccl import VLLMNcclClient
    from engines.vllm.weights import VLLMWeightClient

    # by default a vLLM fleet takes fleetrl's backend over NCCL; vLLM's own nccl backend on request
    c = weight_client(load_run_config("gpu-tiny", []), "nccl", "vllm-0", "http://127.0.0.1:1")
    assert type(c) is VLLMWeightClient and c.weight_backend == "fleetrl" and c.supports_staging
    vllm = load_run_config("gpu-tiny", ["weight_sync.nccl_impl=vllm"])
    c = weight_client(vllm, "nccl", "vllm-0", "http://127.0.0.1:1")
    assert isinstance(c, VLLMNcclClient) and c.weight_backend == "nccl" and c.update_pause_mode == "wait"
    assert not c.supports_staging
    c = weight_client(load_run_config("tiny", []), "gloo", "vllm-0", "http://127.0.0.1:1")
    assert type(c) is VLLMWeightClient and c.weight_backend != "nccl"
    c = weight_client(load_run_config("gpu-tiny", ["rollout.engine=sglang"]), "nccl", "sglang-0", "http://127.0.0.1:1")
    assert isinstance(c, SGLangPublishClient) and c.group_ranks == 1
    with pytest.raises(ValueError, match="'vllm' or 'sglang'"):
        weight_client(load_run_config("tiny", ["rollout.engine=local"]), "gloo", "x", "http://127.0.0.1:1")


@pytest.mark.parametrize("impl, backend", [("auto", "fleetrl"), ("torch", "fleetrl"), ("vllm", "nccl")])
def test_vllm_server_weight_backend_follows_nccl_impl(tmp_path, monkeypatch, impl, backend):
    import torch

    from engines.vllm.factory import VLLMFactory

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the GPU choice, decided without a GPU
    cfg = load_run_config("gpu-tiny", [f"weight_sync.nccl_impl={impl}"])
    server = VLLMFactory(cfg, tmp_path, {0: ("node", [1])})._server(0)
    assert server.weight_backend == backend
    i = server.command().index("--weight-transfer-config")
    assert f'"backend": "{backend}"' in server.command()[i + 1]


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["rollout.engine=sglang", "weight_sync.nccl_impl=torch"], "does not fit"),
        (["weight_sync.nccl_impl=sglang"], "does not fit"),
        (["weight_sync.staging=true", "weight_sync.nccl_impl=vllm"], "staging needs"),
        (["weight_sync.staging=true", "rollout.engine=sglang", "weight_sync.nccl_impl=sglang"], "does not fit"),
    ],
)
def test_weight_sync_choices_that_do_not_fit_the_fleet_are_refused(overrides, match):
    from launch.config import ConfigError

    with pytest.raises((ConfigError, ValueError), match=match):
        load_run_config("gpu-tiny", overrides)


def test_staging_on_a_vllm_fleet_loads():
    cfg = load_run_config("gpu-tiny", ["weight_sync.staging=true"])
    assert cfg.weight_sync.staging and cfg.weight_sync.resolved_nccl_impl("vllm") == "torch"


def test_staging_on_an_sglang_fleet_uses_fleetrl_loader():
    from packaging.version import Version

    from engines.registry import weight_client
    from engines.sglang.loader import LOADER
    from engines.sglang.server import SGLangServer, SGLangServerArgs

    cfg = load_run_config("gpu-tiny", ["weight_sync.staging=true", "rollout.engine=sglang"])
    assert cfg.weight_sync.resolved_nccl_impl("sglang") == "torch"  # fleetrl's group, not SGLang's
    client = weight_client(cfg, "nccl", "sglang-0", "http://127.0.0.1:1")
    assert client.supports_staging
    direct = weight_client(load_run_config("gpu-tiny", ["rollout.engine=sglang"]), "nccl", "s", "http://x:1")
    assert not direct.supports_staging
    cmd = SGLangServer(SGLangServerArgs(model="m", gpus=[0], port=1)).command(Version("0.5.16"))
    assert cmd[cmd.index("--custom-weight-loader") + 1] == LOADER


def test_sglang_factory_server_args(tmp_path):
    from packaging.version import Version

    from engines.sglang.factory import SGLangFactory
    from engines.sglang.server import compat_args

    cfg = load_run_config("gpu-tiny", ["rollout.engine=sglang", "rollout.sglang_server_args=[--log-level, debug]"])
    args = SGLangFactory(cfg, tmp_path, {0: ("node", ["1"])})._args(0)
    assert args.gpus == [1] and args.dtype == "bfloat16" and not args.radix_cache
    assert args.env["NCCL_CUMEM_ENABLE"] == "0"
    assert args.extra_args[-2:] == ["--log-level", "debug"]
    assert args.mem_fraction_static == cfg.rollout.gpu_memory_utilization
    from engines.sglang.server import SGLangServer

    cmd = SGLangServer(args).command(Version("0.5.16"))
    assert "--disable-radix-cache" in cmd and all(a in cmd for a in compat_args(Version("0.5.16")))
    with pytest.raises(ValueError, match="needs GPUs"):
        SGLangFactory(cfg, tmp_path, {})._args(0)
