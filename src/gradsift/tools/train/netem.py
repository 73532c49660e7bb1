"""Real bandwidth-limited links between emulated hosts on one machine.

:class:`EmulatedNetwork` gives every emulated host its own network namespace, joined
to a bridge inside a hub namespace by a veth pair::

    gradsift-<pid>-h<i>: gs0 10.213.0.<i+1>/24 ──veth── gsh<i> ┐
                                                               ├ br0 (gradsift-<pid>-hub)
    gradsift-<pid>-h<j>: gs0 10.213.0.<j+1>/24 ──veth── gsh<j> ┘

The local launcher puts one rank on each host; the torchrun launcher one torchrun
agent (with its ranks) on each host. Both ends of every veth are shaped with a token
bucket (``tc qdisc ... tbf rate R``): each host has an R uplink and an R downlink, like
a machine on a switch. With a latency ``d`` the host end gets ``netem delay d`` with the
token bucket beneath it, so a message between two hosts is delayed by ``d`` once (a
round trip by ``2 d``). Nothing touches the root namespace: the veths are created inside
the hub namespace and the /24 exists only inside our namespaces, so traffic can only
reach loopback or our own namespaces, and concurrent runs (names carry the launcher's
PID) cannot clash. Each host's namespace gets its own ``/etc/hosts`` (``/etc/netns/<name>/``,
which ``ip netns exec`` mounts) naming every host's address, so a peer's name is found without
the DNS no namespace reaches. Deleting a namespace deletes its veth ends and qdiscs, so cleanup is
one ``ip netns del`` per namespace (after killing what still runs inside, its hosts file
removed with it), done on
exit, on exceptions (Ctrl-C; SIGTERM is turned into an exception by the launcher) and
at interpreter exit; :func:`cleanup_stale` removes what a killed (SIGKILL) launcher left
behind.

Every command runs as an argument list (never through a shell); rates and delays are
validated and passed to ``tc`` as integers (``<n>bit``, ``<n>us``).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

from gradsift.core.errors import GradsiftError, InvalidOptionError

PREFIX = "gradsift-"
#: ``ip netns exec NAME`` mounts the files of ``NETNS_ETC/NAME`` over those of ``/etc``.
NETNS_ETC = Path("/etc/netns")
SUBNET = "10.213.0"
WORKER_IFNAME = "gs0"
MASTER_PORT = 29500
MIN_RATE_BPS = 10_000
MAX_RATE_BPS = 100_000_000_000
MAX_DELAY_S = 10.0
_RATE_UNITS = {
    "": 1,
    "bit": 1,
    "kbit": 10**3,
    "mbit": 10**6,
    "gbit": 10**9,
    "k": 10**3,
    "m": 10**6,
    "g": 10**9,
}
_DELAY_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}


class NetemUnavailableError(GradsiftError, RuntimeError):
    """Network emulation cannot run here (not root, no iproute2, kernel lacks a qdisc)."""


def parse_rate(text: str) -> int:
    """``"100mbit"``, ``"1gbit"``, ``"100Mbit/s"``, ``"500kbit"`` or bits/s -> bits per second.

    Allowed range: 10 kbit/s to 100 Gbit/s.
    """
    match = re.fullmatch(
        r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmg]?(?:bit)?)(?:/s|ps)?\s*", str(text).lower()
    )
    if not match:
        raise InvalidOptionError(f"bandwidth must look like 100mbit, 1gbit or 500kbit; got {text!r}")
    rate = round(float(match.group(1)) * _RATE_UNITS[match.group(2)])
    if not MIN_RATE_BPS <= rate <= MAX_RATE_BPS:
        raise InvalidOptionError(f"bandwidth must lie in [10kbit, 100gbit], got {text!r} ({rate} bit/s)")
    return rate


def parse_delay(text: str) -> float:
    """``"1ms"``, ``"500us"``, ``"0.2s"`` or ``"0"`` -> seconds, in [0, 10 s]."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(s|ms|us)?\s*", str(text).lower())
    if not match:
        raise InvalidOptionError(f"latency must look like 1ms, 500us or 0.2s; got {text!r}")
    delay = float(match.group(1)) * _DELAY_UNITS[match.group(2) or "s"]
    if delay > MAX_DELAY_S:
        raise InvalidOptionError(f"latency must lie in [0, 10s], got {text!r}")
    return delay


def missing_prerequisites() -> list[str]:
    """What network emulation lacks on this machine (empty when it can run)."""
    missing = []
    if os.geteuid() != 0:
        missing.append("root privileges (network namespaces and tc need CAP_NET_ADMIN; run as root)")
    missing += [
        f"the `{tool}` command (install iproute2)" for tool in ("ip", "tc") if shutil.which(tool) is None
    ]
    return missing


def _run(*command: str) -> str:
    """Run one iproute2 command; raise :class:`NetemUnavailableError` with its stderr on failure."""
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise NetemUnavailableError(
            f"`{' '.join(command)}` failed: {result.stderr.strip() or result.returncode}"
        )
    return result.stdout


def tbf_burst_bytes(rate_bps: int) -> int:
    """Token-bucket depth: 2 ms of traffic, at least 128 KiB (two 64 KiB GSO packets)."""
    return max(128 * 1024, rate_bps // 8 // 500)


def kernel_has_netem() -> bool:
    """Whether this kernel has the netem qdisc (``sch_netem``): probed by adding one to
    the loopback of a throw-away namespace (``gradsift-<pid>-probe``), deleted after."""
    missing = missing_prerequisites()
    if missing:
        raise NetemUnavailableError("probing the kernel's netem qdisc needs " + "; ".join(missing))
    probe = f"{PREFIX}{os.getpid()}-probe"
    _run("ip", "netns", "add", probe)
    try:
        added = subprocess.run(["tc", "-n", probe, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"],
                               capture_output=True, check=False)  # fmt: skip
        return added.returncode == 0
    finally:
        delete_namespace(probe)


class EmulatedNetwork:
    """Namespaces, veth pairs, bridge and qdiscs for ``hosts`` emulated hosts (a context manager).

    ``command_prefix(host)`` and ``environment(host)`` tell a launcher how to start a
    process inside host ``host``'s namespace with torch.distributed pointed at host 0;
    ``address(host)`` is the host's IPv4 address.
    """

    def __init__(self, hosts: int, rate_bps: int, delay_s: float = 0.0, *, tag: str | None = None) -> None:
        if not 1 <= hosts <= 250:
            raise InvalidOptionError(f"hosts must lie in [1, 250] for network emulation, got {hosts}")
        self.hosts = hosts
        self.rate_bps = rate_bps
        self.delay_s = delay_s
        base = f"{PREFIX}{os.getpid()}{'-' + tag if tag else ''}"
        self.hub = f"{base}-hub"
        self.namespaces = [f"{base}-h{host}" for host in range(hosts)]
        self._created: list[str] = []

    def address(self, host: int) -> str:
        """Host ``host``'s IPv4 address (inside our namespaces only)."""
        return f"{SUBNET}.{host + 1}"

    def hub_port(self, host: int) -> str:
        """Name of the hub-side veth end of host ``host`` (in the hub namespace)."""
        return f"gsh{host}"

    def links(self) -> list[tuple[str, str]]:
        """Every ``(namespace, device)`` veth end this network creates."""
        return [(self.hub, self.hub_port(h)) for h in range(self.hosts)] + [
            (namespace, WORKER_IFNAME) for namespace in self.namespaces
        ]

    def command_prefix(self, host: int) -> list[str]:
        return ["ip", "netns", "exec", self.namespaces[host]]

    def environment(self, host: int) -> dict[str, str]:
        return {
            "MASTER_ADDR": self.address(0),
            "MASTER_PORT": str(MASTER_PORT),
            "GLOO_SOCKET_IFNAME": WORKER_IFNAME,
        }

    def link_counters(self) -> list[dict[str, object]]:
        """Per host: namespace, address and :func:`link_counters` of its ``gs0``."""
        return [{"host": host, "namespace": namespace, "address": self.address(host), **link_counters(namespace)}
                for host, namespace in enumerate(self.namespaces)]  # fmt: skip

    def __enter__(self) -> EmulatedNetwork:
        missing = missing_prerequisites()
        if missing:
            raise NetemUnavailableError("network emulation (--bandwidth) needs " + "; ".join(missing))
        if self.delay_s > 0 and not kernel_has_netem():
            raise NetemUnavailableError(
                "--latency needs the kernel's netem qdisc (sch_netem), which this kernel lacks "
                "(load it with `modprobe sch_netem`, or run without --latency)"
            )
        atexit.register(self.close)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _add_namespace(self, name: str) -> None:
        self._created.append(name)  # first: an exit right after the add still deletes it
        _run("ip", "netns", "add", name)
        _run("ip", "-n", name, "link", "set", "lo", "up")

    def _build(self) -> None:
        self._add_namespace(self.hub)
        _run("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.hub, "link", "set", "br0", "up")
        for host, namespace in enumerate(self.namespaces):
            self._add_namespace(namespace)
            port = self.hub_port(host)
            _run("ip", "-n", self.hub, "link", "add", port, "type", "veth",
                 "peer", "name", WORKER_IFNAME, "netns", namespace)  # fmt: skip
            _run("ip", "-n", self.hub, "link", "set", port, "master", "br0")
            _run("ip", "-n", self.hub, "link", "set", port, "up")
            _run("ip", "-n", namespace, "addr", "add", f"{self.address(host)}/24", "dev", WORKER_IFNAME)
            _run("ip", "-n", namespace, "link", "set", WORKER_IFNAME, "up")
            self._shape(namespace, WORKER_IFNAME, self.delay_s)
            self._shape(self.hub, port, 0.0)
        self._name_hosts()

    def _name_hosts(self) -> None:
        """Give each host's namespace an ``/etc/hosts`` that names every host's address (after the
        machine's own entries): c10d looks up the name of each peer that connects, and without a
        name for it the lookup goes to DNS, which no namespace reaches, and c10d warns (``The hostname
        of the client socket cannot be retrieved``). Best effort: where ``/etc`` cannot be written
        (a read-only root), the runs go on with that warning."""
        machine = Path("/etc/hosts").read_text(encoding="utf-8") if Path("/etc/hosts").exists() else ""
        names = "".join(
            f"{address} {name}\n"
            for h, name in enumerate(self.namespaces)
            for address in (self.address(h), f"::ffff:{self.address(h)}")  # IPv6 sockets see the latter
        )
        with contextlib.suppress(OSError):
            for namespace in self.namespaces:
                folder = NETNS_ETC / namespace
                folder.mkdir(parents=True, exist_ok=True)
                (folder / "hosts").write_text(f"{machine.rstrip()}\n{names}", encoding="utf-8")

    def _shape(self, namespace: str, device: str, delay_s: float) -> None:
        """``tbf rate R`` on ``device``'s egress, under ``netem delay d`` when ``d > 0``."""
        tbf = ["tbf", "rate", f"{self.rate_bps}bit", "burst", str(tbf_burst_bytes(self.rate_bps)),
               "latency", "100ms"]  # fmt: skip
        qdisc = ["tc", "-n", namespace, "qdisc", "add", "dev", device]
        if delay_s <= 0:
            _run(*qdisc, "root", "handle", "1:", *tbf)
            return
        _run(*qdisc, "root", "handle", "1:", "netem", "delay", f"{round(delay_s * 1e6)}us")
        _run(*qdisc, "parent", "1:1", "handle", "10:", *tbf)

    def close(self) -> None:
        """Delete every namespace this network created (idempotent)."""
        while self._created:
            delete_namespace(self._created.pop())
        atexit.unregister(self.close)


def link_counters(namespace: str, device: str = WORKER_IFNAME) -> dict[str, int]:
    """``rx_bytes`` and ``tx_bytes`` the kernel counted on ``device`` in ``namespace`` so far:
    what that host's NIC saw, Ethernet/IP/TCP headers included."""
    shown = json.loads(_run("ip", "-n", namespace, "-s", "-j", "link", "show", "dev", device))
    stats = shown[0]["stats64"]
    return {"rx_bytes": int(stats["rx"]["bytes"]), "tx_bytes": int(stats["tx"]["bytes"])}


def delete_namespace(name: str) -> None:
    """Kill the processes left in namespace ``name``, then delete it (its links go with it)."""
    listed = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True, check=False)
    for pid in listed.stdout.split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), 9)
    subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
    shutil.rmtree(NETNS_ETC / name, ignore_errors=True)
    with contextlib.suppress(OSError):  # the folder ip netns reads, once no namespace of ours uses it
        NETNS_ETC.rmdir()


def our_namespaces() -> list[str]:
    """Names of the gradsift namespaces that exist now."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    names = (line.split()[0] for line in listed.stdout.splitlines() if line.strip())
    return [name for name in names if name.startswith(PREFIX)]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale() -> list[str]:
    """Delete gradsift namespaces whose launcher process is gone; return their names."""
    missing = missing_prerequisites()
    if missing:
        raise NetemUnavailableError("cleaning up network namespaces needs " + "; ".join(missing))
    removed = []
    for name in our_namespaces():
        pid = name.removeprefix(PREFIX).split("-")[0]
        if pid.isdigit() and not _pid_alive(int(pid)):
            delete_namespace(name)
            removed.append(name)
    return removed
