"""The server-control base of both vLLM clients (:class:`VLLMHandle`): pause, resume, prefix cache, sleep, the
load from disk, and the LoRA adapter a version is served as.

The server runs with vLLM's RL endpoints (``VLLM_SERVER_DEV_MODE=1``, bound to 127.0.0.1 or a private network;
fleetrl's engine token guards them, :mod:`core.engine_auth`). Both roles need these calls: the fleet's
generation client (:mod:`engines.vllm.generation`) pauses, sleeps and catches a restarted server up from disk;
the learner's weight client (:mod:`engines.vllm.weights`) pauses around each update. A pause that a failed load
leaves behind is owned by the client that made it (``_stuck``): its next successful load resumes the server.
"""

from __future__ import annotations

import logging

import httpx

from engines.base import EngineError, HttpServerHandle, check_adapter_versions, lora_name
from engines.metrics_text import counter_total
from engines.vllm.lora import load_adapter

log = logging.getLogger(__name__)

GENERATION_TOKENS = "vllm:generation_tokens_total"  # vllm/v1/metrics/loggers.py, a counter of every step's tokens


class VLLMHandle(HttpServerHandle):
    """One vLLM server's control calls; one instance per event loop (its HTTP session binds to the loop)."""

    def __init__(
        self,
        engine_id: str,
        url: str,
        *,
        model: str,
        timeout_s: float = 60.0,
        request_timeout_s: float = 600.0,
        initial_version: int = 0,
        update_pause_mode: str = "keep",
        adapter_prefix: str | None = None,
        adapter_versions: int = 2,
        max_connections: int = 1024,
    ) -> None:
        """``update_pause_mode``: how a weight load pauses the server: ``wait`` lets running
        requests finish under the old weights first (``rollout.weight_update: pause``), ``keep``
        freezes them and lets them continue under the new weights (``inflight``). ``max_connections``:
        requests this client keeps open at once (one per group in flight; with httpx's own pool of 100 the
        rest waited in the client)."""
        if update_pause_mode not in ("keep", "wait", "abort"):
            raise ValueError(f"update_pause_mode must be 'keep', 'wait' or 'abort', got {update_pause_mode!r}")
        self.update_pause_mode = update_pause_mode
        self.engine_id, self.url, self.model = engine_id, url.rstrip("/"), model
        self.timeout_s, self.request_timeout_s = timeout_s, request_timeout_s
        self.health_timeout_s = min(timeout_s, 5.0)
        self._version = initial_version
        self._stuck = False  # paused by a failed update of ours
        self.last_update_steps: dict[str, float] = {}  # seconds per HTTP call of the last update or adapter load
        self._paused = False  # last pause/resume through this instance (the server's /is_paused is authoritative)
        # LoRA (learner.lora): policy version v > 0 is served as adapter '<adapter_prefix>-v<v>' (load_adapter)
        self.adapter_prefix = adapter_prefix
        self.adapter_versions = check_adapter_versions(adapter_versions)  # versions whose adapters stay loaded
        self.prefix_cache_resets_refused = 0  # see reset_prefix_cache
        self._label_api = True  # /update_weight_version exists (vLLM >= 0.32; see label_version)
        self._keep_open(max_connections)

    async def pause(self, mode: str = "keep") -> None:
        if mode not in ("keep", "wait", "abort"):
            raise ValueError(f"pause mode must be 'keep', 'wait' or 'abort', got {mode!r}")
        # clear_cache (vLLM's default, stated so the update path can rely on it): a 'wait' or 'abort'
        # pause ends with an empty prefix cache; 'keep' ignores it (its frozen requests keep their KV).
        await self._request(
            "POST", "/pause", params={"mode": mode, "clear_cache": "true"}, timeout_s=self.request_timeout_s
        )
        self._paused = True

    async def resume(self) -> None:
        await self._request("POST", "/resume")
        self._paused = False

    async def is_paused(self) -> bool:
        return bool((await self._request("GET", "/is_paused")).json()["is_paused"])

    async def generated_tokens(self) -> int | None:
        """vLLM's ``vllm:generation_tokens_total`` from its Prometheus ``/metrics`` (served by default), summed
        over its series. vLLM adds each engine step's new tokens to it, so it rises while responses are still
        being decoded. None where the read fails or the counter is missing (a server started with
        ``--disable-log-stats`` keeps no stats)."""
        try:
            r = await self._request("GET", "/metrics", timeout_s=self.health_timeout_s)
        except (EngineError, httpx.HTTPError) as exc:
            log.debug("engine %s: no /metrics: %s", self.engine_id, exc)
            return None
        return counter_total(r.text, GENERATION_TOKENS)

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
        await self._request(
            "POST", "/wake_up", params=[("tags", t) for t in tags or []], timeout_s=self.request_timeout_s
        )

    async def is_sleeping(self) -> bool:
        return bool((await self._request("GET", "/is_sleeping")).json()["is_sleeping"])

    async def reset_prefix_cache(self) -> None:
        """Drop the server's prefix cache. vLLM refuses (``{"success": false}``) while running requests
        hold KV blocks, as in an in-flight (``keep``) update under load. Requests
        from the generation client carry a per-version cache salt, so they do not reuse the old weights' KV
        even then; other clients' requests could. A refusal is logged and counted
        (``prefix_cache_resets_refused``)."""
        r = await self._request("POST", "/reset_prefix_cache")
        try:
            body = r.json()
        except ValueError:  # servers that answer with an empty body
            body = None
        if isinstance(body, dict) and body.get("success") is False:
            self.prefix_cache_resets_refused += 1
            log.info(
                "engine %s: vLLM refused to reset its prefix cache (running requests hold KV blocks); "
                "fleetrl's requests are kept off older KV by their per-version cache salt",
                self.engine_id,
            )

    async def abort(self) -> int:
        """Abort every in-flight request; returns how many."""
        return int((await self._request("POST", "/abort_requests", json={})).json().get("aborted", 0))

    async def label_version(self, version: int) -> bool:
        """Label the server's weights ``version`` (the per-token versions of api="generate"); False where the
        server has no label route (vLLM < 0.32, e.g. the 0.26 GPU bundle): there the client's own version is
        the only record, as for every update."""
        if not self._label_api:
            return False
        r = await self._request(
            "POST", "/update_weight_version", json={"new_version": str(version)}, check_status=False
        )
        if r.status_code == 404:
            self._label_api = False
            return False
        if r.status_code != 200:
            raise EngineError(f"engine {self.engine_id}: POST /update_weight_version -> HTTP {r.status_code}")
        return True

    async def server_weight_version(self) -> str | None:
        return (await self._request("GET", "/weight_info")).json().get("weight_version")

    async def load_weights_from_path(self, path: str, version: int) -> None:
        """Reload every weight from an HF export on disk (vLLM's ``reload_weights``), labelled ``version``."""
        if self.adapter_prefix:  # LoRA: the base stays; the export's adapter/ folder is the policy (docs/lora.md)
            await load_adapter(self, f"{path.rstrip('/')}/adapter", version)
            return
        pause_here = self._stuck or not await self.is_paused()
        if pause_here:
            self._stuck = True  # ours until the load succeeds (see VLLMWeightClient.update_weights)
            await self.pause(self.update_pause_mode)
        await self._request(
            "POST",
            "/collective_rpc",
            json={"method": "reload_weights", "kwargs": {"weights_path": path}},
            timeout_s=self.request_timeout_s,
        )
        await self.label_version(version)
        await self.reset_prefix_cache()
        self._version = version
        if pause_here:
            await self.resume()
        self._stuck = False

    # ---- LoRA adapters (engines/vllm/lora.py) ---------------------------------
    def served_model(self, version: int) -> str:
        """The model name requests at ``version`` name: the base, or that version's adapter."""
        return lora_name(self.adapter_prefix, version) if self.adapter_prefix and version > 0 else self.model

    async def load_adapter(self, path: str, version: int) -> dict[str, float]:
        """Serve the peft adapter folder ``path`` as policy ``version``; returns seconds per HTTP call."""
        return await load_adapter(self, path, version)
