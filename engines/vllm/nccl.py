"""GPU adapters for vLLM's built-in NCCL weight-transfer backend (vLLM 0.26 and newer).

Two things differ from the CPU (gloo) path of :mod:`engines.vllm.weights`:

* **Where the packed-transfer settings travel.** vLLM 0.26's
  ``NCCLWeightTransferInitInfo`` holds only ``master_address, master_port,
  rank_offset, world_size``; ``packed``, ``packed_buffer_size_bytes`` and
  ``packed_num_buffers`` belong to every update (``NCCLWeightTransferUpdateInfo``,
  default ``packed=False`` = one broadcast per tensor). vLLM 0.32 moved them into the
  init info and rejects them in the update. :class:`VLLMNcclClient` sends each
  where the installed vLLM wants it.
* **Version labels.** vLLM 0.26 has no ``/update_weight_version``: a load from disk
  is only ``reload_weights`` on every worker plus a prefix-cache reset.

The publisher's side (vLLM's PyNccl group) is ``weight_sync.vllm_nccl.VllmNcclGroup``
(``WeightSyncConfig.nccl_impl = "vllm"``). Packed chunks equal fleetrl's buckets for
``packed_buffer_size_bytes = weight_sync.plan.packed_buffer_bytes(plan)``.
"""

from __future__ import annotations

import logging

from packaging.version import Version

from engines.vllm.server import check_vllm_version
from engines.vllm.weights import VLLMWeightClient
from weight_sync.messages import GroupInfo, WeightPlan

log = logging.getLogger(__name__)

_PACKED_KEYS = ("packed", "packed_buffer_size_bytes", "packed_num_buffers")
_PACKED_IN_INIT = Version("0.27")  # 0.26: packed settings per update; 0.32 (checked): in the init info


def packed_in_init(vllm_version: str) -> bool:
    return Version(vllm_version.split("+")[0]) >= _PACKED_IN_INIT


class VLLMNcclClient(VLLMWeightClient):
    """:class:`VLLMWeightClient` for the NCCL backend of whichever supported vLLM is installed."""

    def __init__(self, engine_id: str, url: str, *, model: str, vllm_version: str | None = None, **kw) -> None:
        super().__init__(engine_id, url, model=model, weight_backend="nccl", **kw)
        self._packed_in_init = packed_in_init(vllm_version or check_vllm_version())
        self._packed: dict = {}

    def _init_info(self, group: GroupInfo, plan: WeightPlan) -> dict:
        info = super()._init_info(group, plan)
        if not self._packed_in_init:
            self._packed = {k: info.pop(k) for k in _PACKED_KEYS if k in info}
        return info

    def _update_info(self, version: int, plan_id: str) -> dict:
        info = super()._update_info(version, plan_id)
        if not self._packed_in_init:
            info.update(self._packed)
        else:
            for k in _PACKED_KEYS:
                info.pop(k, None)
        return info

    async def load_weights_from_path(self, path: str, version: int) -> None:
        if self._packed_in_init:
            return await super().load_weights_from_path(path, version)
        # vLLM 0.26 has no /update_weight_version: reload on every worker, then drop stale KV.
        paused_here = not self._paused
        if paused_here:
            await self.pause("keep")
        await self._request(
            "POST",
            "/collective_rpc",
            json={"method": "reload_weights", "kwargs": {"weights_path": path}},
            timeout_s=self.request_timeout_s,
        )
        await self.reset_prefix_cache()
        self._version = version
        if paused_here:
            await self.resume()
