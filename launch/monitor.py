"""What a run shows while it runs: a rich live view, TensorBoard scalars, Prometheus gauges, and W&B.

The driver builds one snapshot dict per tick (:func:`launch.driver` collects it from the
learner, the fleet and the broker) and hands it to :class:`Monitor`. Simulated runs say
so in the view title, in the scalar names (``simulated/...``), in a Prometheus label and
in the W&B run's tags. Weights & Biases is optional (``run.wandb``, off by default): one
W&B run per job, opened by the driver alone (never by the learner or fleet processes),
logging the same scalars at the same steps as TensorBoard, finished at shutdown.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import time
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from core.configbase import ConfigModel
from launch.snapshot import JobSnapshot

log = logging.getLogger(__name__)


class WandbConfig(ConfigModel):
    """``run.wandb``: where the driver logs to Weights & Biases (``run.wandb.project=NAME`` turns it on)."""

    project: str = Field(min_length=1, description="the W&B project")
    entity: str | None = Field(None, description="the W&B team or user; None: the API key's default")
    name: str | None = Field(None, description="run name; None: the run directory's name")
    mode: Literal["online", "offline", "disabled"] | None = Field(
        None, description="None: wandb's own choice (WANDB_MODE, else online)"
    )
    tags: list[str] = Field(default_factory=list, description="W&B run tags")
    init_timeout_s: float = Field(90.0, gt=0, description="wandb.init gives up after this")


GAUGES = {
    "learner_step": "learner/step: optimizer steps applied (the policy version)",
    "learner_idle_fraction": "learner/idle_fraction: share of wall time the learner waited for data",
    "rollout_tokens_per_s": "rollout/tokens_per_s: generated tokens pushed per second",
    "rollout_idle_fraction": "rollout/idle_fraction: share of wall time the fleet had no group in flight",
    "rollout_servers": "rollout/servers: healthy servers",
    "rollout_reward_mean": "rollout/reward_mean: mean reward of the last consumed step",
    "broker_queue_groups": "broker/queue_groups: groups waiting in the broker",
    "rollout_staleness_max_versions": "rollout/staleness_max_versions: max staleness consumed so far",
    "eval_accuracy": "eval/accuracy: test-set accuracy of the latest evaluation",
    "rollout_groups_filtered": "rollout/groups_filtered: uniform groups dropped by dynamic sampling "
    "(rollout.filter_groups), regenerated on their ticket",
}


def stale_lengths_line(hist: dict[str, int]) -> str:
    """``{'64': 3, '512': 9}`` as ``<=64 tok: 3, <=512 tok: 9`` (rows dropped as stale, by length bucket)."""
    return ", ".join(f"<={b} tok: {n}" for b, n in sorted(hist.items(), key=lambda kv: int(kv[0])))


def _fmt(v: Any, spec: str = ".3f") -> str:
    if v is None:
        return "-"
    return format(v, spec) if isinstance(v, float) else str(v)


def reward_server_lines(reward_model: dict[str, Any] | None) -> list[str]:
    """One line per reward server (``reward.model``): answers per second, answers, failed attempts by reason,
    latency, as the fleet's client saw them; and the client's totals first."""
    if not reward_model:
        return []
    rm = reward_model
    out = [
        f"reward model: {rm.get('calls_ok', 0)} calls ok, {rm.get('calls_failed', 0)} failed for good, "
        f"failed attempts {rm.get('failures') or {}}"
    ]
    for url, s in (rm.get("servers") or {}).items():
        out.append(
            f"reward server {url}: {_fmt(s.get('requests_per_s'), '.2f')} req/s, {s.get('requests_ok', 0)} ok, "
            f"failures {s.get('failures') or {}}, latency mean {_fmt(s.get('latency_s_mean'), '.3f')} s "
            f"p95 {_fmt(s.get('latency_s_p95'), '.3f')} s, in flight {s.get('inflight', 0)}"
        )
    return out


def proxy_line(fleet) -> str | None:
    if not fleet.proxy_url:
        return None
    return (
        f"OpenAI proxy: {fleet.proxy_url}/v1 (episodes: /s/<id>/v1), "
        f"{fleet.proxy.get('proxy/requests', 0)} requests, "
        f"{fleet.proxy.get('proxy/history_restarts', 0)} history restarts"
    )


def format_status(answer: dict[str, Any]) -> str:
    """Plain-text rendering of a ``status`` answer (for the ``status`` subcommand)."""
    st = JobSnapshot.from_wire(answer)
    lr = st.learner
    lines = []
    tag = " [SIMULATED]" if st.simulated else ""
    lines.append(f"fleetrl job{tag} ({st.mode}): step {lr.step} / {st.max_steps}  wall {_fmt(st.wall_s, '.1f')} s")
    lines.append(f"learner: wait {_fmt(lr.learner_wait_s, '.2f')} s total, idle {_fmt(lr.learner_idle_fraction)}")
    lines.append(
        f"broker: queue {st.queue_groups} groups, max staleness seen {lr.max_staleness_seen} (bound {st.max_staleness})"
    )
    lines.append(f"staleness histogram (versions: samples): {lr.staleness_hist}")
    if st.broker is not None and st.broker.stale_drop_lengths:
        lines.append(f"stale drops by response length: {stale_lengths_line(st.broker.stale_drop_lengths)}")
    for k, v in (answer.get("metrics_endpoints") or {}).items():  # launch/observe.py
        for name, url in v.items() if isinstance(v, dict) else [(k, v)]:
            lines.append(f"prometheus {name}: {url}")
    lines += reward_server_lines(st.fleet.reward_model)
    if proxy_line(st.fleet):
        lines.append(proxy_line(st.fleet))
    fl = st.fleet
    lines.append(
        f"fleet: {fl.groups_requeued} groups re-queued, {fl.server_deaths} server deaths, "
        f"{fl.server_stalls} server stalls"
    )
    # silent: seconds with requests in flight since the server's last answer (the stall detector's clock)
    lines.append(f"{'server':<14}{'state':<11}{'version':>8}{'inflight':>9}{'groups':>8}{'tok/s':>10}{'silent':>8}")
    for s in st.servers:
        lines.append(
            f"{s.engine_id:<14}{s.state:<11}{s.version:>8}{s.inflight_groups:>9}"
            f"{s.groups_done:>8}{_fmt(s.tok_per_s, '.0f'):>10}{s.silent_s:>7.0f}s"
        )
    return "\n".join(lines)


class _ScalarWriter:
    """TensorBoard event files through the ``tensorboard`` package alone (no torch import:
    the driver stays light; torch's SummaryWriter writes the same records)."""

    def __init__(self, logdir: Path) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._Event, self._Summary = Event, Summary
        self._w = EventFileWriter(str(logdir))

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        summary = self._Summary(value=[self._Summary.Value(tag=tag, simple_value=value)])
        self._w.add_event(self._Event(wall_time=time.time(), step=int(step), summary=summary))

    def close(self) -> None:
        self._w.close()


class WandbWriter:
    """One W&B run (files under ``<run_dir>/wandb``); scalars as :class:`_ScalarWriter` writes them."""

    def __init__(self, cfg: WandbConfig, run_dir: Path, *, simulated: bool, run_config: dict[str, Any]) -> None:
        try:
            import wandb
        except ImportError:
            raise RuntimeError(
                "run.wandb is set but the wandb package is not installed: pip install 'fleetrl[wandb]'"
            ) from None
        self._wandb = wandb
        settings = wandb.Settings(init_timeout=cfg.init_timeout_s, console="off", quiet=True)
        tags = list(cfg.tags) + (["SIMULATED"] if simulated else [])
        # one W&B run per run directory: a re-run on the same --run-dir (resume) continues it
        id_file = Path(run_dir) / "wandb_run_id"
        if not id_file.exists():
            id_file.write_text(secrets.token_hex(4))
        run_id = id_file.read_text().strip()
        try:
            self.run = wandb.init(
                project=cfg.project,
                entity=cfg.entity,
                name=cfg.name or Path(run_dir).name,
                mode=cfg.mode,
                dir=str(run_dir),
                tags=tags,
                settings=settings,
                config={**run_config, "simulated": simulated},
                id=run_id,
                resume="allow",
            )
        except Exception as exc:  # no API key, no network, a bad entity: say so before the job starts
            raise RuntimeError(
                f"W&B: wandb.init(project={cfg.project!r}) failed: {exc} "
                f"(log in with `wandb login`, or set run.wandb.mode=offline)"
            ) from None
        log.info("W&B run %s (%s) in %s", self.run.name, self.run.settings.mode, self.run.dir)

    def add_scalars(self, values: dict[str, Any], step: int) -> None:
        self.run.log(values, step=int(step))

    def resumed_step(self) -> int:
        """The step a resumed run stands at, as its server knows it; 0 for a new or an offline run (an
        offline run learns nothing of its earlier files)."""
        return int(self.run.step) if self.run.resumed else 0

    def table(self, rows: list[dict[str, Any]]):
        cols = list(rows[0])
        return self._wandb.Table(columns=cols, data=[[r[c] for c in cols] for r in rows])

    def close(self) -> None:
        self.run.finish()


class Monitor:
    def __init__(
        self,
        run_dir: Path,
        *,
        simulated: bool,
        tensorboard: bool,
        live: bool,
        prometheus: bool = True,
        wandb: WandbWriter | None = None,
        host: str = "127.0.0.1",
        learner_rows_from: int | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.host = host  # the Prometheus endpoint's interface (network.host)
        self.simulated = simulated
        self._wandb = wandb
        self._tb = None
        self._live = None
        self._gauges: dict[str, Any] = {}
        self._last_tb_step = -1
        self._last_log = 0.0
        self.prometheus_url: str | None = None
        from launch.observe import LearnerRows, RunRecorder

        self.recorder = RunRecorder(self.run_dir)
        # the learner's every step, for W&B: from where the file stood before this launch's learner started
        self._learner_rows = LearnerRows(self.run_dir, learner_rows_from)
        self._wandb_step = -1  # the learner's last step logged to W&B
        self._wandb_pending: list[dict[str, Any]] = []  # rows read from the learner's file, not yet logged
        if tensorboard:
            try:
                self._tb = _ScalarWriter(self.run_dir / "tensorboard")
            except ImportError as exc:
                log.warning("TensorBoard disabled: %s", exc)
        if prometheus:
            self._start_prometheus()
        if live:
            from rich.console import Console
            from rich.live import Live

            self._live = Live(console=Console(stderr=True), refresh_per_second=4, transient=False)
            self._live.start()

    def _start_prometheus(self) -> None:
        from prometheus_client import CollectorRegistry, Gauge, start_http_server

        self._registry = CollectorRegistry()
        labels = {"simulated": "true" if self.simulated else "false"}
        for name, doc in GAUGES.items():
            self._gauges[name] = Gauge(f"fleetrl_{name}", doc, list(labels), registry=self._registry).labels(**labels)
        self._http, self._http_thread = start_http_server(0, addr=self.host, registry=self._registry)
        port = self._http.server_port
        self.prometheus_url = f"http://{self.host}:{port}/metrics"
        (self.run_dir / "metrics.json").write_text(json.dumps({"prometheus": self.prometheus_url}))
        log.info("Prometheus metrics on %s", self.prometheus_url)

    def update(self, snap: JobSnapshot) -> None:
        lr, fl = snap.learner, snap.fleet
        values = {
            "learner_step": lr.step,
            "learner_idle_fraction": lr.learner_idle_fraction,
            "rollout_tokens_per_s": fl.tok_per_s,
            "rollout_idle_fraction": fl.fleet_idle_fraction,
            "rollout_servers": fl.healthy_servers,
            "rollout_reward_mean": lr.reward,
            "broker_queue_groups": snap.queue_groups,
            "rollout_staleness_max_versions": lr.max_staleness_seen,
            "eval_accuracy": snap.eval_accuracy,
            "rollout_groups_filtered": fl.groups_filtered,
        }
        for k, v in values.items():
            if v is not None and k in self._gauges:
                self._gauges[k].set(float(v))
        self.recorder.tick(snap)
        if self._wandb is not None:
            self._learner_to_wandb()
        step = lr.step
        if step != self._last_tb_step and (self._tb is not None or self._wandb is not None):
            self._last_tb_step = step
            prefix = "simulated/" if self.simulated else ""
            scalars = {prefix + k.replace("_", "/", 1): float(v) for k, v in values.items() if v is not None}
            if self._tb is not None:
                for tag, v in scalars.items():
                    self._tb.add_scalar(tag, v, step)
            if self._wandb is not None:  # into the learner's latest logged step: W&B steps only go up, and
                # the learner's line for `step` may not be written yet (it must not be skipped then)
                self._wandb.add_scalars(scalars, self._wandb_step if self._wandb_step >= 0 else step)
        if self._live is not None:
            self._live.update(self.render(snap))
        elif time.monotonic() - self._last_log > 5.0:
            self._last_log = time.monotonic()
            log.info(
                "step %s reward %s eval %s tok/s %s fleet idle %s learner idle %s queue %s staleness %s",
                step,
                _fmt(lr.reward),
                _fmt(snap.eval_accuracy),
                _fmt(fl.tok_per_s, ".0f"),
                _fmt(fl.fleet_idle_fraction),
                _fmt(lr.learner_idle_fraction),
                snap.queue_groups,
                lr.staleness_hist,
            )

    def wandb_catch_up(self, version: int) -> int:
        """A re-run resuming from learner ``version``: log to W&B the kept steps ``1..version`` the run
        may lack (a ``kill -9``-ed driver's W&B process dies with the steps it had not yet written).

        Online the resumed run knows its last step and only later ones are sent (W&B steps only go up);
        offline it does not, so every kept step is logged again into this launch's offline file.
        Returns the number of steps logged."""
        if self._wandb is None or version <= 0:
            return 0
        from learner.metrics_sink import effective_rows

        have, n = self._wandb.resumed_step(), 0
        for step, row in effective_rows(self.run_dir, before=version + 1).items():
            if step >= have:
                self._wandb.add_scalars(self._wandb_values(row), step)
                n += 1
        self._wandb_step = max(self._wandb_step, version)
        log.info("W&B: %d kept step(s) of 1..%d logged (the run stood at step %d)", n, version, have)
        return n

    def _wandb_values(self, row: dict[str, Any]) -> dict[str, Any]:
        values: dict[str, Any] = dict(row["metrics"])
        if row.get("samples"):
            values["rollout/samples"] = self._wandb.table(row["samples"])
        return values

    def _learner_to_wandb(self) -> None:
        """Every step the learner wrote since the last tick (learner/metrics_sink.py), one log each.

        A row leaves the pending list only once logged: a Ctrl-C raises KeyboardInterrupt wherever the driver
        is (launch/driver.py's handler), and one that landed mid-way through the rows of a tick once lost
        them all (the file position had moved past them); :meth:`close` now logs what is left."""
        self._wandb_pending += self._learner_rows.new_rows()
        while self._wandb_pending:
            row = self._wandb_pending[0]
            step = row.get("step")
            # not a start mark, nor a step a resumed run redoes
            if "metrics" in row and step > self._wandb_step:
                self._wandb.add_scalars(self._wandb_values(row), step)
                self._wandb_step = step
            self._wandb_pending.pop(0)

    def render(self, snap: JobSnapshot):
        from rich.table import Table

        title = "fleetrl" + ("  [bold red]SIMULATED[/] (no model)" if self.simulated else "")
        t = Table(title=title, show_header=False, expand=False)
        t.add_column("what", style="cyan")
        t.add_column("value")
        lr, fl = snap.learner, snap.fleet
        t.add_row("mode", snap.mode)
        t.add_row("step", f"{lr.step} / {snap.max_steps}")
        t.add_row("reward (last step)", _fmt(lr.reward))
        if lr.critic_vf_loss is not None:  # PPO with a critic
            t.add_row(
                "critic (last step)",
                f"vf_loss {_fmt(lr.critic_vf_loss, '.4f')}, explained variance {_fmt(lr.critic_explained_var)}",
            )
        t.add_row("eval accuracy", f"{_fmt(snap.eval_accuracy)} (before {_fmt(snap.eval_accuracy_before)})")
        t.add_row("throughput", f"{_fmt(fl.tok_per_s, '.0f')} tok/s, {fl.healthy_servers} servers")
        t.add_row("fleet idle", _fmt(fl.fleet_idle_fraction))
        t.add_row("learner idle", _fmt(lr.learner_idle_fraction))
        t.add_row("broker queue", f"{snap.queue_groups} groups")
        t.add_row(
            "trajectory lag", f"max {lr.max_staleness_seen} (bound {snap.max_staleness}), histogram {lr.staleness_hist}"
        )
        dropped = {} if snap.broker is None else snap.broker.drops
        t.add_row(
            "groups",
            f"produced {fl.groups_pushed}, consumed {lr.groups_consumed}, "
            f"dropped {dropped}, re-queued {fl.groups_requeued}",
        )
        if snap.broker is not None and snap.broker.stale_drop_lengths:
            t.add_row("stale drops by length", stale_lengths_line(snap.broker.stale_drop_lengths))
        for line in reward_server_lines(fl.reward_model):
            what, _, value = line.partition(": ")
            t.add_row(what, value)
        if proxy_line(fl):
            t.add_row("OpenAI proxy", proxy_line(fl).partition(": ")[2])
        return t

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
        if self._wandb is not None:
            try:
                self._learner_to_wandb()  # the last steps, written after the last tick
            except Exception as exc:
                log.error("W&B: logging the last learner steps failed: %s", exc)
        self.recorder.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            try:
                self._wandb.close()
            except Exception as exc:  # the run's files are on disk; a failed upload must not block shutdown
                log.error("W&B finish failed: %s", exc)
            self._wandb = None
        if getattr(self, "_http", None) is not None:
            self._http.shutdown()
            self._http.server_close()


class _Prefixed(logging.Formatter):
    def __init__(self, prefix: str) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.prefix = prefix

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        if self.prefix and self.prefix.strip() not in record.getMessage():
            head, sep, msg = line.partition(f"{record.name}: ")
            line = f"{head}{sep}{self.prefix}{msg}"
        return line


def setup_logging(run_dir: Path, name: str, *, simulated: bool, level: str = "INFO", stderr: bool = False) -> None:
    """Log to ``<run_dir>/logs/<name>.log`` (and stderr if asked); SIMULATED runs prefix every line."""
    logs = Path(run_dir) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    fmt = _Prefixed("[SIMULATED] " if simulated else "")
    root = logging.getLogger()
    root.setLevel(level.upper())
    for h in list(root.handlers):
        if getattr(h, "_fleetrl", False):
            root.removeHandler(h)
    # appended: a re-run on the same run directory (resume) continues the log after a start line
    handlers: list[logging.Handler] = [logging.FileHandler(logs / f"{name}.log", mode="a")]
    if stderr:
        handlers.append(logging.StreamHandler())
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per HTTP request drowns everything else
    for h in handlers:
        h.setFormatter(fmt)
        h._fleetrl = True  # type: ignore[attr-defined]
        root.addHandler(h)
    logging.getLogger(__name__).info("=== %s starts (pid %d) ===", name, os.getpid())
