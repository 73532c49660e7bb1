"""`gradsift demo --quick`: all five methods run; table, JSON (also at --json PATH) and plots appear.

The demo runs once in the suite: the README's `./dev demo` (run as `gradsift demo --quick`
by the documented-commands machinery, shared with docs/quickstart.md and docs/cli.md), whose
output this test reads; `--json PATH` is checked on the command's own code path."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from gradsift.tools.commands import demo as demo_command
from gradsift.tools.report import PLOTS
from gradsift.tools.train.demo import DEMO_MODEL, DEMO_RUNS, LENGTHS, exact_note
from gradsift.tools.train.models import build_model, parameter_count
from support.doc_commands import COMMANDS_GROUP


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.xdist_group(COMMANDS_GROUP)
def test_readmes_demo_writes_table_json_plots(documented_runs) -> None:
    block = documented_runs.find("./dev demo", source="README.md")
    run = documented_runs.run(block)
    assert run.ok, "\n\n".join(r.describe() for r in run.runs)
    printed = run.runs[0].output
    out = run.directory / "gradsift-demo"
    result = json.loads((out / "demo.json").read_text())
    names = [name for name, _ in DEMO_RUNS]
    assert names == ["none", "bf16", "sidco-exp", "topk", "vgc"]
    assert result["missing_compressors"] == [] and [r["compressor"] for r in result["rows"]] == names
    assert result["steps"] == LENGTHS[True][0]
    for row in result["rows"]:
        assert row["steps"] == LENGTHS[True][0] and row["accuracy"] is not None
        assert row["run"].split()[0] in printed
        if not result["emulated"]:  # over localhost the cost model predicts the slow links' steps
            assert set(row["predicted_step_ms"]) == {"1gbit", "100mbit"}
            # a slower link never predicts a faster step
            assert row["predicted_step_ms"]["100mbit"] >= row["predicted_step_ms"]["1gbit"] > 0
    by_name = {r["compressor"]: r for r in result["rows"]}
    assert by_name["none"]["compression_factor"] == pytest.approx(1.0)
    assert by_name["bf16"]["compression_factor"] == pytest.approx(2.0)
    assert by_name["topk"]["compression_factor"] > 20 and by_name["sidco-exp"]["compression_factor"] > 10
    # the demo's MLP is below sidco-exp's exact_below: its row is topk's, and the note says why
    note = exact_note(parameter_count(build_model(DEMO_MODEL)))
    assert note is not None and note in printed
    sidco, topk = by_name["sidco-exp"], by_name["topk"]
    assert (sidco["density"], sidco["accuracy"]) == (topk["density"], topk["accuracy"])
    if result["emulated"]:
        assert f"emulated {result['bandwidth']} links" in printed
    else:
        assert "localhost (no emulation)" in printed and "PREDICTED step time" in printed
    assert all((out / "plots" / name).read_bytes()[:4] == b"\x89PNG" for name in PLOTS)


def test_json_path_gets_a_copy_of_demo_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    written = {"rows": [{"compressor": "none"}], "emulated": False}
    seen = {}

    def fake_run_demo(out: Path, **kwargs: object) -> dict:
        seen.update(out=out, **kwargs)
        return written

    monkeypatch.setattr("gradsift.tools.train.demo.run_demo", fake_run_demo)
    copy = tmp_path / "copy.json"
    args = argparse.Namespace(out=tmp_path / "demo", quick=True, bandwidth="1gbit", json=copy,
                              localhost=True, no_progress=True)  # fmt: skip
    assert demo_command.run(args) == 0
    assert json.loads(copy.read_text()) == written and f"wrote {copy}" in capsys.readouterr().out
    assert seen == {"out": tmp_path / "demo", "quick": True, "bandwidth": "1gbit", "emulate": False,
                    "progress": False}  # fmt: skip


def test_localhost_predictions_follow_the_bytes_and_are_labelled() -> None:
    """Over localhost the demo predicts each run's step on the slow links: compute and
    compression medians plus the message's time on the wire (ring allreduce for `none`:
    2 (N-1)/N of the message each way at the link's rate), a slower link never faster."""
    from types import SimpleNamespace

    from gradsift.tools.train.demo import _add_predictions, format_predictions

    summary = {"workers": 2, "compressor": "none", "bytes_sent_per_step": 1.25e6, "compute_median_s": 0.01,
               "compress_median_s": 0.0, "decompress_median_s": 0.0}  # fmt: skip
    rows = [{"run": "none-w2"}]
    _add_predictions(rows, [SimpleNamespace(summary=summary)])
    predicted = rows[0]["predicted_step_ms"]
    assert set(predicted) == {"1gbit", "100mbit"} and predicted["100mbit"] > predicted["1gbit"] > 10.0
    # 1.25 MB over 100 Mbit/s (12.5 MB/s) is 100 ms once; a 2-worker ring sends it 2 (N-1)/N = 1 time
    assert predicted["100mbit"] == pytest.approx(10.0 + 100.0, rel=0.05)
    table = format_predictions(rows)
    assert table.startswith("PREDICTED step time") and "not measured" in table and "none-w2" in table


def test_the_exact_note_names_the_bound_and_only_below_it() -> None:
    from gradsift.compressors.sidco import SIDCoExponential

    bound = SIDCoExponential().exact_below
    below = exact_note(bound - 1)
    assert below is not None and f"{bound - 1:,} parameters" in below and f"({bound:,} elements)" in below
    assert exact_note(bound) is None
