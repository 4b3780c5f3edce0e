"""The pushes of one message get the verdict each would get alone (issue 25, item 3).

The broker validates the batches of a ``Multi``'s pushes together (one concatenation, see
``broker.schema.inspect_batches``) as an optimisation only: for every push, the outcome
(accepted with exactly these groups, or refused with this error code) must equal the
outcome of that push sent alone. Checked over mutated batches: rows with random defects
(the row-level mutants of test_broker_validate), slices, several groups per push, batches
past the joint-copy size, Arrow IPC frames with flipped bytes, and field names that are
not UTF-8. A crash of any check is a failure here (``internal:...`` never equals a code).
"""

from __future__ import annotations

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_broker_validate import DEFECTS, _rows  # same folder

from broker import protocol as P
from broker.groups import split_groups
from broker.protocol import BrokerError
from broker.schema import SchemaError, inspect_batch
from broker.server import BrokerServer
from tests.support.broker_groups import batch_from_rows, make_groups

pytestmark = pytest.mark.timeout(300)


class _Frame:
    """What the server reads of a zmq.Frame: its buffer and length."""

    def __init__(self, data: bytes) -> None:
        self.buffer = memoryview(data)
        self._n = len(data)

    def __len__(self) -> int:
        return self._n


def _outcome(batches, view) -> object:
    try:
        if not batches:
            return "bad_frame"
        batch = batches[0] if len(batches) == 1 else pa.concat_batches(batches)
        view = view if view is not None else inspect_batch(batch)
        return tuple(
            (g.group_id, g.label, g.vmin, g.vmax, g.batch.num_rows, g.versions.tolist())
            for g in split_groups(batch, None, view)
        )
    except SchemaError:
        return "bad_schema"
    except (BrokerError, P.ProtocolError) as e:
        return e.code
    except Exception as e:  # a crash is what this test looks for
        return f"internal:{type(e).__name__}"


def alone(payload: bytes) -> object:
    try:
        batches = P.ipc_to_batches(payload)
    except P.ProtocolError as e:
        return e.code
    except Exception as e:
        return f"internal:{type(e).__name__}"
    return _outcome(batches, None)


def together(payloads: list[bytes]) -> list[object]:
    subs = [(P.Push(producer_id="p"), [None, _Frame(b)]) for b in payloads]
    prepared = BrokerServer._prepare_pushes(subs)
    out = []
    for j in range(len(payloads)):
        p = prepared.get(j)
        out.append(p.code if isinstance(p, P.ProtocolError) else _outcome(*p))
    return out


def _flip(data: bytes, draw) -> bytes:
    raw = bytearray(data)
    for _ in range(draw(st.integers(1, 3))):
        i = draw(st.integers(0, len(raw) - 1))
        raw[i] ^= 1 << draw(st.integers(0, 7))
    return bytes(raw)


@settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data(), k=st.integers(2, 4))
def test_each_push_of_a_multi_gets_the_verdict_it_gets_alone(data, k):
    draw = data.draw
    payloads = []
    for j in range(k):
        kind = draw(st.sampled_from(["rows", "rows", "groups", "big", "flip", "utf8"]))
        if kind == "rows":  # random row defects, maybe sliced
            n = draw(st.integers(1, 6))
            defects = draw(st.lists(st.sampled_from(DEFECTS[:3] * 4 + DEFECTS), min_size=n, max_size=n))
            rows = _rows(n, defects, draw(st.integers(0, 4)), lambda m: draw(st.integers(0, m - 1)))
            for r in rows:
                r["traj_id"] = f"b{j}/{r['traj_id']}" if draw(st.booleans()) else r["traj_id"]
                r["step"] = draw(st.sampled_from([1, 2, 2, 2, -5]))
            b = batch_from_rows(rows)
            if n > 1 and draw(st.booleans()):
                b = b.slice(1)
        else:
            groups = [f"m{j}-{i}" for i in range(draw(st.integers(1, 3)))]
            b = make_groups(
                groups,
                step=1,
                version=draw(st.integers(0, 3)),
                group_size=draw(st.integers(1, 3)),
                resp_len=20000 if kind == "big" else 5,
            )
        data_ = P.batch_to_ipc(b).to_pybytes()
        if kind == "flip":
            data_ = _flip(data_, draw)
        elif kind == "utf8":
            data_ = data_.replace(b"traj_id", b"traj\xffid"[:7], 1)
        payloads.append(data_)
    got, want = together(payloads), [alone(p) for p in payloads]
    assert got == want
    assert not any(isinstance(x, str) and x.startswith("internal") for x in want), want


def test_field_names_that_are_not_utf8_are_a_schema_error_alone_and_together():
    good = P.batch_to_ipc(make_groups(["a"], step=1, version=0)).to_pybytes()
    bad = good.replace(b"traj_id", b"traj\xffid"[:7], 1)
    assert alone(bad) == "bad_schema"
    assert together([bad, good])[0] == "bad_schema" and together([good, bad])[1] == "bad_schema"
