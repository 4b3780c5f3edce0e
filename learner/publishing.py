"""Weights out of the learner: one rank's side of weight sync (rank 0 publishes, the other ranks follow its
gathers), the weight-sync group's membership as the fleet reports it, and the publish counters of the run's status.

:class:`RankPublishing` belongs to a :class:`learner.rank.LearnerRank` and is called once per step by the training
loop (``publish``, or ``unchanged`` for a step that applied no update). Three ways out, chosen by the config:

* full weights over a group (:class:`weight_sync.publisher.Publisher`, NCCL on GPU, gloo on CPU): every rank
  gathers each bucket of HF-named tensors (``engine.iter_full_params``), rank 0 broadcasts it;
* full weights over CUDA IPC (:class:`weight_sync.ipc_publisher.IpcPublisher`) into engines colocated on this
  rank's GPU;
* ``learner.lora`` on a vLLM or SGLang fleet: only the adapter folder
  (:class:`weight_sync.adapter_publisher.AdapterPublisher`).

Membership follows the fleet: before each publish rank 0 asks for the healthy servers; one that vanished leaves
the group, a new or restarted one joins as a late joiner (loading the latest HF export first when the run
directory is shared). One client per server lives for the whole run: a client owns the pauses it made, so a
server dropped and taken back must get the same one.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engines.base import adapter_versions
from engines.registry import weight_client
from weight_sync.adapter_publisher import AdapterPublisher, AdapterPublishError, adapter_publish
from weight_sync.endpoint import WeightEndpoint
from weight_sync.ipc import choose_transport
from weight_sync.ipc_publisher import IpcPublisher
from weight_sync.plan import build_plan
from weight_sync.publisher import Publisher, PublishError

if TYPE_CHECKING:
    from learner.rank import FleetView, RankConfig

log = logging.getLogger(__name__)


class RankPublishing:
    """One rank's publishing state; the group, the clients and the counters are rank 0's."""

    def __init__(self, cfg: RankConfig, run_dir: Path, fleet: FleetView | None, exports_shared: bool) -> None:
        self.cfg, self.run_dir, self.fleet = cfg, run_dir, fleet
        # False on a multi-node job without network.shared_dir: the run directory's exports are on this
        # node only, so a late joiner is never sent a path; it gets the weights at the next publish
        self.exports_shared = exports_shared
        self.rank = 0
        self.world_size = 0  # known once the process group is up
        self.pub = None
        self.adapter_pub: AdapterPublisher | None = None  # learner.lora on a vLLM or SGLang fleet (_publish_adapter)
        self.exported_version = 0  # the latest HF export a late joiner can load (set by the rank's step record)
        self.publish_s = 0.0
        self.publishes = 0  # publishes that reached at least one engine
        self.last_published_version = 0
        self.publish_errors = 0
        self.publishes_skipped = 0  # steps without an optimizer update: engines relabelled, no publish
        self.publish_held_s = 0.0  # the last publish: seconds the engines were held for it
        self.holding: dict[str, int] = {}  # rank 0: the version each weight-sync engine was last given
        # rank 0: one client per server for the whole run. A client owns the pauses it made (a load that
        # failed half-way leaves the server paused, and that client's next load resumes it): a server the
        # publisher dropped and takes back must get the same client, or its pause would have no owner
        self.clients: dict[str, WeightEndpoint] = {}

    def bucket_bytes(self) -> int:
        return int(self.cfg.weight_sync.bucket_mb * (1 << 20))

    def wire_dtype(self):
        """Publish in the servers' dtype (model.dtype): bf16 servers get bf16, no cast on their side."""
        return torch.bfloat16 if self.cfg.model.dtype == "bfloat16" else None

    def sync_members(self) -> None:
        """Rank 0, before a publish: the group becomes the fleet's servers (gone ones leave, new ones join late)."""
        if self.fleet is None:  # a learner without a fleet (tests): nothing to publish to
            return
        urls = self.fleet.server_urls()
        for eid, client in list(self.pub.engines.items()):
            if urls.get(eid) != client.url:
                log.info("weight sync: %s left the fleet (or moved); removed from the group", eid)
                self.pub.remove_engine(eid)
        export = self.run_dir / "export" / "latest"
        for eid, url in urls.items():
            if eid in self.pub.engines:
                continue
            client = self.clients.get(eid)
            if client is None or client.url != url:  # new, or restarted elsewhere: a new server, a new client
                client = self.clients[eid] = weight_client(self.cfg, self.pub.backend, eid, url)
            if self.exports_shared and self.exported_version > 0 and export.exists():
                log.info("weight sync: late joiner %s loads export v%d, then joins", eid, self.exported_version)
                self.pub.add_engine(client, str(export), self.exported_version)
                self.holding[eid] = self.exported_version
            else:
                self.pub.add_engine(client)

    def needs_weights(self) -> bool:
        """Rank 0, while no batch comes: has a server joined that holds none of the published weights?

        Without a shared disk a late joiner starts at version 0 and gets the weights at the next
        publish; when it is the only server left, that publish would wait for its groups forever."""
        if self.pub is None or self.fleet is None or self.last_published_version == 0:
            return False
        try:
            self.sync_members()
        except Exception as exc:  # the fleet did not answer: ask again at the next poll
            log.warning("weight sync: fleet membership unknown (%s)", exc)
            return False
        return any(self.holding.get(eid, -1) < self.last_published_version for eid in self.pub.engines)

    def _new_publisher(self, engine):
        """Rank 0's publisher: on CUDA its buffers live on this rank's GPU; the group kind follows the engine.
        Colocated with every server on this GPU (``colocate.weight_transport``): CUDA IPC, no group."""
        ws = self.cfg.weight_sync
        colo = self.cfg.colocate
        # SGLang: always its own distributed update over gloo (launch/config.py refuses 'ipc' with it)
        if (
            colo.enabled
            and self.cfg.rollout.engine != "sglang"
            and choose_transport(colo.weight_transport, cuda=torch.cuda.is_available(), shared_gpu=self.world_size == 1)
            == "ipc"
        ):
            plan = build_plan(engine.param_plan(self.wire_dtype()), self.bucket_bytes())
            log.info(
                "weight sync: CUDA IPC into the colocated engines, %d bucket(s), %d slot(s)",
                len(plan.buckets),
                colo.ipc_slots,
            )
            return IpcPublisher(
                plan, device=f"cuda:{torch.cuda.current_device()}", slots=colo.ipc_slots, timeout_s=ws.timeout_s
            )
        ws = ws.model_copy(update={"nccl_impl": ws.resolved_nccl_impl(self.cfg.rollout.engine)})
        nccl = ws.backend == "nccl" or (ws.backend == "auto" and torch.cuda.is_available())
        device = f"cuda:{torch.cuda.current_device()}" if nccl else "cpu"
        plan = build_plan(engine.param_plan(self.wire_dtype()), self.bucket_bytes(), ws.tail_bytes(nccl))
        log.info(
            "weight sync: backend %s, nccl_impl %s, device %s, %d bucket(s)",
            "nccl" if nccl else "gloo",
            ws.nccl_impl,
            device,
            len(plan.buckets),
        )
        return Publisher(ws, plan, rank=0, device=device)

    def _publish_adapter(self, version: int, engine) -> None:
        """learner.lora on a vLLM or SGLang fleet: only the adapter folder goes out (weight_sync/adapter_publisher.py)."""
        t0 = time.monotonic()
        if self.adapter_pub is None:
            if not self.exports_shared:
                raise RuntimeError(
                    "learner.lora publishes adapter folders by path, but the servers on other nodes "
                    "cannot read this run directory: set network.shared_dir"
                )
            # one folder more than the versions a server keeps loaded: vLLM and SGLang reload an evicted adapter that a
            # running request still names from its folder
            self.adapter_pub = AdapterPublisher(
                [],
                self.run_dir / "adapters",
                keep=adapter_versions(self.cfg.broker.max_staleness) + 1,
                timeout_s=self.cfg.weight_sync.timeout_s,
                dtype=self.wire_dtype(),
            )
        if self.rank == 0 and self.fleet is not None:
            try:
                urls = self.fleet.server_urls()
            except Exception as exc:  # the fleet did not answer: publish to the members we know
                log.warning("weight sync: fleet membership unknown (%s)", exc)
                urls = {ep.engine_id: ep.url for ep in self.adapter_pub.endpoints}
            for eid, url in urls.items():
                if eid not in self.clients or self.clients[eid].url != url:
                    self.clients[eid] = weight_client(self.cfg, "gloo", eid, url)
            self.adapter_pub.endpoints = [self.clients[eid] for eid in urls]
        try:
            self.adapter_pub.publish(version, engine)  # collective: every rank gathers the adapters
            if self.rank == 0 and self.adapter_pub.endpoints:
                ids = [ep.engine_id for ep in self.adapter_pub.endpoints]
                self.publishes += 1
                self.last_published_version = version
                self.publish_held_s = 0.0  # nothing is paused
                self.holding.update(dict.fromkeys(ids, version))
                if self.fleet is not None:
                    self.fleet.engines_updated(ids, version)
                last = self.adapter_pub.last
                calls = {eid: {k: round(v, 3) for k, v in st.items()} for eid, st in last["engines"].items()}
                log.info(
                    "published LoRA adapter v%d (%d bytes) to %s in %.2fs: write %.3f s, per engine %s",
                    version,
                    last["bytes"],
                    ids,
                    time.monotonic() - t0,
                    last["write_seconds"],
                    calls,  # load_adapter / label_version / unload_old seconds (engines/vllm/lora.py)
                )
        except AdapterPublishError as exc:
            self.publish_errors += 1
            log.error("publish of adapter v%d failed: %s", version, exc)
        self.publish_s += time.monotonic() - t0

    def publish(self, version: int, engine) -> None:
        """Every rank, after step ``version``'s update: the full weights (or the adapter) go to every server.
        A publish the servers fail (PublishError, AdapterPublishError) is counted and logged, not raised; the
        full-weight publisher drops the servers it blames from its group."""
        if adapter_publish(self.cfg):
            self._publish_adapter(version, engine)
            return
        t0 = time.monotonic()
        buckets = engine.iter_full_params(self.bucket_bytes(), self.wire_dtype())
        tensors = (item for bucket in buckets for item in bucket)
        if self.rank != 0:  # every gather is a collective: follow rank 0 through the same buckets
            for _ in tensors:
                pass
            return
        if self.pub is None:
            self.pub = self._new_publisher(engine)
        try:
            self.sync_members()
        except Exception as exc:  # the fleet did not answer: publish to the members we know
            log.warning("weight sync: fleet membership unknown (%s)", exc)
        try:
            rep = self.pub.publish(version, tensors)
            log.info("published v%d to %s in %.2fs", version, rep.engines if rep else [], time.monotonic() - t0)
            if rep is not None:
                # pause mode holds the engines for the whole publish; staged updates only for the commit
                staged = self.cfg.weight_sync.staging
                self.publish_held_s = rep.seconds - (rep.broadcast_seconds if staged else 0.0)
            if rep is not None and rep.engines:
                self.publishes += 1
                self.last_published_version = version
                self.holding.update(dict.fromkeys(rep.engines, version))
                if self.fleet is not None:
                    # vLLM 0.26 cannot tell the fleet which weights it holds (no /weight_info): we do
                    self.fleet.engines_updated(list(rep.engines), version)
        except PublishError as exc:
            self.publish_errors += 1
            log.error("publish of v%d failed: %s (blamed %s)", version, exc, exc.blamed)
        self.publish_s += time.monotonic() - t0

    def unchanged(self, version: int) -> None:
        """The step applied no update: no publish (it would pause the fleet for the same weights);
        the servers are told they hold ``version`` so admission and staleness move on."""
        if self.rank != 0:
            return
        self.publishes_skipped += 1
        if self.fleet is None:
            return
        try:
            ids = list(self.pub.engines) if self.pub is not None else list(self.fleet.server_urls())
        except Exception as exc:  # the fleet did not answer: the next publish brings the versions up
            log.warning("weight sync: fleet membership unknown for the relabel to v%d (%s)", version, exc)
            return
        log.info("step %d changed no weights: publish skipped, %d engines relabelled", version, len(ids))
        self.fleet.engines_updated(ids, version, relabel=True)

    def close(self) -> None:
        if self.pub is not None:
            self.pub.close()
