"""Network emulation: rate/latency parsing, and real namespaces shaped with tc (root only)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from gradsift.core.errors import InvalidOptionError
from gradsift.tools.train import netem
from gradsift.tools.train.netem import (
    EmulatedNetwork,
    NetemUnavailableError,
    our_namespaces,
    parse_delay,
    parse_rate,
)
from support.train import TINY, rank_pid, wait_for

MISSING = netem.missing_prerequisites()
needs_netem = pytest.mark.skipif(bool(MISSING), reason="network emulation needs " + "; ".join(MISSING))


def test_parse_rate_units_and_range() -> None:
    assert parse_rate("100mbit") == 100_000_000
    assert parse_rate("1Gbit/s") == 1_000_000_000
    assert parse_rate("500kbit") == 500_000
    assert parse_rate("2.5mbit") == 2_500_000
    assert parse_rate("64000") == 64_000
    for bad in ("fast", "100mb/s/s", "-1mbit", "100 MB", "2mbps"):  # tc's mbps means megabytes: refused
        with pytest.raises(InvalidOptionError, match="bandwidth must look like"):
            parse_rate(bad)
    with pytest.raises(InvalidOptionError, match=r"bandwidth must lie in \[10kbit, 100gbit\]"):
        parse_rate("200gbit")


def test_parse_delay_units_and_range() -> None:
    assert parse_delay("1ms") == pytest.approx(1e-3)
    assert parse_delay("250us") == pytest.approx(250e-6)
    assert parse_delay("0.2s") == pytest.approx(0.2)
    assert parse_delay("0") == 0.0
    with pytest.raises(InvalidOptionError, match="latency must look like"):
        parse_delay("1 minute")
    with pytest.raises(InvalidOptionError, match=r"latency must lie in \[0, 10s\]"):
        parse_delay("11s")


def test_missing_root_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(netem.shutil, "which", lambda tool: None)
    missing = netem.missing_prerequisites()
    assert any("root privileges" in m for m in missing)
    assert any("`tc` command (install iproute2)" in m for m in missing)
    with pytest.raises(NetemUnavailableError, match="needs root privileges"), EmulatedNetwork(2, 10**8):
        pass


RECEIVER = textwrap.dedent("""
    import socket, sys, time
    server = socket.socket(); server.bind(("0.0.0.0", 5201)); server.listen(1)
    print("ready", flush=True)
    connection, _ = server.accept(); connection.settimeout(30)
    received, first = 0, None
    while True:
        chunk = connection.recv(1 << 20)
        if not chunk:
            break
        first = first or time.perf_counter()
        received += len(chunk)
    print(received, time.perf_counter() - first, flush=True)
""")
SENDER = textwrap.dedent("""
    import socket, sys
    connection = socket.create_connection((sys.argv[1], 5201), timeout=30)
    block = b"x" * (1 << 20)
    for _ in range(int(sys.argv[2])):
        connection.sendall(block)
    connection.close()
""")


@needs_netem
@pytest.mark.slow
def test_shaped_link_carries_the_set_rate_and_is_removed(tmp_path: Path) -> None:
    rate = 40_000_000
    megabytes = 10  # 2 s at 40 Mbit/s: bounded bytes and time
    with EmulatedNetwork(2, rate, tag="test") as network:
        assert {network.hub, *network.namespaces} <= set(our_namespaces())
        receiver = subprocess.Popen([*network.command_prefix(1), sys.executable, "-c", RECEIVER],
                                    stdout=subprocess.PIPE, text=True)  # fmt: skip
        try:
            assert receiver.stdout.readline().strip() == "ready"
            subprocess.run([*network.command_prefix(0), sys.executable, "-c", SENDER, network.address(1), str(megabytes)],
                           check=True, timeout=60)  # fmt: skip
            received, seconds = receiver.communicate(timeout=60)[0].split()
        finally:
            receiver.kill()
    assert int(received) == megabytes << 20
    goodput = int(received) * 8 / float(seconds)
    # Measured goodput / rate over 8 runs at load average 21 on 2 cores: 0.9658-0.9683 (the
    # tbf shaper sets the pace, not the CPU); the lower bound sits 0.17 below the lowest.
    assert 0.8 * rate <= goodput <= 1.2 * rate, f"measured {goodput / 1e6:.1f} Mbit/s at {rate / 1e6} Mbit/s"
    _assert_removed(network)


@needs_netem
def test_namespaces_cannot_reach_outside() -> None:
    with EmulatedNetwork(1, 10**8, tag="iso") as network:
        routes = subprocess.run(
            ["ip", "-n", network.namespaces[0], "route"], capture_output=True, text=True
        ).stdout
    assert (
        routes.strip()
        == f"{netem.SUBNET}.0/24 dev {netem.WORKER_IFNAME} proto kernel scope link src {netem.SUBNET}.1"
    )


@needs_netem
@pytest.mark.slow
def test_every_host_names_its_peers_addresses_without_dns() -> None:
    """c10d looks up the name of each peer that connects to its store, as an IPv4 address or one
    mapped into IPv6: in a namespace, which reaches no DNS server, a lookup that falls through
    to DNS fails ("Temporary failure in name resolution") and c10d warns on every run. Each
    host's own /etc/hosts names every host, both ways; it goes with the network."""
    lookup = (
        "import socket, sys; a = sys.argv[1]; "
        "print(socket.getnameinfo((a, 1, 0, 0) if ':' in a else (a, 1), socket.NI_NAMEREQD)[0])"
    )
    with EmulatedNetwork(2, 10**8, tag="names") as network:
        for address in (network.address(1), f"::ffff:{network.address(1)}"):
            found = subprocess.run([*network.command_prefix(0), sys.executable, "-c", lookup, address],
                                   capture_output=True, text=True, timeout=30)  # fmt: skip
            assert found.stdout.strip() == network.namespaces[1], found.stderr
    _assert_removed(network)


@needs_netem
@pytest.mark.slow
def test_a_hosts_file_that_cannot_be_written_leaves_the_network_working(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hosts files are best effort: where their folder cannot be made (a read-only ``/etc``;
    here a file in its place), the hosts and their shaped links are built as before."""
    blocked = tmp_path / "netns"
    blocked.write_text("not a folder")
    monkeypatch.setattr(netem, "NETNS_ETC", blocked)
    with EmulatedNetwork(2, 10**8, tag="ro") as network:
        shown = [subprocess.run(["ip", "-n", namespace, "-o", "addr", "show", "dev", netem.WORKER_IFNAME],
                                capture_output=True, text=True).stdout for namespace in network.namespaces]  # fmt: skip
        shaped = subprocess.run(["tc", "-n", network.namespaces[0], "qdisc", "show", "dev", netem.WORKER_IFNAME],
                                capture_output=True, text=True).stdout  # fmt: skip
    assert all(f"inet {network.address(h)}/24" in text for h, text in enumerate(shown)), shown
    assert "tbf" in shaped and blocked.read_text() == "not a folder"
    assert not ({network.hub, *network.namespaces} & set(our_namespaces()))


@needs_netem
@pytest.mark.distributed
@pytest.mark.slow
def test_cleanup_when_a_worker_is_killed_and_after_a_killed_launcher(tmp_path: Path) -> None:
    def launch(out: Path) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "gradsift", "train", *TINY, "--steps", "100000",
                                 "--bandwidth", "200mbit", "--out", str(out)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip

    def mine(pid: int) -> set[str]:
        return {n for n in our_namespaces() if n.startswith(f"{netem.PREFIX}{pid}-")}

    # 1. a worker dies: the launcher reports it and removes every namespace
    launcher = launch(tmp_path / "a")
    try:
        steps = tmp_path / "a" / "steps.jsonl"
        wait_for(lambda: steps.exists() and steps.stat().st_size > 0, 120, "the first step", launcher)
        assert len(mine(launcher.pid)) == 3
        os.kill(wait_for(lambda: rank_pid(launcher.pid, 1), 10, "rank 1"), signal.SIGKILL)
        _, stderr = launcher.communicate(timeout=60)
    finally:
        launcher.kill()
    assert "rank 1 of 2 was killed by signal SIGKILL" in stderr
    assert mine(launcher.pid) == set()

    # 2. the launcher itself is SIGKILLed: --cleanup-netem removes what it left, workers included
    launcher = launch(tmp_path / "b")
    steps = tmp_path / "b" / "steps.jsonl"
    wait_for(lambda: steps.exists() and steps.stat().st_size > 0, 120, "the first step", launcher)
    workers = [rank_pid(launcher.pid, rank) for rank in (0, 1)]
    launcher.kill()
    launcher.wait()
    assert len(mine(launcher.pid)) == 3
    result = subprocess.run([sys.executable, "-m", "gradsift", "train", "--cleanup-netem"],
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    assert result.returncode == 0 and f"{netem.PREFIX}{launcher.pid}-hub" in result.stdout
    assert mine(launcher.pid) == set()
    assert not list(netem.NETNS_ETC.glob(f"{netem.PREFIX}{launcher.pid}-*"))
    time.sleep(0.5)
    for pid in workers:
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]


def _gone(pid: int) -> bool:
    """The process no longer runs (exited, or a zombie waiting for its reaper)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


@needs_netem
@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("moment", ["network setup", "training"])
def test_sigterm_to_the_launcher_cleans_up(tmp_path: Path, moment: str) -> None:
    """SIGTERM exits with 143 and leaves no namespace and no worker behind, whether it
    arrives while the network is still being built (its first namespace exists, the
    ranks do not yet) or while both ranks train (the first step is written)."""
    environment = dict(os.environ)
    if moment == "network setup":
        # every `ip` the launcher runs waits 0.3 s first: the build (a dozen commands)
        # lasts seconds, so the signal lands inside it whatever the machine's load
        shim = tmp_path / "bin"
        shim.mkdir()
        (shim / "ip").write_text(f'#!/bin/sh\nsleep 0.3\nexec {shutil.which("ip")} "$@"\n')
        (shim / "ip").chmod(0o755)
        environment["PATH"] = f"{shim}{os.pathsep}{environment['PATH']}"
    launcher = subprocess.Popen([sys.executable, "-m", "gradsift", "train", *TINY, "--steps", "100000",
                                 "--bandwidth", "200mbit", "--out", str(tmp_path / "run")],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment)  # fmt: skip

    def mine() -> list[str]:
        return [n for n in our_namespaces() if n.startswith(f"{netem.PREFIX}{launcher.pid}-")]

    workers: list[int] = []
    try:
        if moment == "network setup":
            wait_for(mine, 120, "the first namespace", launcher)
            assert len(mine()) < 3 and rank_pid(launcher.pid, 0) is None, (
                "the build was over before the signal"
            )
        else:
            steps = tmp_path / "run" / "steps.jsonl"
            wait_for(lambda: steps.exists() and steps.stat().st_size > 0, 120, "the first step", launcher)
            workers = [wait_for(lambda r=r: rank_pid(launcher.pid, r), 10, f"rank {r}") for r in (0, 1)]
        launcher.send_signal(signal.SIGTERM)
        launcher.communicate(timeout=120)
    finally:
        launcher.kill()
        launcher.wait()
        left = mine()
        for name in left:  # a failing launcher's leftovers do not outlive the test
            netem.delete_namespace(name)
    assert launcher.returncode == 128 + signal.SIGTERM
    assert not left
    for pid in workers:
        wait_for(lambda pid=pid: _gone(pid), 10, f"worker {pid} to end")


ECHO_SERVER = textwrap.dedent("""
    import socket
    server = socket.socket(); server.bind(("0.0.0.0", 5202)); server.listen(1)
    print("ready", flush=True)
    connection, _ = server.accept()
    connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while chunk := connection.recv(1):
        connection.sendall(chunk)
""")
PING = textwrap.dedent("""
    import socket, statistics, sys, time
    connection = socket.create_connection((sys.argv[1], 5202), timeout=30)
    connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    rtts = []
    for _ in range(20):
        begin = time.perf_counter(); connection.sendall(b"x"); connection.recv(1)
        rtts.append(time.perf_counter() - begin)
    print(statistics.median(rtts))
""")


def _assert_removed(network: EmulatedNetwork) -> None:
    """Every namespace the network created is gone, and with them every veth end: none
    is listed in its namespace, none ever lived in (or fell back to) the root namespace; so is
    each namespace's ``/etc/netns`` folder."""
    assert not ({network.hub, *network.namespaces} & set(our_namespaces()))
    assert not [name for name in (network.hub, *network.namespaces) if (netem.NETNS_ETC / name).exists()]
    root = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    for namespace, device in network.links():
        shown = subprocess.run(["ip", "-n", namespace, "link", "show", "dev", device], capture_output=True)
        assert shown.returncode != 0, (namespace, device)
        assert f": {device}@" not in root and f": {device}:" not in root, device


@needs_netem
@pytest.mark.slow
def test_latency_is_applied_where_the_kernel_has_netem_and_refused_clearly_where_not() -> None:
    delay = 0.02
    network = EmulatedNetwork(2, 10**8, delay, tag="lat")
    if netem.kernel_has_netem():
        with network:
            qdiscs = subprocess.run(["tc", "-n", network.namespaces[0], "qdisc", "show", "dev", netem.WORKER_IFNAME],
                                    capture_output=True, text=True).stdout  # fmt: skip
            server = subprocess.Popen([*network.command_prefix(1), sys.executable, "-c", ECHO_SERVER],
                                      stdout=subprocess.PIPE, text=True)  # fmt: skip
            try:
                assert server.stdout.readline().strip() == "ready"
                ping = [*network.command_prefix(0), sys.executable, "-c", PING, network.address(1)]
                rtt = float(
                    subprocess.run(ping, capture_output=True, text=True, check=True, timeout=60).stdout
                )
            finally:
                server.kill()
        assert "netem" in qdiscs and "delay 20ms" in qdiscs and "tbf" in qdiscs
        # Each host end delays its egress by d: a round trip crosses two of them.
        assert 2 * delay <= rtt <= 2 * delay + 0.015, (
            f"round trip {rtt * 1e3:.1f} ms at {delay * 1e3} ms one way"
        )
    else:
        with pytest.raises(
            NetemUnavailableError, match=r"--latency needs the kernel's netem qdisc \(sch_netem\)"
        ):
            network.__enter__()
        # The probe is right: the qdisc really is unknown to this kernel.
        with EmulatedNetwork(1, 10**8, tag="lat0") as plain:
            added = subprocess.run(["tc", "-n", plain.namespaces[0], "qdisc", "add", "dev", "lo", "root", "netem",
                                    "delay", "1ms"], capture_output=True, text=True)  # fmt: skip
        assert added.returncode != 0 and "unknown" in added.stderr.lower()
        _assert_removed(plain)
    _assert_removed(network)
    assert not [n for n in our_namespaces() if n.startswith(f"{netem.PREFIX}{os.getpid()}-probe")]
