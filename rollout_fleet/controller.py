"""The fleet controller: the engine servers of one fleet, their health, load and policy version.

Dataflow::

    rollout worker --run_group(prompt, n)--> controller.pick()  (least outstanding tokens)
                                               |
                                               v
                                   server_i.generate(prompt, n)  --samples--> worker
                                               |  EngineError / health check fails / stalled
                                               v
                           server marked dead, its requests cancelled, their groups retried on others,
                           server restarted (or dropped), loads the latest export,
                           joins weight sync, takes new work again

    simulated publisher --update_fleet(v)--> pause -> load v -> reset prefix -> resume   (each server)
    vLLM: the learner's weight_sync Publisher drives the same steps per server over HTTP and
    the fleet learns each server's version by polling it (engines/vllm/factory.py)

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
* Stalls: a server that answers its probe but has held requests for ``stall_timeout_s`` without
  answering any (rollout_fleet/progress.py measures it) is taken out as a dead one is, and counted
  in ``server_stalls``. The fleet's own weight update (:meth:`update_fleet`) and colocated sleep
  (:meth:`hold`) stop its clock; a server that says it is paused (``is_paused``: a publish from the
  learner loading) gets ``stall_timeout_s`` more; one whose generated-token count (``generated_tokens``)
  rose in the silence is decoding long responses: its clock starts again (``servers_kept_generating``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

import msgspec

from engines.base import (
    BadRequest,
    EngineClient,
    EngineError,
    PauseMode,
    Sample,
    SamplingParams,
)
from rollout_fleet.busy import BusyClock
from rollout_fleet.config import RolloutConfig
from rollout_fleet.progress import ProgressWatch
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
    progress: ProgressWatch = field(default_factory=ProgressWatch)  # the stall detector's clock
    requests: set[asyncio.Future[list[Sample]]] = field(default_factory=set)  # generate calls in flight

    @property
    def engine_id(self) -> str:
        return self.engine.engine_id


class NoServerError(EngineError):
    """No healthy server is available within the wait limit."""


class ServerTakenOut(EngineError):
    """A request ended by the fleet because its server was found dead or stalled (its group is retried)."""


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
        self.server_stalls = 0  # alive, answering nothing for stall_timeout_s: taken out as a dead server
        self.servers_kept_generating = 0  # silences past stall_timeout_s excused by a rising token count
        self.weight_updates = 0
        self.weight_update_s = 0.0
        self.busy: dict[str, BusyClock] = {}  # per engine id: when it had a group in flight (rollout_fleet/busy.py)
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
            log.warning(
                "fleet: %s still had %d groups after %.0f s of draining; they are retried elsewhere",
                engine_id,
                len(server.inflight),
                timeout_s,
            )
        server.state = ServerState.REMOVED
        del self.servers[engine_id]
        await self.factory.stop(server.engine)
        log.info("fleet: server %s drained and removed", engine_id)

    async def scale_to(self, n_servers: int) -> list[int]:
        """Grow or shrink the fleet; shrinking drains the least loaded servers (their indices are returned)."""
        if n_servers < 0:
            raise ValueError(f"scale_to: n_servers must be >= 0, got {n_servers}")
        live = [
            s
            for s in self.servers.values()
            if s.state in (ServerState.HEALTHY, ServerState.RESTARTING, ServerState.DEAD)
        ]
        if n_servers > len(live) + len(self.starting):  # servers still starting count: they are on the way
            await asyncio.gather(*(self.add_server() for _ in range(n_servers - len(live) - len(self.starting))))
        elif n_servers < len(live):
            if self.starting:
                raise ValueError(
                    f"fleet: servers {sorted(self.starting)} are still starting; scale down once they joined"
                )
            victims = sorted(live, key=lambda s: (s.state == ServerState.HEALTHY, s.outstanding_tokens))[
                : len(live) - n_servers
            ]
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
        return [
            s
            for s in self.servers.values()
            if s.state == ServerState.HEALTHY and s.engine.weight_version >= min_version
        ]

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
                raise NoServerError(
                    f"fleet: no healthy server at version >= {min_version} for {wait_s:.0f} s "
                    f"(servers: {self.states()})"
                )
            async with self._capacity:
                try:
                    await asyncio.wait_for(self._capacity.wait(), timeout=min(left, 0.5))
                except TimeoutError:
                    pass

    async def run_group(
        self, group_id: str, prompt_ids: list[int], params: SamplingParams, min_version: int = 0
    ) -> tuple[str, list[Sample]]:
        """Generate one GRPO group on a server at ``min_version`` or newer; retried elsewhere if it dies."""
        cost = params.n * params.max_tokens
        last_error: Exception | None = None
        for _attempt in range(self.max_attempts):
            server = await self.pick(cost, self.cfg.startup_timeout_s, min_version)
            server.outstanding_tokens += cost
            server.inflight.add(group_id)
            busy = self.busy.setdefault(server.engine_id, BusyClock())
            busy.enter()
            try:
                samples = await self._generate(server, prompt_ids, params)
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
                busy.exit()
            if any(s.finish_reason == "abort" for s in samples):
                # an aborted group is incomplete: the whole group runs again
                self.groups_requeued += 1
                continue
            server.groups_done += 1
            server.tokens_done += sum(len(s.token_ids) for s in samples)
            return server.engine_id, samples
        raise EngineError(f"fleet: group {group_id} failed {self.max_attempts} times; last error: {last_error}")

    async def _generate(self, server: Server, prompt_ids: list[int], params: SamplingParams) -> list[Sample]:
        """One request, limited by ``request_timeout_s`` and told to the stall detector's clock; a server
        taken out (dead, stalled) cancels it, which raises :class:`ServerTakenOut`."""
        watch = server.progress  # a server taken out gets a new clock; this request ends on its own
        watch.sent(time.monotonic())
        request = asyncio.ensure_future(server.engine.generate(prompt_ids, params))
        server.requests.add(request)
        answered = False
        try:
            samples = await asyncio.wait_for(request, timeout=self.cfg.request_timeout_s)
            answered = True
            return samples
        except BadRequest:
            answered = True  # a refusal is an answer: the server works
            raise
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # the caller is cancelled (shutdown), not only the request
            raise ServerTakenOut(
                f"fleet: request to {server.engine_id} cancelled: the server was taken out ({server.state.value})"
            ) from None
        finally:
            server.requests.discard(request)
            (watch.answered if answered else watch.failed)(time.monotonic())

    # -- health and recovery -----------------------------------------------------------------
    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.health_interval_s)
            for server in list(self.servers.values()):
                if server.state == ServerState.HEALTHY:
                    await self._suspect(server)  # a death is named as one first
                    await self._check_progress(server)

    async def _generated_tokens(self, server: Server) -> int | None:
        """The server's generated-token count (``EngineClient.generated_tokens``); None if it cannot say."""
        read = getattr(server.engine, "generated_tokens", None)
        if read is None:
            return None
        try:
            tokens = await asyncio.wait_for(read(), timeout=self.cfg.health_timeout_s)
        except Exception as exc:  # whatever the reason it cannot say, its silence counts as it is
            log.debug("fleet: %s could not say how many tokens it generated: %s", server.engine_id, exc)
            return None
        return tokens if isinstance(tokens, int) and not isinstance(tokens, bool) else None

    async def _check_progress(self, server: Server) -> None:
        """The stall detector: a healthy server that has held requests for ``stall_timeout_s`` and answered
        none is taken out, unless its generated-token count rose in that silence (long responses still being
        decoded; see ProgressWatch.tokens_moved) or it says it is paused (a weight update loading; see
        ProgressWatch.excused)."""
        timeout = self.cfg.stall_timeout_s
        if timeout is None or server.state != ServerState.HEALTHY:
            return
        watch = server.progress
        if watch.wants_baseline(time.monotonic(), timeout):
            epoch = watch.epoch
            watch.baseline(await self._generated_tokens(server), epoch)
        if server.state != ServerState.HEALTHY or not watch.stalled(time.monotonic(), timeout):
            return
        epoch = watch.epoch
        tokens = await self._generated_tokens(server)
        now = time.monotonic()
        if server.progress is not watch or server.state != ServerState.HEALTHY or not watch.stalled(now, timeout):
            return  # an answer (or a death) came while it was asked
        if watch.epoch == epoch:
            silent_s = watch.silent_s(now)
            verdict = watch.tokens_moved(tokens, now)
            if verdict == "moved":
                if not watch.kept:
                    watch.kept = True
                    self.servers_kept_generating += 1
                    log.info(
                        "fleet: %s has answered none of its %d requests for %.1f s but its generated-token count "
                        "rose to %d (long responses being decoded): kept; its clock starts again",
                        server.engine_id,
                        watch.inflight,
                        silent_s,
                        tokens,
                    )
                return
            if verdict == "first":
                return  # the first count read in this silence: judged at the next check
        try:
            paused = await asyncio.wait_for(server.engine.is_paused(), timeout=self.cfg.health_timeout_s)
        except Exception as exc:  # whatever the reason it cannot say, its silence counts as it is
            log.debug("fleet: %s could not say whether it is paused: %s", server.engine_id, exc)
            paused = None
        watch, now = server.progress, time.monotonic()
        if server.state != ServerState.HEALTHY or not watch.stalled(now, timeout):
            return  # an answer (or a death) came while it was asked
        first_found = watch.paused_since is None
        if watch.excused(paused, now, timeout):
            if first_found:
                log.info(
                    "fleet: %s has answered none of its %d requests for %.1f s but is paused (a weight "
                    "update loading); it is stalled if still so in %.0f s",
                    server.engine_id,
                    watch.inflight,
                    watch.silent_s(now),
                    timeout,
                )
            return
        self.server_stalls += 1
        paused_for = "" if watch.paused_since is None else f", paused for {now - watch.paused_since:.1f} s"
        log.error(
            "fleet: server %s stalled: it answers its health probe but answered none of its %d requests in "
            "flight for %.1f s (rollout.stall_timeout_s=%g%s); they are re-queued on other servers and it is %s",
            server.engine_id,
            watch.inflight,
            watch.silent_s(now),
            timeout,
            paused_for,
            "restarted" if self.cfg.restart_dead_servers else "dropped",
        )
        self._take_out(server)

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
            log.warning(
                "fleet: %s failed a health probe (%d of %d): %s",
                server.engine_id,
                server.failed_probes,
                self.cfg.health_failures,
                why,
            )
            return
        self.server_deaths += 1
        log.error(
            "fleet: server %s is dead (%s; %d groups in flight are re-queued)",
            server.engine_id,
            why,
            len(server.inflight),
        )
        self._take_out(server)

    def _take_out(self, server: Server) -> None:
        """Out of rotation (dead): cancel its requests (:meth:`run_group` retries their groups on other
        servers), give it a new stall clock, and restart or drop it (:meth:`_recover`)."""
        server.state = ServerState.DEAD
        server.progress = ProgressWatch()
        for request in list(server.requests):
            request.cancel()
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
        record the change as a new segment. The load goes through each engine's in-process weight client
        (``engine.weights``: :class:`engines.simulated.SimulatedWeightClient`); real engines take their
        weights from the learner's publisher instead.
        """
        mode = PauseMode.WAIT if self.cfg.weight_update == "pause" else PauseMode.KEEP
        t0 = time.monotonic()
        async with self._update_lock:
            self.version = version
            # simulated engines have no files: their "export" is a label the late joiner loads
            self.latest_export = export_path if export_path is not None else f"simulated://v{version}"
            targets = [s for s in self.servers.values() if s.state in (ServerState.HEALTHY, ServerState.DRAINING)]
            results = await asyncio.gather(
                *(self._update_one(s, version, plan_id, mode) for s in targets), return_exceptions=True
            )
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
        e, watch = server.engine, server.progress
        timeout = self.cfg.request_timeout_s
        watch.hold("weight update")  # paused by us: its silence is no stall
        try:
            await asyncio.wait_for(e.pause(mode), timeout=timeout)
            try:
                await asyncio.wait_for(e.weights.update_weights(version, plan_id), timeout=timeout)
                await asyncio.wait_for(e.reset_prefix_cache(), timeout=timeout)
            finally:
                await asyncio.wait_for(e.resume(), timeout=timeout)
        finally:
            watch.release("weight update", time.monotonic())

    def hold(self, why: str) -> None:
        """Stop the stall clock of every healthy server until :meth:`unhold` with the same ``why``: they
        generate nothing by design meanwhile (colocated sleep while the learner trains)."""
        for s in self.servers.values():
            if s.state == ServerState.HEALTHY:
                s.progress.hold(why)

    def unhold(self, why: str) -> None:
        """End the hold ``why``; each server's silence starts again now."""
        now = time.monotonic()
        for s in self.servers.values():
            s.progress.release(why, now)

    # -- introspection -----------------------------------------------------------------------
    def busy_intervals(self) -> dict[str, list[tuple[float, float]]]:
        """Per engine id, the unix-second intervals during which it had a group in flight."""
        return {eid: clock.snapshot() for eid, clock in self.busy.items()}

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
            servers=[
                ServerStatus(
                    engine_id=s.engine_id,
                    index=s.index,
                    state=s.state,
                    version=s.engine.weight_version,
                    simulated=s.engine.simulated,
                    outstanding_tokens=s.outstanding_tokens,
                    inflight_groups=len(s.inflight),
                    groups_done=s.groups_done,
                    tokens_done=s.tokens_done,
                    restarts=s.restarts,
                    pid=getattr(s.engine, "pid", None),
                    tok_per_s=s.tokens_done / max(1e-9, now - s.started_at),
                    silent_s=round(s.progress.silent_s(now), 3),
                )
                for s in sorted(self.servers.values(), key=lambda s: s.index)
            ]
            + [
                ServerStatus(
                    engine_id=engine_name(self.cfg.engine, i),
                    index=i,
                    state=ServerState.STARTING,
                    version=0,
                    simulated=self.cfg.engine == "simulated",
                    outstanding_tokens=0,
                    inflight_groups=0,
                    groups_done=0,
                    tokens_done=0,
                    restarts=0,
                    pid=None,
                    tok_per_s=0.0,
                )
                for i in sorted(self.starting)
            ],
            groups_requeued=self.groups_requeued,
            groups_bad_request=self.groups_bad_request,
            server_deaths=self.server_deaths,
            server_stalls=self.server_stalls,
            servers_kept_generating=self.servers_kept_generating,
            weight_updates=self.weight_updates,
            weight_update_s=round(self.weight_update_s, 4),
        )
