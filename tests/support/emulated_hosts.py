"""Emulated hosts for tests: Linux network namespaces joined by a bridge (needs root).

Each host is a namespace ``<prefix>-h<i>`` with its own loopback and one veth into the bridge
``<prefix>-br``, address ``<subnet>.<i+1>/24``; traffic between hosts crosses the bridge and never
leaves the machine. Every name starts with ``prefix``, so :meth:`EmulatedHosts.remove` also clears
what a previous, failed run left behind. Processes in a namespace are found with ``ip netns pids``
(never by name), so a test kills exactly its own.

Example::

    hosts = EmulatedHosts("fr18e", "10.213.18", 3)
    try:
        hosts.create()
        proc = hosts.popen(1, ["python", "-c", "..."])   # runs inside host 1
        hosts.kill_host(2)                                # every process of host 2, SIGKILL
    finally:
        hosts.remove()
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def netns_usable() -> str | None:
    """None if namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "needs root (ip netns)"
    missing = [c for c in ("ip", "ss") if shutil.which(c) is None]
    if missing:
        return f"{' and '.join(missing)} not found (iproute2)"
    probe = f"fr18probe{os.getpid()}"
    r = _ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"ip netns add failed: {r.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


class EmulatedHosts:
    def __init__(self, prefix: str, subnet: str, n: int) -> None:
        if len(prefix) > 8:
            raise ValueError(f"prefix {prefix!r}: interface names must fit 15 characters")
        self.prefix, self.subnet, self.n = prefix, subnet, n
        self.bridge = f"{prefix}-br"

    def ns(self, i: int) -> str:
        return f"{self.prefix}-h{i}"

    def ip(self, i: int) -> str:
        return f"{self.subnet}.{i + 1}"

    def create(self) -> None:
        self.remove()  # leftovers of a failed run
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("link", "set", self.bridge, "up")
        for i in range(self.n):
            ns, host_end, ns_end = self.ns(i), f"{self.prefix}-v{i}", f"{self.prefix}-p{i}"
            _ip("netns", "add", ns)
            _ip("link", "add", host_end, "type", "veth", "peer", "name", ns_end)
            _ip("link", "set", ns_end, "netns", ns)
            _ip("link", "set", host_end, "master", self.bridge)
            _ip("link", "set", host_end, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "addr", "add", f"{self.ip(i)}/24", "dev", ns_end)
            _ip("-n", ns, "link", "set", ns_end, "up")

    def pids(self, i: int) -> list[int]:
        r = _ip("netns", "pids", self.ns(i), check=False)
        return [int(p) for p in r.stdout.split()] if r.returncode == 0 else []

    def popen(self, i: int, cmd: list[str], **kw) -> subprocess.Popen:
        return subprocess.Popen(["ip", "netns", "exec", self.ns(i), *cmd], **kw)

    def run(self, i: int, cmd: list[str], **kw) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", self.ns(i), *cmd], **kw)

    def kill_host(self, i: int, sig: int = signal.SIGKILL) -> list[int]:
        """Every process in host ``i``'s namespace, until none is left (a dying parent may fork)."""
        killed: list[int] = []
        for _ in range(20):
            pids = self.pids(i)
            if not pids:
                break
            for p in pids:
                try:
                    os.kill(p, sig)
                    killed.append(p)
                except ProcessLookupError:
                    pass
            time.sleep(0.2)
        return killed

    def remove(self) -> None:
        """Kill what runs in our namespaces, then delete them, their veths and the bridge (also leftovers)."""
        listed = _ip("netns", "list", check=False).stdout.split("\n")
        ours = [line.split()[0] for line in listed if line.startswith(f"{self.prefix}-h")]
        for ns in ours:
            for _ in range(20):
                r = _ip("netns", "pids", ns, check=False)
                pids = [int(p) for p in r.stdout.split()]
                if not pids:
                    break
                for p in pids:
                    try:
                        os.kill(p, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                time.sleep(0.2)
            _ip("netns", "del", ns, check=False)
        links = _ip("-o", "link", "show", check=False).stdout.splitlines()
        for line in links:
            name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
            if name.startswith(f"{self.prefix}-v") or name == self.bridge:
                _ip("link", "del", name, check=False)
