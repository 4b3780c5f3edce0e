"""The vLLM engine: a vLLM OpenAI server subprocess (:class:`VLLMServer`) and its client (:class:`VLLMClient`).

The server runs with vLLM's RL endpoints (``VLLM_SERVER_DEV_MODE=1``, bound to
127.0.0.1 or a private network: they are unauthenticated) and a weight-transfer
backend: fleetrl's ``fleetrl`` (weight_sync/vllm_plugin.py; gloo on CPU, NCCL on
GPU) or vLLM's built-in ``nccl`` (GPU). The client generates through
``/v1/completions`` with token-id prompts and takes weights through vLLM's
weight-update choreography::

    pause(wait|keep) -> start_weight_update -> update_weights (the broadcast) ->
    finish_weight_update(version) -> [reset_prefix_cache] -> [checksum] -> resume

(the reset is skipped after a ``wait`` pause, which already emptied the cache)

or, with ``weight_sync.staging`` (fleetrl's backend), a staged update that
leaves the server generating while the bytes arrive::

    begin_update: /collective_rpc fleetrl_stage_begin (post the receives) ... broadcast ...
    commit_update: [pause(wait)] -> /collective_rpc fleetrl_stage_commit (load) -> [reset_prefix_cache]
                   -> label the version -> [resume]

A failed update leaves the engine paused: its model may be half loaded, so it
must not generate until a later update or load succeeds.

Example::

    server = VLLMServer(VLLMServerArgs(model="models/tiny-adder"), run_dir)
    server.start()                                  # waits for /health
    client = VLLMClient("vllm-0", server.url, model="models/tiny-adder")
    samples = await client.generate([1, 5, 7], SamplingParams(n=4, max_tokens=8))
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import httpx
import numpy as np

from core.net import HttpEngineClient
from rollout_fleet.engines.base import EngineClient, EngineError, Sample, SamplingParams
from rollout_fleet.engines.vllm_lora import load_adapter, lora_name
from rollout_fleet.engines.vllm_server import VLLMServer, VLLMServerArgs, check_vllm_version  # noqa: F401
from weight_sync.endpoint import WeightEndpoint
from weight_sync.messages import GroupInfo, WeightPlan

log = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class _Segments:
    starts: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)


def _segments(spans: list[dict] | None, default_version: int) -> _Segments:
    """vLLM's ``weight_versions`` spans ([{version, start, end}]) -> fleetrl's run-length segments."""
    if not spans:
        return _Segments(starts=[0], versions=[default_version])
    seg = _Segments()
    for s in sorted(spans, key=lambda s: s["start"]):
        try:
            v = int(s["version"])
        except (TypeError, ValueError):
            v = default_version  # a label we did not set (e.g. the initial load)
        if seg.versions and seg.versions[-1] == v:
            continue
        seg.starts.append(int(s["start"]))
        seg.versions.append(v)
    seg.starts[0] = 0
    return seg


class _Laps:
    """Seconds per step of a weight update, each since the previous one: where its unavailability goes."""

    def __init__(self, steps: dict[str, float] | None = None) -> None:
        self.steps = dict(steps or {})
        self._t = time.perf_counter()

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.steps[name], self._t = now - self._t, now


class VLLMClient(HttpEngineClient, EngineClient, WeightEndpoint):
    """Client of one vLLM server; one instance per event loop (its HTTP session binds to the loop)."""

    def __init__(self, engine_id: str, url: str, *, model: str, weight_backend: str = "fleetrl",
                 timeout_s: float = 60.0, request_timeout_s: float = 600.0, group_ranks: int = 1,
                 initial_version: int = 0, api: str = "completions", update_pause_mode: str = "keep",
                 adapter_prefix: str | None = None) -> None:
        """``update_pause_mode``: how a weight update pauses the server: ``wait`` lets running
        requests finish under the old weights first (``rollout.weight_update: pause``), ``keep``
        freezes them and lets them continue under the new weights (``inflight``).

        ``api``: ``completions`` (``/v1/completions``, every supported vLLM) or ``generate``
        (``/inference/v1/generate``, vLLM >= 0.32 started with ``--enable-scale-out``: also reports
        per-sample ``weight_versions`` spans)."""
        if weight_backend not in ("fleetrl", "fleetrl_gloo", "nccl"):
            raise ValueError("weight_backend must be 'fleetrl' (fleetrl's receiver, gloo or NCCL; 'fleetrl_gloo' is "
                             f"its older name) or 'nccl' (vLLM's built-in, GPU), got {weight_backend!r}")
        if api not in ("completions", "generate"):
            raise ValueError(f"api must be 'completions' or 'generate', got {api!r}")
        if update_pause_mode not in ("keep", "wait", "abort"):
            raise ValueError(f"update_pause_mode must be 'keep', 'wait' or 'abort', got {update_pause_mode!r}")
        self.api = api
        self.update_pause_mode = update_pause_mode
        self.engine_id, self.url, self.model = engine_id, url.rstrip("/"), model
        self.weight_backend = weight_backend
        self.timeout_s, self.request_timeout_s = timeout_s, request_timeout_s
        self.group_ranks = group_ranks
        self._version = initial_version
        self._stuck = False  # paused by a failed update of ours
        self.last_update_steps: dict[str, float] = {}  # seconds per HTTP call of the last update_weights
        self._paused = False  # last pause/resume through this instance (the server's /is_paused is authoritative)
        self._plan: WeightPlan | None = None
        self._join_timeout_s = timeout_s
        self._stage_steps: dict[str, float] = {}
        self._label_api = True  # /update_weight_version exists (vLLM >= 0.32)
        # LoRA (learner.lora): policy version v > 0 is served as adapter '<adapter_prefix>-v<v>' (load_adapter)
        self.adapter_prefix = adapter_prefix
        self.prefix_cache_resets_refused = 0  # see reset_prefix_cache

    # ---- generation ---------------------------------------------------------------
    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> list[Sample]:
        sp = {"n": params.n, "max_tokens": params.max_tokens, **params.processing(), "logprobs": 0,
              "stop_token_ids": params.stop_token_ids}
        if params.seed is not None:
            sp["seed"] = params.seed
        # Without per-token spans a sample is tagged with the version the server held when it started:
        # an in-flight update may change the weights mid-sample, and the older version bounds its
        # staleness from above (the server is never behind what this client knows).
        start_version = self._version
        # The prefix cache is salted with the weight version, so a request never reuses KV computed under
        # other weights; vLLM's reset cannot promise that while requests run (see reset_prefix_cache).
        salt = f"fleetrl-v{start_version}"
        model = self.served_model(start_version)
        if self.api == "generate":
            body = {"model": model, "token_ids": list(prompt_ids), "sampling_params": sp, "cache_salt": salt}
            r = await self._request("POST", "/inference/v1/generate", json=body, timeout_s=self.request_timeout_s)
        else:
            body = {"model": model, "prompt": list(prompt_ids), "return_token_ids": True, "cache_salt": salt, **sp}
            r = await self._request("POST", "/v1/completions", json=body, timeout_s=self.request_timeout_s)
        return [self._sample(c, start_version) for c in sorted(r.json()["choices"], key=lambda c: c["index"])]

    def _sample(self, c: dict, start_version: int) -> Sample:
        ids = c.get("token_ids")
        lp_field = c.get("logprobs") or {}
        if self.api == "generate":  # [{token_id, logprob, ...}] per generated token
            content = lp_field.get("content")
            lp = None if content is None else [e["logprob"] for e in content]
        else:
            lp = lp_field.get("token_logprobs")
        if ids is None or lp is None or len(ids) != len(lp):
            raise EngineError(f"engine {self.engine_id}: choice {c.get('index')} lacks token ids or per-token "
                              f"log-probs (token_ids={ids is not None}, logprobs={lp is not None})")
        seg = _segments(c.get("weight_versions"), start_version)
        return Sample(token_ids=np.asarray(ids, dtype=np.int32),
                      logprobs=np.asarray([-np.inf if x is None else x for x in lp], dtype=np.float32),
                      finish_reason=c.get("finish_reason") or "abort",
                      segment_starts=seg.starts, segment_versions=seg.versions)

    async def health(self) -> bool:
        try:
            r = await self.http.get(self.url + "/health", timeout=min(self.timeout_s, 5.0))
            return r.status_code == 200
        except httpx.HTTPError:
            return False

    async def pause(self, mode: str = "keep") -> None:
        if mode not in ("keep", "wait", "abort"):
            raise ValueError(f"pause mode must be 'keep', 'wait' or 'abort', got {mode!r}")
        # clear_cache (vLLM's default, stated so the update path can rely on it): a 'wait' or 'abort'
        # pause ends with an empty prefix cache; 'keep' ignores it (its frozen requests keep their KV).
        await self._request("POST", "/pause", params={"mode": mode, "clear_cache": "true"},
                            timeout_s=self.request_timeout_s)
        self._paused = True

    async def resume(self) -> None:
        await self._request("POST", "/resume")
        self._paused = False

    async def is_paused(self) -> bool:
        return bool((await self._request("GET", "/is_paused")).json()["is_paused"])

    # ---- sleep mode (colocated: the server was started with --enable-sleep-mode) ---------------
    async def sleep(self, level: int) -> None:
        """Free the server's GPU memory: level 1 moves the weights to host memory and drops the KV cache,
        level 2 drops both (the next weight load brings them). Nothing may be running (it is aborted)."""
        if level not in (1, 2):
            raise ValueError(f"vLLM sleep level must be 1 or 2, got {level}")
        await self._request("POST", "/sleep", params={"level": str(level)}, timeout_s=self.request_timeout_s)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Reallocate what sleep freed: ``["weights"]`` first (then load new ones), ``["kv_cache"]`` after;
        None: everything."""
        await self._request("POST", "/wake_up", params=[("tags", t) for t in tags or []],
                            timeout_s=self.request_timeout_s)

    async def is_sleeping(self) -> bool:
        return bool((await self._request("GET", "/is_sleeping")).json()["is_sleeping"])

    async def reset_prefix_cache(self) -> None:
        """Drop the server's prefix cache. vLLM refuses (``{"success": false}``) while running requests
        hold KV blocks, as in an in-flight (``keep``) update under load. Requests
        from :meth:`generate` carry a per-version cache salt, so they do not reuse the old weights' KV
        even then; other clients' requests could. A refusal is logged and counted
        (``prefix_cache_resets_refused``)."""
        r = await self._request("POST", "/reset_prefix_cache")
        try:
            body = r.json()
        except ValueError:  # servers that answer with an empty body
            body = None
        if isinstance(body, dict) and body.get("success") is False:
            self.prefix_cache_resets_refused += 1
            log.info("engine %s: vLLM refused to reset its prefix cache (running requests hold KV blocks); "
                     "fleetrl's requests are kept off older KV by their per-version cache salt", self.engine_id)

    async def abort(self) -> int:
        """Abort every in-flight request; returns how many."""
        return int((await self._request("POST", "/abort_requests", json={})).json().get("aborted", 0))

    async def server_weight_version(self) -> str | None:
        return (await self._request("GET", "/weight_info")).json().get("weight_version")

    # ---- weights ------------------------------------------------------------------
    def _init_info(self, group: GroupInfo, plan: WeightPlan) -> dict:
        from weight_sync.plan import packed_buffer_bytes, plan_to_dict

        if self.weight_backend == "nccl":
            # vLLM's built-in NCCL backend: its packed chunks equal our buckets for this buffer size.
            return {"master_address": group.master_addr, "master_port": group.master_port,
                    "rank_offset": group.rank_offset, "world_size": group.world_size, "packed": True,
                    "packed_buffer_size_bytes": packed_buffer_bytes(plan), "packed_num_buffers": 2}
        return {"master_address": group.master_addr, "master_port": group.master_port,
                "rank_offset": group.rank_offset, "world_size": group.world_size, "group_epoch": group.group_epoch,
                "plan": plan_to_dict(plan), "engine_id": self.engine_id, "timeout_s": self._join_timeout_s,
                "backend": group.backend}

    async def init_weight_transfer(self, group: GroupInfo, plan: WeightPlan) -> None:
        self._plan = plan
        await self._request("POST", "/init_weight_transfer_engine", json={"init_info": self._init_info(group, plan)},
                        timeout_s=self._join_timeout_s + 10)

    def _update_info(self, version: int, plan_id: str) -> dict:
        plan = self._plan
        if plan is None or plan.plan_id != plan_id:
            raise EngineError(f"engine {self.engine_id}: update_weights(v{version}) with plan {plan_id!r} but the "
                              f"announced plan is {plan.plan_id if plan else None!r}")
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
            await self._request("POST", "/start_weight_update")
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
        await self._request("POST", "/collective_rpc", timeout_s=self._join_timeout_s,
                            json={"method": "fleetrl_stage_begin", "kwargs": {"version": version, "plan_id": plan_id}})
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
            r = await self._request("POST", "/collective_rpc", timeout_s=self.request_timeout_s,
                                    json={"method": "fleetrl_stage_commit", "kwargs": {"version": version}})
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
            if self._label_api:  # the label of per-token versions (api="generate"); vLLM < 0.32 has neither
                r = await self._request("POST", "/update_weight_version", json={"new_version": str(version)},
                                        check_status=False)
                if r.status_code == 404:
                    self._label_api = False
                elif r.status_code != 200:
                    raise EngineError(f"engine {self.engine_id}: POST /update_weight_version -> HTTP {r.status_code}")
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

    async def load_weights_from_path(self, path: str, version: int) -> None:
        """Reload every weight from an HF export on disk (vLLM's ``reload_weights``), labelled ``version``."""
        if self.adapter_prefix:  # LoRA: the base stays; the export's adapter/ folder is the policy (docs/lora.md)
            await load_adapter(self, f"{path.rstrip('/')}/adapter", version)
            return
        pause_here = self._stuck or not await self.is_paused()
        if pause_here:
            self._stuck = True  # ours until the load succeeds (see update_weights)
            await self.pause(self.update_pause_mode)
        await self._request("POST", "/collective_rpc", json={"method": "reload_weights", "kwargs": {"weights_path": path}},
                        timeout_s=self.request_timeout_s)
        await self._request("POST", "/update_weight_version", json={"new_version": str(version)})
        await self.reset_prefix_cache()
        self._version = version
        if pause_here:
            await self.resume()
        self._stuck = False

    @property
    def weight_version(self) -> int:
        return self._version

    # ---- LoRA adapters (rollout_fleet/engines/vllm_lora.py) ---------------------------------
    def served_model(self, version: int) -> str:
        """The model name requests at ``version`` name: the base, or that version's adapter."""
        return lora_name(self.adapter_prefix, version) if self.adapter_prefix and version > 0 else self.model

    async def load_adapter(self, path: str, version: int) -> dict[str, float]:
        """Serve the peft adapter folder ``path`` as policy ``version``; returns seconds per HTTP call."""
        return await load_adapter(self, path, version)

