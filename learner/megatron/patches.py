"""The patches fleetrl applies to megatron-core, each with the versions it was checked against.

``apply()`` is idempotent and is called by the Megatron engine before its first checkpoint save.
A patch whose target moved (another megatron-core version) is not applied: ``check()`` names it,
and tests/gpu/test_megatron_gpu.py (checkpoint save/resume in daemonic rank processes) fails.
"""

from __future__ import annotations

import logging
import queue

logger = logging.getLogger(__name__)

# [first, last) megatron-core versions the patch below was read against (the 0.19.2 source).
RESULTS_QUEUE_VERSIONS = ("0.19.0", "0.20.0")


def _version() -> str:
    import megatron.core

    return megatron.core.__version__


def _in_range(version: str, bounds: tuple[str, str]) -> bool:
    from packaging.version import Version

    return Version(bounds[0]) <= Version(version) < Version(bounds[1])


def check() -> list[str]:
    """Names of the patches that do not apply to the installed megatron-core (empty: all apply)."""
    problems = []
    version = _version()
    if not _in_range(version, RESULTS_QUEUE_VERSIONS):
        problems.append(
            f"in_process_checkpoint_results_queue: megatron-core {version} is outside {RESULTS_QUEUE_VERSIONS}"
        )
    else:
        from megatron.core.dist_checkpointing.strategies import filesystem_async as fa

        if not (hasattr(fa, "_results_queue") and hasattr(fa, "get_write_results_queue")):
            problems.append(
                "in_process_checkpoint_results_queue: filesystem_async has no _results_queue / get_write_results_queue"
            )
    return problems


def in_process_checkpoint_results_queue() -> bool:
    """A synchronous ``dist_checkpointing.save`` writes with threads of this process, but megatron-core
    0.19 collects their results through ``multiprocessing.Manager().Queue()``, which starts a server
    process. That is refused inside a daemonic process ("daemonic processes are not allowed to have
    children": our spawned test ranks) and is left running, orphaned, when a rank ends with
    ``os._exit``. A ``queue.Queue`` carries a synchronous save's results as well (asynchronous saves,
    which fleetrl does not use, would need the Manager). Returns whether the patch is in place."""
    if check():
        logger.warning("megatron-core patch not applied: %s", "; ".join(check()))
        return False
    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa

    if fa._results_queue is None:
        fa._results_queue = queue.Queue()
    return isinstance(fa._results_queue, queue.Queue)


def apply() -> None:
    in_process_checkpoint_results_queue()
