"""benchmarks/vgc/padding.py: padded over sent of the demand-following compressors, end to end."""

import json
import sys

import pytest

from gradsift.tools.train.data import EMBEDDED_DIR
from support import ROOT


def padding_module():
    """benchmarks/vgc/padding.py as a module (its folder first on the path, as when it runs)."""
    sys.path.insert(0, str(ROOT / "benchmarks" / "vgc"))
    try:
        import padding
    finally:
        sys.path.pop(0)
    return padding


@pytest.mark.slow
@pytest.mark.distributed  # gradsift train starts two gloo workers
def test_padding_benchmark_reads_each_runs_telemetry(tmp_path, monkeypatch):
    """The benchmark's main on its command line, here (no interpreter start and torch import
    for it): its seven runs train for real, in its two launches of the workers, and it reads
    the telemetry they leave. The runs read the Fashion-MNIST subset embedded in the package
    (``--data-dir``, as the documented commands do): the full dataset's load and test set
    would cost most of each run, and the benchmark's reading of the telemetry is the same on
    either."""
    out = tmp_path / "padding.json"
    padding = padding_module()
    monkeypatch.setattr(sys, "argv", ["padding.py", "--steps", "8", "--skip", "2", "--seeds", "0",
                                      "--data-dir", str(EMBEDDED_DIR), "--json", str(out)])  # fmt: skip
    padding.main()
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
    padding = padding_module().padding
    steps = [{"bytes_padded": 100, "bytes_sent": 1}, {"bytes_padded": 30, "bytes_sent": 20},
             {"bytes_padded": 10, "bytes_sent": 5}]  # fmt: skip
    assert padding(steps, 1) == 40 / 25
