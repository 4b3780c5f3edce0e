"""The vLLM client of CUDA IPC weight loads (colocated mode on one GPU): :class:`VLLMIpcClient`.

The server runs fleetrl's weight-transfer backend (``--weight-transfer-config '{"backend": "fleetrl"}'``,
engines/vllm/plugin.py) as for gloo; only the messages differ. One publish, as
:class:`weight_sync.ipc_publisher.IpcPublisher` drives it::

    ipc_join:  /init_weight_transfer_engine {backend: "ipc", plan, ipc: IpcInit}   (once per epoch)
    ipc_begin: [pause(wait)] -> /start_weight_update
    ipc_load:  /update_weights {version, plan_id, extra: {ipc: IpcLoad}}            (once per round)
    ipc_end:   /finish_weight_update -> [reset_prefix_cache] -> checksum (/collective_rpc) -> [resume]

A failure anywhere after the pause leaves the server paused (its weights may be half loaded) until a
later load succeeds, as :class:`engines.vllm.weights.VLLMWeightClient` does.
"""

from __future__ import annotations

import msgspec

from engines.base import EngineError
from engines.vllm.weights import VLLMWeightClient, _Laps
from weight_sync.ipc import IpcInit, IpcLoad
from weight_sync.ipc_publisher import IpcEndpoint
from weight_sync.messages import WeightPlan
from weight_sync.plan import plan_to_dict


class VLLMIpcClient(VLLMWeightClient, IpcEndpoint):
    """:class:`VLLMWeightClient` whose weights come from the learner's CUDA IPC slots on the same GPU."""

    def __init__(self, engine_id: str, url: str, *, model: str, **kw) -> None:
        super().__init__(engine_id, url, model=model, weight_backend="fleetrl", **kw)
        self._pause_here = False
        self._laps: _Laps | None = None

    async def ipc_join(self, plan: WeightPlan, init: IpcInit, epoch: int) -> None:
        self._plan = plan
        info = {
            "master_address": "",
            "master_port": 0,
            "rank_offset": 0,
            "world_size": 1,
            "group_epoch": epoch,
            "plan": plan_to_dict(plan),
            "engine_id": self.engine_id,
            "timeout_s": init.timeout_s,
            "backend": "ipc",
            "ipc": msgspec.to_builtins(init),
        }
        await self._request(
            "POST", "/init_weight_transfer_engine", json={"init_info": info}, timeout_s=self._join_timeout_s + 10
        )

    async def ipc_begin(self, version: int) -> None:
        self._laps = lap = _Laps()
        self._pause_here = self._stuck or not await self.is_paused()
        lap("is_paused")
        if self._pause_here:
            self._stuck = True  # ours until the publish succeeds (see VLLMWeightClient.update_weights)
            await self.pause(self.update_pause_mode)
            lap("pause")
        await self._start_session()
        lap("start_weight_update")

    async def ipc_load(self, msg: IpcLoad) -> None:
        self._update_info(msg.version, msg.plan_id)  # the plan check
        info = {"version": msg.version, "plan_id": msg.plan_id, "extra": {"ipc": msgspec.to_builtins(msg)}}
        try:
            await self._request("POST", "/update_weights", json={"update_info": info}, timeout_s=self.request_timeout_s)
        except EngineError as e:
            raise EngineError(f"{e} (engine {self.engine_id} stays paused: its weights may be partly loaded)") from e
        if self._laps is not None:
            self._laps(f"update_weights_{msg.loads[0][0]}")

    async def ipc_end(self, version: int) -> str:
        lap = self._laps or _Laps()
        try:
            await self._request("POST", "/finish_weight_update", json={"weight_version": str(version)})
            lap("finish_weight_update")
            if not self._pause_emptied_cache(self._pause_here):
                await self.reset_prefix_cache()
                lap("reset_prefix_cache")
            checksum = await self._checksum(version)
            lap("checksum")
        except EngineError as e:
            raise EngineError(f"{e} (engine {self.engine_id} stays paused: its weights may be partly loaded)") from e
        self._version = version
        if self._pause_here:
            await self.resume()
            lap("resume")
        self._stuck = False
        self.last_update_steps = lap.steps
        return checksum

    async def update_weights(self, version: int, plan_id: str) -> str:
        raise EngineError(
            f"engine {self.engine_id}: takes its weights by CUDA IPC (ipc_begin/ipc_load/ipc_end), "
            "not from a weight-sync group"
        )
