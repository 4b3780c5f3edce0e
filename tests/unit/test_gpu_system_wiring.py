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
    from launch.real_fleet import VLLMFactory

    cfg = load_run_config("gpu-tiny", [])
    server = VLLMFactory(cfg, tmp_path, {0: ("node", [1])})._server(0)
    cmd = server.command()
    i = cmd.index("--attention-backend")
    assert cmd[i + 1] == "TRITON_ATTN"
    assert server.args.env["CUDA_VISIBLE_DEVICES"] == "1" and server.args.env["NCCL_CUMEM_ENABLE"] == "0"


def test_publisher_client_follows_engine_and_backend():
    from launch.real_learner import publish_client
    from launch.real_sglang import SGLangPublishClient
    from rollout_fleet.engines.vllm import VLLMClient
    from rollout_fleet.engines.vllm_nccl import VLLMNcclClient

    vllm = load_run_config("gpu-tiny", [])
    c = publish_client(vllm, "nccl", "vllm-0", "http://127.0.0.1:1")
    assert isinstance(c, VLLMNcclClient) and c.weight_backend == "nccl" and c.update_pause_mode == "wait"
    c = publish_client(load_run_config("tiny", []), "gloo", "vllm-0", "http://127.0.0.1:1")
    assert type(c) is VLLMClient and c.weight_backend != "nccl"
    c = publish_client(load_run_config("gpu-tiny", ["rollout.engine=sglang"]), "nccl", "sglang-0", "http://127.0.0.1:1")
    assert isinstance(c, SGLangPublishClient) and c.group_ranks == 1
    with pytest.raises(ValueError, match="'vllm' or 'sglang'"):
        publish_client(load_run_config("tiny", ["rollout.engine=local"]), "gloo", "x", "http://127.0.0.1:1")


def test_sglang_factory_server_args(tmp_path):
    from launch.real_sglang import SGLangFactory
    from rollout_fleet.engines.sglang import compat_args
    from packaging.version import Version

    cfg = load_run_config("gpu-tiny", ["rollout.engine=sglang", "rollout.sglang_server_args=[--log-level, debug]"])
    args = SGLangFactory(cfg, tmp_path, {0: ("node", ["1"])})._args(0)
    assert args.gpus == [1] and args.dtype == "bfloat16" and not args.radix_cache
    assert args.env["NCCL_CUMEM_ENABLE"] == "0"
    assert args.extra_args[-2:] == ["--log-level", "debug"]
    assert args.mem_fraction_static == cfg.rollout.gpu_memory_utilization
    from rollout_fleet.engines.sglang import SGLangServer

    cmd = SGLangServer(args).command(Version("0.5.16"))
    assert "--disable-radix-cache" in cmd and all(a in cmd for a in compat_args(Version("0.5.16")))
    with pytest.raises(ValueError, match="needs GPUs"):
        SGLangFactory(cfg, tmp_path, {})._args(0)
