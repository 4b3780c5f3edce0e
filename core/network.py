"""Where the job's listeners bind, what address they advertise, and the CurveZMQ keys of cross-host ZMQ.

One rule for every listener (broker, control endpoint, metrics, engine HTTP servers, the
weight-sync store): a single-host job binds loopback; a multi-node job binds each node's own
address (the one its Ray node registered with), so a peer on another host can reach it and
nothing listens on every interface by accident. :class:`NetworkConfig` holds the choice and
:func:`resolve_host` turns ``auto`` into an address once, in the driver.

ZMQ traffic that leaves loopback (broker, control) is CurveZMQ by default: :func:`make_curve_keys`
makes one server and one client keypair at start, in the run directory, secret files 0600.
The engines' HTTP endpoints bind only the node's address on the job's network and require the
run's token (:mod:`core.engine_auth`, kept like the keys: 0600 in the run directory).

Example::

    net = NetworkConfig()                          # host: auto, curve: auto
    host = resolve_host(net, ray_address="10.0.0.1:6379")  # the local address that reaches the head
    if curve_enabled(net, host):
        keys = make_curve_keys(run_dir / "curve")
"""

from __future__ import annotations

import ipaddress
import os
import socket
import stat
import weakref
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from core.configbase import ConfigModel

LOOPBACK = "127.0.0.1"
#: the files :func:`make_curve_keys` writes; a node without the run directory gets them as data
KEY_FILES = ("server.key", "server.key_secret", "client.key", "client.key_secret", "clients/client.key")


class NetworkConfig(ConfigModel):
    host: str = Field(
        "auto",
        description="address the driver's listeners bind and advertise: 'auto' = loopback on "
        "a single host, and with --address the local address that routes to the Ray head; or an IP of "
        "this host. Processes on other nodes bind their own Ray node address (loopback if this is)",
    )
    curve: Literal["auto", "on", "off"] = Field(
        "auto", description="CurveZMQ on the broker and control sockets: auto = on unless host is loopback"
    )
    shared_dir: str | None = Field(
        None,
        description="a directory every node of a multi-node job sees (NFS, ...): checked at start; exports "
        "are loaded by late joiners from it. None on a multi-node job: late joiners get the weights at the next "
        "publish over weight sync (the fleet gives them no work before)",
    )

    @field_validator("host")
    @classmethod
    def _host_form(cls, v: str) -> str:
        if v == "auto":
            return v
        try:
            ipaddress.ip_address(v)
        except ValueError:
            raise ValueError(f"network.host={v!r} is neither 'auto' nor an IP address (e.g. 10.0.0.5)") from None
        if v in ("0.0.0.0", "::"):
            raise ValueError(f"network.host={v!r} binds every interface; give the one address peers use")
        return v


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def route_ip(peer: str, port: int = 9) -> str:
    """The local address the kernel would use to reach ``peer`` (a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((peer, port))
        except OSError as exc:
            raise OSError(f"no route from this host to {peer}: {exc}") from None
        return s.getsockname()[0]


def resolve_host(cfg: NetworkConfig, ray_address: str | None) -> str:
    """``cfg.host`` with ``auto`` resolved: loopback without a cluster, else the address that reaches its head."""
    if cfg.host != "auto":
        return cfg.host
    if ray_address is None or ray_address in ("auto", "local"):
        return LOOPBACK
    head = ray_address.split("://")[-1].rsplit(":", 1)[0]
    return route_ip(socket.gethostbyname(head))


def curve_enabled(cfg: NetworkConfig, host: str) -> bool:
    return cfg.curve == "on" or (cfg.curve == "auto" and not is_loopback(host))


def make_curve_keys(directory: str | os.PathLike) -> Path:
    """server.key(_secret), client.key(_secret) and clients/client.key (the allowed list), secrets 0600."""
    import zmq.auth

    d = Path(directory)
    (d / "clients").mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    zmq.auth.create_certificates(d, "server")
    zmq.auth.create_certificates(d, "client")
    (d / "clients" / "client.key").write_bytes((d / "client.key").read_bytes())
    for name in KEY_FILES:
        os.chmod(d / name, stat.S_IRUSR | stat.S_IWUSR)
    return d


def read_curve_keys(directory: str | os.PathLike) -> dict[str, bytes]:
    """The key files as data, for a process on a node that does not see the run directory."""
    d = Path(directory)
    return {name: (d / name).read_bytes() for name in KEY_FILES}


def write_curve_keys(directory: str | os.PathLike, keys: dict[str, bytes]) -> Path:
    """Put ``keys`` (from :func:`read_curve_keys`) at ``directory`` unless they are there already (0600)."""
    d = Path(directory)
    if all((d / n).exists() for n in KEY_FILES):
        return d
    unknown = set(keys) - set(KEY_FILES)
    if unknown or len(keys) != len(KEY_FILES):
        raise ValueError(f"CurveZMQ key data must hold exactly {KEY_FILES}; got {sorted(keys)}")
    (d / "clients").mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    for name, data in keys.items():
        fd = os.open(d / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    return d


_AUTHENTICATORS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # context -> its ZAP authenticator


def curve_server(sock, keys_dir: str | os.PathLike, ctx):
    """Make ``sock`` a CurveZMQ server that admits only the keys in ``keys_dir/clients``; returns the
    authenticator thread (stop it when the socket closes). An unknown client's handshake is refused."""
    from zmq.auth import load_certificate
    from zmq.auth.thread import ThreadAuthenticator

    keys = Path(keys_dir)
    public, secret = load_certificate(keys / "server.key_secret")
    if ctx in _AUTHENTICATORS:
        # a context has one ZAP endpoint, and it stays bound after the authenticator stops: a second
        # one fails to bind it ("Address already in use"); give each CurveZMQ server its own context
        raise RuntimeError(
            "curve_server: this ZMQ context already has a CurveZMQ authenticator; "
            "create the socket on a context of its own"
        )
    auth = ThreadAuthenticator(ctx)
    auth.start()
    _AUTHENTICATORS[ctx] = auth
    auth.configure_curve(domain="*", location=str(keys / "clients"))
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_server = True
    return auth


def curve_client(sock, keys_dir: str | os.PathLike | None) -> None:
    """Give ``sock`` the client keypair and the server's public key (no-op without ``keys_dir``)."""
    if not keys_dir:
        return
    from zmq.auth import load_certificate

    keys = Path(keys_dir)
    server_public, _ = load_certificate(keys / "server.key")
    public, secret = load_certificate(keys / "client.key_secret")
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_serverkey = server_public
