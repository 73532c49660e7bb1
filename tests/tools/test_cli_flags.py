"""The command line as PyTorch users expect: every default in ``--help``, one meaning per
flag name, ``--json PATH`` on every command that writes results, the same ``--device``
choices everywhere, progress on long work."""

import argparse
import dataclasses
import re
from pathlib import Path

import pytest
import torch

from gradsift.core.errors import InvalidOptionError
from gradsift.tools.cli import build_parser
from gradsift.tools.cli import main as cli_main
from gradsift.tools.commands.train import config_from_args, exchange_options, format_summary
from gradsift.tools.train.config import TrainConfig
from gradsift.tools.train.demo import LENGTHS
from gradsift.tools.train.devices import DEVICES
from support.cli import subparser

#: Every command with options (``bench`` has only its sub-commands); each writes results.
COMMANDS = [("train",), ("demo",), ("report",), ("analyze",), ("bench", "compress")]


def help_blocks(path: tuple[str, ...]) -> dict[str, str]:
    """``gradsift PATH... --help`` cut into one block per option, by its first flag."""
    text = subparser(*path).format_help()
    blocks = re.split(r"\n(?=  -)|\n(?=\S)", text)
    return {
        block.split()[0].rstrip(","): " ".join(block.split()) for block in blocks if block.startswith("  -")
    }


def options_of(path: tuple[str, ...]) -> list[argparse.Action]:
    """The options ``--help`` lists (the parser's own record, not the help text)."""
    return [
        a
        for a in subparser(*path)._actions
        if a.option_strings and a.help is not argparse.SUPPRESS and not isinstance(a, argparse._HelpAction)
    ]


@pytest.mark.parametrize("path", COMMANDS, ids=" ".join)
def test_help_states_every_default(path):
    blocks = help_blocks(path)
    options = options_of(path)
    assert options, path
    for action in options:
        block = blocks[action.option_strings[0]]
        assert "default" in block, block


def test_help_shows_the_back_ends_defaults():
    train, fields = help_blocks(("train",)), {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    assert f"(default: {fields['timeout_s']})" in train["--timeout"]
    assert f"(default: {fields['eval_every']})" in train["--eval-every"]
    assert f"(default: {fields['warmup_steps']})" in train["--lr-warmup-steps"]
    assert "auto (default:" in train["--compressor"] and fields["compressor"] == "auto"
    demo = help_blocks(("demo",))
    assert f"{LENGTHS[True][0]} steps per method instead of {LENGTHS[False][0]}" in demo["--quick"]
    assert "(default: 100mbit)" in demo["--bandwidth"]


def parsed_train(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["train", *argv])


def test_warmup_steps_is_a_deprecated_alias_of_lr_warmup_steps(capsys, tmp_path):
    assert parsed_train("--lr-warmup-steps", "5").lr_warmup_steps == 5
    assert capsys.readouterr().err == ""
    args = parsed_train("--warmup-steps", "7", "--synthetic", "--model", "mlp", "--compressor", "topk")
    warning = capsys.readouterr().err
    assert "--warmup-steps is deprecated" in warning
    assert "--lr-warmup-steps" in warning and "--dense-warmup-steps" in warning
    config = config_from_args(args, str(tmp_path / "run"), workers=2)
    assert config.warmup_steps == 7  # the learning-rate warm-up, not the hook's dense steps
    assert "warmup_steps" not in config.options
    assert "--warmup-steps" not in subparser("train").format_help()  # hidden: the two new names are shown


def test_dense_warmup_steps_is_the_hooks_warmup_steps():
    assert exchange_options(parsed_train("--dense-warmup-steps", "3"))["warmup_steps"] == 3
    assert "warmup_steps" not in exchange_options(parsed_train("--lr-warmup-steps", "3"))
    with pytest.raises(InvalidOptionError, match="warmup_steps is given twice"):
        exchange_options(parsed_train("--dense-warmup-steps", "3", "--option", "warmup_steps=2"))


@pytest.mark.parametrize("path", COMMANDS, ids=" ".join)
def test_every_result_writing_command_takes_json_path(path):
    (action,) = [a for a in subparser(*path)._actions if "--json" in a.option_strings]
    assert action.metavar == "PATH" and action.type is Path


def test_device_choices_are_the_same_everywhere():
    for path in (("train",), ("bench", "compress")):
        (action,) = [a for a in subparser(*path)._actions if a.dest == "device"]
        assert tuple(action.choices) == DEVICES, path


def test_analyze_shows_progress_over_the_tensors(tmp_path, capsys):
    file = tmp_path / "grads.pt"
    torch.save({"a": torch.randn(2000), "b": torch.randn(3000)}, file)
    argv = ["analyze", str(file), "--compressors", "topk", "--calls", "1"]
    assert cli_main([*argv, "--json", str(tmp_path / "out.json")]) == 0
    assert "2/2" in capsys.readouterr().err
    assert (tmp_path / "out.json").is_file()
    assert cli_main([*argv, "--no-progress"]) == 0
    assert "2/2" not in capsys.readouterr().err


def _summary(sent: float, padded: float) -> dict:
    return {"final_test_accuracy": 0.8, "time_to_accuracy_s": None, "compressor": "vgc", "workers": 2,
            "model": "mlp", "steps": 10, "step_time_median_s": 0.01, "bytes_sent_per_step": sent,
            "bytes_padded_per_step": padded, "dense_bytes_per_step": 1e6, "compression_factor": 1e6 / sent,
            "achieved_density": 0.01, "wall_time_s": 1.0, "target_accuracy": None}  # fmt: skip


def test_the_summary_names_the_bytes_padded_to_capacity_when_they_exceed_those_sent():
    padded = format_summary(_summary(sent=10_000, padded=14_300), "runs/x")
    # the wire carries the whole capacity: 1e6 dense bytes over 14,300 on the wire
    assert (
        "0.010 MB sent per step per worker (100.0x less than fp32), 0.014 MB with the padding to "
        "capacity (69.9x less)" in padded
    )
    exact = format_summary(_summary(sent=10_000, padded=10_000), "runs/x")
    assert "padding" not in exact and "(100.0x less than fp32), density" in exact


def test_the_summary_names_the_bytes_received_too():
    """An allgather's worker receives every other worker's message: the line says both."""
    line = format_summary(
        {**_summary(sent=10_000, padded=10_000), "bytes_received_per_step": 30_000}, "runs/x"
    )
    assert "0.010 MB sent per step per worker (100.0x less than fp32), 0.030 MB received, density" in line


def test_the_summary_of_one_worker_alone_says_nothing_was_sent():
    # the telemetry counts the dense message a lone worker would send; the line must not report it as sent
    alone = format_summary({**_summary(sent=1e6, padded=1e6), "workers": 1, "compressor": "none"}, "runs/x")
    assert "none on 1 worker (mlp, 10 steps): test accuracy 0.8000" in alone
    assert (
        "nothing sent (one worker alone)" in alone
        and "MB sent" not in alone
        and "less than fp32" not in alone
    )


def test_the_summary_without_evaluation_keeps_its_headline():
    quiet = format_summary({**_summary(sent=10_000, padded=10_000), "final_test_accuracy": None}, "runs/x")
    assert quiet.splitlines()[0] == "vgc on 2 workers (mlp, 10 steps): no evaluation"


def test_the_summary_names_autos_choice_and_its_re_measures():
    auto = {"choice": "bf16", "predicted_ms": {"none": 300.0, "bf16": 200.0}, "remeasures": 0}
    summary = {**_summary(sent=10_000, padded=10_000), "recipe": {"auto": auto}}
    assert format_summary(summary, "runs/x").startswith(
        "auto -> bf16 (predicted ms per step: none 300.0, bf16 200.0) on 2 workers"
    )
    summary["recipe"]["auto"] = {**auto, "remeasures": 2}
    assert "bf16 200.0, measured again 2 times) on" in format_summary(summary, "runs/x")


def test_the_summary_says_auto_was_still_measuring_or_chose_without_a_prediction():
    base = {**_summary(sent=10_000, padded=10_000)}
    measuring = {"choice": "measuring", "running": "sidco-exp", "predicted_ms": {}, "remeasures": 0}
    line = format_summary({**base, "recipe": {"auto": measuring}}, "runs/x").splitlines()[0]
    assert line.startswith("auto -> still measuring when the run ended (on sidco-exp) on 2 workers")
    fell_back = {"choice": "none", "running": "none", "predicted_ms": {}, "remeasures": 0}
    line = format_summary({**base, "recipe": {"auto": fell_back}}, "runs/x").splitlines()[0]
    assert line.startswith("auto -> none on 2 workers") and "predicted" not in line
    fell_back["left"] = {"sidco-exp": "the gradients SGD steps ... clipping after backward (clip_grad_norm_)"}
    line = format_summary({**base, "recipe": {"auto": fell_back}}, "runs/x").splitlines()[0]
    assert line.startswith("auto -> none, having left sidco-exp (why: summary.json, recipe.auto.left) on 2")


def test_the_summary_of_diloco_names_its_round_and_compressor():
    diloco = {"enabled": False, "optimizer": "SGD", "diloco": {"sync_every": 4, "compressor": "blockquant"}}
    summary = {**_summary(sent=10_000, padded=10_000), "compressor": "auto", "recipe": diloco}
    assert format_summary(summary, "runs/x").startswith("DiLoCo every 4 steps, blockquant on 2 workers")


#: Per command: its arguments with ``{out}`` / ``{json}`` for the outputs, the flag of its output
#: directory (None: it has none) and the function that starts its work.
OUTPUTS = {
    "train": (["train", "--synthetic", "--model", "mlp", "--steps", "1", "--workers", "1",
               "--out", "{out}", "--json", "{json}"], "--out", "gradsift.tools.train.launcher.run_training"),
    "demo": (["demo", "--quick", "--out", "{out}", "--json", "{json}"], "--out",
             "gradsift.tools.train.demo.run_demo"),
    "report": (["report", "{runs}", "--out", "{out}", "--json", "{json}"], "--out", "gradsift.tools.report.find_runs"),
    "analyze": (["analyze", "{runs}/g.pt", "--compressors", "topk", "--plot", "{out}", "--json", "{json}"],
                "--plot", "gradsift.tools.analysis.load_gradients"),
    "bench compress": (["bench", "compress", "--sizes", "1000", "--json", "{json}"], None,
                       "gradsift.tools.benchmarking.run_compress_benchmark"),
}  # fmt: skip


@pytest.mark.parametrize(
    ("command", "wrong"),
    [
        (command, wrong)
        for command, (_, out_flag, _) in OUTPUTS.items()
        for wrong in ["json under a file", "json is a directory", "out is a file"]
        if out_flag is not None or wrong != "out is a file"
    ],
)
def test_an_output_that_cannot_be_written_is_refused_before_any_work(
    command, wrong, tmp_path, capsys, monkeypatch
):
    argv, out_flag, work = OUTPUTS[command]

    def started(*args, **kwargs):
        raise AssertionError(f"{command} started its work")

    module, name = work.rsplit(".", 1)
    monkeypatch.setattr(f"{module}.{name}", started)
    (tmp_path / "runs").mkdir()
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    paths = {"out": tmp_path / "out", "json": tmp_path / "results" / "r.json", "runs": tmp_path / "runs"}
    if wrong == "json under a file":
        paths["json"], flag = blocker / "r.json", "--json"
    elif wrong == "json is a directory":
        paths["json"], flag = tmp_path / "runs", "--json"
    else:
        paths["out"], flag = blocker, out_flag
    code = cli_main([a.format(**{k: str(v) for k, v in paths.items()}) for a in argv])
    err = capsys.readouterr().err
    assert code == 2 and len(err.splitlines()) == 1 and f"error: {flag}" in err, err
    assert not (tmp_path / "out").exists() and not (tmp_path / "results").exists()


@pytest.mark.parametrize("command", OUTPUTS)
def test_outputs_are_made_with_their_folders_before_the_work(command, tmp_path, monkeypatch):
    argv, out_flag, work = OUTPUTS[command]
    made = {}

    def started(*args, **kwargs):
        made["folders"] = (tmp_path / "out").is_dir(), (tmp_path / "results" / "new").is_dir()
        raise InvalidOptionError("stop here")

    module, name = work.rsplit(".", 1)
    monkeypatch.setattr(f"{module}.{name}", started)
    (tmp_path / "runs").mkdir()
    paths = {
        "out": tmp_path / "out",
        "json": tmp_path / "results" / "new" / "r.json",
        "runs": tmp_path / "runs",
    }
    assert cli_main([a.format(**{k: str(v) for k, v in paths.items()}) for a in argv]) == 2
    assert made["folders"] == (out_flag is not None, True)
