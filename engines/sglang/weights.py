"""The learner's client of one SGLang server: weight transfer (:class:`SGLangWeightClient`); the server process is
:mod:`engines.sglang.server`, the server-control base both roles share :mod:`engines.sglang.handle`.

Weights come from fleetrl's publisher over SGLang's own distributed update:
``/init_weights_update_group`` joins a torch NCCL group (rank ``rank_offset +
tp_rank``; every TP rank receives the full tensors and shards them itself),
then each bucket of the fixed plan is one ``/update_weights_from_distributed``
call with ``load_format="flattened_bucket"``: one broadcast of a uint8 buffer
holding the bucket's tensors back to back, byte for byte
:func:`weight_sync.plan.pack_bucket`'s layout. SGLang >= 0.5.23 additionally
wants the calls between ``/begin_weight_update`` and ``/end_weight_update``;
the client finds out which API the server has at start.

One weight update, engine side (what the fleet controller drives)::

    pause(mode) -> [begin] -> update bucket 0 .. k-1 (each meets one publisher broadcast)
                -> [end] -> flush_cache -> continue_generation

With ``staging`` (``weight_sync.staging``), weights go instead through fleetrl's
loader in SGLang's workers (:mod:`engines.sglang.loader`, registered with
``--custom-weight-loader``) over fleetrl's own group (publisher ``nccl_impl='torch'``);
the engine is held only for the commit, and the bytes cross the wire while it
generates::

    begin_update:  a stage request in fleetrl's store -> each worker's request thread posts the receives
    ... the publisher broadcasts; the engine generates ...
    commit_update: pause(in_place) -> /update_weights_from_tensor [commit: copy into the model] -> continue
                   or, with between_steps (TP=1): a commit request in the store -> the worker's next
                   forward first copies into the model (no pause; an idle engine gets the loader call)

Versions: SGLang 0.5.16 (the release built for torch 2.11) to 0.5.23 are
supported; :func:`engines.sglang.server.check_sglang_version` fails fast otherwise.

NCCL: every process of one weight-sync group must agree on
``NCCL_CUMEM_ENABLE``. SGLang sets it to 0 in its own process when unset, a
plain torch learner leaves NCCL's default (1); peers that disagree fail in the
first broadcast with ``unhandled cuda error ... invalid argument``. The server
started here gets ``NCCL_CUMEM_ENABLE=0`` and :func:`weight_sync.sglang_group.publisher_nccl_env` says
what the learner process must set before its first NCCL call.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
from typing import Any

from packaging.version import Version

from engines.base import EngineError, PauseMode
from engines.sglang.handle import SGLangHandle
from weight_sync.endpoint import WeightEndpoint
from weight_sync.messages import GroupInfo, WeightPlan
from weight_sync.sglang_group import sglang_group_name

log = logging.getLogger(__name__)

_SESSION_API = Version("0.5.23")  # update_weights_from_distributed must sit inside begin/end_weight_update


class SGLangWeightClient(SGLangHandle, WeightEndpoint):
    """Weight transfer into one SGLang server (any TP size)."""

    def __init__(
        self,
        engine_id: str,
        url: str,
        *,
        tp_size: int = 1,
        version: str | None = None,
        staging: bool = False,
        between_steps: bool = True,
        **kw,
    ) -> None:
        """``version``: the server's SGLang (None: asked of the server at the first join); ``staging``: weights
        arrive through fleetrl's loader in the server's workers (the server must run
        with :data:`engines.sglang.loader.LOADER` as ``--custom-weight-loader``, as
        :class:`~engines.sglang.server.SGLangServer` starts it) and the publisher's group is fleetrl's own (``nccl_impl='torch'``).
        ``between_steps`` (TP=1, on by default): a commit to an engine that is not paused runs before the
        worker's next forward instead of in an ``in_place`` pause and SGLang's loader call (how long the
        engine is held either way: bench/results/engines_gpu.md). With ``rollout.weight_update='pause'`` the controller pauses the
        engine first, and the commit goes through the loader as without it. ``kw``:
        :class:`~engines.sglang.handle.SGLangHandle`'s."""
        super().__init__(engine_id, url, **kw)
        self.group_ranks = tp_size  # ranks this engine holds in the weight-sync group
        self._version_str = version
        self._session_api: bool | None = None
        self._plan: WeightPlan | None = None
        self._group: GroupInfo | None = None
        self.staging = staging
        self._store: Any = (
            None  # a torch TCPStore: fleetrl's weight-sync store, where the loader leaves its outcomes (staging)
        )
        self._store_at: tuple[str, int] | None = None
        self._seq = 0
        self._req_n = 0
        self._req_keys: list[str] = []
        self.between_steps = between_steps
        self.between_steps_wait_s = 0.25  # an engine that generates runs a forward every few milliseconds
        self._call_laps: dict[str, float] = {}
        self._stage_steps: dict[str, float] = {}

    # -- joining and direct updates -------------------------------------------------------------------------------
    async def _detect_session_api(self) -> bool:
        if self._session_api is None:
            if self._version_str:
                self._session_api = Version(self._version_str) >= _SESSION_API
            else:  # attached to a running server: ask it which routes it has
                r = await self.http.get(self.url + "/openapi.json", timeout=self.control_timeout_s)
                self._session_api = r.status_code == 200 and "/begin_weight_update" in r.text
        return self._session_api

    async def init_weight_transfer(self, group: GroupInfo, plan: WeightPlan) -> None:
        if self.staging:  # fleetrl's receivers take gloo too (the CPU tests' stand-in server)
            return await self._loader_join(group, plan)
        if group.backend not in ("nccl", "gloo"):  # gloo: colocated mode, learner and server on one GPU
            raise EngineError(
                f"engine {self.engine_id}: SGLang receives weights over NCCL or gloo, not {group.backend!r}"
            )
        await self._detect_session_api()
        if self._group is not None:
            try:  # leave the previous epoch's group so its communicator is freed
                await self._control(
                    "/destroy_weights_update_group", {"group_name": sglang_group_name(self._group.group_epoch)}
                )
            except EngineError as e:
                log.debug("engine %s: destroying the old update group failed: %s", self.engine_id, e)
        await self._control(
            "/init_weights_update_group",
            {
                "master_address": group.master_addr,
                "master_port": group.master_port,
                "rank_offset": group.rank_offset,
                "world_size": group.world_size,
                "group_name": sglang_group_name(group.group_epoch),
                "backend": group.backend,
            },
        )
        self._group, self._plan = group, plan

    async def update_weights(self, version: int, plan_id: str) -> str:
        """One call per bucket, in plan order; each returns once its broadcast has landed and loaded.

        The cache is flushed by :meth:`reset_prefix_cache`, not here: SGLang >= 0.5.23 fails an
        update whose flush is refused (requests queued during an in-flight update).
        """
        plan, group = self._check_plan(version, plan_id)
        if self.staging:  # through fleetrl's loader: stage, then a commit that waits for the bytes in the engine
            await self.begin_update(version, plan_id)
            return await self.commit_update(version)
        name = sglang_group_name(group.group_epoch)
        if self._session_api:
            await self._control("/begin_weight_update", {})
        for b, idx in enumerate(plan.buckets):
            last = b == len(plan.buckets) - 1
            await self._control(
                "/update_weights_from_distributed",
                {
                    "names": [plan.names[i] for i in idx],
                    "dtypes": [plan.dtypes[i] for i in idx],
                    "shapes": [plan.shapes[i] for i in idx],
                    "group_name": name,
                    "load_format": "flattened_bucket",
                    "flush_cache": False,
                    "weight_version": str(version) if last else None,
                },
                self.timeout_s,
            )
        if self._session_api:
            await self._control("/end_weight_update", {})
        self._version = version
        return ""  # SGLang's own update computes no checksum; tests compare outputs instead

    def _check_plan(self, version: int, plan_id: str) -> tuple[WeightPlan, GroupInfo]:
        """The joined plan and group, if ``plan_id`` is that plan."""
        plan, group = self._plan, self._group
        if plan is None or group is None:
            raise EngineError(f"engine {self.engine_id}: update_weights(v{version}) before init_weight_transfer")
        if plan_id != plan.plan_id:
            raise EngineError(f"engine {self.engine_id}: publish uses plan {plan_id!r}, announced {plan.plan_id!r}")
        return plan, group

    # -- staged updates: fleetrl's loader in SGLang's workers (engines/sglang/loader.py) ------------------
    @property
    def supports_staging(self) -> bool:
        return self.staging

    async def _loader_join(self, group: GroupInfo, plan: WeightPlan) -> None:
        from weight_sync import group as wgroup
        from weight_sync.plan import plan_to_dict

        at = (group.master_addr, group.master_port)
        if self._store_at != at:  # the publisher's store: the loader leaves its outcomes there
            self._store = await asyncio.to_thread(wgroup.connect_store, *at, min(self.control_timeout_s, 30.0))
            self._store_at = at
        self._group = self._plan = None  # until this join succeeds
        g = {
            "master_addr": group.master_addr,
            "master_port": group.master_port,
            "rank_offset": group.rank_offset,
            "world_size": group.world_size,
            "group_epoch": group.group_epoch,
            "backend": group.backend,
        }
        await self._loader_call("join", self.control_timeout_s + 10, group=g, plan=plan_to_dict(plan))
        self._group, self._plan = group, plan
        self._req_n, self._req_keys = 0, []  # requests are counted per join: the workers' threads count alike

    async def _loader_call(self, cmd: str, timeout_s: float, **args) -> tuple[list[dict], float]:
        """Run ``cmd`` in every TP worker inside an ``in_place`` pause (the running batch is frozen, not
        retracted; none if the engine is paused already). Returns the workers' outcomes and how long
        generation was held. A failed commit leaves the engine paused: its weights may be half loaded."""
        from engines.sglang import loader

        if self._store is None or self._store_at is None:
            raise EngineError(f"engine {self.engine_id}: {cmd} before init_weight_transfer")
        store_addr, store_port = self._store_at
        seq = args.pop("seq", None)
        if seq is None:
            self._seq += 1
            seq = self._seq
        caller = self._caller()
        body = {
            "serialized_named_tensors": [
                loader.payload(
                    cmd,
                    engine_id=caller,
                    seq=seq,
                    timeout_s=self.control_timeout_s,
                    store={"addr": store_addr, "port": store_port},
                    **args,
                )
            ]
            * self.group_ranks,
            "load_format": loader.LOADER,
            "flush_cache": False,
        }
        if cmd == "commit":
            body["weight_version"] = str(args["version"])
        t0 = time.perf_counter()
        laps = self._call_laps = {}
        freeze = not self._paused
        if freeze:
            await self._post("/pause_generation", {"mode": "in_place"})
            self._paused = "frozen"
            laps["pause"] = time.perf_counter() - t0
        try:
            t1 = time.perf_counter()
            await self._control("/update_weights_from_tensor", body, timeout_s)
            t2 = time.perf_counter()
            laps["call"] = t2 - t1
            outs = await self._outcomes(seq, f"fleetrl {cmd}")
            if "t_enter" in outs[0]:  # same host: how long SGLang took to bring the call to the loader and back
                laps["to_loader"] = outs[0]["t_enter"] - t1
                laps["from_loader"] = t2 - outs[0]["t_exit"]
        except EngineError as e:
            if cmd == "commit":
                raise EngineError(
                    f"{e} (engine {self.engine_id} stays paused: its weights may be partly loaded)"
                ) from e
            if freeze:
                await self.resume()
            raise
        if freeze or (cmd == "commit" and self._paused == "frozen"):  # a good commit ends an earlier failure's freeze
            t1 = time.perf_counter()
            await self.resume()
            laps["continue"] = time.perf_counter() - t1
        return outs, time.perf_counter() - t0

    async def _ask(self, cmd: str, **args) -> int:
        """Leave a stage or commit request in the store for the workers' request threads; returns its seq."""
        from engines.sglang import loader

        if self._group is None or self._store is None:
            raise EngineError(f"engine {self.engine_id}: {cmd} before the loader joined a weight-sync group")
        self._seq += 1
        self._req_n += 1
        key = loader.request_key(self._group.group_epoch, self._group.rank_offset, self._req_n)
        await asyncio.to_thread(
            self._store.set, key, loader.request(cmd, engine_id=self._caller(), seq=self._seq, **args)
        )
        self._req_keys.append(key)
        return self._seq

    async def _outcomes_within(self, seq: int, what: str, wait_s: float) -> list[dict] | None:
        """The TP workers' outcomes of request ``seq``; ``None`` if ``wait_s`` passes without them."""
        from engines.sglang import loader

        keys = [loader.outcome_key(self._caller(), seq, r) for r in range(self.group_ranks)]
        try:
            await asyncio.to_thread(self._store.wait, keys, datetime.timedelta(seconds=wait_s))
        except Exception:  # noqa: BLE001 - not there within wait_s
            return None
        return await self._outcomes(seq, what)

    async def _outcomes(self, seq: int, what: str) -> list[dict]:
        """The TP workers' outcomes of request ``seq`` (waits for them within the store's timeout)."""
        from engines.sglang import loader

        try:
            outs = await asyncio.to_thread(loader.read_outcomes, self._store, self._caller(), seq, self.group_ranks)
        except Exception as e:  # noqa: BLE001 - the store or a worker's thread is gone: this engine fails
            raise EngineError(f"engine {self.engine_id}: {what} failed: {e}") from e
        bad = [f"TP worker {r}: {o.get('error')}" for r, o in enumerate(outs) if not o.get("ok")]
        if bad:
            raise EngineError(f"engine {self.engine_id}: {what} failed: {'; '.join(bad)}")
        return outs

    async def begin_update(self, version: int, plan_id: str) -> None:
        """Have the workers post the receives of ``version`` into their standing buffers. This goes
        through fleetrl's store to a thread in each worker, not through SGLang: the engine is not held."""
        self._check_plan(version, plan_id)
        t0 = time.perf_counter()
        seq = await self._ask("stage", version=version, plan_id=plan_id)
        outs = await self._outcomes(seq, f"stage of v{version}")
        self._stage_steps = {"stage": time.perf_counter() - t0, "stage_in_engine": max(o["stage_s"] for o in outs)}

    def _caller(self) -> str:
        return f"{self.engine_id}.{id(self):x}"  # a fresh client never reads an old client's outcomes

    async def commit_update(self, version: int) -> str:
        """Copy the staged ``version`` into the model; returns the checksum. Through the loader inside an
        ``in_place`` freeze; with ``between_steps`` (TP=1) the worker runs it before its next forward (no
        pause, no SGLang call), and only if no forward comes within ``between_steps_wait_s`` (an idle
        engine) through the loader."""
        t0 = time.perf_counter()
        outs, held, laps = None, 0.0, {}
        if self.between_steps and self.group_ranks == 1 and not self._paused:
            seq = await self._ask("commit", version=version)
            outs = await self._outcomes_within(seq, f"commit of v{version}", self.between_steps_wait_s)
            if outs is not None:
                held = max(o["commit_s"] for o in outs)  # the step it ran before was delayed by this
                laps["commit_between_steps_s"] = time.perf_counter() - t0
        else:
            seq = None
        if outs is None:  # through SGLang: the loader runs it (or finds the forward hook did, and its outcome)
            outs, held = await self._loader_call("commit", self.timeout_s, version=version, seq=seq)
            laps = {f"commit_{k}_s": v for k, v in self._call_laps.items()}
        sums = {o["checksum"] for o in outs}
        if len(sums) != 1:
            raise EngineError(f"engine {self.engine_id}: TP workers disagree after v{version}: {outs}")
        steps = {
            **self._stage_steps,
            "commit_held": held,
            "commit_in_engine": max(o["commit_s"] for o in outs),
            "commit_replayed": float(outs[0].get("replayed_buckets", 0)),
            "commit_between_steps": float(bool(outs[0].get("between_steps"))),
            **laps,
        }
        for part, sec in (outs[0].get("commit_parts") or {}).items():
            steps[f"commit_{part}"] = sec
        steps["unavailable_s"] = held  # the stage held nothing: it ran in the workers' own threads
        self.last_update_steps, self._stage_steps = steps, {}
        self._version = version
        await self._forget_requests()
        return sums.pop()

    async def _forget_requests(self) -> None:
        keys, self._req_keys = self._req_keys, []
        for key in keys:  # served: a few bytes each, but a long run makes many
            try:
                await asyncio.to_thread(self._store.delete_key, key)
            except Exception:  # noqa: BLE001 - best effort
                pass


class SGLangPublishClient(SGLangWeightClient):
    """The learner's client of one SGLang server: update choreography around the bucket calls.

    Weight updates without a pause: SGLang's ``/update_weights_from_distributed``, called
    while generation is not paused, takes the server's model-update writer lock, which
    waits for running requests to finish and holds new ones back (a writer-preferring lock,
    ``sglang/srt/utils/aio_rwlock.py``): the same "finish under the old weights, then load"
    as vLLM's ``pause(wait)``. A plan of several buckets is several calls, and requests
    could start between two of them on half-new weights, so then the client pauses with
    ``abort`` first (the fleet re-runs aborted groups). The fleet's servers run without the
    radix cache: with it, KV computed under old weights would be reused after an update, and
    SGLang refuses ``/flush_cache`` while requests are queued.
    """

    async def update_weights(self, version: int, plan_id: str) -> str:
        several = self._plan is not None and len(self._plan.buckets) > 1
        if several:  # no request may run on half-new weights between two bucket calls
            await self.pause(PauseMode.ABORT)
        try:
            return await super().update_weights(version, plan_id)
        finally:
            if several:
                await self.resume()
