"""Where listeners bind, the CurveZMQ keys, and the control endpoint refusing a client without them.

Real ZMQ sockets on loopback: Curve's handshake is the same whatever the interface, and the
cross-host case is the emulated-cluster test's.
"""

from __future__ import annotations

import json
import stat
import threading

import msgspec
import pytest
import zmq

from core.network import (
    KEY_FILES,
    NetworkConfig,
    curve_enabled,
    is_loopback,
    make_curve_keys,
    read_curve_keys,
    resolve_host,
    route_ip,
    write_curve_keys,
)
from launch.config import load_run_config
from launch.control import ControlError, ControlServer, request
from launch.netsetup import exports_reachable, resolve_network


def test_host_must_be_auto_or_an_ip_and_never_every_interface():
    assert NetworkConfig().host == "auto"
    with pytest.raises(ValueError, match="neither 'auto' nor an IP"):
        NetworkConfig(host="my-node")
    with pytest.raises(ValueError, match="binds every interface"):
        NetworkConfig(host="0.0.0.0")


def test_auto_is_loopback_on_one_host_and_the_routing_address_with_a_cluster():
    net = NetworkConfig()
    assert resolve_host(net, None) == "127.0.0.1"
    assert resolve_host(net, "127.0.0.1:6379") == "127.0.0.1"  # the kernel's route to a loopback head
    assert resolve_host(NetworkConfig(host="10.213.0.7"), "10.213.0.1:6379") == "10.213.0.7"
    assert route_ip("127.0.0.1") == "127.0.0.1"
    assert is_loopback("127.0.0.1") and is_loopback("::1") and not is_loopback("10.213.0.1")


def test_curve_is_on_off_loopback_by_default():
    assert not curve_enabled(NetworkConfig(), "127.0.0.1")
    assert curve_enabled(NetworkConfig(), "10.213.0.1")
    assert curve_enabled(NetworkConfig(curve="on"), "127.0.0.1")
    assert not curve_enabled(NetworkConfig(curve="off"), "10.213.0.1")


def test_keys_are_private_and_travel_as_data(tmp_path):
    d = make_curve_keys(tmp_path / "curve")
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    for name in KEY_FILES:
        assert stat.S_IMODE((d / name).stat().st_mode) == 0o600, name
    copy = write_curve_keys(tmp_path / "elsewhere" / "curve", read_curve_keys(d))
    assert read_curve_keys(copy) == read_curve_keys(d)
    assert stat.S_IMODE((copy / "client.key_secret").stat().st_mode) == 0o600
    with pytest.raises(ValueError, match="must hold exactly"):
        write_curve_keys(tmp_path / "bad", {"server.key": b"x"})


def test_resolve_network_rewrites_every_listener_for_a_cluster(tmp_path):
    cfg = load_run_config("tiny", [f"run.run_dir={tmp_path}", "network.host=10.213.0.7"])
    out = resolve_network(cfg, "10.213.0.1:6379", tmp_path)
    assert out.network.host == "10.213.0.7"
    assert out.broker.address == "tcp://10.213.0.7:0"
    assert out.weight_sync.master_addr == "10.213.0.7"
    assert out.broker.curve_keys_dir == str(tmp_path / "curve")
    assert (tmp_path / "curve" / "server.key_secret").exists()
    assert not exports_reachable(out)  # no shared dir: late joiners get weights over weight sync
    one_host = resolve_network(load_run_config("tiny", [f"run.run_dir={tmp_path}"]), None, tmp_path)
    assert one_host.broker.address == "tcp://127.0.0.1:0" and one_host.broker.curve_keys_dir is None
    assert exports_reachable(one_host)


def test_shared_dir_must_exist_and_hold_the_run_dir(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    cfg = load_run_config("tiny", [f"network.shared_dir={tmp_path / 'missing'}"])
    with pytest.raises(ValueError, match="is not a directory"):
        resolve_network(cfg, None, tmp_path / "run")
    cfg = load_run_config("tiny", [f"network.shared_dir={shared}"])
    with pytest.raises(ValueError, match="is not inside network.shared_dir"):
        resolve_network(cfg, None, tmp_path / "run")
    assert exports_reachable(resolve_network(cfg, "127.0.0.1:6379", shared / "run"))


@pytest.fixture
def curve_control(tmp_path):
    keys = make_curve_keys(tmp_path / "curve")
    server = ControlServer(tmp_path, lambda req: {"op": req.op}, host="127.0.0.1", curve_keys_dir=str(keys))
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            server.poll(50)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield server, tmp_path, keys
    finally:
        stop.set()
        t.join(5)
        server.close()


def _raw_request(address: str, keys_dir=None, timeout_ms: int = 1000) -> dict | None:
    from core.network import curve_client

    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    if keys_dir is not None:
        curve_client(sock, keys_dir)
    try:
        sock.connect(address)
        sock.send(msgspec.json.encode({"op": "status"}))
        return json.loads(sock.recv()) if sock.poll(timeout_ms, zmq.POLLIN) else None
    finally:
        sock.close(0)


def test_control_endpoint_refuses_a_client_without_the_keys(curve_control, tmp_path):
    server, run_dir, keys = curve_control
    info = json.loads((run_dir / "control.json").read_text())
    assert info["curve_keys_dir"] == str(keys)
    assert request(run_dir, {"op": "status"}, timeout_s=5)["op"] == "status"  # the CLI's path: keys from the file
    assert _raw_request(server.address) is None  # plain-text client: the handshake never completes
    stranger = make_curve_keys(tmp_path / "stranger")  # a valid keypair the server was not given
    (stranger / "server.key").write_bytes((keys / "server.key").read_bytes())
    assert _raw_request(server.address, stranger) is None
    assert _raw_request(server.address, keys) == {"ok": True, "op": "status"}


def test_control_request_without_keys_names_the_timeout(curve_control):
    server, run_dir, _ = curve_control
    info = json.loads((run_dir / "control.json").read_text())
    (run_dir / "control.json").write_text(json.dumps({**info, "curve_keys_dir": None}))
    with pytest.raises(ControlError, match="did not answer 'status'"):
        request(run_dir, {"op": "status"}, timeout_s=1)


def test_a_second_authenticator_on_one_context_is_refused(tmp_path):
    import zmq

    from core.network import curve_server

    keys = make_curve_keys(tmp_path / "curve")
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.REP), ctx.socket(zmq.REP)
    try:
        auth = curve_server(a, keys, ctx)
        with pytest.raises(RuntimeError, match="already has a CurveZMQ authenticator"):
            curve_server(b, keys, ctx)
        auth.stop()
        with pytest.raises(RuntimeError, match="already has a CurveZMQ authenticator"):
            curve_server(b, keys, ctx)  # stopped, it still holds the context's ZAP endpoint
    finally:
        a.close(0)
        b.close(0)
        ctx.term()
