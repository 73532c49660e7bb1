"""`gradsift train` checks every argument, compressor and hook options included, before
any worker starts: a bad one is one line on stderr and exit status 2."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import gradsift.tools.train.launcher
from gradsift.compressors.registry import available_compressors
from gradsift.hook.options import HOOK_OPTIONS
from gradsift.tools.cli import main as cli_main
from gradsift.tools.train.config import TrainConfig
from support.train import TINY


@pytest.fixture
def no_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if the launcher is reached: validation must come first."""

    def supervise(*args, **kwargs):
        raise AssertionError("a worker was started")

    monkeypatch.setattr(gradsift.tools.train.launcher, "supervise", supervise)


def rejected(tmp_path: Path, capsys: pytest.CaptureFixture[str], *arguments: str) -> str:
    """Run ``gradsift train`` with ``arguments``; assert exit 2 and one stderr line; return it."""
    code = cli_main(["train", *TINY, "--out", str(tmp_path / "run"), *arguments])
    err = capsys.readouterr().err
    assert code == 2, err
    assert len(err.splitlines()) == 1, err
    assert not (tmp_path / "run").exists()
    return err.strip()


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        # the example: `none` takes no ratio
        (
            ["--compressor", "none", "--ratio", "0.01"],
            r"unknown option\(s\) ratio: .*compressor 'none' takes none$",
        ),
        (
            ["--compressor", "topk", "--option", "bogus=1"],
            r"unknown option\(s\) bogus: .*'topk' takes ratio$",
        ),
        (
            ["--compressor", "topk", "--option", "warmup_step=3"],
            r"unknown option\(s\) warmup_step \(did you mean warmup_steps\?\): the hook's options are optimizer, ",
        ),
        (["--compressor", "fp16", "--ratio", "0.01"], r"unknown option\(s\) ratio: .*'fp16' takes none$"),
        (["--compressor", "sidco-exp", "--ratio", "2"], r"ratio must lie in \(0.0, 1.0\], got 2.0"),
        (["--compressor", "vgc", "--option", "alpha=-1"], "alpha must"),
        (["--compressor", "topk", "--option", "granularity=row"], "granularity must be one of bucket, layer"),
        (["--compressor", "topk", "--option", "min_numel=-1"], "min_numel must"),
        (["--compressor", "topk", "--option", "value_dtype=int8"], "value_dtype must be one of"),
        (["--compressor", "topk", "--option", "momentum=1.5"], "momentum must"),
        (["--compressor", "topk", "--option", "process_group=1"], "process_group cannot be set"),
        (["--compressor", "topk", "--ratio", "0.01", "--option", "ratio=0.1"], "option ratio is given twice"),
        (["--compressor", "zip"], "compressor must be one of"),
        (
            ["--compressor", "sidco"],
            r"compressor must be one of .*; got 'sidco' \(did you mean 'sidco-exp'\?\)$",
        ),
        (["--workers", "0"], r"workers must lie in \[1, 256\], got 0"),
        (["--lr", "0"], "lr must lie in"),
        (["--momentum", "1"], "momentum must lie in"),
        (["--batch-size", "0"], "batch_size must"),
        (["--eval-every", "-1"], "eval_every must"),
        (["--decay-steps", "0"], "decay_steps must"),
        (["--decay-factor", "0"], "decay_factor must"),
        (
            ["--lr-schedule", "cosine", "--decay-steps", "5"],
            r"decay_steps are the step schedule's .* takes none",
        ),
        (["--target-accuracy", "85"], "target_accuracy must lie in"),
        (["--timeout", "0.5"], "timeout_s must"),
        (
            ["--timeout", "1e30"],
            r"timeout_s must lie in \[1.0, 604800.0\]",
        ),  # was an OverflowError in the workers
        (["--epochs", "0"], r"--epochs must lie in \(0.0, inf\), got 0.0"),
        (["--epochs", "nan"], "--epochs must be a number, got NaN"),  # was a ValueError's traceback
        (["--epochs", "inf"], "--epochs must be finite"),
        (["--lr-warmup-steps", "-1"], r"lr_warmup_steps must lie in \[0, inf\), got -1"),
        (
            ["--dense-warmup-steps", "-1"],
            r"warmup_steps must lie in \[0, inf\), got -1",
        ),  # auto: was in the workers
        (["--option", "nonfinite=never"], "nonfinite must be one of"),
        (["--latency", "1ms"], "--latency needs --bandwidth"),
        (["--bandwidth", "fast"], "fast"),
        (["--launcher", "torchrun"], "launcher torchrun .* needs a bandwidth"),
        (  # AdamW taken over by a named method: its dense warm-up needs steps (was raised in the workers)
            ["--compressor", "topk", "--optimizer", "adamw", "--dense-warmup-steps", "0"],
            r"warmup_steps=0 with adam='frozen-variance'",
        ),
        (["--nodes", "2"], "nodes needs launcher torchrun"),
        (  # VGC's test reads backward's variance of each gradient, not a round's pseudo-gradient's
            ["--compressor", "vgc", "--sync-every", "2"],
            r"compressor 'vgc' tests each value against the variance .* DiLoCo's pseudo-gradient",
        ),
        (
            ["--compressor", "sidco-exp", "--clip-grad-norm", "1"],
            r"--clip-grad-norm clips after the exchange.*--option clip_norm=1 .*or --no-recipe",
        ),
    ],
)
def test_bad_argument_is_one_line_before_any_worker(tmp_path, capsys, no_workers, arguments, message):
    line = rejected(tmp_path, capsys, *arguments)
    assert line.startswith("gradsift train: error: ")
    assert re.search(message, line), line


def test_the_dataset_and_output_paths_are_checked_first(tmp_path, capsys, no_workers):
    tiny = [arg for arg in TINY if arg != "--synthetic"]
    code = cli_main(["train", *tiny, "--data-dir", str(tmp_path / "nowhere"), "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and "does not hold the Fashion-MNIST files" in err and len(err.splitlines()) == 1
    (tmp_path / "no-text").mkdir()
    code = cli_main(
        [
            "train",
            *tiny,
            "--model",
            "gpt",
            "--data-dir",
            str(tmp_path / "no-text"),
            "--out",
            str(tmp_path / "run"),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and "holds 0 *.py files" in err and len(err.splitlines()) == 1
    (tmp_path / "file").write_text("")
    assert "--out" in rejected(tmp_path, capsys, "--out", str(tmp_path / "file"))
    line = rejected(tmp_path, capsys, "--json", str(tmp_path / "file" / "s.json"))
    assert "--json" in line and "is not a directory" in line


def test_more_workers_than_gpus_is_rejected(tmp_path, capsys, no_workers, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    line = rejected(tmp_path, capsys, "--workers", "2")
    assert "--workers 2 needs 2 GPUs" in line and "has 1" in line and "--device cpu" in line
    line = rejected(tmp_path, capsys, "--workers", "2", "--device", "cuda")
    assert "--workers 2 needs 2 GPUs" in line
    with pytest.raises(AssertionError, match="a worker was started"):  # every check passed
        cli_main(["train", *TINY, "--out", str(tmp_path / "run"), "--device", "cpu"])
    assert TrainConfig.load(tmp_path / "run" / "config.json").device == "cpu"


def test_bandwidth_under_torchrun_is_rejected_before_the_rank_starts(tmp_path, capsys, monkeypatch):
    import gradsift.tools.commands.train

    def rank(config):
        raise AssertionError("a torchrun rank was started")

    monkeypatch.setattr(gradsift.tools.commands.train, "_run_as_torchrun_rank", rank)
    for name, value in {
        "RANK": "0",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "1",
    }.items():
        monkeypatch.setenv(name, value)
    line = rejected(tmp_path, capsys, "--bandwidth", "100mbit")
    assert line == (
        "gradsift train: error: --bandwidth emulates links between local ranks; it cannot be used under torchrun"
    )


REQUIRED = {"threshold": {"threshold": 0.001}}  # compressors with an option that has no default


@pytest.mark.parametrize("compressor", available_compressors())
def test_every_compressor_with_default_options_is_valid(tmp_path, compressor):
    options = REQUIRED.get(compressor, {})
    assert TrainConfig(out=str(tmp_path), compressor=compressor, options=options).options == options


def test_a_required_option_that_is_missing_is_named(tmp_path, capsys, no_workers):
    line = rejected(tmp_path, capsys, "--compressor", "threshold")
    assert "compressor 'threshold' needs option(s) threshold" in line


def test_hook_and_compressor_options_together_are_valid(tmp_path):
    options = {"ratio": 0.01, "granularity": "layer", "min_numel": 10, "warmup_steps": 2, "nonfinite": "skip"}
    assert TrainConfig(out=str(tmp_path), compressor="topk", options=options).options == options
    assert set(options) - {"ratio"} <= set(HOOK_OPTIONS)
