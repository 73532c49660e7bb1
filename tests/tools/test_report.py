"""`gradsift report`: loading runs, the comparison table, targets and the plots."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from gradsift.core.errors import InvalidOptionError, MissingExtraError
from gradsift.tools.commands import report as report_command
from gradsift.tools.report import (
    PLOTS,
    comparison_rows,
    default_target,
    find_runs,
    format_table,
    plot_runs,
    predicted_step_seconds,
)
from gradsift.tools.train.summary import summarize

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def make_run(directory: Path, compressor: str, accuracies: list[float], *, step_s: float, bytes_sent: float,
             ratio: float | None = None, bytes_padded: float | None = None, workers: int = 2,
             bytes_received: float = 0.0) -> Path:  # fmt: skip
    """A run directory as `gradsift train` writes it, from hand-made records."""
    steps = [{"step": i, "loss": 1.0, "step_s": step_s, "compute_s": step_s / 2, "compress_s": 0.002,
              "communicate_s": step_s / 2 - 0.003, "decompress_s": 0.001, "bytes_sent": bytes_sent,
              "bytes_padded": bytes_sent if bytes_padded is None else bytes_padded, "bytes_received": bytes_received,
              "dense_bytes": 4000.0, "density": bytes_sent / 4000.0}
             for i in range(4 * len(accuracies))]  # fmt: skip
    evals = [{"step": 4 * (i + 1), "accuracy": a, "loss": 1.0, "train_time_s": 4 * (i + 1) * step_s,
              "wall_time_s": 5 * (i + 1) * step_s} for i, a in enumerate(accuracies)]  # fmt: skip
    options = {"ratio": ratio} if ratio else {}
    run = {
        "compressor": compressor,
        "options": options,
        "model": "mlp",
        "workers": workers,
        "bandwidth": "100mbit",
    }
    summary = summarize(steps, evals, run=run, target_accuracy=None, wall_time_s=10.0)
    directory.mkdir(parents=True)
    (directory / "summary.json").write_text(json.dumps(summary))
    (directory / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
    (directory / "evals.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evals))
    return directory


@pytest.fixture
def runs_dir(tmp_path: Path) -> Path:
    make_run(tmp_path / "runs" / "none", "none", [0.6, 0.8, 0.85], step_s=0.5, bytes_sent=4000.0)
    make_run(
        tmp_path / "runs" / "topk", "topk", [0.5, 0.75, 0.84, 0.845], step_s=0.1, bytes_sent=80.0, ratio=0.01
    )
    return tmp_path / "runs"


def test_table_rows_and_default_target(runs_dir: Path) -> None:
    runs = find_runs([runs_dir])
    assert [r.label for r in runs] == ["none w2 100mbit", "topk r=0.01 w2 100mbit"]
    target = default_target(runs)
    assert target == pytest.approx(0.84)
    rows = comparison_rows(runs, target)
    # dense reaches 0.84 at its 3rd eval (12 steps x 0.5 s), topk at its 3rd (12 x 0.1 s)
    assert rows[0]["time_to_accuracy_s"] == pytest.approx(6.0)
    assert rows[1]["time_to_accuracy_s"] == pytest.approx(1.2)
    assert rows[1]["compression_factor"] == pytest.approx(50.0)
    assert rows[1]["overhead_ms"] == pytest.approx(3.0)
    table = format_table(rows)
    assert "t->0.840 s" in table and "topk r=0.01 w2 100mbit" in table and "50.0" in table
    assert runs[1].cumulative_bytes_at(8) == 640.0


def test_the_table_gives_the_factor_below_fp32_on_the_wire_with_the_padding(tmp_path: Path) -> None:
    make_run(tmp_path / "vgc", "vgc", [0.5, 0.8], step_s=0.1, bytes_sent=80.0, bytes_padded=100.0)
    (row,) = comparison_rows(find_runs([tmp_path / "vgc"]), None)
    assert row["compression_factor"] == pytest.approx(50.0)  # 4000 dense bytes over 80 sent
    assert row["wire_factor"] == pytest.approx(40.0)  # ... over the 100 on the wire
    lines = format_table([row]).splitlines()
    cells = lines[2][len(row["run"]) :].split()  # after the label, which has spaces: MB/step, fp32/sent, ...
    assert lines[0].split()[2:4] == ["fp32/sent", "fp32/wire"] and cells[1:3] == ["50.0", "40.0"]


def test_the_table_gives_the_bytes_received_beside_those_sent(tmp_path: Path) -> None:
    # an allgather over 4 workers: each receives the 3 others' 80-byte messages
    make_run(tmp_path / "topk", "topk", [0.5, 0.8], step_s=0.1, bytes_sent=80_000.0, bytes_received=240_000.0)
    (row,) = comparison_rows(find_runs([tmp_path / "topk"]), None)
    assert row["bytes_received_per_step"] == pytest.approx(240_000.0)
    lines = format_table([row]).splitlines()
    cells = lines[2][len(row["run"]) :].split()
    assert lines[0].split()[4:6] == ["MB", "recv"] and cells[0] == "0.080" and cells[3] == "0.240"
    old = {k: v for k, v in json.loads((tmp_path / "topk" / "summary.json").read_text()).items()
           if k != "bytes_received_per_step"}  # fmt: skip
    (tmp_path / "topk" / "summary.json").write_text(json.dumps(old))
    (row,) = comparison_rows(find_runs([tmp_path / "topk"]), None)  # a run recorded before the key
    assert format_table([row]).splitlines()[2][len(row["run"]) :].split()[3] == "-"


def test_a_worker_alone_sent_nothing_in_the_table_and_the_bytes(tmp_path: Path) -> None:
    # its telemetry counts the dense message (4000 bytes a step) that DDP would send
    make_run(tmp_path / "alone", "none", [0.5, 0.7], step_s=0.1, bytes_sent=4000.0, workers=1)
    (run,) = find_runs([tmp_path / "alone"])
    assert run.cumulative_bytes_at(8) == 0.0
    (row,) = comparison_rows([run], None)
    assert row["bytes_per_step"] == 0.0 and row["compression_factor"] is None and row["wire_factor"] is None
    cells = format_table([row]).splitlines()[2][len(row["run"]) :].split()
    assert cells[:3] == ["0.000", "-", "-"]  # MB/step, fp32/sent, fp32/wire


def test_no_dense_run_means_no_default_target(runs_dir: Path) -> None:
    assert default_target(find_runs([runs_dir / "topk"])) is None


def test_missing_or_unfinished_directories_are_named(tmp_path: Path) -> None:
    with pytest.raises(InvalidOptionError, match="does not exist"):
        find_runs([tmp_path / "nope"])
    with pytest.raises(InvalidOptionError, match="holds no summary.json"):
        find_runs([tmp_path])
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "summary.json").write_text("{}")
    with pytest.raises(InvalidOptionError, match="missing steps.jsonl, evals.jsonl"):
        find_runs([tmp_path / "half"])


def test_a_record_that_is_not_json_is_named_by_file_and_line(runs_dir: Path) -> None:
    """A run cut short mid-line, or two runs writing one directory (was a JSONDecodeError's traceback)."""
    steps = runs_dir / "topk" / "steps.jsonl"
    lines = steps.read_text().splitlines()
    steps.write_text("\n".join([*lines[:2], "\0\0" + lines[2][:10], *lines[3:]]) + "\n")
    with pytest.raises(InvalidOptionError, match=r"topk/steps.jsonl:3 is not JSON \(Expecting value\)"):
        find_runs([runs_dir / "topk"])
    (runs_dir / "none" / "summary.json").write_text('{"loss": ')
    with pytest.raises(InvalidOptionError, match=r"none/summary.json is not JSON"):
        find_runs([runs_dir / "none"])


def test_plots_are_written_as_png(runs_dir: Path, tmp_path: Path) -> None:
    written = plot_runs(find_runs([runs_dir]), tmp_path / "plots")
    assert [p.name for p in written] == list(PLOTS)
    assert all(p.read_bytes()[:8] == PNG_MAGIC and p.stat().st_size > 5000 for p in written)


def test_missing_matplotlib_names_the_extra(
    runs_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(MissingExtraError, match=r"pip install 'gradsift\[plot\]'"):
        plot_runs(find_runs([runs_dir]), tmp_path / "plots")


def test_report_command_prints_table_and_writes_json_and_plots(runs_dir: Path, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    import argparse

    parser = argparse.ArgumentParser()
    report_command.add_parser(parser.add_subparsers())
    args = parser.parse_args(["report", str(runs_dir), "--target", "0.8", "--json", str(tmp_path / "r.json")])
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    assert "t->0.800 s" in printed and all(name in printed for name in PLOTS)
    rows = json.loads((tmp_path / "r.json").read_text())
    assert [r["time_to_accuracy_s"] for r in rows] == pytest.approx([4.0, 1.2])
    assert all((runs_dir / "report" / name).is_file() for name in PLOTS)


def test_predicted_step_time_uses_allreduce_or_allgather(runs_dir: Path) -> None:
    dense, sparse = (r.summary for r in find_runs([runs_dir]))
    bandwidth = 1000.0  # bytes/s
    # none: compute + (compress+decompress) + 2 (N-1)/N * 4000 B / bw with N = 4
    expected_dense = dense["compute_median_s"] + 0.003 + 2 * 3 / 4 * 4000 / bandwidth
    assert predicted_step_seconds(dense, bandwidth, workers=4) == pytest.approx(expected_dense)
    # topk: compute + (compress+decompress) + (N-1) * 80 B / bw
    expected_sparse = sparse["compute_median_s"] + 0.003 + 3 * 80 / bandwidth
    assert predicted_step_seconds(sparse, bandwidth, workers=4) == pytest.approx(expected_sparse)


def test_the_label_names_what_auto_chose_and_a_diloco_round(tmp_path: Path) -> None:
    """``auto``'s runs are told apart by their choice, DiLoCo's by its round and compressor (the
    compressor named ``auto`` in both)."""
    recipes = {
        "auto": {"auto": {"choice": "bf16", "predicted_ms": {"none": 3.0, "bf16": 2.0}}},
        "diloco": {"enabled": False, "diloco": {"sync_every": 4, "compressor": "blockquant"}},
    }
    for name, recipe in recipes.items():
        directory = make_run(tmp_path / name, "auto", [0.5, 0.6], step_s=0.1, bytes_sent=80.0)
        summary = json.loads((directory / "summary.json").read_text())
        (directory / "summary.json").write_text(json.dumps({**summary, "recipe": recipe}))
    labels = {run.path.name: run.label for run in find_runs([tmp_path])}
    assert labels == {"auto": "auto->bf16 w2 100mbit", "diloco": "diloco-h4 blockquant w2 100mbit"}


def test_an_auto_run_is_noted_with_its_steps_from_the_choice_on(tmp_path: Path) -> None:
    """The row's means are every step's; the note under the table gives those from the choice on
    (here 3 measuring steps of 80 bytes, then fp32's 4,000)."""
    directory = make_run(tmp_path / "auto", "auto", [0.5, 0.6], step_s=0.1, bytes_sent=80.0)
    steps = [json.loads(line) for line in (directory / "steps.jsonl").read_text().splitlines()]
    for record in steps[3:]:
        record.update(bytes_sent=4000.0, bytes_padded=4000.0, bytes_received=4000.0, density=1.0)
    run = {"compressor": "auto", "model": "mlp", "workers": 2, "bandwidth": "100mbit",
           "recipe": {"auto": {"choice": "none", "decided_at": 3, "predicted_ms": {}}}}  # fmt: skip
    summary = summarize(steps, [], run=run, target_accuracy=None, wall_time_s=1.0)
    (directory / "summary.json").write_text(json.dumps(summary))
    (row,) = comparison_rows(find_runs([directory]), None)
    assert row["bytes_per_step"] == pytest.approx((3 * 80 + 5 * 4000) / 8)
    table = format_table([row]).splitlines()
    assert len(table) == 4 and table[3] == (
        "auto->none w2 100mbit: the row counts every step, the measuring steps included; from step 3 on "
        "(the choice's): 0.004 MB/step, fp32/sent 1.0, 0.004 MB recv, density 1.0000, step 100.0 ms"
    )
    plain = make_run(tmp_path / "topk", "topk", [0.5], step_s=0.1, bytes_sent=80.0)
    assert len(format_table(comparison_rows(find_runs([plain]), None)).splitlines()) == 3


def test_a_target_that_is_not_an_accuracy_is_refused(runs_dir: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    from gradsift.tools.cli import main

    assert main(["report", str(runs_dir), "--target", "85", "--out", str(tmp_path / "plots")]) == 2
    err = capsys.readouterr().err
    assert "--target must lie in [0.0, 1.0], got 85" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "plots").exists()


def test_runs_of_one_setting_are_told_apart_in_rows_and_plots(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three seeds of one setting share a label: each row and each bar names its directory
    (matplotlib puts bars of one category name on top of each other)."""
    for seed in range(3):
        make_run(tmp_path / "seeds" / f"seed{seed}", "topk", [0.5, 0.7 + seed / 100], step_s=0.1, bytes_sent=80.0,
                 ratio=0.01)  # fmt: skip
    make_run(tmp_path / "other" / "seed0", "topk", [0.5, 0.6], step_s=0.1, bytes_sent=80.0, ratio=0.01)
    make_run(tmp_path / "seeds" / "alone", "none", [0.5, 0.6], step_s=0.1, bytes_sent=4000.0)
    runs = find_runs([tmp_path / "seeds", tmp_path / "other"])
    labels = [row["run"] for row in comparison_rows(runs, target=None)]
    assert len(set(labels)) == len(runs) == 5
    assert "none w2 100mbit" in labels  # a label no other run shares stays as it is
    assert "topk r=0.01 w2 100mbit [seed1]" in labels
    assert f"topk r=0.01 w2 100mbit [{tmp_path / 'other' / 'seed0'}]" in labels  # names agree: the path
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    bars = []
    original = plt.Axes.bar

    def bar(axes, x, *args, **kwargs):
        bars.append(list(x))
        return original(axes, x, *args, **kwargs)

    monkeypatch.setattr(plt.Axes, "bar", bar)
    plot_runs(runs, tmp_path / "plots")
    assert all(len(set(categories)) == len(runs) for categories in bars)
