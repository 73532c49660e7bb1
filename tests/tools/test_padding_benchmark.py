"""benchmarks/vgc/padding.py: padded over sent of the demand-following compressors, end to end."""

import json
import subprocess
import sys

import pytest

from support import ROOT


@pytest.mark.slow
@pytest.mark.distributed  # gradsift train starts two gloo workers
def test_padding_benchmark_reads_each_runs_telemetry(tmp_path):
    out = tmp_path / "padding.json"
    command = [sys.executable, str(ROOT / "benchmarks" / "vgc" / "padding.py"), "--steps", "8", "--skip", "2",
               "--seeds", "0", "--json", str(out)]  # fmt: skip
    process = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert process.returncode == 0, process.stdout + process.stderr
    report = json.loads(out.read_text())
    results = report["results"]
    assert set(results) == {"fp32", "bf16", "alone", "vgc-alpha4", "threshold-0.1", "vgc-alpha4-padding1.1",
                            "vgc-alpha6"}  # fmt: skip
    for label, entry in results.items():
        (run,) = entry["runs"]
        assert 0.0 <= run["final_test_accuracy"] <= 1.0
        assert entry["accuracy_mean"] == run["final_test_accuracy"]
        assert entry["bytes_padded_per_step_mean"] == run["bytes_padded_per_step"]
        if label == "alone":  # one worker: nothing travels, so no ratio
            assert entry["workers"] == 1 and "padded_over_sent_mean" not in entry
            assert run["padded_over_sent"] is None and run["bytes_padded_per_step"] == 0.0
            continue
        # a payload is padded up to its capacity, never cut below what it carries
        assert run["padded_over_sent"] >= 1.0
        assert run["bytes_padded_per_step"] >= run["bytes_sent_per_step"] > 0
        assert entry["padded_over_sent_mean"] == run["padded_over_sent"]
    # the dense controls carry no padding; bf16 sends half of fp32's bytes
    assert (
        results["fp32"]["runs"][0]["padded_over_sent"]
        == results["bf16"]["runs"][0]["padded_over_sent"]
        == 1.0
    )
    assert (
        results["bf16"]["runs"][0]["bytes_sent_per_step"] * 2
        == results["fp32"]["runs"][0]["bytes_sent_per_step"]
    )


def test_padding_is_the_ratio_of_the_sums_after_the_skipped_steps():
    sys.path.insert(0, str(ROOT / "benchmarks" / "vgc"))
    try:
        from padding import padding
    finally:
        sys.path.pop(0)
    steps = [{"bytes_padded": 100, "bytes_sent": 1}, {"bytes_padded": 30, "bytes_sent": 20},
             {"bytes_padded": 10, "bytes_sent": 5}]  # fmt: skip
    assert padding(steps, 1) == 40 / 25
