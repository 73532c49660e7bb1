"""`gradsift analyze`: table, JSON, plots, safe loading."""

import json
import pickle

import pytest
import torch

from gradsift.compressors import get_compressor
from gradsift.core.errors import InvalidOptionError
from gradsift.hook.feedback import ErrorFeedback
from gradsift.tools.analysis import estimation_series, load_gradients, percentile_summary
from gradsift.tools.cli import main


@pytest.fixture
def gradient_file(tmp_path):
    path = tmp_path / "grads.pt"
    relu = torch.distributions.Laplace(0.0, 1.0).sample((20_000,)).relu()
    torch.save({"layer.weight": torch.randn(100, 200), "relu": relu}, path)
    return path


def test_cli_prints_table_and_writes_json(gradient_file, tmp_path, capsys):
    out = tmp_path / "result.json"
    code = main(["analyze", str(gradient_file), "--compressors", "sidco-exp", "topk", "--ratios", "0.01", "0.001",
                 "--calls", "4", "--json", str(out)])  # fmt: skip
    assert code == 0
    printed = capsys.readouterr().out
    assert "== layer.weight  numel=20000" in printed and "fit gamma" in printed and "sidco-exp" in printed
    report = json.loads(out.read_text())
    assert report["calls"] == 4
    tensors = {t["name"]: t for t in report["tensors"]}
    assert set(tensors) == {"layer.weight", "relu"}
    assert tensors["relu"]["fits"]["zero_fraction"] == pytest.approx(0.5, abs=0.02)
    assert tensors["relu"]["fits"]["gamma"]["ks"] < tensors["relu"]["fits"]["exponential"]["ks"]
    rows = tensors["layer.weight"]["estimation"]
    assert [(r["compressor"], r["ratio"]) for r in rows] == [
        ("sidco-exp", 0.01), ("sidco-exp", 0.001), ("topk", 0.01), ("topk", 0.001),
    ]  # fmt: skip
    topk = rows[2]
    assert topk["target"] == 200 and topk["achieved"] == [200] * 4
    assert topk["quality"] == {"median": 1.0, "p10": 1.0, "p90": 1.0}
    assert len(rows[0]["ratio_series"]) == 4 and 0.8 <= rows[0]["quality"]["median"] <= 1.25


def test_cli_writes_plots(gradient_file, tmp_path):
    pytest.importorskip("matplotlib", reason="plots need the plot extra: pip install 'gradsift[plot]'")
    plots = tmp_path / "plots"
    assert (
        main(
            [
                "analyze",
                str(gradient_file),
                "--compressors",
                "sidco-gamma",
                "--calls",
                "1",
                "--plot",
                str(plots),
            ]
        )
        == 0
    )
    names = sorted(p.name for p in plots.iterdir())
    assert names == ["layer.weight-hist.png", "layer.weight-qq.png", "relu-hist.png", "relu-qq.png"]
    assert all((plots / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for name in names)


class _RunsCode:
    def __reduce__(self):
        return (print, ("code from the file ran",))


def test_file_that_would_run_code_is_refused(tmp_path, capsys):
    path = tmp_path / "evil.pt"
    with path.open("wb") as f:
        pickle.dump({"x": _RunsCode()}, f, protocol=2)
    assert main(["analyze", str(path), "--compressors", "topk"]) == 2
    captured = capsys.readouterr()
    assert "code from the file ran" not in captured.out
    assert "refused" in captured.err and "weights_only" in captured.err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--ratios", "0"], "--ratios must lie in"),
        (["--calls", "0"], "--calls must lie in"),
        (["--compressors", "nope"], "unknown compressor"),
    ],
)
def test_bad_arguments_are_reported(gradient_file, capsys, argv, message):
    assert main(["analyze", str(gradient_file), *argv]) == 2
    assert message in capsys.readouterr().err


def test_load_gradients_accepts_a_bare_tensor_and_rejects_non_float(tmp_path):
    path = tmp_path / "t.pt"
    torch.save(torch.ones(3), path)
    assert list(load_gradients(path)) == ["tensor"]
    for entry, message in [
        (torch.arange(3), "'ids' must be a floating-point tensor, got a torch.int64 tensor"),
        (torch.ones(2, dtype=torch.bool), "'ids' must be a floating-point tensor, got a torch.bool tensor"),
        ("text", "'ids' must be a floating-point tensor, got str"),
        (torch.zeros(0), "'ids' has no elements"),
        (torch.tensor([1.0, float("inf")]), "'ids' holds NaN or Inf"),
        (torch.tensor([float("nan"), 1.0], dtype=torch.float64), "'ids' holds NaN or Inf"),
    ]:
        torch.save({"fine": torch.ones(3), "ids": entry}, path)
        with pytest.raises(TypeError, match=message):
            load_gradients(path)
    with pytest.raises(ValueError, match="does not exist"):
        load_gradients(tmp_path / "missing.pt")


@pytest.mark.parametrize("content", [{}, [torch.ones(3)]], ids=["empty dict", "list"])
def test_a_file_without_named_tensors_is_refused_by_name(tmp_path, capsys, content):
    path = tmp_path / "grads.pt"
    torch.save(content, path)
    message = f"FILE {str(path)!r} must hold a tensor or a non-empty dict name -> tensor"
    with pytest.raises(InvalidOptionError) as info:
        load_gradients(path)
    assert str(info.value) == message
    assert main(["analyze", str(path)]) == 2
    assert capsys.readouterr().err == f"gradsift analyze: error: {message}\n"


def test_estimation_series_closes_the_error_feedback_loop():
    compressor = get_compressor("topk", ratio=0.1)
    feedback = ErrorFeedback()
    gradients = [torch.ones(10)] * 3
    series = estimation_series(compressor, gradients, feedback=feedback)
    assert series["target"] == 1 and series["achieved"] == [1, 1, 1]
    # 3 calls of ones, one element sent per call: the residual holds the rest
    assert float(feedback.residuals[0].sum()) == pytest.approx(30 - 1 - 2 - 3)


def test_percentile_summary():
    assert percentile_summary([1.0, 2.0, 3.0, 4.0, 5.0]) == {"median": 3.0, "p10": 1.4, "p90": 4.6}


def test_the_table_keeps_its_columns_apart_whatever_the_numbers(tmp_path, capsys):
    """A constant tensor: the threshold methods send every tied element, 100x the target."""
    path = tmp_path / "const.pt"
    torch.save({"const": torch.ones(4000)}, path)
    assert (
        main(["analyze", str(path), "--compressors", "redsync", "topk", "--calls", "1", "--no-progress"]) == 0
    )
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if "compressor" in line)
    redsync = next(line for line in lines if line.strip().startswith("redsync"))
    assert redsync.split() == [
        "redsync",
        "0.01",
        "40",
        "4000",
        "100.000",
        "100.000",
        "100.000",
        redsync.split()[-1],
    ]
    assert len(header.split()) == 8 and len(redsync) == len(header)  # the columns line up
