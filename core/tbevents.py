"""TensorBoard event files through the ``tensorboard`` package alone (no torch, no TensorFlow).

Scalars, histograms and text (the text plugin's tensor summaries), and a ``SessionLog.START``
mark: a writer that resumes a run at step ``s`` writes ``start(s)`` first, and TensorBoard's
reader then drops the earlier files' events at steps ``>= s`` (the steps the resumed run redoes),
so a curve continues instead of doubling back. Example::

    w = EventWriter(run_dir / "tensorboard" / "learner")
    w.start(1)
    w.scalars({"learner/loss_total": 0.3}, step=1)
    w.histogram("learner/staleness_versions", [0, 0, 1, 2], step=1)
    w.close()
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path


class EventWriter:
    def __init__(self, logdir: str | Path, *, suffix: str = "") -> None:
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog
        from tensorboard.compat.proto.summary_pb2 import HistogramProto, Summary
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._Event, self._SessionLog, self._Summary, self._Hist = Event, SessionLog, Summary, HistogramProto
        Path(logdir).mkdir(parents=True, exist_ok=True)
        self._w = EventFileWriter(str(logdir), filename_suffix=suffix)

    def _add(self, step: int, **kw) -> None:
        self._w.add_event(self._Event(wall_time=time.time(), step=int(step), **kw))

    def start(self, step: int) -> None:
        """Mark a (re)start at ``step``: readers purge older events at this step and later."""
        self._add(step, session_log=self._SessionLog(status=self._SessionLog.START))

    def scalars(self, values: dict[str, float], step: int) -> None:
        vals = [self._Summary.Value(tag=k, simple_value=float(v)) for k, v in values.items()]
        self._add(step, summary=self._Summary(value=vals))

    def histogram(self, tag: str, values: Iterable[float], step: int) -> None:
        """Integer-valued samples (staleness in versions): one bucket per value."""
        xs = sorted(float(x) for x in values)
        if not xs:
            return
        counts: dict[float, int] = {}
        for x in xs:
            counts[x] = counts.get(x, 0) + 1
        # bucket_limit[i] is the right edge of bucket i; a bucket per integer value v is (v - 1, v]
        limits = sorted(counts)
        h = self._Hist(
            min=xs[0],
            max=xs[-1],
            num=len(xs),
            sum=sum(xs),
            sum_squares=sum(x * x for x in xs),
            bucket_limit=limits,
            bucket=[float(counts[v]) for v in limits],
        )
        self._add(step, summary=self._Summary(value=[self._Summary.Value(tag=tag, histo=h)]))

    def text(self, tag: str, markdown: str, step: int) -> None:
        from tensorboard.plugins.text.summary_v2 import text_pb

        self._add(step, summary=text_pb(tag, markdown))

    def flush(self) -> None:
        self._w.flush()

    def close(self) -> None:
        self._w.close()
