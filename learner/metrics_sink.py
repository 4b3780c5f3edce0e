"""Rank 0's per-step metrics: written by the learner itself at every step, never sampled.

Each step's record goes to three places, from the learner process:

* ``RUN_DIR/metrics/learner.jsonl``: one JSON line per step (appended; a resumed run adds its
  lines after a ``{"event": "start", "step": s}`` line). It holds every scalar, the staleness
  histogram, the ids of the groups trained, and every ``samples_every`` steps a few decoded
  sample generations. The driver forwards these lines to W&B (one ``log`` per step) and
  ``launch/report.py`` plots from them;
* TensorBoard, ``RUN_DIR/tensorboard/learner`` (:class:`core.tbevents.EventWriter`): the scalars,
  a histogram ``learner/staleness_versions`` and a text table ``rollout/samples``;
* Prometheus: a gauge per scalar on rank 0's own endpoint (``fleetrl_step_`` + the name with ``/`` as
  ``_``), whose address is in ``RUN_DIR/metrics/learner_endpoint.json``.

Names follow ``component/thing_unit``. :data:`EVERY_STEP` lists the scalars every step has
(the loop's, learner/loop.py, plus the batch's below); ``rollout/reward_mean_<source>`` is added
per data source of the batch.
"""

from __future__ import annotations

import json
import logging
import re
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

log = logging.getLogger(__name__)

# The scalars of every step: the loop's (learner/loop.py, learner/losses.py, the engine's train_step)
# and those this module adds from the step's batch and the rank's publish.
EVERY_STEP = (
    "learner/loss_total",
    "learner/loss_policy",
    "learner/clip_frac",
    "learner/clip_dual_frac",
    "learner/ratio_mean",
    "learner/is_weight_mean",
    "learner/is_weight_max",
    "learner/mismatch_kl_k3",
    "learner/mismatch_kl_k3_fresh",
    "learner/drift_kl_k3",
    "learner/entropy",
    "learner/grad_norm",
    "learner/lr",
    "learner/step_skipped",
    "learner/steps_skipped_total",
    "learner/batch_samples_dropped_uniform",
    "learner/groups_dropped_uniform",
    "learner/staleness_mean_versions",
    "learner/staleness_max_versions",
    "learner/time_wait_data_seconds",
    "learner/time_train_seconds",
    "learner/time_publish_seconds",
    "learner/time_checkpoint_seconds",
    "learner/time_step_seconds",
    "learner/publish_engine_held_seconds",
    "rollout/response_length_mean_tokens",
    "rollout/response_length_max_tokens",
    "rollout/response_length_min_tokens",
    "rollout/response_length_p50_tokens",
    "rollout/response_length_p90_tokens",
    "rollout/truncated_fraction",
    "rollout/reward_mean",
)
JSONL = Path("metrics") / "learner.jsonl"
ENDPOINT = Path("metrics") / "learner_endpoint.json"


def source_key(source: str) -> str:
    return "rollout/reward_mean_" + (re.sub(r"[^A-Za-z0-9_]", "_", source) or "unknown")


def batch_metrics(batch: pa.RecordBatch, step: int) -> tuple[dict[str, float], dict[str, int], list[str]]:
    """(scalars, staleness histogram {versions: samples}, sorted group ids) of one step's batch."""
    lengths = np.array([len(r) for r in batch.column("response_ids").to_pylist()], dtype=np.int64)
    finish = np.array(batch.column("finish_reason").to_pylist())
    reward = batch.column("reward").to_numpy(zero_copy_only=False).astype(np.float64)
    sources = np.array(batch.column("data_source").to_pylist())
    v0 = np.array([v[0] for v in batch.column("segment_versions").to_pylist()], dtype=np.int64)
    stale = step - 1 - v0
    out = {
        "rollout/response_length_mean_tokens": float(lengths.mean()),
        "rollout/response_length_max_tokens": float(lengths.max()),
        "rollout/response_length_min_tokens": float(lengths.min()),
        # numpy's default (linear) interpolation between the two nearest samples
        "rollout/response_length_p50_tokens": float(np.percentile(lengths, 50)),
        "rollout/response_length_p90_tokens": float(np.percentile(lengths, 90)),
        "rollout/truncated_fraction": float((finish == "length").mean()),
        "rollout/reward_mean": float(reward.mean()),
    }
    for src in sorted(set(sources.tolist())):
        out[source_key(src)] = float(reward[sources == src].mean())
    if "loss_mask" in batch.schema.names:  # multi-turn episodes: turns (runs of 1) and observations (runs of 0)
        turns, observed = [], []
        for m in batch.column("loss_mask").to_pylist():
            if not m:
                continue
            a = np.asarray(m, dtype=np.int8)
            starts = np.flatnonzero(np.diff(np.concatenate(([0], a))) == 1)
            turns.append(len(starts))
            observed.append(bool((a == 0).any()))
        if turns:
            out["rollout/turns_mean"] = float(np.mean(turns))
            out["rollout/observation_fraction"] = float(np.mean(observed))
    vals, counts = np.unique(stale, return_counts=True)
    hist = {str(int(v)): int(c) for v, c in zip(vals, counts, strict=True)}
    return out, hist, sorted(set(batch.column("group_id").to_pylist()))


def effective_rows(run_dir: str | Path, before: int | None = None) -> dict[int, dict[str, Any]]:
    """Each step's record as it stands: the last one written for it (a resumed run redoes the steps after
    its checkpoint, and its records replace the dead run's), optionally only steps ``< before``."""
    path = Path(run_dir) / JSONL
    rows: dict[int, dict[str, Any]] = {}
    if not path.exists():
        return rows
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a line cut by kill -9
            continue
        if "metrics" in row and (before is None or row["step"] < before):
            rows[int(row["step"])] = row
    return dict(sorted(rows.items()))


def _prom_name(key: str) -> str:
    return "fleetrl_step_" + re.sub(r"[^A-Za-z0-9_]", "_", key)


class MetricsSink:
    """Rank 0's writer (see the module docstring); ``start_step``: the first step this process runs."""

    def __init__(
        self,
        run_dir: str | Path,
        *,
        start_step: int,
        tensorboard: bool = True,
        prometheus: bool = True,
        samples_every: int = 10,
        samples_n: int = 4,
        model_path: str | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        self.run_dir = Path(run_dir)
        self.samples_every, self.samples_n, self.model_path = samples_every, samples_n, model_path
        self._tok = None
        self.steps_skipped = 0
        (self.run_dir / "metrics").mkdir(parents=True, exist_ok=True)
        self._jsonl = open(self.run_dir / JSONL, "a", buffering=1)  # noqa: SIM115 (closed in close())
        self._jsonl.write(json.dumps({"event": "start", "step": start_step, "wall_time": time.time()}) + "\n")
        self._tb = None
        if tensorboard:
            from core.tbevents import EventWriter

            self._tb = EventWriter(self.run_dir / "tensorboard" / "learner")
            self._tb.start(start_step)  # a resumed run: readers drop the earlier run's later steps
        self._gauges: dict[str, Any] = {}
        self._http = None
        if prometheus:
            from prometheus_client import CollectorRegistry, start_http_server

            self._registry = CollectorRegistry()
            self._http, _ = start_http_server(0, addr=host, registry=self._registry)
            url = f"http://{host}:{self._http.server_port}/metrics"
            (self.run_dir / ENDPOINT).write_text(json.dumps({"learner": url}))
            log.info("learner Prometheus metrics on %s", url)

    def write(
        self, step: int, metrics: dict[str, float], batch: pa.RecordBatch | None, extra: dict[str, float] | None = None
    ) -> dict[str, float]:
        """Record one step; returns the scalars written."""
        scalars = {k: float(v) for k, v in metrics.items()}
        self.steps_skipped += int(scalars.get("learner/step_skipped", 0.0) > 0)
        pull = scalars.get("learner/pull_seconds", 0.0)
        publish = scalars.get("learner/publish_seconds", 0.0)
        total = scalars.get("learner/total_step_seconds", 0.0)
        ckpt = scalars.get("learner/checkpoint_seconds", 0.0)
        scalars.update(
            {
                "learner/steps_skipped_total": float(self.steps_skipped),
                "learner/time_wait_data_seconds": pull,
                "learner/time_publish_seconds": publish,
                "learner/time_checkpoint_seconds": ckpt,
                "learner/time_step_seconds": total,
                "learner/time_train_seconds": max(0.0, total - pull - publish - ckpt),
            }
        )
        scalars.update(extra or {})
        scalars.setdefault("learner/publish_engine_held_seconds", 0.0)
        hist, groups, samples = {}, [], None
        if batch is not None:
            b, hist, groups = batch_metrics(batch, step)
            scalars.update(b)
            size = max(1, int(batch.column("group_size")[0].as_py()))
            scalars["learner/groups_dropped_uniform"] = scalars.get("learner/batch_samples_dropped_uniform", 0.0) / size
            if self.samples_every and step % self.samples_every == 0:
                samples = self._samples(batch)
        row = {"step": step, "wall_time": time.time(), "metrics": scalars, "staleness_hist": hist, "groups": groups}
        if samples:
            row["samples"] = samples
        self._jsonl.write(json.dumps(row) + "\n")
        if self._tb is not None:
            self._tb.scalars(scalars, step)
            self._tb.histogram("learner/staleness_versions", [int(k) for k, n in hist.items() for _ in range(n)], step)
            if samples:
                self._tb.text("rollout/samples", _table(samples), step)
            self._tb.flush()
        if self._http is not None:
            self._set_gauges(scalars)
        return scalars

    def _set_gauges(self, scalars: dict[str, float]) -> None:
        from prometheus_client import Gauge

        for k, v in scalars.items():
            g = self._gauges.get(k)
            if g is None:
                g = self._gauges[k] = Gauge(_prom_name(k), k, registry=self._registry)
            g.set(v)

    def _samples(self, batch: pa.RecordBatch) -> list[dict[str, Any]]:
        """The first sample of the first ``samples_n`` groups, decoded (ids if no tokenizer loads)."""
        if self._tok is None and self.model_path:
            try:
                from transformers import AutoTokenizer

                self._tok = AutoTokenizer.from_pretrained(self.model_path)
            except Exception as exc:  # a table of ids is still a table
                log.warning("sample table: no tokenizer (%s); showing token ids", exc)
                self.model_path = None
        rows = batch.select(["group_id", "prompt_ids", "response_ids", "reward", "finish_reason"]).to_pylist()
        seen, out = set(), []
        for r in rows:
            if r["group_id"] in seen:
                continue
            seen.add(r["group_id"])
            dec = (lambda ids: self._tok.decode(ids)) if self._tok is not None else str
            out.append(
                {
                    "prompt": dec(r["prompt_ids"]),
                    "response": dec(r["response_ids"]),
                    "reward": r["reward"],
                    "finish_reason": r["finish_reason"],
                }
            )
            if len(out) >= self.samples_n:
                break
        return out

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        self._jsonl.close()
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()


def _cell(s: str) -> str:
    return str(s).replace("|", "\\|").replace("\n", " ")[:200]


def _table(samples: list[dict[str, Any]]) -> str:
    lines = ["| prompt | response | reward | finish |", "|---|---|---|---|"]
    lines += [
        f"| {_cell(s['prompt'])} | {_cell(s['response'])} | {s['reward']:.3f} | {s['finish_reason']} |" for s in samples
    ]
    return "\n".join(lines)
