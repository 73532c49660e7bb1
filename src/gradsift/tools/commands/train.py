"""``gradsift train``: one distributed training run, launched here or under torchrun."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gradsift.core.errors import InvalidOptionError
from gradsift.exchanges import AUTO, available_exchanges
from gradsift.tools.commands import DEVICES, ExamplesHelpFormatter, prepare_outputs

if TYPE_CHECKING:
    from gradsift.tools.train.config import TrainConfig

# The choices the parser offers, written here because their back-ends load torch
# (tests/tools/test_cli.py checks each equals its source): sorted(gradsift.tools.train.models.MODELS),
# gradsift.tools.train.config.LR_SCHEDULES and OPTIMIZERS,
# and gradsift.tools.train.devices.DEVICES (gradsift.tools.commands.DEVICES, shared with bench). TrainConfig
# checks the values again.
MODEL_NAMES = ("gpt", "lstm", "mlp", "mlp-wide", "resnet20", "vgg")
LR_SCHEDULES = ("step", "cosine")
OPTIMIZERS = ("sgd", "adamw", "demo", "lion")

HELP = "one distributed training run (model, compressor, workers, bandwidth, steps)"
DESCRIPTION = (
    "Train on Fashion-MNIST with data-parallel workers exchanging compressed gradients. "
    "Starts --workers processes on this machine (NCCL, one GPU each, with CUDA; gloo on the CPU "
    "without it or with --device cpu), or runs as one rank when started by torchrun. "
    "Writes config.json, steps.jsonl, evals.jsonl and summary.json to --out."
)
EPILOG = """\
examples:
  gradsift train --model vgg --compressor sidco-exp --ratio 0.01 --workers 4 --steps 500
  gradsift train --compressor topk --ratio 0.01 --bandwidth 100mbit --target-accuracy 0.85
  gradsift train --compressor vgc --option alpha=1.0 --option zeta=0.999 --steps 200

multi-machine (the same command on every node; the trainer detects torchrun's env):
  torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST:29400 \\
      -m gradsift train --model vgg --compressor sidco-exp --ratio 0.01 --steps 1000
"""


def parse_option(text: str) -> tuple[str, Any]:
    """``key=value`` -> ``(key, value)``, the value read as JSON when it parses (1, 0.5,
    true, null, [1,2]) and as a string otherwise."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"--option expects key=value, got {text!r}")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    return key.strip(), value


def _int_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"expected comma-separated step numbers, got {text!r}") from error


class DeprecatedWarmupSteps(argparse.Action):
    """``--warmup-steps``: the old name of ``--lr-warmup-steps``, kept working with a warning
    on stderr (in the library ``warmup_steps`` is the DDP hook's dense steps)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        print(
            f"gradsift train: warning: {option_string} is deprecated and will be removed: it is "
            "--lr-warmup-steps (learning-rate warm-up); the hook's dense steps are --dense-warmup-steps",
            file=sys.stderr,
        )
        setattr(namespace, self.dest, values)


def add_training_arguments(parser: argparse.ArgumentParser) -> None:
    """The run and network-emulation flags of ``gradsift train``."""
    run = parser.add_argument_group("run")
    run.add_argument("--model", choices=MODEL_NAMES, default="vgg", help="network to train (default: vgg)")
    run.add_argument("--compressor", default="auto",
                     help="auto (default: the hook measures the link and picks none, bf16 or the optimizer's "
                     "compressed method, as register_comm_hook does), or a registry name, e.g. none (fp32 DDP, "
                     "the baseline), bf16, topk, sidco-exp, vgc")  # fmt: skip
    run.add_argument("--ratio", type=float,
                     help="target density delta, passed as the compressor's ratio option (default: the "
                     "compressor's own, e.g. 0.01 for the sparsifiers)")  # fmt: skip
    run.add_argument("--exchange", choices=(AUTO, *available_exchanges()),
                     help="how buckets travel: auto (the compressor's default) or an exchange it supports "
                     "(default: auto)")  # fmt: skip
    run.add_argument("--option", action="append", type=parse_option, default=[], metavar="KEY=VALUE",
                     help="another compressor/hook option (repeatable; value parsed as JSON when possible; "
                     "default: none)")  # fmt: skip
    run.add_argument("--workers", type=int, default=2, help="ranks to start on this machine")
    run.add_argument("--batch-size", type=int, default=32, help="samples per worker per step")
    run.add_argument("--optimizer", choices=OPTIMIZERS,
                     help="sgd (with --momentum), adamw (with --betas), demo (gradsift.DeMo: no DDP, DCT top-k "
                     "of the local momentum exchanged, sign steps; --compressor none; its beta, chunk, topk, "
                     "value_dtype, nonfinite by --option), or lion (gradsift.DistributedLion: no DDP, each worker's "
                     "Lion sign update sent in 1 bit per element; --compressor none; --betas are Lion's; "
                     "--option aggregate=vote (majority, the default) or aggregate=average); default: adamw for "
                     "--model gpt, sgd for the image models")  # fmt: skip
    run.add_argument("--lr", type=float,
                     help="peak learning rate (default: 0.05 for sgd, 0.003 for adamw, 0.001 for demo, 0.0003 "
                     "for lion)")  # fmt: skip
    run.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    run.add_argument("--betas", type=float, nargs=2, default=[0.9, 0.99], metavar=("BETA1", "BETA2"),
                     help="AdamW's betas, or Lion's with --optimizer lion")  # fmt: skip
    run.add_argument("--weight-decay", type=float,
                     help="weight decay (default: 0 for sgd and demo; 0.1 for adamw; 1.0 for lion; decoupled for "
                     "adamw, demo and lion)")  # fmt: skip
    run.add_argument("--clip-grad-norm", type=float, default=0.0, metavar="C",
                     help="clip the gradients' total norm to C before each optimizer step, as GPT recipes do "
                     "(torch.nn.utils.clip_grad_norm_; with the AdamW recipe it clips the first moment the hook "
                     "hands the optimizer; with the SGD recipe and a named method use --option clip_norm=C); "
                     "default 0: no clipping")  # fmt: skip
    run.add_argument("--sync-every", type=int, default=0, metavar="H",
                     help="DiLoCo (no DDP): each worker takes H steps on its own, then one outer step on the "
                     "compressed pseudo-gradient (gradsift.diloco's outer defaults: outer lr 1, no outer momentum, "
                     "residual decay 0.95 with error feedback; DiLoCo's outer step: --option outer_lr=0.7 --option "
                     "outer_momentum=0.9; also nesterov, buffers); default 0: DDP with gradsift's hook every step")  # fmt: skip
    run.add_argument("--no-recipe", dest="recipe", action="store_false",
                     help="without the recipe: the optimizer keeps its momentum on top of error feedback, no "
                     "density warm-up (default for error-feedback compressors but powersgd, which leaves the "
                     "optimizer its moments: SGD's momentum corrected in the hook with masking, AdamW's first "
                     "moment in the hook with its second frozen after a dense warm-up of 10%% of the steps, and a "
                     "density warm-up over the first 2.5%% of the steps)")  # fmt: skip
    run.add_argument("--lr-warmup-steps", type=int, default=0, metavar="N",
                     help="linear learning-rate warm-up over the first N steps")  # fmt: skip
    run.add_argument("--warmup-steps", dest="lr_warmup_steps", type=int, default=argparse.SUPPRESS,
                     action=DeprecatedWarmupSteps, help=argparse.SUPPRESS)  # fmt: skip
    run.add_argument("--dense-warmup-steps", type=int, metavar="N",
                     help="the DDP hook's first N steps dense (the hook option warmup_steps; default: the "
                     "recipe's, 10%% of the steps for AdamW with an error-feedback compressor, else 0)")  # fmt: skip
    run.add_argument("--lr-schedule", choices=LR_SCHEDULES, default="step",
                     help="after the warm-up: step (multiply by --decay-factor at --decay-steps; default) "
                     "or cosine (from --lr down to 0 at the last step)")  # fmt: skip
    run.add_argument("--decay-steps", type=_int_list, default=[], metavar="S1,S2",
                     help="steps where the learning rate is multiplied by --decay-factor")  # fmt: skip
    run.add_argument("--decay-factor", type=float, default=0.1, help="step decay factor")
    length = run.add_mutually_exclusive_group()
    length.add_argument("--steps", type=int, help="optimizer steps (default: 100)")
    length.add_argument("--epochs", type=float,
                        help="passes over the training set instead of --steps (default: none)")  # fmt: skip
    run.add_argument(
        "--eval-every", type=int, default=0, help="test accuracy every N steps (0: at the end only)"
    )
    run.add_argument("--target-accuracy", type=float,
                     help="report time_to_accuracy_s for this test accuracy (0-1; default: none)")  # fmt: skip
    run.add_argument("--target-loss", type=float,
                     help="report time_to_loss_s for this evaluation loss (the language model's target; "
                     "default: none)")  # fmt: skip
    run.add_argument("--seed", type=int, default=0, help="seed of weights and data order")
    run.add_argument("--data-dir", help="Fashion-MNIST IDX files (default: search path); for --model gpt, "
                     "a directory of *.py files (default: this Python's standard library)")  # fmt: skip
    run.add_argument("--synthetic", action="store_true", help="tiny generated data instead of Fashion-MNIST")
    run.add_argument("--device", choices=DEVICES, default="auto",
                     help="auto (default): one GPU per worker with NCCL on a machine with CUDA (too few GPUs "
                     "is an error), the CPU with gloo on one without; cuda: insist on GPUs; cpu: the CPU with "
                     "gloo even where CUDA is present")  # fmt: skip
    run.add_argument("--timeout", type=float, default=300.0,
                     help="process-group timeout in seconds, at most a week: a vanished peer ends the run after it")  # fmt: skip
    net = parser.add_argument_group("network emulation (root + iproute2)")
    net.add_argument("--bandwidth",
                     help="emulate links of this rate per worker, e.g. 100mbit, 1gbit (default: none, the "
                     "host's own network)")  # fmt: skip
    net.add_argument("--latency",
                     help="one-way delay added per message with --bandwidth, e.g. 1ms (needs sch_netem; "
                     "default: none)")  # fmt: skip
    net.add_argument("--launcher", choices=("local", "torchrun"), default="local",
                     help="local: one process per rank (default); torchrun: one torchrun agent per emulated "
                     "host, c10d rendezvous on host 0 (needs --bandwidth)")  # fmt: skip
    net.add_argument("--nodes", type=int, help="emulated hosts for --launcher torchrun (default: one per worker; "
                     "--workers must be a multiple)")  # fmt: skip


def exchange_options(args: argparse.Namespace) -> dict[str, Any]:
    """The compressor/hook options: every ``--option``, ``--ratio`` as ``ratio``,
    ``--exchange`` as ``exchange`` and ``--dense-warmup-steps`` as ``warmup_steps``; each key once."""
    options: dict[str, Any] = {}
    given = [
        *args.option,
        *([("ratio", args.ratio)] if args.ratio is not None else []),
        *([("exchange", args.exchange)] if args.exchange is not None else []),
        *([("warmup_steps", args.dense_warmup_steps)] if args.dense_warmup_steps is not None else []),
    ]
    for key, value in given:
        if key in options:
            raise InvalidOptionError(
                f"option {key} is given twice (--ratio sets ratio, --exchange exchange, --dense-warmup-steps "
                f"warmup_steps; --option {key}=...)"
            )
        options[key] = value
    return options


def check_devices(workers: int, device: str) -> None:
    """``--device`` can place ``workers`` local ranks: with CUDA every rank takes one GPU,
    so a CUDA machine with fewer GPUs than workers is refused (``--device cpu`` trains there)."""
    from gradsift.tools.train.devices import resolve_device

    resolve_device(device, workers)


def config_from_args(args: argparse.Namespace, out: str, workers: int) -> TrainConfig:
    """Validate the parsed flags into a :class:`TrainConfig` (which also builds the
    compressor and the hook state once: :func:`gradsift.tools.train.config.check_exchange_options`)."""
    from gradsift.core.validation import check_real
    from gradsift.tools.train.config import TrainConfig
    from gradsift.tools.train.datasets import examples_for_model
    from gradsift.tools.train.netem import parse_delay, parse_rate

    options = exchange_options(args)
    if args.latency is not None and args.bandwidth is None:
        raise InvalidOptionError("--latency needs --bandwidth (latency is emulated on the shaped links)")
    # Finds the data and reads its index (Fashion-MNIST's labels, or the text corpus), so a
    # missing or malformed dataset fails here rather than in every worker.
    examples = examples_for_model(args.model, args.data_dir, synthetic=args.synthetic)
    steps = args.steps if args.steps is not None else 100
    if args.epochs is not None:
        check_real(args.epochs, "--epochs", low=0.0, low_open=True)
        per_rank = math.ceil(examples / workers)
        steps = max(1, round(args.epochs * math.ceil(per_rank / args.batch_size)))
    return TrainConfig(
        out=out, model=args.model, compressor=args.compressor, options=options, workers=workers,
        batch_size=args.batch_size, lr=args.lr, optimizer=args.optimizer, momentum=args.momentum,
        betas=list(args.betas), weight_decay=args.weight_decay, clip_grad_norm=args.clip_grad_norm, sync_every=args.sync_every, recipe=args.recipe,
        warmup_steps=args.lr_warmup_steps,
        lr_schedule=args.lr_schedule, decay_steps=args.decay_steps, decay_factor=args.decay_factor,
        steps=steps, eval_every=args.eval_every, seed=args.seed, target_accuracy=args.target_accuracy,
        target_loss=args.target_loss, bandwidth=args.bandwidth,
        bandwidth_bps=parse_rate(args.bandwidth) if args.bandwidth else None, latency=args.latency,
        latency_s=parse_delay(args.latency) if args.latency else 0.0, data_dir=args.data_dir,
        synthetic=args.synthetic, timeout_s=args.timeout, device=args.device, progress=not args.no_progress,
    )  # fmt: skip


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "train", help=HELP, description=DESCRIPTION, epilog=EPILOG, formatter_class=ExamplesHelpFormatter
    )
    add_training_arguments(parser)
    parser.add_argument("--out", help="run directory (default: runs/<compressor>-w<workers>[-<bandwidth>])")
    parser.add_argument("--json", type=Path, metavar="PATH",
                        help="also write summary.json's content to PATH (default: none)")  # fmt: skip
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--cleanup-netem", action="store_true",
                        help="only delete network namespaces left by killed gradsift runs, then exit")  # fmt: skip
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from gradsift.tools.train.launcher import emulated_hosts, run_training, under_torchrun

    if args.cleanup_netem:
        from gradsift.tools.train.netem import cleanup_stale

        removed = cleanup_stale()
        print(f"removed {len(removed)} stale namespace(s)" + (": " + ", ".join(removed) if removed else ""))
        return 0
    torchrun = under_torchrun()
    workers = int(os.environ["WORLD_SIZE"]) if torchrun else args.workers
    out = args.out or f"runs/{args.compressor}-w{workers}" + (f"-{args.bandwidth}" if args.bandwidth else "")
    config = config_from_args(args, out, workers)  # every check before any worker starts
    if torchrun and config.bandwidth_bps is not None:
        raise InvalidOptionError(
            "--bandwidth emulates links between local ranks; it cannot be used under torchrun"
        )
    if not torchrun:
        check_devices(workers, config.device)
        emulated_hosts(config, args.launcher, args.nodes)  # the launcher's refusals, before --out is made
    prepare_outputs({"--out": out}, {"--json": args.json})
    if torchrun:
        summary = _run_as_torchrun_rank(config)
        if summary is None:
            return 0
    else:
        summary = run_training(config, launcher=args.launcher, nodes=args.nodes)
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    print(format_summary(summary, out))
    return 0


def _run_as_torchrun_rank(config: TrainConfig) -> dict[str, Any] | None:
    """One rank under torchrun: rank 0 saves the config; returns the summary on rank 0."""
    from gradsift.tools.train.loop import run_worker

    if int(os.environ["RANK"]) == 0:
        Path(config.out).mkdir(parents=True, exist_ok=True)
        config.save(Path(config.out) / "config.json")
    return run_worker(config)


#: The summary names the bytes padded to capacity when they exceed the bytes sent by more than this factor.
PADDING_SHOWN = 1.01


def _auto_method(auto: dict[str, Any]) -> str:
    """What ``auto`` ran: its choice and the predicted step times it chose from; still measuring
    when the run ended, the method its measuring steps ran; chosen without a prediction (DDP's
    join, clipping after a takeover's exchange), the choice alone; and the methods it left for
    what the script does (why: ``summary.json``'s ``recipe.auto.left``)."""
    if auto["choice"] == "measuring":
        return f"auto -> still measuring when the run ended (on {auto.get('running', 'none')})"
    left = auto.get("left") or {}
    after = f", having left {', '.join(left)} (why: summary.json, recipe.auto.left)" if left else ""
    predicted = ", ".join(f"{name} {ms:.1f}" for name, ms in auto["predicted_ms"].items())
    again = auto.get("remeasures", 0)
    remeasured = f", measured again {again} time{'' if again == 1 else 's'}" if again else ""
    return (
        f"auto -> {auto['choice']}"
        + (f" (predicted ms per step: {predicted}{remeasured})" if predicted else "")
        + after
    )


def _step_and_traffic(part: dict[str, Any], summary: dict[str, Any]) -> str:
    """The median step, bytes per step and density of ``part`` (the run's ``summary``, or its
    ``since_choice``)."""
    from gradsift.tools.train.summary import single_worker, wire_factor

    sent, wire = part["bytes_sent_per_step"], part["bytes_padded_per_step"]
    # a payload padded to its capacity travels whole: say so when the padding is more than rounding
    padded = (
        f", {wire / 1e6:.3f} MB with the padding to capacity ({wire_factor(part):.1f}x less)"
        if wire > PADDING_SHOWN * sent
        else ""
    )
    received = part.get("bytes_received_per_step")  # absent from runs recorded before it was
    got = "" if received is None else f", {received / 1e6:.3f} MB received"
    traffic = (
        "nothing sent (one worker alone)"
        if single_worker(summary)
        else f"{sent / 1e6:.3f} MB sent per step per worker ({part['compression_factor']:.1f}x less than fp32)"
        f"{padded}{got}"
    )
    return (
        f"step time median {part['step_time_median_s'] * 1e3:.1f} ms, {traffic}, "
        f"density {part['achieved_density']:.4f}"
    )


def _traffic_lines(summary: dict[str, Any]) -> list[str]:
    """The whole run's step and traffic; under ``auto`` with a choice made, the steps from the
    choice on too (the whole run's include the measuring steps, on another method)."""
    whole = _step_and_traffic(summary, summary)
    since = summary.get("since_choice")
    if since is None:
        return [f"  {whole}"]
    choice = summary["recipe"]["auto"]["choice"]
    return [
        f"  every step, the measuring steps included: {whole}",
        f"  from step {since['from_step']} on ({choice}, auto's choice): {_step_and_traffic(since, summary)}",
    ]


def format_summary(summary: dict[str, Any], out: str) -> str:
    """A few human-readable lines about a finished run."""
    accuracy = summary["final_test_accuracy"]
    tta = summary["time_to_accuracy_s"]
    recipe = summary.get("recipe") or {}
    optimizer = recipe.get("optimizer")
    own = optimizer in ("DeMo", "DistributedLion")  # its own exchange, compressor none
    workers = summary["workers"]
    auto, outer = recipe.get("auto"), recipe.get("diloco")
    method = optimizer if own else summary["compressor"]
    if outer is not None and "compressor" in outer:  # DiLoCo: its round and the compressor that ran
        method = f"DiLoCo every {outer['sync_every']} steps, {outer['compressor']}"
    elif auto is not None:  # what auto chose, and the predicted step times it chose from
        method = _auto_method(auto)
    lines = [
        f"{method} on {workers} worker{'' if workers == 1 else 's'} "
        f"({summary['model']}, {summary['steps']} steps): "
        + (f"test accuracy {accuracy:.4f}" if accuracy is not None else "no evaluation"),
        *_traffic_lines(summary),
        f"  wall time {summary['wall_time_s']:.1f} s"
        + (f", time to accuracy {summary['target_accuracy']}: " + (f"{tta:.1f} s" if tta is not None else "not reached")
           if summary["target_accuracy"] is not None else ""),
        f"  results in {out}/ (summary.json, steps.jsonl, evals.jsonl)",
    ]  # fmt: skip
    return "\n".join(lines)
