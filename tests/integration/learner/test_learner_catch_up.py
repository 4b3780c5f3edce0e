"""A publish of the current weights while the learner waits for a batch and a server lacks them.

Two real FSDP ranks (gloo, forked processes) on the tiny Qwen2: rank 0's source holds step 2's batch
back, as a broker does when the only server left is a late joiner at version 0 (its groups would be
past the staleness bound), until a publish of version 1 happened again. Every rank must take part in
that publish (each gather is a collective), and training then goes on; without the hook, or with no
server lacking weights, the wait simply continues to the source's batch or the timeout.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from learner_testkit import join_gloo, make_batches, make_tiny_model, run_procs, write_batches

STEPS = 3
pytestmark = pytest.mark.timeout(240)


def _rank(rank: int, world_size: int, port: int, kw: dict) -> None:

    import pyarrow as pa

    from learner.config import LearnerConfig
    from learner.fsdp import FSDPEngine
    from learner.loop import Learner
    from learner.source import InProcessSource

    join_gloo(rank, world_size, port)
    cfg = LearnerConfig.model_validate(
        {
            "loss": {"correction": "decoupled"},
            "micro_batch_tokens": 64,
            "logprob_probe_tolerance": None,
            "optim": {"lr": 1e-3, "warmup_steps": 1},
        }
    )
    engine = FSDPEngine(cfg, kw["model"], total_steps=STEPS, seed=0)
    published: list[int] = []
    asked: list[float] = []

    def publish(version: int, eng) -> None:
        for _bucket in eng.iter_full_params(1 << 16):  # the gathers every rank must run, as a publisher's
            pass
        published.append(version)

    class HeldBack(InProcessSource):
        """Step 2's batch only once version 1 was published a second time."""

        def next_batch(self, step, timeout_s=None):
            if step == 2 and kw["hold"] and published.count(1) < 2:
                time.sleep(timeout_s or 0)
                raise TimeoutError(f"no batch for step {step} within {timeout_s}")
            return super().next_batch(step, timeout_s)

    source = None
    if rank == 0:
        with pa.ipc.open_file(kw["data"]) as f:
            source = HeldBack([f.get_batch(i) for i in range(f.num_record_batches)])

    def needs_weights() -> bool:  # a server joined at version 0 until the next publish reaches it
        asked.append(time.monotonic())
        return kw["lacking"] and published.count(1) < 2

    learner = Learner(
        engine,
        cfg,
        source=source,
        max_steps=STEPS,
        publish=publish,
        needs_weights=needs_weights if kw["hook"] else None,
        idle_poll_s=0.2,
        batch_timeout_s=kw["timeout_s"],
    )
    out: dict = {"published": published, "catch_up": 0, "asked": 0, "error": None}
    try:
        learner.run()
    except TimeoutError as exc:
        out["error"] = str(exc)
    out.update(catch_up=learner.catch_up_publishes, asked=len(asked), version=learner.version)
    Path(f"{kw['out']}.rank{rank}").write_text(json.dumps(out))
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("catchup")
    return d, make_tiny_model(d / "model"), write_batches(d / "data.arrow", make_batches(STEPS))


def _run(files, name: str, **kw) -> list[dict]:
    d, model, data = files
    args = (
        dict(model=str(model), data=str(data), out=str(d / name), hold=True, hook=True, lacking=True, timeout_s=30.0)
        | kw
    )
    run_procs(_rank, 2, args, timeout=180, start_method="fork")
    return [json.loads(Path(f"{d / name}.rank{r}").read_text()) for r in range(2)]


def test_every_rank_publishes_the_current_weights_again_then_trains_on(files):
    for r in _run(files, "caught"):
        assert r["error"] is None
        assert r["published"] == [1, 1, 2, 3], r  # v1 twice: its own publish, then the catch-up
        assert r["catch_up"] == 1 and r["version"] == STEPS


def test_no_catch_up_while_every_server_holds_the_weights(files):
    r0, r1 = _run(files, "current", lacking=False, timeout_s=1.5)
    # the source keeps step 2 back and nobody lacks weights: the wait ends at the timeout, nothing republished
    assert r0["published"] == [1] and r1["published"] == [1] and r0["catch_up"] == 0
    assert r0["asked"] >= 3  # asked at every 0.2 s poll, not once
    assert "no batch within 2 s in all" in r0["error"] and "step 2" in r0["error"], r0["error"]
    assert "learner rank 0 got no batch" in r1["error"]
