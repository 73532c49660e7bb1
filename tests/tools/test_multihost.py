"""Multi-host launches: one torchrun agent per emulated host, c10d rendezvous over the
shaped links (``gradsift train --launcher torchrun``), and cleanup of every namespace
and veth, also when an agent is killed. Needs root and iproute2."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from gradsift.core.errors import InvalidOptionError
from gradsift.tools.train import netem
from gradsift.tools.train.config import TrainConfig
from gradsift.tools.train.launcher import emulated_hosts
from gradsift.tools.train.netem import our_namespaces
from support.train import TINY, running, wait_for

MISSING = netem.missing_prerequisites()
needs_netem = pytest.mark.skipif(bool(MISSING), reason="emulated hosts need " + "; ".join(MISSING))
TWO_HOSTS = [*TINY, "--launcher", "torchrun", "--nodes", "2", "--bandwidth", "200mbit"]


def _launch(out: Path, steps: int) -> subprocess.Popen:
    """``gradsift train --launcher torchrun`` on 2 emulated hosts x 1 rank, in the background."""
    command = [
        sys.executable,
        "-m",
        "gradsift",
        "train",
        *TWO_HOSTS,
        "--steps",
        str(steps),
        "--out",
        str(out),
    ]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _leftovers(launcher_pid: int) -> list[str]:
    """Namespaces of this launcher still present, and veth ends of ours in the root namespace."""
    namespaces = [n for n in our_namespaces() if n.startswith(f"{netem.PREFIX}{launcher_pid}-")]
    root_links = json.loads(
        subprocess.run(["ip", "-j", "link", "show"], capture_output=True, text=True).stdout
    )
    ours = {netem.WORKER_IFNAME, *(f"gsh{h}" for h in range(2))}
    return namespaces + [link["ifname"] for link in root_links if link["ifname"] in ours]


def _pids_in(namespace: str) -> list[int]:
    listed = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True)
    return [int(pid) for pid in listed.stdout.split()]


def test_launcher_options_are_checked() -> None:
    config = TrainConfig(out="unused", model="mlp", workers=4, bandwidth="1gbit", bandwidth_bps=10**9)
    assert emulated_hosts(config, "local", None) == 4
    assert emulated_hosts(config, "torchrun", None) == 4
    assert emulated_hosts(config, "torchrun", 2) == 2
    with pytest.raises(InvalidOptionError, match=r"workers \(4\) must be a multiple of nodes \(3\)"):
        emulated_hosts(config, "torchrun", 3)
    with pytest.raises(InvalidOptionError, match=r"nodes must be an integer in \[1, workers=4\]"):
        emulated_hosts(config, "torchrun", 5)
    with pytest.raises(InvalidOptionError, match="nodes needs launcher torchrun"):
        emulated_hosts(config, "local", 2)
    with pytest.raises(InvalidOptionError, match="launcher must be one of local, torchrun"):
        emulated_hosts(config, "mpirun", None)
    unshaped = TrainConfig(out="unused", model="mlp", workers=2)
    with pytest.raises(InvalidOptionError, match="needs a bandwidth"):
        emulated_hosts(unshaped, "torchrun", None)


@needs_netem
@pytest.mark.distributed
@pytest.mark.slow
def test_two_hosts_train_under_torchrun_over_the_shaped_links(tmp_path: Path) -> None:
    launcher = _launch(tmp_path, steps=3)
    try:
        _, stderr = launcher.communicate(timeout=240)
    finally:
        launcher.kill()
    assert launcher.returncode == 0, stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["workers"] == 2 and summary["steps"] == 3 and summary["bandwidth"] == "200mbit"
    assert len((tmp_path / "steps.jsonl").read_text().splitlines()) == 3
    hosts = json.loads((tmp_path / "network.json").read_text())["hosts"]
    assert [h["namespace"] for h in hosts] == [f"{netem.PREFIX}{launcher.pid}-h{i}" for i in range(2)]
    # Every host's NIC saw at least the 3 steps' messages the exchange counted as received
    # (the one line measures on sidco-exp under SGD), so the ranks talked over the veths.
    for host in hosts:
        assert host["rx_bytes"] >= 3 * summary["bytes_received_per_step"] > 0, host
    assert _leftovers(launcher.pid) == []


@needs_netem
@pytest.mark.distributed
@pytest.mark.slow
def test_a_killed_agent_ends_the_run_and_everything_is_removed(tmp_path: Path) -> None:
    launcher = _launch(tmp_path, steps=100000)
    namespaces = [f"{netem.PREFIX}{launcher.pid}-h{i}" for i in range(2)]
    try:
        steps = tmp_path / "steps.jsonl"
        wait_for(lambda: steps.exists() and steps.stat().st_size > 0, 180, "the first step", launcher)
        inside = {namespace: _pids_in(namespace) for namespace in namespaces}
        assert all(len(pids) >= 2 for pids in inside.values()), inside  # an agent and its rank per host
        agents = [pid for pid in inside[namespaces[1]]
                  if b"torch.distributed.run" in Path(f"/proc/{pid}/cmdline").read_bytes()]  # fmt: skip
        assert len(agents) == 1
        os.kill(agents[0], signal.SIGKILL)
        _, stderr = launcher.communicate(timeout=120)
    finally:
        launcher.kill()
    assert launcher.returncode != 0
    assert "host 1 of 2 (torchrun agent) was killed by signal SIGKILL" in stderr
    assert _leftovers(launcher.pid) == []
    # The killed agent's rank (an orphan in host 1) and host 0's agent and rank are gone too.
    assert [pid for pids in inside.values() for pid in pids if running(pid)] == []
