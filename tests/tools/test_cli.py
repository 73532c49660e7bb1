"""The ``gradsift`` command reads its arguments before it imports a back-end.

``gradsift --version``, ``--help`` and every ``SUBCOMMAND --help`` must not load torch,
SciPy or matplotlib (each ``gradsift`` process the suite and the docs start paid ~2-5
CPU-s for them: docs/decisions.md, "The command line imports a subcommand's back-end
only when it runs"). So the parsers show names and defaults written in the command
modules; these tests check each against the back-end it stands for, and that a fresh
interpreter building the parsers imports none of the heavy packages.
"""

import dataclasses
import json
import subprocess
import sys

import pytest

from gradsift.exchanges import available_exchanges
from gradsift.tools import analysis, benchmarking
from gradsift.tools.cli import build_parser, main
from gradsift.tools.commands import analyze as analyze_command
from gradsift.tools.commands import bench as bench_command
from gradsift.tools.train.config import LR_SCHEDULES, OPTIMIZERS
from gradsift.tools.train.devices import DEVICES
from gradsift.tools.train.models import MODELS
from support.cli import subparser

HEAVY = ("torch", "scipy", "matplotlib", "numpy")

ARGVS = ["--version", "--help", "analyze --help", "bench --help", "bench compress --help", "train --help",
         "demo --help", "report --help"]  # fmt: skip

# Runs each of sys.argv[2]'s command lines through gradsift.tools.cli.main in one fresh
# interpreter and prints, as JSON, which of sys.argv[1]'s packages are loaded after
# each. The last entry is the check's positive control: a public name that needs torch.
PROBE = """
import json, sys
heavy, argvs = set(json.loads(sys.argv[1])), json.loads(sys.argv[2])
def loaded():
    return sorted({name.split(".")[0] for name in sys.modules} & heavy)
import gradsift
report = {"import gradsift": loaded()}
from gradsift.tools.cli import main
for argv in argvs:
    try:
        main(argv.split())
    except SystemExit:
        pass
    report[argv] = loaded()
gradsift.get_compressor
report["gradsift.get_compressor"] = loaded()
print(json.dumps(report))
"""


def choices(path: tuple[str, ...], dest: str) -> tuple:
    """The choices ``gradsift PATH... --help`` offers for the flag stored in ``dest``."""
    action = next(a for a in subparser(*path)._actions if a.dest == dest)
    return tuple(action.choices)


def test_train_choices_are_the_back_ends():
    assert choices(("train",), "model") == tuple(sorted(MODELS))
    assert choices(("train",), "exchange") == ("auto", *available_exchanges())
    assert choices(("train",), "lr_schedule") == LR_SCHEDULES
    assert choices(("train",), "optimizer") == OPTIMIZERS
    assert choices(("train",), "optimizer") == OPTIMIZERS
    assert choices(("train",), "device") == DEVICES


def test_bench_compress_defaults_are_the_configs():
    args = build_parser().parse_args(["bench", "compress"])
    config = dataclasses.asdict(benchmarking.CompressBenchConfig())
    assert {name: getattr(args, name) for name in config} == config
    assert choices(("bench", "compress"), "dtype") == tuple(benchmarking.DTYPES)
    assert bench_command.INPUT_DESCRIPTION == benchmarking.INPUT_DESCRIPTION
    assert benchmarking.INPUT_DESCRIPTION in " ".join(subparser("bench", "compress").description.split())


def test_analyze_default_compressors_are_the_back_ends():
    assert analyze_command.DEFAULT_COMPRESSORS == analysis.DEFAULT_COMPRESSORS
    assert " ".join(analysis.DEFAULT_COMPRESSORS) in " ".join(subparser("analyze").format_help().split())


@pytest.mark.slow
def test_parsing_arguments_loads_no_back_end():
    done = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(HEAVY), json.dumps(ARGVS)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    assert "torch" in report.pop("gradsift.get_compressor"), "the probe cannot see an import"
    heavy = {argv: packages for argv, packages in report.items() if packages}
    assert not heavy, f"heavy packages loaded: {heavy}"
    assert set(report) == {"import gradsift", *ARGVS}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ("train --compresor topk", "gradsift train: error: unrecognized arguments: --compresor topk (did you mean --compressor?)"),
        ("train --ratoi=0.1", "gradsift train: error: unrecognized arguments: --ratoi=0.1 (did you mean --ratio?)"),
        ("bench compress --sizs 5", "gradsift bench compress: error: unrecognized arguments: --sizs 5 (did you mean --sizes?)"),
        ("report runs --bogus", "gradsift report: error: unrecognized arguments: --bogus"),
        ("train extra", "gradsift train: error: unrecognized arguments: extra"),
    ],
)  # fmt: skip
def test_an_unknown_argument_is_named_by_its_command_with_the_closest_option(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv.split())
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1] == message
    # the command's usage, not the top level's
    assert lines[0].startswith(f"usage: gradsift {argv.split()[0]}")


def test_bench_sizes_take_whole_numbers_written_as_floats(capsys):
    parse = build_parser().parse_args
    assert parse(["bench", "compress", "--sizes", "1e6", "2.5e5", "4096"]).sizes == [1_000_000, 250_000, 4096]
    for text, message in [("1.5", "'1.5' is not a whole number"), ("ten", "invalid whole number: 'ten'")]:
        with pytest.raises(SystemExit):
            parse(["bench", "compress", "--sizes", text])
        assert message in capsys.readouterr().err
