"""A third-party GPT training script with the line a user adds, against stock DDP in the same runs.

The script is nanoGPT's ``train.py`` (Andrej Karpathy, MIT licence), read from a git snapshot of
https://github.com/karpathy/nanoGPT at :data:`NANOGPT_COMMIT` (``--nanogpt``: the git directory;
nothing of it is kept in this repository). Each run copies ``train.py``, ``model.py``,
``configurator.py`` and ``config/train_shakespeare_char.py`` into a fresh directory and changes only
what CPU ranks on gloo and the arm's line need (:data:`PATCHES`, each found exactly once or the run
stops naming it):

1. the DDP branch's device: the script sets ``cuda:<local rank>``; a CPU run keeps ``--device=cpu``;
2. ``DDP(model, device_ids=[...])`` becomes ``DDP(model)`` (a CPU module takes no device ids),
   followed by the arm's line (:data:`ARMS`: nothing for stock DDP, ``gradsift_hook =
   gradsift.register_comm_hook(model)`` for the one line, ...);
3. the seed: ``1337 + seed_offset`` becomes ``1337 + 100 * NANOGPT_SEED + seed_offset`` (seed 0 is
   the script's own);
4. before the process group is destroyed, rank 0 writes the trainable parameter count and the
   hook's ``stats()`` (if the arm has a hook) to ``gradsift-stats.json``.

Everything else is the script as users run it: AdamW over two parameter groups with nanoGPT's
cosine schedule and warm-up, gradient accumulation with DDP's ``require_backward_grad_sync``
toggled on the micro-steps (what ``no_sync`` does), clipping at 1.0 after ``scaler.unscale_`` (a
disabled ``GradScaler``: the run is float32). Configuration: ``train_shakespeare_char.py`` with
the README's CPU settings (:data:`CONFIG`; ``--iterations``, default 400; gradient accumulation 4, so two
micro-steps per rank on 2 ranks). Data: bytes (vocabulary 256) of CPython's standard library's
top-level modules, the corpus of :mod:`gradsift.tools.train.text`, its training and validation files
(every tenth file is validation).

Measured per run, from rank 0's output: the last evaluation's validation loss (``eval_iters``
batches drawn by rank 0's generator, which no arm's hook touches, so every arm of a seed is
evaluated on the same batches), the median iteration time (evaluation iterations left out), the
wall time (the sum of every iteration's time, evaluations included: what the user waits), and
bytes per worker per step sent and received: the hook's ``stats()``, and for stock DDP a ring
allreduce of the fp32 gradients (``2 (W - 1) / W`` of them each way). "alone" is one worker
training without communication on the per-worker batch (gradient accumulation 2). Paired per
seed with stock DDP, 95 % t-intervals. A run counts once rank 0 has left the training loop (it
writes ``gradsift-stats.json``): a rank that then dies at exit -- gloo's teardown aborts a
process now and then, stock DDP's too -- is recorded in ``exit_codes``; a rank that dies before
stops the run within :data:`GRACE_S` seconds. Usage (repository root, a clean checkout of a commit on
main; ``--bandwidth`` needs root: network namespaces and tc)::

    flock /tmp/gradsift-cpu.lock python benchmarks/thirdparty/nanogpt.py --json results/thirdparty/nanogpt-localhost.json
    flock /tmp/gradsift-cpu.lock python benchmarks/thirdparty/nanogpt.py --bandwidth 100mbit \\
        --arms stock one-line zero-one --json results/thirdparty/nanogpt-100mbit.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pickle
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: provenance, the statistics
import provenance
from convergence.analyze44 import ring_received
from intervals import Interval, interval, paired_gap

from gradsift.tools.train.launcher import Localhost
from gradsift.tools.train.netem import EmulatedNetwork, parse_rate
from gradsift.tools.train.text import corpus_files, split_files, stdlib_dir

NANOGPT_COMMIT = "3adf61e154c3fe3fca428ad6bc3818b27a3b8291"
DEFAULT_NANOGPT = Path("/work/.mirror/karpathy+nanoGPT/repo")
FILES = ("train.py", "model.py", "configurator.py", "config/train_shakespeare_char.py")
WORKERS = 2
GRACE_S = 15.0  # for the other ranks, once one has exited with an error
DATASET = "stdlib_bytes"

#: The command line after ``train.py``: the shakespeare_char config with the README's CPU settings.
CONFIG = ("config/train_shakespeare_char.py", "--device=cpu", "--compile=False", "--dtype=float32",
          "--backend=gloo", f"--dataset={DATASET}", "--block_size=64", "--batch_size=12", "--n_layer=4",
          "--n_head=4", "--n_embd=128", "--dropout=0.0", "--log_interval=1", "--always_save_checkpoint=False")  # fmt: skip
GRADIENT_ACCUMULATION = 4  # over both ranks: two micro-steps per rank

#: (found once in train.py, replaced by). ``{line}`` is the arm's line (or ``pass``).
PATCHES = (
    ("    device = f'cuda:{ddp_local_rank}'\n    torch.cuda.set_device(device)\n",
     "    if device != 'cpu':\n        device = f'cuda:{ddp_local_rank}'\n        torch.cuda.set_device(device)\n"),
    ("    model = DDP(model, device_ids=[ddp_local_rank])\n",
     "    model = DDP(model) if device == 'cpu' else DDP(model, device_ids=[ddp_local_rank])\n"
     "    import gradsift\n    {line}\n"),
    ("torch.manual_seed(1337 + seed_offset)",
     "torch.manual_seed(1337 + 100 * int(os.environ['NANOGPT_SEED']) + seed_offset)"),
    ("if ddp:\n    destroy_process_group()",
     "if master_process:\n    import json\n"
     "    json.dump({'parameters': sum(p.numel() for p in raw_model.parameters() if p.requires_grad),\n"
     "               'stats': globals()['gradsift_hook'].stats() if 'gradsift_hook' in globals() else None},\n"
     "              open('gradsift-stats.json', 'w'), default=str)\n"
     "if ddp:\n    destroy_process_group()"),
)  # fmt: skip


@dataclass(frozen=True)
class Arm:
    """A line added after the script's DDP wrap (None: the script unchanged), on ``workers`` ranks."""

    line: str | None
    workers: int = WORKERS


ARMS = {
    "stock": Arm(None),
    "one-line": Arm("gradsift_hook = gradsift.register_comm_hook(model)"),
    "bf16": Arm("gradsift_hook = gradsift.register_comm_hook(model, 'bf16')"),
    "onebit": Arm("gradsift_hook = gradsift.register_comm_hook(model, 'efsignsgd', optimizer=optimizer)"),
    "onebit-w40": Arm("gradsift_hook = gradsift.register_comm_hook(model, 'efsignsgd', optimizer=optimizer, "
                      "warmup_steps=40)"),
    "zero-one": Arm("gradsift_hook = gradsift.register_comm_hook(model, 'efsignsgd', optimizer=optimizer, "
                    "adam='zero-one', warmup_steps=100, warmup_compressor='blockquant', local_steps=(100, 2))"),
    "zero-one-l50x4": Arm("gradsift_hook = gradsift.register_comm_hook(model, 'efsignsgd', optimizer=optimizer, "
                          "adam='zero-one', warmup_steps=100, warmup_compressor='blockquant', local_steps=(50, 4))"),
    "zero-one-q2-l100x2": Arm("gradsift_hook = gradsift.register_comm_hook(model, 'efsignsgd', optimizer=optimizer, "
                              "adam='zero-one', warmup_steps=100, warmup_compressor=gradsift.get_compressor("
                              "'blockquant', bits=2), local_steps=(100, 2))"),
    "onebit-q4w100": Arm("gradsift_hook = gradsift.register_comm_hook(model, 'efsignsgd', optimizer=optimizer, "
                         "warmup_steps=100, warmup_compressor='blockquant')"),
    "onebit-q2w100": Arm("gradsift_hook = gradsift.register_comm_hook(model, 'efsignsgd', optimizer=optimizer, "
                         "warmup_steps=100, warmup_compressor=gradsift.get_compressor('blockquant', bits=2))"),
    "zero-one-q2": Arm("gradsift_hook = gradsift.register_comm_hook(model, 'efsignsgd', optimizer=optimizer, "
                       "adam='zero-one', warmup_steps=100, warmup_compressor=gradsift.get_compressor('blockquant', "
                       "bits=2))"),
    "dense-fv": Arm("gradsift_hook = gradsift.register_comm_hook(model, 'topk', ratio=1.0, momentum_masking=False, "
                    "optimizer=optimizer, warmup_steps=100)"),
    "alone": Arm(None, workers=1),
}  # fmt: skip

EVAL = re.compile(r"^step (\d+): train loss ([\d.]+), val loss ([\d.]+)", re.MULTILINE)
ITERATION = re.compile(r"^iter (\d+): loss ([\d.]+), time ([\d.]+)ms", re.MULTILINE)


def patched_train(source: str, line: str | None) -> str:
    """``train.py`` with :data:`PATCHES` applied; each anchor must occur exactly once."""
    for anchor, replacement in PATCHES:
        count = source.count(anchor)
        if count != 1:
            raise SystemExit(
                f"nanoGPT's train.py has {count} copies of {anchor!r} (expected 1): another commit?"
            )
        source = source.replace(anchor, replacement.replace("{line}", line or "pass"))
    return source


def write_corpus(directory: Path) -> dict[str, Any]:
    """``train.bin`` / ``val.bin`` (uint16 tokens = bytes) and ``meta.pkl`` in ``directory``: the
    corpus's training and validation files (:func:`~gradsift.tools.train.text.split_files`)."""
    directory.mkdir(parents=True)
    sizes = {}
    for name, files in zip(("train", "val"), split_files(corpus_files(stdlib_dir())), strict=True):
        tokens = np.frombuffer(b"".join(path.read_bytes() for path in files), dtype=np.uint8)
        tokens.astype(np.uint16).tofile(directory / f"{name}.bin")
        sizes[name] = len(tokens)
    (directory / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": 256}))
    return sizes


def checkout(nanogpt: Path, workdir: Path, line: str | None) -> None:
    """The script's files at :data:`NANOGPT_COMMIT` in ``workdir``, ``train.py`` patched."""
    for name in FILES:
        text = subprocess.run(["git", "--git-dir", str(nanogpt), "show", f"{NANOGPT_COMMIT}:{name}"],
                              check=True, capture_output=True, text=True).stdout  # fmt: skip
        if name == "train.py":
            text = patched_train(text, line)
        (workdir / name).parent.mkdir(parents=True, exist_ok=True)
        (workdir / name).write_text(text)


@contextmanager
def link(bandwidth: str | None, hosts: int) -> Iterator[Any]:
    """Localhost, or ``hosts`` emulated hosts joined by ``bandwidth`` links."""
    if bandwidth is None or hosts == 1:
        yield Localhost()
        return
    with EmulatedNetwork(hosts, parse_rate(bandwidth), tag="nanogpt") as network:
        yield network


def supervise(commands: list[tuple[list[str], dict[str, str], Path]], cwd: Path, timeout: float) -> list[int]:
    """Run every ``(command, environment, log)`` at once; their exit codes. Once one has failed
    the others get :data:`GRACE_S` to end (a rank that dies at exit leaves the others done,
    one that dies in training leaves them stuck), then are killed (-9); past ``timeout`` all
    are killed and the run fails."""
    with contextlib.ExitStack() as logs:
        processes = [subprocess.Popen(c, cwd=cwd, env={**os.environ, **e}, stdout=logs.enter_context(open(log, "w")),
                                      stderr=subprocess.STDOUT) for c, e, log in commands]  # fmt: skip
        deadline, failed_at = time.monotonic() + timeout, None
        try:
            while any(p.poll() is None for p in processes):
                now = time.monotonic()
                if failed_at is None and any(p.poll() not in (None, 0) for p in processes):
                    failed_at = now
                if failed_at is not None and now > failed_at + GRACE_S:
                    break
                if now > deadline:
                    raise SystemExit(
                        f"nanoGPT run timed out after {timeout:.0f} s; logs: {[str(c[2]) for c in commands]}"
                    )
                time.sleep(0.2)
        finally:
            for process in processes:
                if process.poll() is None:
                    process.kill()
                    process.wait()
    return [p.returncode for p in processes]


def run(label: str, seed: int, args: argparse.Namespace, corpus: Path) -> dict[str, Any]:
    """One run of the script with ``label``'s line; what it measured."""
    arm = ARMS[label]
    with tempfile.TemporaryDirectory(prefix=f"nanogpt-{label}-") as tmp:
        workdir = Path(tmp)
        checkout(args.nanogpt, workdir, arm.line)
        (workdir / "data").mkdir()
        (workdir / "data" / DATASET).symlink_to(corpus)
        accumulation = GRADIENT_ACCUMULATION * arm.workers // WORKERS
        command = [sys.executable, "train.py", *CONFIG, f"--gradient_accumulation_steps={accumulation}",
                   f"--max_iters={args.iterations}", f"--eval_interval={args.iterations // 2}",
                   f"--lr_decay_iters={args.iterations}", f"--out_dir={workdir / 'out'}",
                   *(f"--{setting}" for setting in args.set)]  # fmt: skip
        print(f"+ [{label}, seed {seed}]", " ".join(command), flush=True)
        with link(args.bandwidth, arm.workers) as network:
            ranks = []
            for rank in range(arm.workers):
                env = {"NANOGPT_SEED": str(seed), "OMP_NUM_THREADS": "1"}
                if arm.workers > 1:
                    env |= {**network.environment(rank), "RANK": str(rank), "LOCAL_RANK": str(rank),
                            "WORLD_SIZE": str(arm.workers)}  # fmt: skip
                ranks.append(([*network.command_prefix(rank), *command], env, workdir / f"rank{rank}.log"))
            codes = supervise(ranks, workdir, args.timeout)
        output = (workdir / "rank0.log").read_text()
        stats = workdir / "gradsift-stats.json"
        if not stats.exists():  # rank 0 never left the training loop
            failed = next((rank for rank, code in enumerate(codes) if code), 0)
            tail = "\n".join((workdir / f"rank{failed}.log").read_text().splitlines()[-15:])
            raise SystemExit(
                f"nanoGPT run {label}, seed {seed} failed: exit codes {codes}; rank {failed}'s log ends:\n{tail}"
            )
        written = json.loads(stats.read_text())
    return {**measure(label, seed, arm, output, written), "exit_codes": codes}


def measure(label: str, seed: int, arm: Arm, output: str, written: dict[str, Any]) -> dict[str, Any]:
    """A run's record from rank 0's output and ``gradsift-stats.json``."""
    evals = [(int(s), float(t), float(v)) for s, t, v in EVAL.findall(output)]
    times = {int(i): float(ms) / 1e3 for i, _, ms in ITERATION.findall(output)}
    evaluated = {step for step, _, _ in evals}
    stats = written["stats"]
    dense = 4.0 * written["parameters"]
    if stats is not None:
        total = stats["total"]
        sent, received = total["bytes_sent"] / total["steps"], total["bytes_received"] / total["steps"]
    else:
        sent = received = ring_received(dense, arm.workers)
    return {
        "arm": label,
        "seed": seed,
        "workers": arm.workers,
        "line": arm.line,
        "final_validation_loss": evals[-1][2],
        "evaluations": [{"step": s, "train_loss": t, "validation_loss": v} for s, t, v in evals],
        "step_time_median_s": statistics.median(t for i, t in times.items() if i not in evaluated),
        "wall_time_s": sum(times.values()),
        "bytes_sent_per_step": sent,
        "bytes_received_per_step": received,
        "parameters": written["parameters"],
        "auto": None if stats is None else stats.get("auto"),
        "adam_warmup": None if stats is None else stats.get("adam_warmup"),
        "said": [line for line in output.splitlines() if "gradsift" in line or "Warning" in line][:20],
    }


def as_dict(values: Interval) -> dict[str, Any]:
    return {"n": values.n, "mean": values.mean, "low": values.low, "high": values.high}


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per arm, paired per seed with stock DDP (95 % t-intervals): the validation loss's gap in
    % of stock's, the median step's and the wall time's ratios to stock's; stock's bytes
    received per step over the arm's (the factor fewer); what ``auto`` chose."""
    stock = {r["seed"]: r for r in runs if r["arm"] == "stock"}
    summary = {}
    for label in dict.fromkeys(r["arm"] for r in runs if r["arm"] != "stock" and stock):
        mine = {r["seed"]: r for r in runs if r["arm"] == label and r["seed"] in stock}
        loss = {seed: r["final_validation_loss"] for seed, r in mine.items()}
        entry = {
            "loss_gap_percent": as_dict(
                paired_gap(loss, {s: stock[s]["final_validation_loss"] for s in mine}, True)
            )
        }
        for field in ("step_time_median_s", "wall_time_s"):
            entry[field] = as_dict(interval([r[field] / stock[s][field] for s, r in mine.items()]))
        received = statistics.fmean(r["bytes_received_per_step"] for r in mine.values())
        stock_received = statistics.fmean(stock[s]["bytes_received_per_step"] for s in mine)
        entry["fewer_bytes_received"] = stock_received / received if received else None
        entry["choices"] = sorted({r["auto"]["choice"] for r in mine.values() if r["auto"]})
        summary[label] = entry
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arms", nargs="+", choices=sorted(ARMS), default=list(ARMS),
                        help="arms to run, each seed in this order (default: all)")  # fmt: skip
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds (default: 0 1 2)")
    parser.add_argument(
        "--iterations", type=int, default=400, help="max_iters and lr_decay_iters (default: 400)"
    )
    parser.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                        help="more of the script's settings, e.g. grad_clip=0.0 (default: none)")  # fmt: skip
    parser.add_argument("--bandwidth", default=None, help="emulated link between the ranks, e.g. 100mbit")
    parser.add_argument("--nanogpt", type=Path, default=DEFAULT_NANOGPT,
                        help=f"nanoGPT's git directory (default: {DEFAULT_NANOGPT})")  # fmt: skip
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds per run (default: 1200)")
    parser.add_argument("--json", type=Path, required=True, help="where the result goes")
    parser.add_argument("--summarise", action="store_true",
                        help="run nothing: recompute --json's summary from its runs")  # fmt: skip
    args = parser.parse_args(argv)
    if args.summarise:
        report = json.loads(args.json.read_text())
        report["summary"] = summarise(report["runs"])
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(json.dumps(report["summary"], indent=2))
        return 0
    stamp = provenance.start(seeds=args.seeds)
    runs = []
    with tempfile.TemporaryDirectory(prefix="nanogpt-data-") as data:
        corpus = write_corpus(Path(data) / DATASET)
        for seed in args.seeds:
            for label in args.arms:
                runs.append(run(label, seed, args, Path(data) / DATASET))
                print(json.dumps({k: runs[-1][k] for k in ("arm", "seed", "final_validation_loss",
                                  "step_time_median_s", "wall_time_s", "bytes_received_per_step")}), flush=True)  # fmt: skip
    report = {"script": f"karpathy/nanoGPT@{NANOGPT_COMMIT}:train.py", "config": [*CONFIG], "iterations": args.iterations, "set": args.set,
              "gradient_accumulation_steps": GRADIENT_ACCUMULATION, "bandwidth": args.bandwidth,
              "corpus": corpus, "summary": summarise(runs), "runs": runs, "provenance": stamp.finish()}  # fmt: skip
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["summary"], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
