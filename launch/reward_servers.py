"""Reward servers (``--reward-gpus N``): judge or reward-model servers the launcher starts for ``reward.model``.

Placed like the rollout servers: on GPUs, one placement group per server (one bundle of
``reward.model.server.tensor_parallel_size`` GPUs, the slot :func:`launch.placement.plan_placement`
chose after the learner and the rollout servers); on CPU (``--rollout-gpus 0 --learner-gpus 0``)
``N`` vLLM CPU servers on the driver's node. Each server is kept by its own :class:`RewardServerActor`
(its node, exactly its bundle's GPUs), which starts vLLM or SGLang there without weight transfer: a
reward server never takes the policy's weights.

Start order (the driver)::

    place (placement groups) -> prepare (each actor picks its address: the URLs are known at once)
      -> the fleet gets reward.model.urls and starts its rollout servers
         while every reward server starts (both take the same minutes: they overlap)
      -> the fleet's workers wait for every reward server's /health before their first group

A reward server that dies while starting ends the job with its log tail. One that dies later (``kill -9``,
a crash) is restarted on its address by its actor (``check``, from the driver's loop; at most
``MAX_RESTARTS`` times), while the fleet's scorers wait for it and score their groups again
(rollout_fleet/reward_models.py). ``stop`` ends every server (and their actors: a server dies with its
actor, ``die_with_parent``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path
from typing import Any

import ray

from core.http_client import free_port
from core.network import LOOPBACK
from engines.vllm.server import VLLMServer, VLLMServerArgs, shared_cache_dir
from launch.placement import Slot, bundles

log = logging.getLogger(__name__)
CALL_TIMEOUT_S = 60.0
CHECK_EVERY_S = 2.0  # how often the driver asks whether each reward server's process lives
MAX_RESTARTS = 3  # deaths of one reward server a run survives


def server_spec(cfg, index: int) -> dict[str, Any]:
    """What reward server ``index`` runs (engine, model, limits) as plain data for its actor."""
    rm = cfg.reward.model
    s = rm.server
    extra = list(s.extra_args)
    if s.tokenizer_path:
        extra += ["--tokenizer-path" if s.engine == "sglang" else "--tokenizer", str(Path(s.tokenizer_path).resolve())]
    return {
        "engine": s.engine,
        "model": str(Path(s.model_path or cfg.model.path).resolve()),
        "served": rm.model,
        "dtype": s.dtype,
        "max_model_len": s.max_model_len,
        "tp": s.tensor_parallel_size,
        "gpu_memory_utilization": s.gpu_memory_utilization,
        "max_num_seqs": s.max_num_seqs,
        "enforce_eager": s.enforce_eager,
        "extra_args": extra,
        "seed": cfg.run.seed + 1000 + index,
        "startup_timeout_s": s.startup_timeout_s,
    }


@ray.remote(num_cpus=0, max_restarts=0)
class RewardServerActor:
    """Keeps one reward server on its node: ``prepare`` picks the address, ``start`` waits until healthy."""

    def __init__(self) -> None:
        self.server = None
        self.engine = ""

    def prepare(self, spec: dict[str, Any], run_dir: str, cache_dir: str, loopback: bool) -> dict[str, Any]:
        ctx = ray.get_runtime_context()
        # a colocated reward server holds no GPU of Ray's (learner rank i holds the bundle): the spec names it
        gpus = [str(g) for g in spec.get("gpus") or ctx.get_accelerator_ids().get("GPU", [])]
        ip = ray.util.get_node_ip_address()
        host = LOOPBACK if loopback else ip
        port = free_port(host)
        self.engine = spec["engine"]
        env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        if self.engine == "sglang":
            from engines.sglang.server import SGLangServer, SGLangServerArgs

            Path(run_dir).mkdir(parents=True, exist_ok=True)
            dtype = "bfloat16" if spec["dtype"] == "auto" else spec["dtype"]
            self.server = SGLangServer(
                SGLangServerArgs(
                    model=spec["model"],
                    gpus=[int(g) for g in gpus],
                    port=port,
                    host=host,
                    tensor_parallel_size=spec["tp"],
                    mem_fraction_static=spec["gpu_memory_utilization"],
                    max_running_requests=spec["max_num_seqs"],
                    dtype=dtype,
                    seed=spec["seed"],
                    fleetrl_loader=False,
                    skip_tokenizer_init=False,
                    env=env,
                    log_path=str(Path(run_dir) / "sglang_server.log"),
                    extra_args=[
                        "--context-length",
                        str(spec["max_model_len"]),
                        "--served-model-name",
                        spec["served"],
                        *spec["extra_args"],
                    ],
                )
            )
        else:
            if gpus:  # exactly the bundle's GPUs, as Ray assigned them on this node
                env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
            args = VLLMServerArgs(
                model=spec["model"],
                dtype=spec["dtype"],
                max_model_len=spec["max_model_len"],
                tensor_parallel_size=spec["tp"],
                gpu_memory_utilization=spec["gpu_memory_utilization"],
                max_num_seqs=spec["max_num_seqs"],
                host=host,
                port=port,
                seed=spec["seed"],
                enforce_eager=spec["enforce_eager"],
                served_model_name=spec["served"],
                extra_args=spec["extra_args"],
                env=env,
                startup_timeout_s=spec["startup_timeout_s"],
                die_with_parent=True,
                weight_transfer=False,
            )
            self.server = VLLMServer(args, run_dir, cache_dir=cache_dir)
        self._timeout = spec["startup_timeout_s"]
        return {
            "url": self.server.url,
            "node_ip": ip,
            "node_id": ctx.get_node_id(),
            "gpus": gpus,
            "engine": self.engine,
            "model": spec["model"],
            "served_model_name": spec["served"],
        }

    def start(self) -> dict[str, Any]:
        """Start the server and wait for ``/health`` (raises with the server's log tail)."""
        if self.engine == "sglang":
            asyncio.run(self.server.start(timeout_s=self._timeout))
            return {"pid": self.server.proc.pid if self.server.proc else None}
        self.server.start()
        return {"pid": self.server.pid}

    def alive(self) -> bool:
        """The server process is running (False once it died, e.g. ``kill -9``; True before ``start``)."""
        proc = getattr(self.server, "proc", None)
        return proc is None or proc.poll() is None

    def restart(self) -> dict[str, Any]:
        """The server died: end what is left of its process group, start it again on the same address
        (its clients keep their URL) and wait until it is healthy."""
        self.server.stop()
        return self.start()

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None


def actor_options(slots: list[Slot], pgs: list[Any], index: int, *, shared: bool, here: str) -> tuple[dict, list]:
    """(Ray options, GPU ids for the spec) of reward server ``index``'s actor.

    Own GPUs: its placement group's bundle (Ray assigns the GPUs, the actor reads them). Shared
    (colocated mode): no GPU resource (learner rank i's bundle holds GPU i), the actor pinned to the
    slot's node and the GPU named in its spec (``CUDA_VISIBLE_DEVICES`` of the server). CPU: the driver's node.
    """
    from ray.util.scheduling_strategies import (
        NodeAffinitySchedulingStrategy,
        PlacementGroupSchedulingStrategy,
    )

    if shared and slots:
        slot = slots[index]
        return (
            {"num_gpus": 0, "scheduling_strategy": NodeAffinitySchedulingStrategy(slot.node_id, soft=False)},
            [str(g) for g in slot.gpu_ids],
        )
    if pgs:
        return (
            {
                "num_gpus": len(slots[index].gpu_ids),
                "scheduling_strategy": PlacementGroupSchedulingStrategy(pgs[index], placement_group_bundle_index=0),
            },
            [],
        )
    # CPU reward servers: on the driver's node, as the CPU rollout servers are
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(here, soft=False)}, []


def colocated_slots(server_slots: dict[int, Slot]) -> list[Slot]:
    """Colocated mode's reward slots: server i's GPU (the one learner rank i shares), in server order."""
    return [server_slots[i] for i in sorted(server_slots)]


class RewardServers:
    """The driver's handle of the reward servers: placement groups, actors, URLs, start and stop.
    ``shared``: colocated mode's servers on the GPUs the learner and the rollout servers share (no
    placement groups of their own; started, and waited for, before the rollout servers)."""

    def __init__(
        self,
        cfg,
        run_dir: Path,
        *,
        count: int,
        slots: list[Slot],
        pin: dict[str, str],
        loopback: bool,
        shared: bool = False,
    ) -> None:
        self.cfg, self.run_dir, self.count = cfg, Path(run_dir), count
        self.slots, self.pin, self.loopback, self.shared = list(slots), dict(pin), loopback, shared
        self.pgs: list[Any] = []
        self.actors: list[Any] = []
        self.info: list[dict[str, Any]] = []
        self._starts: list[Any] = []
        self._checks: dict[int, tuple[Any, str, float]] = {}  # server -> (ref, "alive" | "restart", sent at)
        self._last_check = 0.0
        self._died: dict[int, float] = {}
        self.restarts: dict[int, int] = {}
        self.recoveries: list[dict[str, Any]] = []  # each restart: server, seconds from seen dead to healthy

    def place(self) -> list[Any]:
        """One placement group per GPU server (its TP bundle, pinned to the planned node); none on CPU."""
        from ray.util.placement_group import placement_group

        if self.shared:
            return []
        self.pgs = [
            placement_group(bundles([s], self.pin), strategy="STRICT_PACK", name=f"fleetrl-reward-{i}")
            for i, s in enumerate(self.slots)
        ]
        return self.pgs

    def launch(self) -> list[str]:
        """Create the actors, let each pick its address, then start every server (not waited for here)."""
        here = ray.get_runtime_context().get_node_id()
        specs = []
        for i in range(self.count):
            opts, gpus = actor_options(self.slots, self.pgs, i, shared=self.shared, here=here)
            self.actors.append(RewardServerActor.options(**opts).remote())
            specs.append(dict(server_spec(self.cfg, i), gpus=gpus))
        refs = [
            a.prepare.remote(specs[i], str(self.run_dir / f"reward-{i}"), str(shared_cache_dir()), self.loopback)
            for i, a in enumerate(self.actors)
        ]
        self.info = ray.get(refs, timeout=CALL_TIMEOUT_S * 2)
        self._starts = [a.start.remote() for a in self.actors]
        for i, inf in enumerate(self.info):
            log.info(
                "reward server %d (%s, %s): starting at %s on node %s, GPUs %s",
                i,
                inf["engine"],
                inf["served_model_name"],
                inf["url"],
                inf["node_ip"],
                inf["gpus"] or "none (CPU)",
            )
        return [inf["url"] for inf in self.info]

    def wait_started(self, also, timeout_s: float) -> None:
        """Until every reward server is healthy; ``also`` (the fleet's start) is watched meanwhile so that
        its failure is not hidden behind a long reward-server start. Raises RuntimeError naming the server."""
        pending = {ref: i for i, ref in enumerate(self._starts)}
        waiting = list(pending) + ([also] if also is not None else [])
        t_end = time.monotonic() + timeout_s
        while pending:
            left = t_end - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"reward server(s) {sorted(pending.values())} not healthy within {timeout_s:.0f} s")
            done, waiting = ray.wait(waiting, num_returns=1, timeout=left)
            for ref in done:
                if ref is also:
                    ray.get(ref)  # re-raises the fleet's failure; a success just leaves the rewards to wait for
                    continue
                i = pending.pop(ref)
                try:
                    self.info[i].update(ray.get(ref))
                except Exception as exc:
                    raise RuntimeError(f"reward server {i} at {self.info[i]['url']} failed to start: {exc}") from None
                log.info("reward server %d healthy at %s (pid %s)", i, self.info[i]["url"], self.info[i].get("pid"))

    def check(self) -> None:
        """Once per driver loop, never blocking: restart a reward server whose process died.

        Its actor is asked whether the process lives about every ``CHECK_EVERY_S``; a dead one is
        restarted on its address, at most ``MAX_RESTARTS`` times per server (then the job fails, naming
        it). Meanwhile the fleet's scorers wait for it (rollout_fleet/reward_models.py ModelRewardScorer)."""
        now = time.monotonic()
        for i, (ref, what, t0) in list(self._checks.items()):
            done, _ = ray.wait([ref], timeout=0)
            if not done:
                limit = CALL_TIMEOUT_S if what == "alive" else self.cfg.reward.model.server.startup_timeout_s + 60
                if now - t0 > limit:
                    raise RuntimeError(f"reward server {i}: {what} not answered within {limit:.0f} s")
                continue
            del self._checks[i]
            try:
                res = ray.get(ref)
            except Exception as exc:
                raise RuntimeError(f"reward server {i} at {self.info[i]['url']}: {what} failed: {exc}") from None
            if what == "restart":
                self.info[i].update(res)
                back = time.monotonic() - self._died[i]
                self.recoveries.append({"server": i, "back_s": round(back, 2)})
                log.warning(
                    "reward server %d restarted and healthy at %s (pid %s), %.1f s after its death was seen",
                    i,
                    self.info[i]["url"],
                    res.get("pid"),
                    back,
                )
            elif not res:
                self.restarts[i] = self.restarts.get(i, 0) + 1
                if self.restarts[i] > MAX_RESTARTS:
                    raise RuntimeError(
                        f"reward server {i} at {self.info[i]['url']} died a {self.restarts[i]}th "
                        f"time (at most {MAX_RESTARTS} restarts)"
                    )
                self._died[i] = now
                log.error(
                    "reward server %d at %s died; restarting it on its address (restart %d of %d)",
                    i,
                    self.info[i]["url"],
                    self.restarts[i],
                    MAX_RESTARTS,
                )
                self._checks[i] = (self.actors[i].restart.remote(), "restart", now)
        if now - self._last_check >= CHECK_EVERY_S:
            self._last_check = now
            for i, a in enumerate(self.actors):
                if i not in self._checks:
                    self._checks[i] = (a.alive.remote(), "alive", now)

    def describe(self) -> list[dict[str, Any]]:
        return [dict(inf, server=i) for i, inf in enumerate(self.info)]

    def stop(self) -> dict[str, Any]:
        """Stop every server (each within its own limit), then end the actors and their placement groups."""
        from ray.util.placement_group import remove_placement_group

        stopped = 0
        refs = [a.stop.remote() for a in self.actors]
        for i, ref in enumerate(refs):
            try:
                ray.get(ref, timeout=CALL_TIMEOUT_S)
                stopped += 1
            except Exception as exc:  # its node may be gone: the actor's death takes the server with it
                log.warning("stopping reward server %d: %s", i, exc)
        for a in self.actors:
            try:
                ray.kill(a)
            except Exception as exc:
                log.warning("killing a reward server actor: %s", exc)
        for pg in self.pgs:
            try:
                remove_placement_group(pg)
            except Exception:
                pass
        self.actors, self.pgs = [], []
        return {"reward_servers_stopped": stopped}


def announce(rewards: RewardServers | None, fleet: dict[str, Any]) -> None:
    """Print (and log) where the reward servers and the fleet's OpenAI-compatible proxy serve."""
    lines = []
    for inf in rewards.describe() if rewards is not None else []:
        lines.append(
            f"  reward server {inf['server']} ({inf['engine']}, serving {inf['served_model_name']!r}): "
            f"{inf['url']} on {inf['node_ip']}, GPUs {inf['gpus'] or 'none (CPU)'}"
        )
    if fleet.get("proxy_url"):
        lines.append(
            f"  OpenAI-compatible proxy: {fleet['proxy_url']}/v1 (recorded episodes: "
            f"{fleet['proxy_url']}/s/<episode>/v1)"
        )
    if lines:
        msg = "Serving:\n" + "\n".join(lines)
        log.info(msg)
        print(msg, flush=True)


def place_reward_servers(job, slots: list[Slot], pin: dict[str, str]) -> None:
    """The job's reward servers in ``slots`` (GPU) or, with none, ``--reward-gpus`` CPU servers."""
    from launch.netsetup import spans_hosts

    rm = job.cfg.reward.model
    shared = rm is not None and rm.server.colocated
    count = len(slots) or (1 if shared else job.args.reward_gpus)
    job.rewards = RewardServers(
        job.cfg, job.run_dir, count=count, slots=slots, pin=pin, loopback=not spans_hosts(job.cfg), shared=shared
    )
    for i, pg in enumerate(job.rewards.place()):
        job.placement.pgs[f"reward-{i}"] = pg


def with_urls(cfg, urls: list[str]):
    """``cfg`` with ``reward.model.urls`` set to the launched servers' URLs (what the fleet's clients call)."""
    rm = cfg.reward.model.model_copy(update={"urls": list(urls)})
    return cfg.model_copy(update={"reward": cfg.reward.model_copy(update={"model": rm})})
