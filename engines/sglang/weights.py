"""SGLang engine client (:class:`SGLangClient`); the server process is :mod:`rollout_fleet.engines.sglang_server`.

Generation is SGLang's native ``/generate`` with ``input_ids`` (token in, token
out, no tokenizer in the loop: the server runs with ``--skip-tokenizer-init``),
``n`` samples and ``return_logprob``; the sampler's log-probs come back per
token in ``meta_info.output_token_logprobs``.

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
loader in SGLang's workers (:mod:`weight_sync.sglang_ext`, registered with
``--custom-weight-loader``) over fleetrl's own group (publisher ``nccl_impl='torch'``);
the engine is held only for the commit, and the bytes cross the wire while it
generates::

    begin_update:  a stage request in fleetrl's store -> each worker's request thread posts the receives
    ... the publisher broadcasts; the engine generates ...
    commit_update: pause(in_place) -> /update_weights_from_tensor [commit: copy into the model] -> continue
                   or, with between_steps (TP=1): a commit request in the store -> the worker's next
                   forward first copies into the model (no pause; an idle engine gets the loader call)

Colocated mode (``colocate.enabled``; the server runs with ``--enable-memory-saver``): the fleet's
sleep / wake calls become SGLang's memory release, and the publish comes over gloo on the same host
(NCCL between two processes on one GPU fails) through the same ``/update_weights_from_distributed``
calls, into the group SGLang's workers build with ``backend="gloo"``::

    sleep(level)       -> /release_memory_occupation {"tags": ["kv_cache", "weights"]}   (nothing may run)
    wake_up(weights)   -> /resume_memory_occupation {"tags": ["weights"]}   (contents are garbage: the
                          publish that follows brings every tensor)
    ... update_weights over gloo ...
    wake_up(kv_cache)  -> /resume_memory_occupation {"tags": ["kv_cache"]}

SGLang kills its scheduler on a release while a request runs (an assert) and on a resume of a tag
that is not released (``offload_tags.remove``), and does not refuse a generation while released: so
the client refuses all three itself, naming the engine.

Versions: SGLang 0.5.16 (the release built for torch 2.11) to 0.5.23 are
supported; :func:`rollout_fleet.engines.sglang_server.check_sglang_version` fails fast otherwise.

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

import httpx
import msgspec
import numpy as np
from packaging.version import Version

from core.net import HttpEngineClient
from rollout_fleet.engines.base import EngineClient, EngineError, PauseMode, Sample, SamplingParams
from rollout_fleet.engines.sglang_lora import load_adapter as sglang_load_adapter
from rollout_fleet.engines.vllm_lora import lora_name
from weight_sync.endpoint import WeightEndpoint
from weight_sync.messages import GroupInfo, WeightPlan
from weight_sync.sglang_group import sglang_group_name

log = logging.getLogger(__name__)

_SESSION_API = Version("0.5.23")  # update_weights_from_distributed must sit inside begin/end_weight_update
# What a colocated sleep releases (SGLang's GPU_MEMORY_TYPE_* tags; "cuda_graph" too only where graphs run
# under the memory saver, which compat_args turns off on 0.5.16), and what each fleet wake tag resumes.
RELEASE_TAGS = ("kv_cache", "weights")

class _Meta(msgspec.Struct):
    output_token_logprobs: list = []
    finish_reason: dict | None = None
    weight_version: str | None = None


class _Out(msgspec.Struct):
    output_ids: list[int]
    meta_info: _Meta


_decode_one = msgspec.json.Decoder(_Out)
_decode_many = msgspec.json.Decoder(list[_Out])


class SGLangClient(HttpEngineClient, EngineClient, WeightEndpoint):
    """EngineClient of one SGLang server (any TP size)."""

    def __init__(self, engine_id: str, url: str, *, tp_size: int = 1, version: str | None = None,
                 radix_cache: bool = True, timeout_s: float = 600.0, control_timeout_s: float = 120.0,
                 max_connections: int = 1024, staging: bool = False, between_steps: bool = True,
                 adapter_prefix: str | None = None) -> None:
        """``staging``: weights arrive through fleetrl's loader in the server's workers (the server must run
        with :data:`weight_sync.sglang_ext.LOADER` as ``--custom-weight-loader``, as
        :class:`~rollout_fleet.engines.sglang_server.SGLangServer` starts it) and the publisher's group is fleetrl's own (``nccl_impl='torch'``).
        ``between_steps`` (TP=1, on by default): a commit to an engine that is not paused runs before the
        worker's next forward instead of in an ``in_place`` pause and SGLang's loader call (how long the
        engine is held either way: bench/results/engines_gpu.md). With ``rollout.weight_update='pause'`` the controller pauses the
        engine first, and the commit goes through the loader as without it."""
        self.engine_id = engine_id
        self.url = url.rstrip("/")
        self.group_ranks = tp_size  # ranks this engine holds in the weight-sync group
        self.timeout_s, self.control_timeout_s = timeout_s, control_timeout_s
        self.radix_cache = radix_cache
        self._version = 0
        self._version_str = version
        self._session_api: bool | None = None
        self._plan: WeightPlan | None = None
        self._group: GroupInfo | None = None
        self._paused = ""
        self._released: set[str] = set()  # SGLang memory tags released by sleep() and not resumed yet
        self._releasing = False
        self._inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._http_limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self.staging = staging
        self._store = None  # fleetrl's weight-sync store, where the loader leaves its outcomes (staging)
        self._store_at: tuple[str, int] | None = None
        self._seq = 0
        self._req_n = 0
        self._req_keys: list[str] = []
        self.between_steps = between_steps
        self.between_steps_wait_s = 0.25  # an engine that generates runs a forward every few milliseconds
        self._call_laps: dict[str, float] = {}
        self._stage_steps: dict[str, float] = {}
        self.last_update_steps: dict[str, float] = {}
        self.adapter_prefix = adapter_prefix  # LoRA: version v > 0 is adapter '<prefix>-v<v>' (sglang_lora.py)

    async def _post(self, path: str, body: dict, timeout_s: float | None = None) -> bytes:
        r = await self._request("POST", path, timeout_s=timeout_s or self.control_timeout_s,
                                content=msgspec.json.encode(body), headers={"Content-Type": "application/json"})
        return r.content

    async def _control(self, path: str, body: dict, timeout_s: float | None = None) -> None:
        """POST a weight/control call whose answer is ``{"success": bool, "message": str}``."""
        raw = await self._post(path, body, timeout_s)
        reply = msgspec.json.decode(raw)
        if isinstance(reply, dict) and reply.get("success") is False:
            raise EngineError(f"engine {self.engine_id}: {path} failed: {reply.get('message')}")

    # -- generation ------------------------------------------------------------------------
    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> list[Sample]:
        # every processing field pinned: SGLang's --sampling-defaults=model would fill unset ones from the model
        sp = {"max_new_tokens": params.max_tokens, **params.processing()}
        if params.stop_token_ids:
            sp["stop_token_ids"] = list(params.stop_token_ids)
        if params.seed is not None and params.n > 1:
            # one seed for n parallel samples would make them identical: give each its own
            body = {"input_ids": [list(prompt_ids)] * params.n, "return_logprob": True,
                    "sampling_params": [dict(sp, sampling_seed=params.seed + i) for i in range(params.n)]}
        else:
            if params.seed is not None:
                sp["sampling_seed"] = params.seed
            body = {"input_ids": list(prompt_ids), "return_logprob": True, "sampling_params": dict(sp, n=params.n)}
        if self._released or self._releasing:  # SGLang would run the batch on unmapped memory
            raise EngineError(f"engine {self.engine_id}: generate while its GPU memory is released "
                              f"({sorted(self._released or RELEASE_TAGS)}); wake_up first")
        start_version = self._version
        if self.adapter_prefix and start_version > 0:
            body["lora_path"] = lora_name(self.adapter_prefix, start_version)
        self._inflight += 1
        self._idle.clear()
        try:
            raw = await self._post("/generate", body, self.timeout_s)
        finally:
            self._inflight -= 1
            if self._inflight == 0:
                self._idle.set()
        outs = _decode_one.decode(raw) if raw.lstrip()[:1] == b"{" else _decode_many.decode(raw)
        outs = [outs] if isinstance(outs, _Out) else outs
        if len(outs) != params.n:
            raise EngineError(f"engine {self.engine_id}: asked for {params.n} samples, got {len(outs)}")
        return [self._sample(o, start_version) for o in outs]

    def _sample(self, o: _Out, start_version: int) -> Sample:
        lps = o.meta_info.output_token_logprobs
        if len(lps) != len(o.output_ids):
            raise EngineError(f"engine {self.engine_id}: {len(o.output_ids)} tokens but {len(lps)} log-probs")
        fr = (o.meta_info.finish_reason or {}).get("type", "abort")
        # A sample that spans an in-flight update is tagged with its oldest version: SGLang does
        # not say at which token the weights changed, and staleness is counted from the oldest.
        return Sample(token_ids=np.asarray(o.output_ids, dtype=np.int32),
                      logprobs=np.asarray([x[0] for x in lps], dtype=np.float32),
                      finish_reason=fr if fr in ("stop", "length", "abort") else "stop",
                      segment_starts=[0], segment_versions=[start_version])

    async def health(self) -> bool:
        try:
            r = await self.http.get(self.url + "/health", timeout=min(self.control_timeout_s, 10.0))
            return r.status_code == 200
        except httpx.HTTPError:
            return False

    # -- pause / resume ------------------------------------------------------------------------
    async def pause(self, mode: PauseMode = PauseMode.KEEP) -> None:
        """``abort``: end running requests now; ``wait``: let this client's requests finish first;
        ``keep``: SGLang's ``retract`` (running requests go back to the queue and are recomputed
        with the new weights on resume). With ``keep`` the prefix cache cannot be flushed while
        requests are queued, so start the server with ``radix_cache=False`` for in-flight updates.
        """
        if mode not in tuple(PauseMode):
            raise ValueError(f"pause mode must be 'abort', 'wait' or 'keep', got {mode!r}")
        if mode == "wait":
            try:
                await asyncio.wait_for(self._idle.wait(), self.timeout_s)
            except asyncio.TimeoutError:
                raise EngineError(f"engine {self.engine_id}: {self._inflight} requests still running "
                                  f"after {self.timeout_s:.0f}s of pause(wait)") from None
        await self._post("/pause_generation", {"mode": "retract" if mode == "keep" else "abort"})
        self._paused = mode

    async def resume(self) -> None:
        await self._post("/continue_generation", {"torch_empty_cache": False})
        self._paused = ""

    async def reset_prefix_cache(self) -> None:
        if self._paused == "keep":
            if self.radix_cache:
                log.warning("engine %s: prefix cache not flushed during an in-flight update (requests are "
                            "queued); start SGLang with radix_cache=False for in-flight updates", self.engine_id)
            return
        await self._post("/flush_cache", {})  # refused (requests still queued) -> HTTP 400 -> EngineError

    # -- memory release (colocated mode: the server runs with --enable-memory-saver) ------------------
    async def _memory_call(self, path: str, tags: list[str], what: str) -> None:
        """One release/resume call; SGLang 0.5.16 answers ``null`` on success, an error body otherwise."""
        try:
            raw = await self._post(path, {"tags": tags}, self.control_timeout_s)
        except EngineError as e:
            raise EngineError(f"{what} of {tags} failed: {e}", e.code) from e
        reply = msgspec.json.decode(raw) if raw.strip() else None
        if isinstance(reply, dict) and (reply.get("success") is False or "error" in reply):
            raise EngineError(f"engine {self.engine_id}: {what} of {tags} failed: {reply}")

    async def sleep(self, level: int) -> None:
        """Release the server's GPU memory (weights and KV cache) for the learner's step. SGLang drops the
        weights at both levels (no CPU copy): every colocated step publishes them after :meth:`wake_up`.
        Waits (``control_timeout_s``) for this client's requests first: SGLang's scheduler dies on a
        release while a request runs."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if self._released:
            raise EngineError(f"engine {self.engine_id}: sleep while {sorted(self._released)} are still released")
        try:
            await asyncio.wait_for(self._idle.wait(), self.control_timeout_s)
        except TimeoutError:
            raise EngineError(f"engine {self.engine_id}: {self._inflight} requests still running after "
                              f"{self.control_timeout_s:.0f}s; SGLang releases memory only when idle") from None
        self._releasing = True  # no request may start between the idle check and the release
        try:
            await self._memory_call("/release_memory_occupation", list(RELEASE_TAGS), "memory release")
        finally:
            self._releasing = False
        self._released = set(RELEASE_TAGS)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Resume what :meth:`sleep` released: ``["weights"]`` (then publish), ``["kv_cache"]`` after; None:
        everything still released. A tag that is not released is skipped (SGLang's scheduler dies on it)."""
        asked = list(RELEASE_TAGS) if tags is None else list(tags)
        unknown = [t for t in asked if t not in RELEASE_TAGS]
        if unknown:
            raise ValueError(f"SGLang wake_up tags must be among {list(RELEASE_TAGS)}, got {unknown}")
        todo = [t for t in asked if t in self._released]
        if not todo:
            return
        await self._memory_call("/resume_memory_occupation", todo, "memory resume")
        self._released.difference_update(todo)

    async def is_sleeping(self) -> bool:
        """Whether this client left any of the server's memory released (SGLang 0.5.16 cannot say)."""
        return bool(self._released)

    # -- weights -------------------------------------------------------------------------------
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
            raise EngineError(f"engine {self.engine_id}: SGLang receives weights over NCCL or gloo, "
                              f"not {group.backend!r}")
        await self._detect_session_api()
        if self._group is not None:
            try:  # leave the previous epoch's group so its communicator is freed
                await self._control("/destroy_weights_update_group",
                                    {"group_name": sglang_group_name(self._group.group_epoch)})
            except EngineError as e:
                log.debug("engine %s: destroying the old update group failed: %s", self.engine_id, e)
        await self._control("/init_weights_update_group", {
            "master_address": group.master_addr, "master_port": group.master_port,
            "rank_offset": group.rank_offset, "world_size": group.world_size,
            "group_name": sglang_group_name(group.group_epoch), "backend": group.backend})
        self._group, self._plan = group, plan

    async def update_weights(self, version: int, plan_id: str) -> str:
        """One call per bucket, in plan order; each returns once its broadcast has landed and loaded.

        The cache is flushed by :meth:`reset_prefix_cache`, not here: SGLang >= 0.5.23 fails an
        update whose flush is refused (requests queued during an in-flight update).
        """
        self._check_plan(version, plan_id)
        if self.staging:  # through fleetrl's loader: stage, then a commit that waits for the bytes in the engine
            await self.begin_update(version, plan_id)
            return await self.commit_update(version)
        plan, group = self._plan, self._group
        name = sglang_group_name(group.group_epoch)
        if self._session_api:
            await self._control("/begin_weight_update", {})
        for b, idx in enumerate(plan.buckets):
            last = b == len(plan.buckets) - 1
            await self._control("/update_weights_from_distributed", {
                "names": [plan.names[i] for i in idx], "dtypes": [plan.dtypes[i] for i in idx],
                "shapes": [plan.shapes[i] for i in idx], "group_name": name, "load_format": "flattened_bucket",
                "flush_cache": False, "weight_version": str(version) if last else None}, self.timeout_s)
        if self._session_api:
            await self._control("/end_weight_update", {})
        self._version = version
        return ""  # SGLang's own update computes no checksum; tests compare outputs instead

    def _check_plan(self, version: int, plan_id: str) -> None:
        plan = self._plan
        if plan is None or self._group is None:
            raise EngineError(f"engine {self.engine_id}: update_weights(v{version}) before init_weight_transfer")
        if plan_id != plan.plan_id:
            raise EngineError(f"engine {self.engine_id}: publish uses plan {plan_id!r}, announced {plan.plan_id!r}")

    # -- staged updates: fleetrl's loader in SGLang's workers (weight_sync/sglang_ext.py) ------------------
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
        g = {"master_addr": group.master_addr, "master_port": group.master_port, "rank_offset": group.rank_offset,
             "world_size": group.world_size, "group_epoch": group.group_epoch, "backend": group.backend}
        await self._loader_call("join", self.control_timeout_s + 10, group=g, plan=plan_to_dict(plan))
        self._group, self._plan = group, plan
        self._req_n, self._req_keys = 0, []  # requests are counted per join: the workers' threads count alike

    async def _loader_call(self, cmd: str, timeout_s: float, **args) -> tuple[list[dict], float]:
        """Run ``cmd`` in every TP worker inside an ``in_place`` pause (the running batch is frozen, not
        retracted; none if the engine is paused already). Returns the workers' outcomes and how long
        generation was held. A failed commit leaves the engine paused: its weights may be half loaded."""
        from weight_sync import sglang_ext

        if self._store is None:
            raise EngineError(f"engine {self.engine_id}: {cmd} before init_weight_transfer")
        seq = args.pop("seq", None)
        if seq is None:
            self._seq += 1
            seq = self._seq
        caller = self._caller()
        body = {"serialized_named_tensors": [sglang_ext.payload(
                    cmd, engine_id=caller, seq=seq, timeout_s=self.control_timeout_s,
                    store={"addr": self._store_at[0], "port": self._store_at[1]}, **args)] * self.group_ranks,
                "load_format": sglang_ext.LOADER, "flush_cache": False}
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
                raise EngineError(f"{e} (engine {self.engine_id} stays paused: its weights may be partly loaded)") from e
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
        from weight_sync import sglang_ext

        self._seq += 1
        self._req_n += 1
        key = sglang_ext.request_key(self._group.group_epoch, self._group.rank_offset, self._req_n)
        await asyncio.to_thread(self._store.set, key, sglang_ext.request(cmd, engine_id=self._caller(),
                                                                        seq=self._seq, **args))
        self._req_keys.append(key)
        return self._seq

    async def _outcomes(self, seq: int, what: str, wait_s: float | None = None) -> list[dict] | None:
        """The TP workers' outcomes of request ``seq``; ``None`` if ``wait_s`` passes without them."""
        from weight_sync import sglang_ext

        try:
            if wait_s is not None:
                keys = [sglang_ext.outcome_key(self._caller(), seq, r) for r in range(self.group_ranks)]
                try:
                    await asyncio.to_thread(self._store.wait, keys, datetime.timedelta(seconds=wait_s))
                except Exception:  # noqa: BLE001 - not there within wait_s
                    return None
            outs = await asyncio.to_thread(sglang_ext.read_outcomes, self._store, self._caller(), seq, self.group_ranks)
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
            outs = await self._outcomes(seq, f"commit of v{version}", self.between_steps_wait_s)
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
        steps = {**self._stage_steps, "commit_held": held, "commit_in_engine": max(o["commit_s"] for o in outs),
                 "commit_replayed": float(outs[0].get("replayed_buckets", 0)),
                 "commit_between_steps": float(bool(outs[0].get("between_steps"))), **laps}
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

    async def load_weights_from_path(self, path: str, version: int) -> None:
        await self._control("/update_weights_from_disk", {"model_path": path, "weight_version": str(version),
                                                          "flush_cache": True}, self.timeout_s)
        self._version = version
        if self._paused == "frozen":  # a failed staged commit froze it; whole new weights end that
            await self.resume()

    @property
    def weight_version(self) -> int:
        return self._version

    async def load_adapter(self, path: str, version: int) -> dict[str, float]:
        """Serve the peft adapter folder ``path`` as policy ``version`` (rollout_fleet/engines/sglang_lora.py)."""
        return await sglang_load_adapter(self, path, version)

