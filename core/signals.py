"""A stop flag that a signal handler may set.

``threading.Event.set`` takes a lock. A handler that calls it can be interrupted inside it by a
second signal, whose handler then waits on that lock in the same thread forever: a broker that got
SIGTERM from its parent's death (``PR_SET_PDEATHSIG``) and more signals right after it hung like
that, holding its port and spool (seen 2026-12-03, four nested handlers in ``Event.set``). Python
runs handlers in the main thread between bytecodes, so assigning an attribute is safe to nest.

Example::

    stop = SignalFlag()
    signal.signal(signal.SIGTERM, stop.handler)
    while not stop.is_set():
        ...
"""

from __future__ import annotations


class SignalFlag:
    """``set``/``is_set`` like ``threading.Event`` (the part a polling loop reads), without a lock.

    Readers poll it; nothing can wait on it."""

    __slots__ = ("_set",)

    def __init__(self) -> None:
        self._set = False

    def set(self) -> None:
        self._set = True

    def is_set(self) -> bool:
        return self._set

    def handler(self, signum, frame) -> None:
        """A ``signal.signal`` handler: sets the flag, nothing else."""
        self._set = True
