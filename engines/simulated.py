"""A SIMULATED engine: no model, realistic timing, the same client interface as vLLM.

It exists so the control plane (broker admission, fleet balancing, the weight-update
choreography, scaling, lag monitoring) can be exercised at hundreds of servers on one
CPU machine. Responses are random token ids with random log-probs; their lengths follow
a lognormal (long tail) clipped at ``max_tokens`` (every one exactly ``max_tokens`` with
``ignore_eos``); each sequence decodes at
``tokens_per_s``. Weight updates take ``weight_bytes / transfer_gb_per_s`` seconds.

Everything it produces says it is a simulation: engine ids start with ``sim-``, every
log line starts with ``[SIMULATED]``, ``simulated`` is True.

Timing is event driven, not ticked: a group sleeps until its longest sample would end
or until the engine's state changes (pause, resume, new version, abort, death); at each
change it books the tokens decoded since the last change. So 500 engines cost little CPU.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time

import numpy as np

from engines.base import EngineClient, EngineError, PauseMode, Sample, SamplingParams
from engines.config import SimulatedEngineConfig
from weight_sync.endpoint import WeightEndpoint
from weight_sync.messages import GroupInfo, WeightPlan

log = logging.getLogger(__name__)
SIM = "[SIMULATED]"


class SimulatedEngine(EngineClient):
    """One simulated server and its generation client in one object (there is no process to talk to); its
    weight-receiving side is :attr:`weights`, a :class:`SimulatedWeightClient` of the same server.

    Example::

        eng = SimulatedEngine("sim-0", SimulatedEngineConfig(tokens_per_s=5000), seed=1)
        samples = await eng.generate([1, 2, 3], SamplingParams(n=4, max_tokens=64))
        await eng.weights.update_weights(1, "plan")
    """

    simulated = True

    def __init__(self, engine_id: str, cfg: SimulatedEngineConfig, *, seed: int = 0) -> None:
        self.engine_id = engine_id if engine_id.startswith("sim-") else f"sim-{engine_id}"
        self.cfg = cfg
        self._rng = np.random.default_rng(seed)
        self._version = 0
        self._admitting = True  # False while paused: new requests wait
        self._frozen = False  # True under pause(keep): running requests make no progress
        self._alive = True
        self._abort_epoch = 0
        self._changed = asyncio.Event()
        self._inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self.weights = SimulatedWeightClient(self)
        self.tokens_generated = 0
        self.busy_s = 0.0

    # -- state changes wake every running group so it can book its progress ------------
    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _check_alive(self, call: str) -> None:
        if not self._alive:
            raise EngineError(f"{SIM} engine {self.engine_id}: {call} failed: server is dead")

    def kill(self) -> None:
        """Simulate ``kill -9`` of the server: running and future calls fail."""
        log.warning("%s engine %s killed", SIM, self.engine_id)
        self._alive = False
        self._notify()

    async def restart(self) -> None:
        """Bring a dead server back empty: version 0 until it loads the latest export."""
        await asyncio.sleep(self.cfg.startup_s)
        self._alive, self._admitting, self._frozen, self._version = True, True, False, 0
        self.weights.forget_group()
        log.info("%s engine %s restarted (version 0)", SIM, self.engine_id)

    # -- generation ---------------------------------------------------------------------
    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> list[Sample]:
        self._check_alive("generate")
        while not self._admitting:  # a paused server admits nothing new
            await self._changed.wait()
            self._check_alive("generate")
        n, cap = params.n, params.max_tokens
        rng = np.random.default_rng(params.seed) if params.seed is not None else self._rng
        median = self.cfg.length_median * (1.0 + self.cfg.length_growth * self._version)
        lengths = np.clip(np.rint(rng.lognormal(np.log(median), self.cfg.length_sigma, n)), 1, cap).astype(np.int64)
        if params.ignore_eos:  # no end-of-sequence: every sample runs to its limit
            lengths = np.full(n, cap, dtype=np.int64)
        produced = np.zeros(n)
        seg_starts = [[0] for _ in range(n)]
        seg_versions = [[self._version] for _ in range(n)]
        abort_epoch = self._abort_epoch
        aborted = False
        self._inflight += 1
        self._idle.clear()
        rate = self.cfg.tokens_per_s
        try:
            last = time.monotonic()
            while (produced < lengths).any():
                # the engine's state is constant between two notifications, so an interval
                # either decoded at full rate (running) or not at all (paused)
                changed, running = self._changed, not self._frozen
                if running:
                    left = float((lengths - produced).max()) / rate
                    try:
                        await asyncio.wait_for(changed.wait(), timeout=left + 1e-4)
                    except TimeoutError:
                        pass
                else:
                    await changed.wait()
                now = time.monotonic()
                if running:
                    produced = np.minimum(lengths, produced + (now - last) * rate)
                    self.busy_s += now - last
                last = now
                self._check_alive("generate")
                if self._abort_epoch != abort_epoch:
                    aborted = True
                    break
                self._book_version(produced, lengths, seg_starts, seg_versions)
        finally:
            self._inflight -= 1
            if self._inflight == 0:
                self._idle.set()
        out = []
        for i in range(n):
            t = int(produced[i]) if aborted else int(lengths[i])
            t = max(t, 1) if not aborted else t
            starts = [s for s in seg_starts[i] if s < t or s == 0]
            versions = seg_versions[i][: len(starts)]
            reason = "abort" if aborted and t < lengths[i] else ("length" if lengths[i] >= cap else "stop")
            out.append(
                Sample(
                    token_ids=rng.integers(0, self.cfg.vocab_size, t, dtype=np.int32),
                    logprobs=-rng.exponential(1.0, t).astype(np.float32),
                    finish_reason=reason,
                    segment_starts=starts,
                    segment_versions=versions,
                )
            )
            self.tokens_generated += t
        return out

    def _book_version(self, produced, lengths, seg_starts, seg_versions) -> None:
        """Open a new segment in every unfinished sample whose version changed."""
        for i in range(len(lengths)):
            if produced[i] >= lengths[i] or seg_versions[i][-1] == self._version:
                continue
            at = int(produced[i])
            if at == seg_starts[i][-1]:  # no token at the old version yet: relabel
                seg_versions[i][-1] = self._version
            else:
                seg_starts[i].append(at)
                seg_versions[i].append(self._version)

    # -- control --------------------------------------------------------------------------
    async def health(self) -> bool:
        return self._alive

    async def pause(self, mode: PauseMode = PauseMode.KEEP) -> None:
        """``keep``: freeze running requests; ``wait``: let them finish; ``abort``: end them now."""
        if mode not in tuple(PauseMode):
            raise ValueError(f"pause mode must be 'keep', 'wait' or 'abort', got {mode!r}")
        self._check_alive("pause")
        self._admitting = False
        if mode == PauseMode.ABORT:
            self._abort_epoch += 1
        self._frozen = mode == PauseMode.KEEP
        self._notify()
        if mode == PauseMode.WAIT:
            await self._idle.wait()
            self._check_alive("pause")

    async def resume(self) -> None:
        self._check_alive("resume")
        self._admitting, self._frozen = True, False
        self._notify()

    async def reset_prefix_cache(self) -> None:
        self._check_alive("reset_prefix_cache")

    async def load_weights_from_path(self, path: str, version: int) -> None:
        self._check_alive("load_weights_from_path")
        await asyncio.sleep(self.cfg.load_s)
        self._set_version(version)

    def record_version(self, version: int) -> None:
        self._version = max(self._version, int(version))

    def _set_version(self, version: int) -> None:
        if version < self._version:
            raise EngineError(f"{SIM} engine {self.engine_id}: version {version} is older than held {self._version}")
        self._version = version
        self._notify()

    @property
    def weight_version(self) -> int:
        return self._version

    @property
    def alive(self) -> bool:
        return self._alive


class SimulatedWeightClient(WeightEndpoint):
    """The weight-receiving side of one :class:`SimulatedEngine`: an update takes
    ``weight_bytes / transfer_gb_per_s`` seconds, then the engine holds the new version."""

    def __init__(self, engine: SimulatedEngine) -> None:
        self.engine = engine
        self.engine_id = engine.engine_id
        self._plan: WeightPlan | None = None
        self._group: GroupInfo | None = None

    def forget_group(self) -> None:
        """A restarted server has joined no weight-sync group."""
        self._plan = self._group = None

    async def health(self) -> bool:
        return await self.engine.health()

    async def init_weight_transfer(self, group: GroupInfo, plan: WeightPlan) -> None:
        self.engine._check_alive("init_weight_transfer")
        self._group, self._plan = group, plan
        log.info("%s engine %s joined weight group epoch %d", SIM, self.engine.engine_id, group.group_epoch)

    def transfer_s(self) -> float:
        return self.engine.cfg.weight_bytes / (self.engine.cfg.transfer_gb_per_s * 1e9)

    async def update_weights(self, version: int, plan_id: str) -> str:
        self.engine._check_alive("update_weights")
        if self._plan is not None and plan_id != self._plan.plan_id:
            raise EngineError(
                f"{SIM} engine {self.engine.engine_id}: unknown plan {plan_id!r} (joined {self._plan.plan_id!r})"
            )
        await asyncio.sleep(self.transfer_s())
        self.engine._check_alive("update_weights")
        self.engine._set_version(version)
        return simulated_checksum(version)

    async def load_weights_from_path(self, path: str, version: int) -> None:
        await self.engine.load_weights_from_path(path, version)

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version


def simulated_checksum(version: int) -> str:
    return "sim-" + hashlib.sha1(f"simulated-weights-{version}".encode()).hexdigest()[:16]


class SimulatedFactory:
    """Starts SIMULATED engines for the fleet controller (``sim-<index>``)."""

    def __init__(self, cfg: SimulatedEngineConfig, *, seed: int = 0) -> None:
        self.cfg, self.seed = cfg, seed

    async def start(self, index: int) -> SimulatedEngine:
        await asyncio.sleep(self.cfg.startup_s)
        return SimulatedEngine(f"sim-{index}", self.cfg, seed=self.seed * 100_003 + index)

    async def restart(self, engine: SimulatedEngine) -> SimulatedEngine:
        await engine.restart()
        return engine

    async def stop(self, engine: SimulatedEngine) -> None:
        engine.kill()
