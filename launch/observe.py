"""The driver's side of watching a run: its own time series, the metrics endpoints, W&B from the learner.

* :class:`RunRecorder`: one line per second in ``RUN_DIR/metrics/driver.jsonl`` (throughput, idle
  fractions, queue, publish time, evaluation: what only the driver sees), and
  ``RUN_DIR/metrics/pids.json`` (the driver's and the engine servers' pids, so a re-run after a
  ``kill -9`` can end what the dead driver left, :mod:`launch.resume`);
* :class:`LearnerRows`: the learner's per-step lines (``learner/metrics_sink.py``) as they are
  appended, for W&B: every step is logged, none is sampled;
* :class:`Endpoints`: every Prometheus endpoint of the job (the driver's, the broker's, the
  learner's, each engine server's own ``/metrics``) in ``RUN_DIR/metrics.json``, printed at start
  and answered by ``status``.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from launch.snapshot import JobSnapshot

log = logging.getLogger(__name__)

DRIVER_JSONL = Path("metrics") / "driver.jsonl"
LEARNER_JSONL = Path("metrics") / "learner.jsonl"
PIDS = Path("metrics") / "pids.json"
ENDPOINTS = "metrics.json"


class RunRecorder:
    def __init__(self, run_dir: Path, every_s: float = 1.0) -> None:
        self.run_dir = Path(run_dir)
        (self.run_dir / "metrics").mkdir(parents=True, exist_ok=True)
        self.every_s = every_s
        self._last = 0.0
        self._pids: list[int] = []
        self._f = open(self.run_dir / DRIVER_JSONL, "a", buffering=1)  # noqa: SIM115 (closed in close())
        self._f.write(json.dumps({"event": "start", "time": time.time(), "pid": os.getpid()}) + "\n")

    def tick(self, snap: JobSnapshot) -> None:
        now = time.monotonic()
        pids = sorted(s.pid for s in snap.servers if s.pid)
        if pids != self._pids:
            self._pids = pids
            tmp = self.run_dir / (str(PIDS) + ".tmp")
            tmp.write_text(json.dumps({"driver": os.getpid(), "engines": pids}))
            tmp.replace(self.run_dir / PIDS)
        if now - self._last < self.every_s:
            return
        self._last = now
        lr, fl = snap.learner, snap.fleet
        row = {
            "time": time.time(),
            "wall_s": round(snap.wall_s, 3),
            "step": lr.step,
            "reward": lr.reward,
            "eval_accuracy": snap.eval_accuracy,
            "tokens_per_s": fl.tok_per_s,
            "tokens_total": fl.tokens_pushed,
            "fleet_idle_fraction": fl.fleet_idle_fraction,
            "learner_idle_fraction": lr.learner_idle_fraction,
            "queue_groups": snap.queue_groups,
            "publish_seconds_total": lr.publish_s,
            "publishes": lr.publishes,
            "healthy_servers": fl.healthy_servers,
        }
        self._f.write(json.dumps(row) + "\n")

    def close(self) -> None:
        self._f.close()


class LearnerRows:
    """New complete lines of ``RUN_DIR/metrics/learner.jsonl`` since the last call."""

    def __init__(self, run_dir: Path, start: int | None = None) -> None:
        """``start``: the file's size before this launch's learner started (None: its size now); a
        resumed run reads only the new learner's lines."""
        self.path = Path(run_dir) / LEARNER_JSONL
        self._pos = start if start is not None else self.size(run_dir)

    @staticmethod
    def size(run_dir: Path) -> int:
        path = Path(run_dir) / LEARNER_JSONL
        return path.stat().st_size if path.exists() else 0

    def new_rows(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        with open(self.path, "rb") as f:
            f.seek(self._pos)
            data = f.read()
        end = data.rfind(b"\n") + 1  # a line being written is read next time
        rows = [json.loads(line) for line in data[:end].splitlines() if line.strip()]
        self._pos += end  # last: the position moves only with the rows in hand
        return rows


class Endpoints:
    """The job's Prometheus endpoints, kept in ``RUN_DIR/metrics.json``."""

    def __init__(self, job) -> None:
        self.job = job
        self.path = Path(job.run_dir) / ENDPOINTS
        self.current: dict[str, Any] = {}
        self._last = 0.0
        self.refresh(force=True)
        lines = [f"  {k}: {v}" for k, v in self.current.items() if k != "engines"]
        lines += [f"  engine {e}: {u}" for e, u in self.current.get("engines", {}).items()]
        msg = "Prometheus endpoints (also in %s):\n%s" % (self.path, "\n".join(lines))
        log.info(msg)
        print(msg, flush=True)

    def refresh(self, force: bool = False) -> None:
        """Re-read the learner's endpoint and the engines' URLs (at most once a second)."""
        if not force and time.monotonic() - self._last < 1.0:
            return
        self._last = time.monotonic()
        job, out = self.job, {}
        mon = job.monitor
        if mon is not None and mon.prometheus_url:
            out["driver"] = mon.prometheus_url
        if job.cfg.broker.metrics_port:
            out["broker"] = f"http://127.0.0.1:{job.cfg.broker.metrics_port}/metrics"
        learner = Path(job.run_dir) / "metrics" / "learner_endpoint.json"
        if learner.exists():
            out.update(json.loads(learner.read_text()))
        try:
            urls = job._get(job.fleet.server_urls.remote(), 10.0, "fleet server urls") if job.fleet else {}
            out["engines"] = {e: u.rstrip("/") + "/metrics" for e, u in sorted(urls.items())}
        except Exception as exc:  # the list is informative: never end the job for it
            log.debug("engine urls: %s", exc)
            out["engines"] = self.current.get("engines", {})
        if out != self.current:
            self.current = out
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"prometheus": out.get("driver"), **out}, indent=1))
            tmp.replace(self.path)
