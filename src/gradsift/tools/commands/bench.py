"""``gradsift bench``: microbenchmarks, one sub-subcommand each (``gradsift bench compress``, ...).

To add ``gradsift bench NAME``, write ``_add_NAME_parser(subparsers)`` (it adds its
parser and sets ``func``) and list it in :data:`BENCHMARKS`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

from gradsift.tools.commands import DEVICES, HelpFormatter, prepare_outputs, whole_number

#: What the parser shows of :mod:`gradsift.tools.benchmarking` (which needs torch), written
#: here so that building it imports no back-end; tests/tools/test_cli.py checks each against
#: the back-end: :class:`~gradsift.tools.benchmarking.CompressBenchConfig`'s defaults, the
#: ``DTYPES`` names and ``INPUT_DESCRIPTION``.
COMPRESS_DEFAULTS = SimpleNamespace(
    sizes=(250_000, 1_000_000), ratios=(0.1, 0.01, 0.001), repeats=5, warmup=3, device="cpu", dtype="fp32",
    seed=0, processes=1,
)  # fmt: skip
DTYPE_NAMES = ("fp32", "bf16", "fp16")
INPUT_DESCRIPTION = (
    "Laplace(0, 1) values times a log-normal scale exp(N(0, 1)) per block of 4096 "
    "elements (a scale mixture: layers of different magnitudes, heavier tails than Laplace), "
    "drawn in float32 and cast to the run's dtype"
)


def _add_compress_parser(subparsers: argparse._SubParsersAction) -> None:
    defaults = COMPRESS_DEFAULTS
    parser = subparsers.add_parser(
        "compress",
        help="compressor overhead vs size and ratio, beside the memory floor and torch.topk",
        description=(
            "Median compress and decompress time of each compressor for each gradient size and target "
            "density, timed side by side (interleaved rounds, after warm-up calls) with a bare "
            "torch.topk(x.abs(), k) and one read pass torch.linalg.vector_norm(x, 1) (the memory floor) "
            f"on the same tensor. Input: {INPUT_DESCRIPTION}. Columns: achieved count / target k, "
            "compress ms, decompress ms (one payload), compress time / floor, torch.topk time / compress "
            "time, the topk compressor's time / compress time, payload MB. Load averages before and after the "
            "run go into the JSON."
        ),
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--sizes", type=whole_number, nargs="+", default=list(defaults.sizes), metavar="N",
                        help="gradient lengths, e.g. 1e6 (default: %(default)s)")  # fmt: skip
    parser.add_argument("--ratios", type=float, nargs="+", default=list(defaults.ratios), metavar="R",
                        help="target densities in (0, 1] (default: %(default)s)")  # fmt: skip
    parser.add_argument("--compressors", nargs="+", metavar="NAME",
                        help="registry names (default: every compressor that compresses a flat tensor)")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=defaults.repeats,
                        help="timed rounds; the median is reported (default: %(default)s)")  # fmt: skip
    parser.add_argument("--warmup", type=int, default=defaults.warmup,
                        help="untimed calls per method first (default: %(default)s)")  # fmt: skip
    parser.add_argument("--threads", type=int, help="torch threads for the run (default: torch's setting)")
    parser.add_argument("--device", choices=DEVICES, default=defaults.device,
                        help="where the gradient lives; auto: cuda on a machine with CUDA, else cpu "
                        "(default: %(default)s)")  # fmt: skip
    parser.add_argument("--dtype", choices=DTYPE_NAMES, default=defaults.dtype,
                        help="the gradient's dtype (default: %(default)s)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=defaults.seed,
                        help="seed of the synthetic gradient (default: %(default)s)")  # fmt: skip
    parser.add_argument("--processes", type=int, default=defaults.processes, metavar="N",
                        help="contended mode: N processes (each with --threads threads) time the same thing "
                        "at the same time; rows report the median over all of them (default: %(default)s)")  # fmt: skip
    parser.add_argument(
        "--json", type=Path, metavar="PATH", help="also write the results as JSON to PATH (default: none)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(func=_run_compress)


def _run_compress(args: argparse.Namespace) -> int:
    from dataclasses import fields

    from gradsift.tools.benchmarking import CompressBenchConfig, format_table, run_compress_benchmark
    from gradsift.tools.train.devices import resolve_device

    # The parser's destinations are the config's field names, so the config takes them by name.
    settings = {field.name: getattr(args, field.name) for field in fields(CompressBenchConfig)}
    settings["device"] = resolve_device(args.device, 1)  # "auto" made "cpu" or "cuda"
    config = CompressBenchConfig(**settings)
    prepare_outputs({}, {"--json": args.json})
    result = run_compress_benchmark(config, progress=not args.no_progress)
    print(format_table(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


#: ``gradsift bench`` sub-subcommands: name -> function adding its parser.
BENCHMARKS = {"compress": _add_compress_parser}


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="microbenchmarks (compressor overhead, ...)",
        description="Microbenchmarks.",
        formatter_class=HelpFormatter,
    )
    benchmarks = parser.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)
    for add in BENCHMARKS.values():
        add(benchmarks)
