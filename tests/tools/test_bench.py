"""``gradsift bench compress`` and the measuring code behind it, on tiny sizes."""

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import ClassVar

import pytest
import torch

import gradsift
from gradsift.compressors.topk import TopK
from gradsift.core.errors import GradsiftError, InvalidOptionError, UnknownCompressorError
from gradsift.core.readout import Readout
from gradsift.tools import cli
from gradsift.tools.benchmarking import (
    CompressBenchConfig,
    HookEncoder,
    benchmarkable,
    in_rotation,
    interleaved_medians_ms,
    run_compress_benchmark,
    synthetic_gradient,
)
from support import ROOT
from support.train import session_alive

ROW_FIELDS = {
    "compressor",
    "options",
    "numel",
    "ratio",
    "target_count",
    "count",
    "count_vs_target",
    "compress_ms",
    "decompress_ms",
    "floor_ms",
    "topk_ms",
    "compress_vs_floor",
    "speedup_vs_topk",
    "speedup_vs_topk_compressor",
    "nbytes",
    "dense_nbytes",
}


def run_cli(argv):
    return cli.main(argv)


def test_bench_compress_cli_writes_documented_json(tmp_path, capsys):
    out = tmp_path / "bench" / "results.json"
    argv = ["bench", "compress", "--sizes", "2000", "5000", "--ratios", "0.1", "0.01", "--repeats", "2",
            "--warmup", "1", "--threads", "1", "--compressors", "topk", "randomk", "threshold", "fp16",
            "--json", str(out), "--no-progress"]  # fmt: skip
    assert run_cli(argv) == 0
    result = json.loads(out.read_text())
    assert set(result) == {"config", "input", "environment", "skipped", "rows"}
    assert result["config"]["sizes"] == [2000, 5000] and result["config"]["threads"] == 1
    assert result["environment"]["threads"] == 1 and result["skipped"] == {}
    loads = result["environment"]["load_average"]
    assert set(loads) == {"before", "after"} and len(loads["before"]) == len(loads["after"]) == 3
    rows = {(r["compressor"], r["numel"], r["ratio"]): r for r in result["rows"]}
    # 2 sizes x (2 ratios x 3 sparsifiers + the ratio-less fp16 once).
    assert len(rows) == len(result["rows"]) == 14
    for row in result["rows"]:
        assert set(row) == ROW_FIELDS
        assert row["floor_ms"] > 0 and row["compress_ms"] > 0 and row["decompress_ms"] > 0
        assert math.isclose(row["compress_vs_floor"], row["compress_ms"] / row["floor_ms"])
        if row["ratio"] is None:
            assert row["topk_ms"] is None and row["speedup_vs_topk"] is None
            assert row["speedup_vs_topk_compressor"] is None
        else:
            assert math.isclose(row["speedup_vs_topk"], row["topk_ms"] / row["compress_ms"])
            topk_row = rows["topk", row["numel"], row["ratio"]]
            assert math.isclose(
                row["speedup_vs_topk_compressor"], topk_row["compress_ms"] / row["compress_ms"]
            )
    for n in (2000, 5000):
        for ratio in (0.1, 0.01):
            k = int(n * ratio)
            assert rows["topk", n, ratio]["count"] == k and rows["topk", n, ratio]["nbytes"] == k * 8 + 4
            assert rows["randomk", n, ratio]["count_vs_target"] == 1.0
            assert rows["randomk", n, ratio]["nbytes"] == k * 4
            # Oracle eta = the k-th largest |x|; strictly above it: k - 1 (continuous data).
            assert rows["threshold", n, ratio]["count"] == k - 1
        assert rows["fp16", n, None]["nbytes"] == 2 * n and rows["fp16", n, None]["count_vs_target"] == 1.0
    table = capsys.readouterr().out
    assert "# n=5,000 ratio=0.01: floor" in table and "bare topk" in table
    assert "compress ms" in table and "vs topk" in table and f"wrote {out}" in table


def test_default_set_skips_what_cannot_compress_a_flat_tensor():
    names, skipped = benchmarkable(None, "cpu")
    assert {"topk", "randomk", "dgc", "redsync", "gaussiank", "threshold", "none"} <= set(names)
    assert "needs_parameters" in skipped["vgc"]
    assert "powersgd" in skipped and "powersgd" not in names


@pytest.mark.parametrize(
    "options,match",
    [
        ({"sizes": [0]}, "sizes"),
        (
            {"sizes": [10**30]},
            r"sizes must lie in \[1, \d+\], got 10{30}",
        ),  # more than memory: was a C++ error
        ({"ratios": [1.5]}, "ratios"),
        ({"repeats": 0}, "repeats"),
        ({"threads": 0}, "threads"),
        ({"device": "tpu"}, "device"),
        ({"processes": 0}, "processes"),
    ],
)
def test_bad_config_names_the_option(options, match):
    with pytest.raises(InvalidOptionError, match=match):
        CompressBenchConfig(**options)


def test_unknown_compressor_fails_before_timing():
    with pytest.raises(UnknownCompressorError, match="nope"):
        CompressBenchConfig(compressors=["topk", "nope"])


def test_synthetic_gradient_is_fixed_and_heavy_tailed():
    x = synthetic_gradient(1_000_000, seed=3)
    assert x.dtype == torch.float32 and x.shape == (1_000_000,)
    assert torch.equal(x, synthetic_gradient(1_000_000, seed=3))
    assert not torch.equal(x, synthetic_gradient(1_000_000, seed=4))
    # E|x| = E[Exp(1)] E[exp(Z)] = e^(1/2); a scale mixture of Laplace has kurtosis above Laplace's 6.
    assert abs(float(x.abs().mean()) / math.exp(0.5) - 1) < 0.05
    x = x.double()
    assert float((x**4).mean() / (x**2).mean() ** 2) > 6
    assert synthetic_gradient(5000).shape == (5000,)  # a partial last block


def test_ratio_less_compressors_alone_time_no_ratio_groups():
    config = CompressBenchConfig(sizes=[3000], ratios=[0.1, 0.01], compressors=["bf16"], repeats=1, warmup=0)
    rows = run_compress_benchmark(config, progress=False)["rows"]
    assert [(r["compressor"], r["ratio"], r["count"], r["nbytes"]) for r in rows] == [
        ("bf16", None, 3000, 6000)
    ]


@pytest.mark.slow
def test_contended_mode_pools_concurrent_processes(tmp_path):
    out = tmp_path / "contended.json"
    argv = ["bench", "compress", "--sizes", "3000", "--ratios", "0.01", "--repeats", "3", "--warmup", "1",
            "--threads", "1", "--processes", "2", "--compressors", "topk", "sidco-exp", "--json", str(out),
            "--no-progress"]  # fmt: skip
    assert run_cli(argv) == 0
    result = json.loads(out.read_text())
    assert result["config"]["processes"] == 2
    rows = {r["compressor"]: r for r in result["rows"]}
    assert set(rows) == {"topk", "sidco-exp"}
    for row in rows.values():
        assert len(row["compress_ms_by_process"]) == 2 and all(ms > 0 for ms in row["compress_ms_by_process"])
        assert min(row["compress_ms_by_process"]) <= row["compress_ms"] <= max(row["compress_ms_by_process"])
        assert row["count"] == 30  # 3000 elements are below sidco's exact_below: both send exactly k


def test_dtype_option_times_the_gradient_in_that_dtype():
    config = CompressBenchConfig(
        sizes=[3000], ratios=[0.01], compressors=["topk"], dtype="bf16", repeats=1, warmup=0
    )
    (row,) = run_compress_benchmark(config, progress=False)["rows"]
    assert (
        row["dense_nbytes"] == 2 * 3000 and row["nbytes"] == 30 * (2 + 4) + 4
    )  # bf16 values, int32 indices, one length
    with pytest.raises(InvalidOptionError, match="dtype"):
        CompressBenchConfig(dtype="int8")


def test_rounds_rotate_the_order_of_the_methods():
    assert in_rotation([1, 2, 3], 0) == [1, 2, 3]
    assert in_rotation([1, 2, 3], 4) == [2, 3, 1]
    assert in_rotation([], 2) == []
    calls: list[str] = []
    methods = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    medians = interleaved_medians_ms(methods, 3, warmup=0)
    assert set(medians) == {"a", "b", "c"}
    assert calls == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]


@pytest.mark.slow
@pytest.mark.distributed
def test_gpu_check_dry_run_runs_every_check_on_cpu(tmp_path):
    """benchmarks/gpu/check.sh --dry-run: the GPU check's own code, on CPU with gloo at toy
    sizes; its numbers must say what the CPU suite says (at most one host read per step for
    every compressor x exchange at 1 and 2 ranks, ratio 1 equal to stock DDP, the two ranks
    in agreement, the GradScaler run within 1e-4 of stock, the counter counting a read in a
    comm hook, the same bits twice, the same selection on both branches), a line per check
    in $OUT/check.jsonl, and the device command's shape (under 2,000 characters, $OUT as the
    default folder, at most 4 files). One thread per process, as every process the suite
    starts (a second thread's barrier, with the other core busy, made each toy-sized
    operation wait milliseconds for it: 62 s against 43 s)."""
    script = ROOT / "benchmarks" / "gpu" / "check.sh"
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(["bash", str(script), "--dry-run"], capture_output=True, text=True, timeout=600,
                          env=env)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert len(script.read_text()) < 2000 and 1 <= len(list(tmp_path.iterdir())) <= 4
    assert f"torch {torch.__version__}" in done.stdout
    lines = [json.loads(line) for line in (tmp_path / "check.jsonl").read_text().splitlines()]
    checks = {line["check"]: line for line in lines}
    assert set(checks) == {"environment", "machine", "sync_counter", "determinism", "selection", "exchanges",
                           "bf16_layer", "memory", "static_graph", "amp", "evaluate", "encode", "step_time",
                           "two_ranks", "train"}  # fmt: skip
    assert all(entry["ok"] for entry in checks.values()), {k: v.get("error") for k, v in checks.items()}
    counter = checks["sync_counter"]["result"]
    assert counter["syncs_of_one_item"] == 1 and counter["syncs_of_a_reading_hook_in_2_steps"] == 2
    assert checks["selection"]["result"]["torch.float32"]["selected"] > 2 * 16  # > 2x capacity passed
    for name in ("exchanges", "two_ranks"):
        check = checks[name]["result"]
        assert check["topk ratio 1 equals stock DDP"] is True and check["failures"] == []
        assert check["pairs"].pop("stock")["syncs_per_step"] == 0
        assert all(entry["syncs_per_step"] <= 1 for entry in check["pairs"].values()), check["pairs"]
    pairs = set(checks["exchanges"]["result"]["pairs"])
    assert pairs == {f"{name} {exchange}" for name, exchange in registry_pairs()}
    assert all(entry["syncs_per_step"] <= 1 for entry in checks["bf16_layer"]["result"]["pairs"].values())
    assert checks["amp"]["result"]["relative_difference"] <= 1e-4
    rows = checks["encode"]["result"]["rows"]
    sizes = {(n, r) for n in (4096, 10_000) for r in (0.01, 0.001)}
    assert {(row["numel"], row["ratio"]) for row in rows} == sizes
    assert {row["method"] for row in rows} == {"torch.topk", "topk", "sidco-exp", "sidco-exp fit"}
    assert checks["machine"]["result"]["commit"] and "load_before" in checks["machine"]["result"]
    train = json.loads((tmp_path / "train-summary.json").read_text())
    assert (train["steps"], train["workers"], train["device"]) == (3, 1, "cpu")


@pytest.mark.slow
def test_gpu_check_writes_down_a_part_that_dies_and_exits_non_zero(tmp_path):
    """A part whose process dies (here: no Python at all) leaves a line saying so in
    check.jsonl, the other parts still run, and the command exits non-zero."""
    script = ROOT / "benchmarks" / "gpu" / "check.sh"
    env = {**os.environ, "PYTHON": "false"}
    done = subprocess.run(["bash", str(script), "--dry-run", str(tmp_path)], capture_output=True, text=True,
                          timeout=60, env=env)  # fmt: skip
    assert done.returncode != 0
    lines = [json.loads(line) for line in (tmp_path / "check.jsonl").read_text().splitlines()]
    parts = [line["check"] for line in lines if line["check"].startswith("part ")]
    assert len(parts) == 5 and "part two_ranks" in parts
    assert not any(line["ok"] for line in lines)


def registry_pairs() -> list[tuple[str, str]]:
    """Every compressor x exchange the registry allows, SIDCo also forced onto its fitted path."""
    fitted = ["sidco-exp/fit", "sidco-gpareto/fit", "sidco-gamma/fit"]
    options = {"threshold": {"threshold": 0.01}}
    return [
        (name, exchange)
        for name in [*gradsift.available_compressors(), *fitted]
        for exchange in gradsift.get_compressor(name.split("/")[0], **options.get(name, {})).exchanges
    ]


@pytest.mark.slow
@pytest.mark.distributed
def test_gpu_check_fails_when_a_check_fails(tmp_path):
    """check.py's exit status follows its checks: the same run under a sync budget of 0 (every
    hooked pair makes its step close's read) and an AMP target below any difference exits 1
    and names what failed. One pair stands for them all: the sweep over every pair is the
    dry run's (test_gpu_check_dry_run_runs_every_check_on_cpu), and a failure is judged
    pair by pair by the same lines."""
    program = (
        "import sys; import check; "
        "check.BUDGET = check.BALANCED_BUDGET = 0; check.AMP_TARGET = -1.0; "
        "check.pairs = lambda: [('topk', 'allgather')]; "
        f"sys.exit(check.main(['--device', 'cpu', '--only', 'exchanges', 'amp', '--jsonl', '{tmp_path}/c.jsonl']))"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "benchmarks" / "gpu")]),
           "OMP_NUM_THREADS": "1"}  # fmt: skip
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env=env)  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    checks = {
        line["check"]: line for line in map(json.loads, (tmp_path / "c.jsonl").read_text().splitlines())
    }
    assert not checks["exchanges"]["ok"] and not checks["amp"]["ok"]
    assert "FAILED exchanges: topk allgather: 1 syncs per step (budget 0)" in done.stdout
    assert "FAILED amp: relative difference" in done.stdout


def _spawned_workers(parent: int) -> list[int]:
    """Pids of the multiprocessing workers (``spawn_main``) that process ``parent`` started."""
    workers = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            command = (entry / "cmdline").read_bytes()
        except OSError:  # it exited meanwhile
            continue
        if ppid == parent and b"spawn_main" in command:
            workers.append(int(entry.name))
    return sorted(workers)


@pytest.mark.slow
def test_contended_mode_fails_within_seconds_when_a_worker_dies(tmp_path):
    """A contended worker killed as the OOM killer would (SIGKILL) while the run has hours
    left: the command exits with an error naming it within 10 s, and no process of the run
    outlives it (the other worker, waiting at the barrier for the dead one, is stopped).
    Before, the parent waited 3600 s on its result queue."""
    out = tmp_path / "contended.json"
    command = [sys.executable, "-m", "gradsift", "bench", "compress", "--sizes", "100000", "--ratios", "0.01",
               "--repeats", "10000000", "--warmup", "0", "--threads", "1", "--processes", "2",
               "--compressors", "topk", "--json", str(out), "--no-progress"]  # fmt: skip
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while len(workers := _spawned_workers(process.pid)) < 2:
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < deadline, "the two contended workers did not start within 120 s"
            time.sleep(0.2)
        time.sleep(1.0)  # past their start-up: measuring, or waiting at the barrier
        os.kill(workers[1], signal.SIGKILL)
        killed = time.monotonic()
        try:
            _, stderr = process.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            pytest.fail("bench compress still waits 10 s after a contended worker died")
        assert time.monotonic() - killed < 10
        assert process.returncode == 2, stderr
        assert f"(pid {workers[1]}): signal SIGKILL" in stderr, stderr[-3000:]
        assert not out.exists()
        deadline = time.monotonic() + 5  # the run's last processes (the resource tracker) leave
        while session_alive(process.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not session_alive(process.pid), "a worker of the run outlived it"
    finally:
        if session_alive(process.pid):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


#: What :class:`HookOnlyTopK`'s encode sleeps: a timed region that holds it shows at least this.
ENCODE_DELAY_S = 0.05


class HookOnlyTopK(TopK):
    """``topk`` whose public ``compress()`` raises: only the DDP hook's ``encode`` works. Each
    encode is recorded (numel, capacity, readout) and sleeps :data:`ENCODE_DELAY_S`."""

    encodes: ClassVar[list[tuple[int, int | None, Readout]]] = []

    def compress(self, tensor, *, key=0, **extra):
        raise GradsiftError("compress() is not what the DDP hook calls")

    def encode(self, flat, *, key, capacity, readout, **extra):
        self.encodes.append((flat.numel(), capacity, readout))
        time.sleep(ENCODE_DELAY_S)
        return super().encode(flat, key=key, capacity=capacity, readout=readout, **extra)


@pytest.fixture
def hook_only(monkeypatch):
    """``hook-only`` registered as :class:`HookOnlyTopK` (undone afterwards); its encode calls."""
    from gradsift.compressors import registry

    monkeypatch.setitem(registry._TABLE, "hook-only", f"{__name__}:HookOnlyTopK")
    monkeypatch.setattr(HookOnlyTopK, "encodes", [])
    return HookOnlyTopK.encodes


def test_bench_times_the_hooks_encode_not_the_public_compress(hook_only):
    """A compressor whose compress() raises is still measured: the bench calls encode with the
    hook's capacity (k) and a fresh step readout, once per warm-up and timed call, and the
    timed region holds it (its sleep shows in compress_ms, not in the baselines')."""
    config = CompressBenchConfig(sizes=[3000], ratios=[0.01], compressors=["hook-only", "topk"], repeats=3,
                                 warmup=2)  # fmt: skip
    result = run_compress_benchmark(config, progress=False)
    assert result["skipped"] == {}
    rows = {row["compressor"]: row for row in result["rows"]}
    assert set(rows) == {"hook-only", "topk"}
    # the probe step (64 elements at ratio 0.5: k = 32), then 2 warm-up and 3 timed steps at k = 30
    assert [(numel, capacity) for numel, capacity, _ in hook_only] == [(64, 32)] + [(3000, 30)] * 5
    readouts = [readout for _, _, readout in hook_only]
    assert all(isinstance(r, Readout) for r in readouts) and len({id(r) for r in readouts}) == 6
    assert rows["hook-only"]["count"] == rows["topk"]["count"] == 30
    assert rows["hook-only"]["nbytes"] == 30 * (4 + 4) + 4  # fp32 values, int32 indices, one length
    delay_ms = ENCODE_DELAY_S * 1e3
    assert rows["hook-only"]["compress_ms"] >= delay_ms
    assert rows["hook-only"]["floor_ms"] < delay_ms and rows["topk"]["compress_ms"] < delay_ms


def test_hook_encoder_sizes_each_step_as_the_hook_does():
    """An adaptive-capacity compressor (a fixed threshold): the first step's payload has room for
    ``first_ratio`` of the elements and keeps the largest that pass; once that step closes, the
    next one has room for the demand (every element above the threshold, counted here by brute
    force) rounded up to 16, and sends them all."""
    x = synthetic_gradient(5000, seed=2)
    eta = float(x.abs().kthvalue(5000 - 300).values)
    passing = sorted(torch.nonzero(x.abs() > eta).flatten().tolist())
    assert len(passing) == 300
    encoder = HookEncoder(gradsift.get_compressor("threshold", threshold=eta, first_ratio=0.01))
    first = encoder.encode(x)
    with pytest.raises(GradsiftError, match="still open"):
        encoder.encode(x)
    encoder.close()
    largest = sorted(torch.topk(x.abs(), 50).indices.tolist())
    assert (first.capacity, first.count) == (50, 50)
    assert sorted(first.indices.tolist()) == largest
    second = encoder.encode(x)
    encoder.close()
    assert (second.capacity, second.count) == (304, 300)
    assert sorted(second.indices[:300].tolist()) == passing
    with pytest.raises(GradsiftError, match="no step is open"):
        encoder.close()
