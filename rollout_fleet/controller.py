"""The fleet controller: the engine servers of one fleet, their health, load and policy version.

Dataflow::

    rollout worker --run_group(prompt, n)--> controller.pick()  (least outstanding tokens)
                                               |
                                               v
                                   server_i.generate(prompt, n)  --samples--> worker
                                               |  EngineError / health check fails
                                               v
                           server marked dead, its in-flight groups retried on others,
                           server restarted (or dropped), loads the latest export,
                           joins weight sync, takes new work again

    simulated publisher --update_fleet(v)--> pause -> load v -> reset prefix -> resume   (each server)
    vLLM: the learner's weight_sync Publisher drives the same steps per server over HTTP and
    the fleet learns each server's version by polling it (rollout_fleet/vllm_fleet.py)

Invariants and delivery semantics:

* A group is owned by exactly one :meth:`run_group` call from its ticket to its return.
  When its server dies the call retries it on another server with the same prompt; the
  failed attempt's samples are discarded, so a group is never returned twice and never
  half-returned (nothing lost, nothing counted twice). ``groups_requeued`` counts retries.
* Load is balanced by *outstanding tokens* (reserved ``n * max_tokens`` per in-flight
  group), not round robin: long-tail groups keep a server busy and it gets less new work.
* A server's ``version`` is what it holds; a server that (re)joins loads the latest
  export first (late-joiner path) and only then receives work, so it never samples with
  weights older than those of the fleet when it joined.
* Admission meets versions: a group admitted for learner step ``s`` (bound ``k``) only
  starts on a server holding version ``>= s - k - 1``, so a server that is behind the
  learner (its publish not yet loaded) never produces a group that is stale on arrival.
* Draining: a draining server takes no new group; it leaves once its in-flight groups end.
* Starting: a server being started (``add_server``) is listed as ``starting`` (no engine yet, no
  work, not a weight-sync member) and joins ``servers`` once it answers and has caught up.
* An engine's 4xx answer (but 408/429) is the request's fault (:class:`BadRequest`): the group
  fails at once and is counted in ``groups_bad_request``; the server is not suspected.
* Every engine call has a timeout (``request_timeout_s`` for generation,
  ``health_timeout_s`` for a probe). A server is dead when its process is gone, or after
  ``health_failures`` consecutive failed probes: one slow answer is not a death.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

import msgspec

from rollout_fleet.config import RolloutConfig
from rollout_fleet.engines.base import (
    BadRequest,
    EngineClient,
    EngineError,
    PauseMode,
    Sample,
    SamplingParams,
)
from rollout_fleet.status import FleetStatus, ServerState, ServerStatus, engine_name

log = logging.getLogger(__name__)


class EngineFactory(Protocol):
    """Starts, restarts and stops engine servers (vLLM processes, simulated engines, ...)."""

    async def start(self, index: int) -> EngineClient: ...

    async def restart(self, engine: EngineClient) -> EngineClient: ...

    async def stop(self, engine: EngineClient) -> None: ...


@dataclass(slots=True)
class Server:
    engine: EngineClient
    index: int
    state: ServerState = ServerState.HEALTHY
    outstanding_tokens: int = 0
    inflight: set[str] = field(default_factory=set)
    groups_done: int = 0
    tokens_done: int = 0
    restarts: int = 0
    failed_probes: int = 0
    started_at: float = field(default_factory=time.monotonic)

    @property
    def engine_id(self) -> str:
        return self.engine.engine_id


class NoServerError(EngineError):
    """No healthy server is available within the wait limit."""


class FleetController:
    """Owns the servers of a fleet. Example::

        fleet = FleetController(cfg.rollout, SimulatedFactory(cfg.rollout.simulated))
        await fleet.start(4)
        engine_id, samples = await fleet.run_group("g1", [1, 2, 3], params)
        await fleet.update_fleet(1)          # pause, load, reset prefix cache, resume
        await fleet.scale_to(8)
    """

    def __init__(self, cfg: RolloutConfig, factory: EngineFactory, *, max_attempts: int = 5) -> None:
        self.cfg = cfg
        self.factory = factory
        self.max_attempts = max_attempts
        self.servers: dict[str, Server] = {}
        self._next_index = itertools.count()
        self._capacity = asyncio.Condition()
        self.version = 0
        self.latest_export: str | None = None
        self._update_lock = asyncio.Lock()
        self._health_task: asyncio.Task | None = None
        self.groups_requeued = 0
        self.groups_bad_request = 0  # refused by an engine (HTTP 4xx): failed once, server not blamed
        self.server_deaths = 0
        self.weight_updates = 0
        self.weight_update_s = 0.0
        self._recovering: set[asyncio.Task] = set()
        self.starting: dict[int, float] = {}  # index -> when its start began (status: "starting")

    # -- membership -------------------------------------------------------------------------
    async def start(self, n_servers: int) -> None:
        await asyncio.gather(*(self.add_server() for _ in range(n_servers)))
        self._health_task = asyncio.create_task(self._health_loop(), name="fleet-health")

    async def add_server(self, index: int | None = None) -> str:
        """Start a server (``index`` names its placement slot; default: the next free number)."""
        used = {s.index for s in self.servers.values()} | set(self.starting)
        if index is None:
            index = next(i for i in self._next_index if i not in used)
        elif index in used:
            raise ValueError(f"fleet: a server with index {index} already exists")
        self.starting[index] = time.monotonic()
        try:
            engine = await self.factory.start(index)
            await self._catch_up(engine)
        finally:
            self.starting.pop(index, None)
        server = Server(engine=engine, index=index)
        self.servers[engine.engine_id] = server
        log.info("fleet: server %s joined at version %d", engine.engine_id, engine.weight_version)
        await self._wake()
        return engine.engine_id

    async def drain_server(self, engine_id: str, timeout_s: float = 600.0) -> None:
        """Stop giving ``engine_id`` work, wait for its groups to end, stop it."""
        server = self.servers[engine_id]
        server.state = ServerState.DRAINING
        deadline = time.monotonic() + timeout_s
        while server.inflight and time.monotonic() < deadline:  # noqa: ASYNC110 (inflight is a plain dict)
            await asyncio.sleep(0.02)
        if server.inflight:
            log.warning("fleet: %s still had %d groups after %.0f s of draining; they are retried elsewhere",
                        engine_id, len(server.inflight), timeout_s)
        server.state = ServerState.REMOVED
        del self.servers[engine_id]
        await self.factory.stop(server.engine)
        log.info("fleet: server %s drained and removed", engine_id)

    async def scale_to(self, n_servers: int) -> list[int]:
        """Grow or shrink the fleet; shrinking drains the least loaded servers (their indices are returned)."""
        if n_servers < 0:
            raise ValueError(f"scale_to: n_servers must be >= 0, got {n_servers}")
        live = [s for s in self.servers.values() if s.state in (ServerState.HEALTHY, ServerState.RESTARTING, ServerState.DEAD)]
        if n_servers > len(live) + len(self.starting):  # servers still starting count: they are on the way
            await asyncio.gather(*(self.add_server() for _ in range(n_servers - len(live) - len(self.starting))))
        elif n_servers < len(live):
            if self.starting:
                raise ValueError(f"fleet: servers {sorted(self.starting)} are still starting; scale down once they joined")
            victims = sorted(live, key=lambda s: (s.state == ServerState.HEALTHY, s.outstanding_tokens))[: len(live) - n_servers]
            await asyncio.gather(*(self.drain_server(s.engine_id) for s in victims))
            return [s.index for s in victims]
        return []

    async def close(self) -> None:
        if self._health_task:
            self._health_task.cancel()
        for t in list(self._recovering):
            t.cancel()
        for s in list(self.servers.values()):
            try:
                await self.factory.stop(s.engine)
            except Exception as exc:  # stopping must go on for the others
                log.warning("fleet: stopping %s failed: %s", s.engine_id, exc)
        self.servers.clear()

    # -- work -------------------------------------------------------------------------------
    def _eligible(self, min_version: int = 0) -> list[Server]:
        return [s for s in self.servers.values() if s.state == ServerState.HEALTHY and s.engine.weight_version >= min_version]

    async def _wake(self) -> None:
        async with self._capacity:
            self._capacity.notify_all()

    async def pick(self, cost: int, wait_s: float, min_version: int = 0) -> Server:
        """The healthy server holding ``min_version`` or newer with the fewest outstanding tokens.

        Waits (up to ``wait_s``) while none qualifies: a server that has not loaded the
        weights a ticket needs yet must not start that group, or it would be stale on arrival.
        """
        deadline = time.monotonic() + wait_s
        while True:
            eligible = self._eligible(min_version)
            if eligible:
                return min(eligible, key=lambda s: (s.outstanding_tokens, s.index))
            left = deadline - time.monotonic()
            if left <= 0:
                raise NoServerError(f"fleet: no healthy server at version >= {min_version} for {wait_s:.0f} s "
                                    f"(servers: {self.states()})")
            async with self._capacity:
                try:
                    await asyncio.wait_for(self._capacity.wait(), timeout=min(left, 0.5))
                except TimeoutError:
                    pass

    async def run_group(self, group_id: str, prompt_ids: list[int], params: SamplingParams,
                        min_version: int = 0) -> tuple[str, list[Sample]]:
        """Generate one GRPO group on a server at ``min_version`` or newer; retried elsewhere if it dies."""
        cost = params.n * params.max_tokens
        last_error: Exception | None = None
        for _attempt in range(self.max_attempts):
            server = await self.pick(cost, self.cfg.startup_timeout_s, min_version)
            server.outstanding_tokens += cost
            server.inflight.add(group_id)
            try:
                samples = await asyncio.wait_for(
                    server.engine.generate(prompt_ids, params), timeout=self.cfg.request_timeout_s
                )
            except BadRequest as exc:
                # the request is at fault: another server (or a retry) would refuse it the same way
                self.groups_bad_request += 1
                log.error("fleet: group %s refused by %s as a bad request: %s", group_id, server.engine_id, exc)
                raise
            except (EngineError, TimeoutError, OSError) as exc:
                last_error = exc
                self.groups_requeued += 1
                log.warning("fleet: group %s failed on %s (%s); re-queued", group_id, server.engine_id, exc)
                await self._suspect(server)
                continue
            finally:
                server.outstanding_tokens -= cost
                server.inflight.discard(group_id)
            if any(s.finish_reason == "abort" for s in samples):
                # an aborted group is incomplete: the whole group runs again
                self.groups_requeued += 1
                continue
            server.groups_done += 1
            server.tokens_done += sum(len(s.token_ids) for s in samples)
            return server.engine_id, samples
        raise EngineError(f"fleet: group {group_id} failed {self.max_attempts} times; last error: {last_error}")

    # -- health and recovery -----------------------------------------------------------------
    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.health_interval_s)
            for server in list(self.servers.values()):
                if server.state == ServerState.HEALTHY:
                    await self._suspect(server)

    async def _suspect(self, server: Server) -> None:
        """Probe a server; it is dead when its process is gone, or after ``health_failures``
        consecutive failed probes (one slow answer from a busy server is not a death)."""
        if server.state != ServerState.HEALTHY:
            return
        if getattr(server.engine, "alive", True) is False:  # the process is known to be gone
            ok, why = False, "process exited"
            server.failed_probes = self.cfg.health_failures
        else:
            try:
                ok = await asyncio.wait_for(server.engine.health(), timeout=self.cfg.health_timeout_s)
                why = "health probe failed"
            except (EngineError, TimeoutError, OSError) as exc:
                ok, why = False, f"health probe: {type(exc).__name__}: {exc}"
        if ok:
            server.failed_probes = 0
            return
        server.failed_probes += 1
        if server.failed_probes < self.cfg.health_failures or server.state != ServerState.HEALTHY:
            log.warning("fleet: %s failed a health probe (%d of %d): %s", server.engine_id,
                        server.failed_probes, self.cfg.health_failures, why)
            return
        server.state = ServerState.DEAD
        self.server_deaths += 1
        log.error("fleet: server %s is dead (%s; %d groups in flight are re-queued)",
                  server.engine_id, why, len(server.inflight))
        task = asyncio.create_task(self._recover(server), name=f"recover-{server.engine_id}")
        self._recovering.add(task)
        task.add_done_callback(self._recovering.discard)

    async def _recover(self, server: Server) -> None:
        if not self.cfg.restart_dead_servers:
            self.servers.pop(server.engine_id, None)
            await self.factory.stop(server.engine)
            log.warning("fleet: server %s dropped (restart_dead_servers=false)", server.engine_id)
            return
        server.state = ServerState.RESTARTING
        try:
            engine = await self.factory.restart(server.engine)
            await self._catch_up(engine)
        except Exception as exc:
            log.error("fleet: restart of %s failed (%s); dropped", server.engine_id, exc)
            self.servers.pop(server.engine_id, None)
            return
        self.servers.pop(server.engine_id, None)
        server.engine, server.state, server.restarts = engine, ServerState.HEALTHY, server.restarts + 1
        server.started_at, server.failed_probes = time.monotonic(), 0
        self.servers[engine.engine_id] = server
        log.info("fleet: server %s is back at version %d", engine.engine_id, engine.weight_version)
        await self._wake()

    async def _catch_up(self, engine: EngineClient) -> None:
        """Late-joiner path: load the latest export before taking work or joining the group."""
        if self.version > engine.weight_version and self.latest_export is not None:
            await engine.load_weights_from_path(self.latest_export, self.version)

    # -- weights -----------------------------------------------------------------------------
    def set_latest_export(self, version: int, path: str) -> None:
        self.version, self.latest_export = version, path

    async def update_fleet(self, version: int, export_path: str | None = None, plan_id: str = "sim") -> float:
        """Run the fleet-side choreography for one publish; returns the seconds it took.

        ``pause``: stop admitting and let running requests finish (``wait``), load, reset
        the prefix cache (stale KV from old weights), resume. ``inflight``: freeze running
        requests (``keep``), load, reset, resume: they continue on the new weights and
        record the change as a new segment.
        """
        mode = PauseMode.WAIT if self.cfg.weight_update == "pause" else PauseMode.KEEP
        t0 = time.monotonic()
        async with self._update_lock:
            self.version = version
            # simulated engines have no files: their "export" is a label the late joiner loads
            self.latest_export = export_path if export_path is not None else f"simulated://v{version}"
            targets = [s for s in self.servers.values() if s.state in (ServerState.HEALTHY, ServerState.DRAINING)]
            results = await asyncio.gather(*(self._update_one(s, version, plan_id, mode) for s in targets),
                                           return_exceptions=True)
            for server, res in zip(targets, results, strict=True):
                if isinstance(res, BaseException):
                    log.warning("fleet: weight update of %s to v%d failed (%s)", server.engine_id, version, res)
                    await self._suspect(server)
        await self._wake()  # groups waiting for this version may start now
        dt = time.monotonic() - t0
        self.weight_updates += 1
        self.weight_update_s += dt
        return dt

    async def _update_one(self, server: Server, version: int, plan_id: str, mode: str) -> None:
        e = server.engine
        timeout = self.cfg.request_timeout_s
        await asyncio.wait_for(e.pause(mode), timeout=timeout)
        try:
            await asyncio.wait_for(e.update_weights(version, plan_id), timeout=timeout)
            await asyncio.wait_for(e.reset_prefix_cache(), timeout=timeout)
        finally:
            await asyncio.wait_for(e.resume(), timeout=timeout)

    # -- introspection -----------------------------------------------------------------------
    def states(self) -> dict[str, str]:
        return {s.engine_id: s.state.value for s in self.servers.values()}

    def status(self) -> dict:
        """:meth:`record` as plain data (what crosses a process boundary)."""
        return msgspec.to_builtins(self.record())

    def record(self) -> FleetStatus:
        """The controller's part of the fleet's status (the worker's counters stay at their defaults)."""
        now = time.monotonic()
        return FleetStatus(
            version=self.version,
            servers=[ServerStatus(engine_id=s.engine_id, index=s.index, state=s.state, version=s.engine.weight_version,
                                  simulated=s.engine.simulated, outstanding_tokens=s.outstanding_tokens,
                                  inflight_groups=len(s.inflight), groups_done=s.groups_done,
                                  tokens_done=s.tokens_done, restarts=s.restarts, pid=getattr(s.engine, "pid", None),
                                  tok_per_s=s.tokens_done / max(1e-9, now - s.started_at))
                     for s in sorted(self.servers.values(), key=lambda s: s.index)]
            + [ServerStatus(engine_id=engine_name(self.cfg.engine, i), index=i, state=ServerState.STARTING, version=0,
                            simulated=self.cfg.engine == "simulated", outstanding_tokens=0, inflight_groups=0,
                            groups_done=0, tokens_done=0, restarts=0, pid=None, tok_per_s=0.0)
               for i in sorted(self.starting)],
            groups_requeued=self.groups_requeued,
            groups_bad_request=self.groups_bad_request,
            server_deaths=self.server_deaths,
            weight_updates=self.weight_updates,
            weight_update_s=round(self.weight_update_s, 4),
        )
