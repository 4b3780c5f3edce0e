"""Seeded bit flips and byte sets over the Arrow body of valid pushes, against a real broker process.

Each mutant is classified here independently of the broker: read with Arrow's own stream
reader and fully validated (``RecordBatch.validate(full=True)``). The claims:

* every structurally invalid mutant is refused with a named error code (never ``internal``);
* no reply to any mutant is ``internal`` (a client's mistake is never reported as the broker's);
* nothing structurally invalid is in the spool afterwards, and a broker restarted on it
  quarantines nothing (so nothing invalid can reach a learner through a replay either).
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np
import pyarrow as pa
import pytest
import zmq

from broker import protocol as P
from broker.client import get_status
from broker.process import BrokerProcess
from broker.spool import Spool, UndecodableBatch, read_segment_entries
from tests.support.broker_groups import make_groups

pytestmark = pytest.mark.timeout(240)

N_MUTANTS = 400
SEED = 40
CODES = {c.value for c in P.ErrorCode}


def mutate(good: bytes, rng: np.random.Generator, body_from: int) -> bytes:
    """One to three bit flips or byte sets in ``good[body_from:-8]`` (the record batch message)."""
    m = bytearray(good)
    for _ in range(int(rng.integers(1, 4))):
        pos = int(rng.integers(body_from, len(good) - 8))
        if rng.random() < 0.5:
            m[pos] ^= 1 << int(rng.integers(0, 8))
        else:
            m[pos] = int(rng.choice([0x00, 0xFF, 0x7F, 0x80, int(rng.integers(0, 256))]))
    return bytes(m)


def structurally_valid(payload: bytes) -> bool:
    """Arrow's own verdict, by another read path than the broker's (a stream reader)."""
    try:
        for b in pa.ipc.open_stream(pa.py_buffer(payload)):
            b.validate(full=True)
        return True
    except (pa.ArrowException, ValueError, OSError):
        return False


def test_structurally_invalid_mutants_are_refused_with_a_named_code_and_never_spooled(tmp_path):
    rng = np.random.default_rng(SEED)
    spool = tmp_path / "spool"
    head = len(P.schema_message(make_groups(["x"], step=1, version=0).schema))
    verdicts: dict[str, int] = {}
    invalid = refused_invalid = 0
    accepted: list[str] = []
    with BrokerProcess(
        groups_per_step=1,
        max_staleness=1024,
        spool_dir=str(spool),
        fsync="never",
        byte_budget_mb=256,
        lease_timeout_s=60,
    ) as bp:
        ctx = zmq.Context()
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(bp.address)
        try:
            for i in range(N_MUTANTS):
                batch = make_groups(
                    [f"m{i:04d}"],
                    step=1,
                    version=0,
                    group_size=int(rng.integers(1, 5)),
                    resp_len=int(rng.integers(1, 40)),
                    rng=rng,
                )
                payload = mutate(P.batch_to_ipc(batch).to_pybytes(), rng, head)
                valid = structurally_valid(payload)
                s.send_multipart(
                    [
                        msgspec.msgpack.encode(
                            {"proto": P.PROTOCOL_VERSION, "type": "push", "req": i, "producer_id": "fuzz"}
                        ),
                        payload,
                    ]
                )
                assert s.poll(10_000), f"no reply to mutant {i}"
                ((reply, _),) = P.split_replies(s.recv_multipart())
                assert reply.req == i
                code = reply.code if isinstance(reply, P.ErrorReply) else "accepted"
                verdicts[code] = verdicts.get(code, 0) + 1
                assert code != P.ErrorCode.INTERNAL, f"mutant {i} answered internal: {reply.message}"
                if not valid:
                    invalid += 1
                    assert isinstance(reply, P.ErrorReply), f"structurally invalid mutant {i} was accepted"
                    assert reply.code in CODES
                    refused_invalid += 1
                elif isinstance(reply, P.PushReply) and reply.groups:
                    # a flip may have changed the group id itself: the one the mutant carries
                    accepted += (
                        pa.ipc.open_stream(pa.py_buffer(payload)).read_all().column("group_id").unique().to_pylist()
                    )
                if isinstance(reply, P.ErrorReply):
                    assert reply.code in CODES, reply.code
            errors = get_status(bp.address)["errors"]
        finally:
            s.close(0)
            ctx.term()
    # The seed gives a mix: many refused for their structure, many accepted (flipped values
    # that stay valid), so the test can fail either way.
    assert invalid >= 50 and len(accepted) >= 50, verdicts
    assert refused_invalid == invalid
    assert errors.get("internal", 0) == 0, errors
    assert verdicts.get("bad_arrow", 0) > 0, verdicts
    entries, torn = read_segment_entries(Path(spool))
    assert torn == 0
    for path, offset, _, b in entries:
        assert not isinstance(b, UndecodableBatch), (path, offset, b)
        b.validate(full=True)
    spooled = {g for _, _, _, b in entries for g in b.column("group_id").to_pylist()}
    assert spooled == set(accepted)
    rec = Spool(spool, fsync="never").recover()
    assert rec.quarantined == 0 and len(rec.batches) == len(entries)
    print(f"{N_MUTANTS} mutants: {verdicts}; {invalid} structurally invalid, all refused")
