"""The benchmark harnesses that start worker processes fail within seconds when one dies.

Each harness runs as a user runs it, for far more steps than the test waits; once both of
its ranks have joined the process group (each holds a socket), one rank is killed with
SIGKILL, as the OOM killer would. The harness must then exit non-zero within 10 s, name
the dead rank, and leave no process behind (the surviving rank, blocked in a collective
with the dead one, is stopped too). Before, the harnesses waited on their result queue
for 30 to 50 minutes.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support import ROOT
from support.train import holds_socket, session_alive

BENCHMARKS = ROOT / "benchmarks"
STEPS = "100000"  # hours of steps: the harness only ends early because a rank died

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def _children(pid: int) -> list[int]:
    children = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:  # it exited meanwhile
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                children.append(int(entry.name))
    return children


def _is_worker(pid: int) -> bool:
    try:
        return b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _workers_in_group(harness: subprocess.Popen, timeout_s: float) -> list[int]:
    """The harness's two worker pids (in start order: rank 0 first) once both hold a socket."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert harness.poll() is None, f"the harness exited early: {harness.communicate()}"
        workers = sorted(pid for pid in _children(harness.pid) if _is_worker(pid))
        if len(workers) == 2 and all(holds_socket(pid) for pid in workers):
            return workers
        time.sleep(0.2)
    raise AssertionError(f"the harness's two ranks did not join a process group within {timeout_s} s")


HARNESSES = {
    "gpu-hook": ["gpu/hook.py", "--device", "cpu", "--width", "16", "--depth", "1", "--batch", "4",
                 "--warmup", "0", "--steps", STEPS, "--json", "{tmp}/hook.json"],
    "hook-overhead": ["hook_overhead/run.py", "--warmup", "0", "--profile-steps", "0", "--steps", STEPS,
                      "--json", "{tmp}/overhead.json"],
    "ddp-bench-hook": ["ddp/bench_hook.py", "--world-sizes", "2", "--warmup", "0", "--steps", STEPS,
                       "--out", "{tmp}/ddp.json"],
}  # fmt: skip


# rank 0 sends the result, rank 1 only computes: each dies in at least one harness
@pytest.mark.parametrize(
    "harness,killed_rank", [("gpu-hook", 1), ("hook-overhead", 0), ("ddp-bench-hook", 1)]
)
def test_a_dead_rank_fails_the_harness_within_seconds(harness, killed_rank, tmp_path):
    script, *options = HARNESSES[harness]
    command = [sys.executable, str(BENCHMARKS / script), *(o.format(tmp=tmp_path) for o in options)]
    process = subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        workers = _workers_in_group(process, timeout_s=120)
        os.kill(workers[killed_rank], signal.SIGKILL)
        killed = time.monotonic()
        try:
            _, stderr = process.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{harness} still waits 10 s after rank {killed_rank} died")
        waited = time.monotonic() - killed
        assert process.returncode != 0
        assert f"rank {killed_rank}: signal SIGKILL" in stderr, stderr[-3000:]
        deadline = time.monotonic() + 5  # the session's last processes (resource tracker) leave
        while session_alive(process.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not session_alive(process.pid), "a worker or helper of the harness outlived it"
        assert waited < 10
    finally:
        if session_alive(process.pid):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def test_hook_overhead_without_profile_steps_finishes(tmp_path):
    """``--profile-steps 0``: timings only, no profile; it used to leave the parent waiting."""
    out = tmp_path / "overhead.json"
    command = [sys.executable, str(BENCHMARKS / "hook_overhead" / "run.py"), "--steps", "1", "--warmup", "0",
               "--profile-steps", "0", "--json", str(out)]  # fmt: skip
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)  # fmt: skip
    try:
        output, _ = process.communicate(timeout=180)
    finally:
        if session_alive(process.pid):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    assert process.returncode == 0, output
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"stock", "torch-allreduce-hook", "torch-builtin-hook", "none", "sidco-exp@0.01",
                            "topk@0.01", "auto"}  # fmt: skip
    for entry in results.values():
        assert len(entry["step_ms"]) == 1 and "profile" not in entry
        assert entry["ratio_to_stock"] == entry["median_step_ms"] / results["stock"]["median_step_ms"]


def test_mean_pass_benchmark_delivers_the_mean_and_writes_its_timings(tmp_path):
    """benchmarks/hook_overhead/mean_pass.py checks both mean ways against the closed-form mean
    (it exits non-zero otherwise) and writes one median per way."""
    out = tmp_path / "mean_pass.json"
    command = [sys.executable, str(BENCHMARKS / "hook_overhead" / "mean_pass.py"), "--numel", "4096",
               "--rounds", "2", "--warmup", "0", "--json", str(out)]  # fmt: skip
    process = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert process.returncode == 0, process.stdout + process.stderr
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"allreduce", "mean-then-allreduce", "reduce-scatter-mean-allgather"}
    for entry in results.values():
        assert len(entry["ms"]) == 2 and entry["median_ms"] > 0
    assert results["allreduce"]["ratio_to_allreduce"] == 1.0
