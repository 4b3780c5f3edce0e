"""A spool holding structurally invalid Arrow data (from an older broker, or damaged on disk) is
replayed without it: each bad record is quarantined and the records after it are replayed."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from broker import protocol as P
from broker.schema import ArrowDataError, check_structure
from broker.spool import Spool
from broker.state import BrokerState
from tests.support.broker_groups import make_groups


def _find_mutants(good: bytes, seed: int = 7) -> tuple[bytes, bytes]:
    """Seeded single-byte mutants of the record batch message of ``good`` (a one-batch stream):
    one whose batch decodes but fails full validation, and one whose message is whole but
    whose batch does not decode. Both keep the framing (lengths) so they spool as they are."""
    rng = np.random.default_rng(seed)
    head = len(P.schema_message(make_groups(["x"], step=1, version=0).schema))
    invalid = undecodable = None
    for _ in range(20_000):
        m = bytearray(good)
        m[int(rng.integers(head, len(good) - 8))] = int(rng.choice([0x00, 0xFF, 0x7F, 0x80]))
        m = bytes(m)
        if P.batch_message(m) is None:  # framing broken: the spool would not hold it as is
            continue
        msg = pa.ipc.read_message(pa.py_buffer(m[head:-8]))
        try:
            b = pa.ipc.read_record_batch(msg, make_groups(["x"], step=1, version=0).schema)
        except (pa.ArrowException, ValueError, OSError):
            undecodable = undecodable or m
            continue
        try:
            check_structure(b)
        except ArrowDataError:
            invalid = invalid or m
        if invalid and undecodable:
            return invalid, undecodable
    raise AssertionError("the seed gave no mutant of each kind")


def test_structurally_invalid_spooled_batches_are_quarantined_and_the_rest_replayed(tmp_path):
    bad = make_groups(["poison"], step=1, version=0)
    invalid, undecodable = _find_mutants(P.batch_to_ipc(bad).to_pybytes())
    sp = Spool(tmp_path, fsync="never")
    sp.on_accept(make_groups(["a"], step=1, version=0))
    sp.on_accept(bad, payload=invalid)  # written as its bytes came, as an older broker spooled it
    sp.on_accept(make_groups(["b"], step=1, version=0))
    sp.on_accept(bad, payload=undecodable)
    sp.on_accept(make_groups(["c"], step=1, version=0))
    sp.close()
    for _ in range(2):  # a second recovery finds them again and copies nothing twice
        sp2 = Spool(tmp_path, fsync="never")
        rec = sp2.recover()
        assert rec.quarantined == 2 and rec.torn_segments == 0
        for b in rec.batches:
            b.validate(full=True)
        s = BrokerState(
            max_staleness=2,
            groups_per_step=3,
            lease_timeout_s=10.0,
            ticket_timeout_s=20.0,
            byte_budget_bytes=64 << 20,
            journal=sp2,
        )
        s.restore(rec.batches, rec.records, now=0)
        assert set(s.pending) == {"a", "b", "c"}  # the good batches after each bad one too
        sp2.close()
    reasons = sorted(p.read_text() for p in (tmp_path / "quarantine").glob("*.reason.txt"))
    assert len(reasons) == 2 and all(r.startswith("bad_arrow") for r in reasons), reasons


def test_each_distinct_internal_error_is_logged_with_its_traceback_once(caplog):
    from broker.config import BrokerConfig
    from broker.server import BrokerServer

    server = BrokerServer(BrokerConfig(address="tcp://127.0.0.1:0"))

    def bug_a():
        raise KeyError("a")

    def bug_b():
        raise KeyError("b")

    try:
        with caplog.at_level("ERROR", logger="broker.server"):
            for bug in (bug_a, bug_a, bug_b, bug_a, bug_b):
                try:
                    bug()
                except KeyError as e:
                    server._internal(b"peer", 1, e)
        with_tb = [r for r in caplog.records if r.exc_info]
        assert len(with_tb) == 2 and {r.exc_info[1].args[0] for r in with_tb} == {"a", "b"}
        assert server.errors["internal"] == 5 and len(server._out) == 5  # each still answered internal
    finally:
        server.close()
