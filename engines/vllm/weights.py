"""The learner's client of one vLLM server: weight transfer (:class:`VLLMWeightClient`).

The server runs a weight-transfer backend: fleetrl's ``fleetrl`` (:mod:`engines.vllm.plugin`; gloo on CPU,
NCCL on GPU) or vLLM's built-in ``nccl`` (GPU, :mod:`engines.vllm.nccl`). The client takes weights through
vLLM's weight-update choreography::

    pause(wait|keep) -> start_weight_update -> update_weights (the broadcast) ->
    finish_weight_update(version) -> [reset_prefix_cache] -> [checksum] -> resume

(the reset is skipped after a ``wait`` pause, which already emptied the cache)

or, with ``weight_sync.staging`` (fleetrl's backend), a staged update that
leaves the server generating while the bytes arrive::

    begin_update: /collective_rpc fleetrl_stage_begin (post the receives) ... broadcast ...
    commit_update: [pause(wait)] -> /collective_rpc fleetrl_stage_commit (load) -> [reset_prefix_cache]
                   -> label the version -> [resume]

A failed update leaves the engine paused: its model may be half loaded, so it
must not generate until a later update or load succeeds. Colocated on one GPU, weights come by CUDA IPC
instead (:mod:`engines.vllm.ipc`).

Example::

    client = VLLMWeightClient("vllm-0", server.url, model="models/tiny-adder")
    pub = Publisher(cfg.weight_sync, plan, engines=[client])   # learner rank 0
"""

from __future__ import annotations

import logging
import time

from engines.base import EngineError
from engines.vllm.handle import VLLMHandle
from weight_sync.endpoint import WeightEndpoint
from weight_sync.messages import GroupInfo, WeightPlan

log = logging.getLogger(__name__)


class _Laps:
    """Seconds per step of a weight update, each since the previous one: where its unavailability goes."""

    def __init__(self, steps: dict[str, float] | None = None) -> None:
        self.steps = dict(steps or {})
        self._t = time.perf_counter()

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.steps[name], self._t = now - self._t, now


class VLLMWeightClient(VLLMHandle, WeightEndpoint):
    """Weight transfer into one vLLM server; one instance per event loop (its HTTP session binds to the loop)."""

    def __init__(
        self, engine_id: str, url: str, *, model: str, weight_backend: str = "fleetrl", group_ranks: int = 1, **kw
    ) -> None:
        """``weight_backend``: the server's (``fleetrl``, or vLLM's ``nccl``); ``group_ranks``: the server's
        workers (TP x PP), each a rank of the weight-sync group. ``kw``: :class:`~engines.vllm.handle.VLLMHandle`'s."""
        if weight_backend not in ("fleetrl", "fleetrl_gloo", "nccl"):
            raise ValueError(
                "weight_backend must be 'fleetrl' (fleetrl's receiver, gloo or NCCL; 'fleetrl_gloo' is "
                f"its older name) or 'nccl' (vLLM's built-in, GPU), got {weight_backend!r}"
            )
        super().__init__(engine_id, url, model=model, **kw)
        self.weight_backend = weight_backend
        self.group_ranks = group_ranks
        self._plan: WeightPlan | None = None
        self._join_timeout_s = self.timeout_s
        self._stage_steps: dict[str, float] = {}

    def _init_info(self, group: GroupInfo, plan: WeightPlan) -> dict:
        from weight_sync.plan import packed_buffer_bytes, plan_to_dict

        if self.weight_backend == "nccl":
            # vLLM's built-in NCCL backend: its packed chunks equal our buckets for this buffer size.
            return {
                "master_address": group.master_addr,
                "master_port": group.master_port,
                "rank_offset": group.rank_offset,
                "world_size": group.world_size,
                "packed": True,
                "packed_buffer_size_bytes": packed_buffer_bytes(plan),
                "packed_num_buffers": 2,
            }
        return {
            "master_address": group.master_addr,
            "master_port": group.master_port,
            "rank_offset": group.rank_offset,
            "world_size": group.world_size,
            "group_epoch": group.group_epoch,
            "plan": plan_to_dict(plan),
            "engine_id": self.engine_id,
            "timeout_s": self._join_timeout_s,
            "backend": group.backend,
        }

    async def init_weight_transfer(self, group: GroupInfo, plan: WeightPlan) -> None:
        self._plan = plan
        await self._request(
            "POST",
            "/init_weight_transfer_engine",
            json={"init_info": self._init_info(group, plan)},
            timeout_s=self._join_timeout_s + 10,
        )

    def _update_info(self, version: int, plan_id: str) -> dict:
        plan = self._plan
        if plan is None or plan.plan_id != plan_id:
            raise EngineError(
                f"engine {self.engine_id}: update_weights(v{version}) with plan {plan_id!r} but the "
                f"announced plan is {plan.plan_id if plan else None!r}"
            )
        if self.weight_backend == "nccl":
            return {"names": plan.names, "dtype_names": plan.dtypes, "shapes": plan.shapes}
        return {"version": version, "plan_id": plan_id}

    async def update_weights(self, version: int, plan_id: str) -> str:
        info = self._update_info(version, plan_id)
        lap = _Laps()
        # Ask the server, not this instance: the fleet may have paused it through another client.
        pause_here = self._stuck or not await self.is_paused()
        lap("is_paused")
        if pause_here:
            # Ours until this load succeeds: if it fails, or the publish cancels this call because a peer
            # failed, the server stays paused (its weights may be partly loaded) and the next load resumes
            # it. Marked before the pause: a cancel can land while it is on the wire.
            self._stuck = True
            await self.pause(self.update_pause_mode)
            lap("pause")
        try:
            await self._start_session()
            lap("start_weight_update")
            await self._request("POST", "/update_weights", json={"update_info": info}, timeout_s=self.request_timeout_s)
            lap("update_weights")
            await self._request("POST", "/finish_weight_update", json={"weight_version": str(version)})
            lap("finish_weight_update")
            # KV computed with the old weights must not be reused. A 'wait'/'abort' pause of ours already
            # emptied the prefix cache and nothing has been scheduled since: a second reset only costs time.
            if not self._pause_emptied_cache(pause_here):
                await self.reset_prefix_cache()
                lap("reset_prefix_cache")
            checksum = await self._checksum(version)
            lap("checksum")
        except EngineError as e:
            raise EngineError(f"{e} (engine {self.engine_id} stays paused: its weights may be partly loaded)") from e
        self._version = version
        if pause_here:
            await self.resume()
            lap("resume")
        self._stuck = False
        self.last_update_steps = lap.steps
        return checksum

    async def _start_session(self) -> None:
        """``/start_weight_update``, first closing a session that an earlier load left open.

        vLLM's worker refuses a start while its update session is active ("start_weight_update called while a
        weight update is already active", vLLM 0.26 and 0.32). A load cancelled after its start and before its
        finish (the publish aborted because another engine failed) leaves the session open for good, and every
        later publish into this server failed on it: seen on the emulated cluster (2026-12-08), the surviving
        server stayed paused at an old version. Closing that session finishes a load this one overwrites in full
        (the server stays paused meanwhile), so nothing half-loaded is ever served."""
        try:
            await self._request("POST", "/start_weight_update")
            return
        except EngineError as e:
            if "already active" not in str(e):
                raise
        log.warning("engine %s: a weight update left open by an interrupted load is finished first", self.engine_id)
        await self._request("POST", "/finish_weight_update", json={})
        await self._request("POST", "/start_weight_update")

    def _pause_emptied_cache(self, pause_here: bool) -> bool:
        """A 'wait'/'abort' pause of ours emptied the prefix cache, and nothing was scheduled since."""
        return pause_here and self.update_pause_mode in ("wait", "abort")

    # ---- staged publish (weight_sync.staging; fleetrl's backend only) ------------------
    @property
    def supports_staging(self) -> bool:
        return self.weight_backend != "nccl"

    async def begin_update(self, version: int, plan_id: str) -> None:
        """Post the receives of ``version`` (workers' staging copies); the server keeps generating."""
        self._update_info(version, plan_id)  # the plan check
        t = time.perf_counter()
        await self._request(
            "POST",
            "/collective_rpc",
            timeout_s=self._join_timeout_s,
            json={"method": "fleetrl_stage_begin", "kwargs": {"version": version, "plan_id": plan_id}},
        )
        self._stage_steps = {"stage_begin": time.perf_counter() - t}

    async def commit_update(self, version: int) -> str:
        """Load the staged ``version``. ``inflight`` (pause mode ``keep``): no pause at all, the engine core
        runs the commit between two steps; ``pause`` (``wait``): running requests finish first."""
        lap = _Laps(self._stage_steps)
        steps = lap.steps
        pause_here = self._stuck or (self.update_pause_mode != "keep" and not await self.is_paused())
        if pause_here:
            self._stuck = True  # ours until the commit succeeds (see update_weights)
            await self.pause(self.update_pause_mode)
            lap("pause")
        try:
            r = await self._request(
                "POST",
                "/collective_rpc",
                timeout_s=self.request_timeout_s,
                json={"method": "fleetrl_stage_commit", "kwargs": {"version": version}},
            )
            lap("commit")
            states = r.json()["results"]
            checksum = self._agreed_checksum(states, version)
            steps["commit_in_engine"] = max(st["commit_s"] for st in states)
            for part, sec in (states[0].get("commit_parts") or {}).items():  # wait / checksum / load
                steps[f"commit_{part}"] = sec
            steps["commit_replayed"] = float(states[0].get("replayed_buckets", 0))  # a count, not seconds
            if not self._pause_emptied_cache(pause_here):
                await self.reset_prefix_cache()
                lap("reset_prefix_cache")
            if await self.label_version(version):
                lap("label_version")
        except EngineError as e:
            # Unpaused, a half-loaded model would go on generating: stop it until a load succeeds.
            if not pause_here:
                try:
                    await self.pause("keep")
                except EngineError as pe:
                    log.error("engine %s: could not pause after a failed commit: %s", self.engine_id, pe)
            self._stuck = True
            raise EngineError(f"{e} (engine {self.engine_id} stays paused: its weights may be partly loaded)") from e
        self._version = version
        if pause_here:
            await self.resume()
            lap("resume")
        self._stuck = False
        self.last_update_steps = steps
        return checksum

    async def _checksum(self, version: int) -> str:
        if self.weight_backend == "nccl":
            return ""  # vLLM's NCCL backend reports none; the publisher accepts an empty ack
        r = await self._request("POST", "/collective_rpc", json={"method": "fleetrl_weight_sync_status"})
        return self._agreed_checksum(r.json()["results"], version)

    def _agreed_checksum(self, states: list[dict], version: int) -> str:
        """The one checksum every worker reports for ``version``; workers that disagree are an error."""
        sums = {st["checksum"] for st in states}
        if len(sums) != 1 or any(st["version"] != version for st in states):
            raise EngineError(f"engine {self.engine_id}: workers disagree after v{version}: {states}")
        return sums.pop()
