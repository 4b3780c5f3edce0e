"""The stall detector's state for one server: how long it has held requests without answering any.

A pure object with no clock of its own (every method takes ``now``), owned by the fleet controller,
which feeds it each request's start and end and asks it whether the server is stalled
(``rollout.stall_timeout_s``). The silence it measures is time *with requests in flight*: it stops
while the server holds none, and ends at every answer. So a slow server that answers some of its
requests is never silent for long, however long each takes, while one whose every request hangs or
times out is (a timeout or a connection error is not an answer).

Tokens are progress too: a server decoding only very long responses answers nothing for minutes. Where the
engine can count its generated tokens (``generated_tokens``: vLLM's ``/metrics``), the controller reads the
count once the silence is half the timeout (:meth:`wants_baseline`) and again when it would be stalled
(:meth:`tokens_moved`): a count that rose is progress, and the clock starts again from that reading; one that
did not move (a hung scheduler) or no count at all leaves the verdict to answers, as before.

Example::

    watch = ProgressWatch()
    watch.sent(now=0.0)
    watch.stalled(now=130.0, timeout_s=120.0)   # True: in flight for 130 s, nothing answered
    watch.answered(now=131.0)                    # the silence ends

    watch.sent(now=200.0)
    watch.wants_baseline(now=260.0, timeout_s=120.0)  # True: half the timeout silent, no count read yet
    watch.baseline(5000, watch.epoch)
    watch.tokens_moved(9000, now=320.0)           # "moved": generating; the clock starts again at 320
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class ProgressWatch:
    """One server's silence: fed each request's start and end, asked whether the server is stalled."""

    inflight: int = 0
    silent_s_before: float = 0.0  # silence accumulated over earlier busy spells, since the last answer
    busy_since: float = 0.0  # start of the current busy spell (meaningful while inflight > 0)
    holds: set[str] = field(
        default_factory=set
    )  # why the server generates nothing by design (own weight update, sleep)
    paused_since: float | None = None  # when the server was first found paused (by the engine's word) in this silence
    # the engine's generated-token count (generated_tokens) as last read in this silence, and whether it was read
    # (read with tokens None: the engine cannot say); epoch counts ends of silences, so a read that an answer
    # overtook is no baseline; kept: the count has kept the server in this silence (the controller logs it once)
    tokens: int | None = None
    tokens_read: bool = False
    epoch: int = 0
    kept: bool = False

    def sent(self, now: float) -> None:
        """A request went to the server."""
        if self.inflight == 0:
            self.busy_since = now
        self.inflight += 1

    def answered(self, now: float) -> None:
        """A request came back with an answer (samples, an abort, a refusal): the server works."""
        self.inflight -= 1
        self._quiet(now)

    def failed(self, now: float) -> None:
        """A request ended without an answer (error, timeout, cancelled): the silence goes on."""
        self.inflight -= 1
        if self.inflight == 0:
            self.silent_s_before += now - self.busy_since

    def hold(self, why: str) -> None:
        """The server generates nothing by design (a weight update the fleet drives, colocated sleep)."""
        self.holds.add(why)

    def release(self, why: str, now: float) -> None:
        """The hold ``why`` ended; the silence starts again from ``now`` once no hold is left."""
        self.holds.discard(why)
        if not self.holds:
            self._quiet(now)

    def silent_s(self, now: float) -> float:
        """Seconds with requests in flight since the last answer (or hold's end)."""
        return self.silent_s_before + (now - self.busy_since if self.inflight else 0.0)

    def stalled(self, now: float, timeout_s: float) -> bool:
        """Requests in flight, no hold, and no answer for ``timeout_s`` (before :meth:`excused`)."""
        return self.inflight > 0 and not self.holds and self.silent_s(now) >= timeout_s

    def excused(self, paused: bool | None, now: float, timeout_s: float) -> bool:
        """Whether a server found stalled is excused by its own word that it is paused (``paused``: what it
        answered; None: it cannot say). A pause is a weight update loading: it gets ``timeout_s`` more from
        when it was first found paused; a server paused longer is stalled too (a pause a failed load left).
        Found running again after that, its pause has ended since: the silence starts again from ``now``."""
        if paused:
            if self.paused_since is None:
                self.paused_since = now
            return now - self.paused_since < timeout_s
        if paused is False and self.paused_since is not None:
            self._quiet(now)
            return True
        return False

    def wants_baseline(self, now: float, timeout_s: float) -> bool:
        """Whether to read the engine's token count now: half the timeout silent and no count read in this
        silence (the later read at the stall then has a baseline, so a hung server is still found in time)."""
        return self.inflight > 0 and not self.holds and not self.tokens_read and self.silent_s(now) >= timeout_s / 2

    def baseline(self, tokens: int | None, epoch: int) -> None:
        """The token count read for :meth:`wants_baseline`; ``epoch``: :attr:`epoch` when the read began (an
        answer since ended that silence: the read belongs to no silence and is dropped)."""
        if epoch == self.epoch:
            self.tokens, self.tokens_read = tokens, True

    def tokens_moved(self, tokens: int | None, now: float) -> str:
        """A stalled server's token count, read now: ``"moved"`` if it rose past the count read earlier in this
        silence (progress: the clock starts again from ``now``, this count the new baseline), ``"first"`` if no
        count was read before in this silence (this one becomes the baseline: judge it at the next check; a
        health interval longer than half the timeout gets here), else ``"still"`` (no count, or it did not rise:
        the silence counts as it is)."""
        last, had = self.tokens, self.tokens_read
        if tokens is None:
            return "still"
        self.tokens, self.tokens_read = tokens, True
        if not had or last is None:
            return "first"
        if tokens <= last:
            return "still"
        self.silent_s_before, self.busy_since, self.paused_since = 0.0, now, None
        return "moved"

    def _quiet(self, now: float) -> None:
        self.silent_s_before, self.busy_since, self.paused_since = 0.0, now, None
        self.tokens, self.tokens_read, self.kept = None, False, False
        self.epoch += 1
