"""The server-control base of both SGLang clients (:class:`SGLangHandle`): pause, resume, cache flush, memory
release, the load from disk, LoRA adapters.

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
"""

from __future__ import annotations

import asyncio
import logging

import msgspec

from engines.base import EngineError, HttpServerHandle, PauseMode, check_adapter_versions
from engines.sglang.lora import load_adapter as sglang_load_adapter

log = logging.getLogger(__name__)

# What a colocated sleep releases (SGLang's GPU_MEMORY_TYPE_* tags; "cuda_graph" too only where graphs run
# under the memory saver, which compat_args turns off on 0.5.16), and what each fleet wake tag resumes.
RELEASE_TAGS = ("kv_cache", "weights")


class SGLangHandle(HttpServerHandle):
    """One SGLang server's control calls (any TP size); one instance per event loop."""

    def __init__(
        self,
        engine_id: str,
        url: str,
        *,
        radix_cache: bool = True,
        timeout_s: float = 600.0,
        control_timeout_s: float = 120.0,
        max_connections: int = 1024,
        adapter_prefix: str | None = None,
        adapter_versions: int = 2,
    ) -> None:
        self.engine_id = engine_id
        self.url = url.rstrip("/")
        self.timeout_s, self.control_timeout_s = timeout_s, control_timeout_s
        self.health_timeout_s = min(control_timeout_s, 10.0)
        self.radix_cache = radix_cache
        self._version = 0
        self._paused = ""
        self._released: set[str] = set()  # SGLang memory tags released by sleep() and not resumed yet
        self._releasing = False
        self._inflight = 0  # this client's generate calls running (pause(wait) and sleep wait for none)
        self._idle = asyncio.Event()
        self._idle.set()
        self._keep_open(max_connections)
        self.last_update_steps: dict[str, float] = {}
        self.adapter_prefix = adapter_prefix  # LoRA: version v > 0 is adapter '<prefix>-v<v>' (engines/sglang/lora.py)
        self.adapter_versions = check_adapter_versions(adapter_versions)  # versions whose adapters stay loaded

    async def _post(self, path: str, body: dict, timeout_s: float | None = None) -> bytes:
        r = await self._request(
            "POST",
            path,
            timeout_s=timeout_s or self.control_timeout_s,
            content=msgspec.json.encode(body),
            headers={"Content-Type": "application/json"},
        )
        return r.content

    async def _control(self, path: str, body: dict, timeout_s: float | None = None) -> None:
        """POST a weight/control call whose answer is ``{"success": bool, "message": str}`` (the LoRA calls:
        ``error_message``)."""
        raw = await self._post(path, body, timeout_s)
        reply = msgspec.json.decode(raw)
        if isinstance(reply, dict) and reply.get("success") is False:
            why = reply.get("message") or reply.get("error_message")
            raise EngineError(f"engine {self.engine_id}: {path} failed: {why}")

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
                raise EngineError(
                    f"engine {self.engine_id}: {self._inflight} requests still running "
                    f"after {self.timeout_s:.0f}s of pause(wait)"
                ) from None
        await self._post("/pause_generation", {"mode": "retract" if mode == "keep" else "abort"})
        self._paused = mode

    async def resume(self) -> None:
        await self._post("/continue_generation", {"torch_empty_cache": False})
        self._paused = ""

    async def generated_tokens(self) -> None:
        """None, so the stall detector judges an SGLang server by its answers alone: SGLang's
        ``sglang:generation_tokens_total`` (served only with ``--enable-metrics``, which fleetrl does not pass)
        is added to when a request finishes (its TokenizerMetricsCollector), so it stays put while long
        responses are decoded and could not tell progress from a hang."""
        return None

    async def reset_prefix_cache(self) -> None:
        if self._paused == "keep":
            if self.radix_cache:
                log.warning(
                    "engine %s: prefix cache not flushed during an in-flight update (requests are "
                    "queued); start SGLang with radix_cache=False for in-flight updates",
                    self.engine_id,
                )
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
            raise EngineError(
                f"engine {self.engine_id}: {self._inflight} requests still running after "
                f"{self.control_timeout_s:.0f}s; SGLang releases memory only when idle"
            ) from None
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

    async def load_weights_from_path(self, path: str, version: int) -> None:
        """Reload every weight from an HF export on disk (``/update_weights_from_disk``), labelled ``version``.
        With ``adapter_prefix`` (LoRA) the base stays and the export's ``adapter/`` folder is loaded as that
        version's adapter instead, as engines/vllm/handle.py does (docs/lora.md): a client that must reload the
        full weights of a LoRA server is one without the prefix."""
        if self.adapter_prefix:
            await self.load_adapter(f"{path.rstrip('/')}/adapter", version)
            return
        await self._control(
            "/update_weights_from_disk",
            {"model_path": path, "weight_version": str(version), "flush_cache": True},
            self.timeout_s,
        )
        self._version = version
        if self._paused == "frozen":  # a failed staged commit froze it; whole new weights end that
            await self.resume()

    async def load_adapter(self, path: str, version: int) -> dict[str, float]:
        """Serve the peft adapter folder ``path`` as policy ``version`` (engines/sglang/lora.py)."""
        return await sglang_load_adapter(self, path, version)
