"""`gradsift demo --quick`: all five methods run; table, JSON (also at --json PATH) and plots appear."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gradsift.tools.cli import main as cli_main
from gradsift.tools.report import PLOTS
from gradsift.tools.train.demo import DEMO_RUNS, LENGTHS


@pytest.mark.distributed
@pytest.mark.slow
def test_quick_demo_on_localhost_writes_table_json_plots(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "demo"
    copy = tmp_path / "copy.json"
    assert (
        cli_main(["demo", "--quick", "--localhost", "--no-progress", "--out", str(out), "--json", str(copy)])
        == 0
    )
    printed = capsys.readouterr().out
    result = json.loads((out / "demo.json").read_text())
    assert json.loads(copy.read_text()) == result and f"wrote {copy}" in printed
    names = [name for name, _ in DEMO_RUNS]
    assert names == ["none", "bf16", "sidco-exp", "topk", "vgc"]
    assert result["missing_compressors"] == [] and [r["compressor"] for r in result["rows"]] == names
    assert result["emulated"] is False and result["steps"] == LENGTHS[True][0]
    for row in result["rows"]:
        assert row["steps"] == LENGTHS[True][0] and row["accuracy"] is not None
        assert set(row["predicted_step_ms"]) == {"1gbit", "100mbit"}
        # a slower link never predicts a faster step
        assert row["predicted_step_ms"]["100mbit"] >= row["predicted_step_ms"]["1gbit"] > 0
        assert row["run"].split()[0] in printed
    by_name = {r["compressor"]: r for r in result["rows"]}
    assert by_name["none"]["compression_factor"] == pytest.approx(1.0)
    assert by_name["bf16"]["compression_factor"] == pytest.approx(2.0)
    assert by_name["topk"]["compression_factor"] > 20 and by_name["sidco-exp"]["compression_factor"] > 10
    assert "PREDICTED step time" in printed and "localhost (no emulation)" in printed
    assert all((out / "plots" / name).read_bytes()[:4] == b"\x89PNG" for name in PLOTS)
