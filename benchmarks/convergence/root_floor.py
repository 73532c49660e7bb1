"""A floor under the frozen Adam root: the frozen-variance methods with it, without it, and with
the step clamp it replaced -- the same runs from a clean worktree of each commit.

    # the runs: resumable, one at a time, at nice 19 (a background campaign; timings unused)
    git worktree add /tmp/wt-none e0d742f && git worktree add /tmp/wt-floor 82a1861
    python benchmarks/convergence/root_floor.py run --tree none=/tmp/wt-none --tree floor=/tmp/wt-floor
    # a ReLU MLP in one process: stock AdamW, the 1-bit Adam method per tree, the controls
    git worktree add /tmp/wt-clamp 041607f
    flock /tmp/gradsift-cpu.lock python benchmarks/convergence/root_floor.py mlp \
        --tree none=/tmp/wt-none --tree clamp=/tmp/wt-clamp --tree floor=/tmp/wt-floor
    # nanoGPT's frozen-variance arms per tree (seeds 0-2; then --seeds 3 4 into nanogpt-q2-<side>-s34.json)
    cd /tmp/wt-none && PYTHONPATH=src flock /tmp/gradsift-cpu.lock python benchmarks/thirdparty/nanogpt.py \
        --arms stock onebit-q2w100 zero-one-q2 dense-fv --json <repo>/results/thirdparty/nanogpt-q2-none.json
    # the table: results/convergence/root_floor/{results.json,table.md}, and docs/adam.md's block
    python benchmarks/convergence/root_floor.py analyze --update-docs

The sides (:data:`SIDES`): e0d742f, the frozen root as it was (``sqrt(v_hat)``, the largest root
where ``v = 0``); 041607f, which clamped each element of ``m / D`` to Adam's own longest step
``(1 - beta1) / sqrt((1 - beta2)(1 - beta1^2 / beta2))`` (on the MLP and nanoGPT only,
``results/thirdparty/nanogpt-q2-clamp.json``: rejected there); 82a1861, which floors the root at
``gradsift.hook.adam_warmup.ROOT_FLOOR`` times its tensor's root-mean-square root. Each GPT run is
the protocol's GPT + AdamW workload at 3,000 steps on 2 workers (:data:`TRAIN`), seeds 0-2: the
1-bit Adam method (``efsignsgd`` under the frozen-variance method), then the method run dense
(``topk`` at ratio 1 without momentum masking: every element sent, the optimizer alone). The
reference is fp32 DDP at the protocol's lr 3e-3, the protocol's own runs
(``results/convergence/runs/gpt-adamw-3k/none-*``).

Statistics (:mod:`analyze44`'s): every arm paired per seed with fp32, and each side paired per
seed with ``none``, ``mean +- t_{0.975, n-1} sd / sqrt(n)``; bytes per worker per step sent and
received over the whole run, and the factor against stock DDP's ring allreduce's received bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import analyze44
import campaign44
import intervals
import provenance
from protocol import WORKLOADS
from run import pack

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "results" / "convergence" / "root_floor"
DOC = ROOT / "docs" / "adam.md"
BEGIN, END = "<!-- root-floor-table:begin -->", "<!-- root-floor-table:end -->"
SEEDS = (0, 1, 2)
#: The protocol's GPT + AdamW workload at 3,000 steps (``campaign44.LONG``).
TRAIN = WORKLOADS[campaign44.LONG].train_arguments(WORKLOADS[campaign44.LONG].epochs)
METHODS = {
    "onebit": (("--compressor", "efsignsgd"), "the 1-bit Adam method (efsignsgd, frozen-variance AdamW)"),
    "densefv": (
        ("--compressor", "topk", "--option", "ratio=1.0", "--option", "momentum_masking=false"),
        "the method run dense (topk at ratio 1, no masking: every element sent)",
    ),
}
SIDES = {
    "none": "as it was (e0d742f)",
    "floor": "floored at a hundredth of its tensor's RMS root (82a1861)",
    "clamp": "as it was, m / D clamped to Adam's longest step (041607f)",
}
BASELINE = "none"
#: nanoGPT's ``train.py`` (``benchmarks/thirdparty/nanogpt.py``, 400 iterations, 2 ranks) per side:
#: stock DDP and the frozen-variance arms whose warm-up is in 2-bit codes, as
#: ``results/thirdparty/nanogpt-20x.json`` ran them, and the method run dense.
#: Its files per side: ``nanogpt-q2-<side>.json`` (seeds 0-2) and ``nanogpt-q2-<side>-<seeds>.json`` (more seeds).
NANOGPT = {side: sorted((ROOT / "results" / "thirdparty").glob(f"nanogpt-q2-{side}*.json")) for side in SIDES}
NANOGPT_ARMS = {
    "onebit-q2w100": "the 1-bit Adam method, a 100-step warm-up in 2-bit codes",
    "zero-one-q2": "0/1 Adam, its warm-up in 2-bit codes",
    "dense-fv": "the method run dense",
}
MLP_STEPS = 400
#: The ReLU MLP's frozen-variance methods: registry name and options.
MLP_METHODS: dict[str, tuple[str, dict[str, Any]]] = {
    "onebit": ("efsignsgd", {}),
    "topk": ("topk", {"ratio": 0.01}),
    "dense": ("topk", {"ratio": 1.0, "momentum_masking": False}),
}


def tree_argument(text: str) -> tuple[str, Path]:
    """``SIDE=PATH`` of ``--tree``, the side one of :data:`SIDES`."""
    side, _, path = text.partition("=")
    if side not in SIDES or not path:
        raise argparse.ArgumentTypeError(
            f"expected SIDE=PATH with SIDE one of {', '.join(SIDES)}, got {text!r}"
        )
    return side, Path(path)


def run_directory(root: Path, method: str, side: str, seed: int) -> Path:
    return root / "runs" / f"{method}-{side}-s{seed}"


def run(trees: dict[str, Path], root: Path, seeds: tuple[int, ...] = SEEDS) -> None:
    """Every missing run of the sides in ``trees`` (side -> a clean worktree of its commit), the 1-bit
    method's first, seed by seed. Each is stamped by its tree's own ``benchmarks/provenance.py``
    (that commit, its load before and after), its steps gzipped and its per-rank logs dropped."""
    for method, (flags, _) in METHODS.items():
        for seed in seeds:
            for side, tree in trees.items():
                out = run_directory(root, method, side, seed)
                if (out / "steps.jsonl.gz").is_file():
                    continue
                train = [sys.executable, "-m", "gradsift", "train", *TRAIN, *flags, "--seed", str(seed),
                         "--out", str(out), "--no-progress"]  # fmt: skip
                stamped = [sys.executable, str(tree / "benchmarks" / "provenance.py"),
                           "--json", str(out / "summary.json"), "--seed", str(seed), "--", *train]  # fmt: skip
                environment = {**os.environ, "PYTHONPATH": str(tree / "src")}
                print(f"+ [{method} {side} s{seed}] {' '.join(train)}", flush=True)
                subprocess.run(stamped, cwd=tree, env=environment, check=True, preexec_fn=lambda: os.nice(19))
                pack(out)


def mlp_run(seed: int, method: str) -> dict[str, float]:
    """One process (gloo, world size 1): a ReLU MLP (256-1024-1024-10) learning a random linear
    teacher's argmax with AdamW (lr 1e-3) for :data:`MLP_STEPS` steps, stock (``method`` "stock") or
    under a frozen-variance method (:data:`MLP_METHODS`, a 64-step dense warm-up); its largest
    weight and its loss and accuracy on 2,000 held-out inputs. The gradsift imported is the
    caller's ``PYTHONPATH``'s."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import gradsift

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29700 + seed))
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024),
                                torch.nn.ReLU(), torch.nn.Linear(1024, 10))  # fmt: skip
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if method != "stock":
        name, options = MLP_METHODS[method]
        gradsift.register_comm_hook(ddp, name, optimizer=optimizer, warmup_steps=64, **options)
    data, teacher = (
        torch.Generator().manual_seed(seed),
        torch.randn(256, 10, generator=torch.Generator().manual_seed(7)),
    )
    for _ in range(MLP_STEPS):
        x = torch.randn(32, 256, generator=data)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), (x @ teacher).argmax(1)).backward()
        optimizer.step()
    held_out = torch.randn(2000, 256, generator=torch.Generator().manual_seed(99))
    with torch.no_grad():
        logits, labels = model(held_out), (held_out @ teacher).argmax(1)
        return {
            "largest_weight": max(float(p.abs().max()) for p in model.parameters()),
            "test_loss": float(torch.nn.functional.cross_entropy(logits, labels)),
            "test_accuracy": float((logits.argmax(1) == labels).float().mean()),
        }


def mlp(trees: dict[str, Path]) -> dict[str, dict[int, dict[str, float]]]:
    """:func:`mlp_run` for stock AdamW (the last tree's), the 1-bit Adam method of each side in
    ``trees``, and the other methods of :data:`MLP_METHODS` with the root as it was (the controls:
    a sparsifier, and no code at all), seeds 0-2, each in a fresh process importing its tree's gradsift."""
    found: dict[str, dict[int, dict[str, float]]] = {}
    arms = [
        ("stock", list(trees.values())[-1], "stock"),
        *((side, tree, "onebit") for side, tree in trees.items()),
    ]
    if BASELINE in trees:
        arms += [
            (f"{BASELINE}-{method}", trees[BASELINE], method) for method in MLP_METHODS if method != "onebit"
        ]
    for arm, tree, method in arms:
        for seed in SEEDS:
            code = f"import json, root_floor; print(json.dumps(root_floor.mlp_run({seed}, {method!r})))"
            environment = {**os.environ, "PYTHONPATH": f"{tree / 'src'}{os.pathsep}{Path(__file__).parent}"}
            done = subprocess.run([sys.executable, "-c", code], env=environment, capture_output=True, text=True,
                                  check=True, timeout=600)  # fmt: skip
            found.setdefault(arm, {})[seed] = json.loads(done.stdout.strip().splitlines()[-1])
            print(f"mlp {arm} s{seed}: {found[arm][seed]}", flush=True)
    return found


def collect(root: Path) -> dict[str, dict[int, dict[str, Any]]]:
    """``{"<method>-<side>": {seed: run}}`` of the finished runs, and ``"fp32"``'s reference runs."""
    found: dict[str, dict[int, dict[str, Any]]] = {"fp32": {}}
    for seed in SEEDS:
        reference = analyze44.load_run(
            analyze44.run_directory(campaign44.LONG, "none", seed, "protocol", campaign44.ISSUE44)
        )
        if reference is not None:
            found["fp32"][seed] = reference
        for method in METHODS:
            for side in SIDES:
                finished = analyze44.load_run(run_directory(root, method, side, seed))
                if finished is not None:
                    found.setdefault(f"{method}-{side}", {})[seed] = finished
    return found


def nanogpt_table(report: dict[str, Any]) -> str:
    """nanoGPT's rows: per arm and side the mean loss, paired per seed with stock DDP of the same
    file (in %) and with the arm's run with the root as it was (in nats), and the bytes per worker
    per step sent and received (the runs' mean)."""
    runs: dict[str, dict[str, dict[int, dict[str, Any]]]] = {}
    for side, paths in NANOGPT.items():
        for path in paths:
            for run in json.loads(path.read_text())["runs"]:
                runs.setdefault(side, {}).setdefault(run["arm"], {})[run["seed"]] = run
    if BASELINE not in runs:
        return ""
    lines = ["| arm | the frozen root | seeds | validation loss (mean) | vs stock DDP, paired "
             "| vs the root as it was, paired (nats) | MB sent / received per step |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: |"]  # fmt: skip

    def losses(side: str, arm: str) -> dict[int, float]:
        return {seed: run["final_validation_loss"] for seed, run in runs[side][arm].items()}

    for arm, setting in NANOGPT_ARMS.items():
        for side, label in SIDES.items():
            if arm not in runs.get(side, {}):
                continue
            found = losses(side, arm)
            stock = intervals.paired_gap(found, losses(side, "stock"), relative=True)
            versus = intervals.paired_gap(found, losses(BASELINE, arm)) if side != BASELINE else None
            sent, received = (sum(r[key] for r in runs[side][arm].values()) / len(found) / 1e6
                              for key in ("bytes_sent_per_step", "bytes_received_per_step"))  # fmt: skip
            report["nanogpt"][f"{arm}-{side}"] = {"losses": found, "versus_stock_pct": stock.__dict__,
                                                  "versus_none": None if versus is None else versus.__dict__,
                                                  "mb_sent_per_step": sent, "mb_received_per_step": received}  # fmt: skip
            lines.append(f"| {setting} | {label.split(' (')[0]} | {','.join(map(str, sorted(found)))} "
                         f"| {sum(found.values()) / len(found):.3f} | {analyze44.ci_text(stock, 1, ' %')} "
                         f"| {'-' if versus is None else analyze44.ci_text(versus, 3)} | {sent:.3f} / {received:.3f} |")  # fmt: skip
    stock = runs[BASELINE]["stock"].values()
    dense = sum(run["bytes_received_per_step"] for run in stock) / len(stock) / 1e6
    return (
        "\n**nanoGPT** (`train.py`, 400 iterations, 2 ranks; `results/thirdparty/nanogpt-q2-*.json`; "
        f"stock DDP receives {dense:.3f} MB per worker per step)\n\n" + "\n".join(lines) + "\n"
    )


MLP_LABELS = {
    "stock": "stock AdamW",
    f"{BASELINE}-topk": "topk at 1 %, root as it was",
    f"{BASELINE}-dense": "the method run dense, root as it was",
}


def mlp_table(root: Path, report: dict[str, Any]) -> str:
    """The ReLU MLP's rows (``<root>/mlp.json``): per arm the largest weight's range over the seeds
    and the held-out loss, paired per seed with stock AdamW."""
    path = root / "mlp.json"
    if not path.is_file():
        return ""
    arms = json.loads(path.read_text())["arms"]
    lines = ["| arm | largest weight (seeds 0-2) | held-out loss (mean) | vs stock AdamW, paired (nats) |",
             "| --- | ---: | ---: | ---: |"]  # fmt: skip
    stock = {int(seed): run["test_loss"] for seed, run in arms["stock"].items()}
    for arm, runs in arms.items():
        losses = {int(seed): run["test_loss"] for seed, run in runs.items()}
        weights = [run["largest_weight"] for run in runs.values()]
        versus = intervals.paired_gap(losses, stock) if arm != "stock" else None
        report["mlp"][arm] = {"largest_weight": weights, "test_loss": losses,
                              "versus_stock": None if versus is None else versus.__dict__}  # fmt: skip
        label = MLP_LABELS.get(arm) or f"the 1-bit Adam method, root {SIDES[arm].split(' (')[0]}"
        lines.append(f"| {label} | {min(weights):.3g} - {max(weights):.3g} | {sum(losses.values()) / len(losses):.3f} "
                     f"| {'-' if versus is None else analyze44.ci_text(versus, 3)} |")  # fmt: skip
    return (
        f"\n**A ReLU MLP** (256-1024-1024-10, AdamW lr 1e-3, {MLP_STEPS} steps in one process; "
        "`results/convergence/root_floor/mlp.json`)\n\n" + "\n".join(lines) + "\n"
    )


def analyse(root: Path) -> tuple[str, dict[str, Any]]:
    """The markdown table and the numbers behind it."""
    runs = collect(root)
    if not runs["fp32"]:
        raise SystemExit("no fp32 reference runs in results/convergence/runs/")
    report: dict[str, Any] = {"arms": {}, "versus_none": {}, "nanogpt": {}, "mlp": {}}
    lines = [
        "| method | the frozen root | seeds | final loss (mean ± sd) | vs fp32, paired (nats) | same in % "
        "| vs the root as it was, paired (nats) | MB sent / received per step | fewer bytes received than ring allreduce |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for method, (_, setting) in METHODS.items():
        for side, label in SIDES.items():
            arm = runs.get(f"{method}-{side}")
            if not arm:
                continue
            stats = analyze44.arm_stats(arm, runs["fp32"])
            report["arms"][f"{method}-{side}"] = stats
            effect = "-"
            baseline = runs.get(f"{method}-{BASELINE}")
            if side != BASELINE and baseline:
                losses = {s: r["final_val_loss"] for s, r in arm.items()}
                gap = intervals.paired_gap(losses, {s: r["final_val_loss"] for s, r in baseline.items()})
                report["versus_none"][f"{method}-{side}"] = gap.__dict__
                effect = analyze44.ci_text(gap, 3)
            gap, pct = (intervals.Interval(**{k: stats[key][k] for k in ("n", "mean", "sd", "half")})
                        for key in ("gap", "gap_pct"))  # fmt: skip
            sd = "" if stats["sd"] is None else f" ± {stats['sd']:.3f}"
            lines.append(
                f"| {setting} | {label} | {','.join(map(str, stats['seeds']))} | {stats['mean']:.3f}{sd} "
                f"| {analyze44.ci_text(gap, 3)} | {analyze44.ci_text(pct, 1, ' %')} | {effect} "
                f"| {stats['bytes_sent_per_step'] / 1e6:.3f} / {stats['bytes_received_per_step'] / 1e6:.3f} "
                f"| {stats['factor_received']:.2f}x |"
            )
    fp32 = runs["fp32"]
    report["fp32"] = {"seeds": sorted(fp32), "final_val_loss": {s: r["final_val_loss"] for s, r in fp32.items()},
                      "commits": sorted({r["commit"] for r in fp32.values() if r["commit"]})}  # fmt: skip
    report["runs"] = {name: {s: {k: r[k] for k in ("directory", "commit", "dirty", "final_val_loss")}
                             for s, r in arm.items()} for name, arm in runs.items()}  # fmt: skip
    reference = ", ".join(f"{fp32[s]['final_val_loss']:.3f}" for s in sorted(fp32))
    head = (
        f"**The project's GPT** + AdamW, 3,000 steps, 2 workers; final validation loss in nats/byte; fp32 DDP at lr 3e-3 "
        f"(seeds {', '.join(map(str, sorted(fp32)))}: {reference}) is the reference of every pair; the "
        "second pairs each seed with the same method's run with the root as it was.\n\n"
    )
    return head + "\n".join(lines) + "\n" + nanogpt_table(report) + mlp_table(root, report), report


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--root", type=Path, default=RESULTS, help="where runs/ lies (default: %(default)s)")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (("run", "the missing runs"), ("mlp", "the ReLU MLP in one process: <root>/mlp.json")):
        command = sub.add_parser(name, help=text)
        command.add_argument("--tree", action="append", type=tree_argument, required=True, metavar="SIDE=PATH",
                             help=f"a clean worktree of a side's commit; sides: {', '.join(SIDES)}")  # fmt: skip
    sub.choices["run"].add_argument(
        "--seeds", type=int, nargs="+", default=list(SEEDS), help="default: %(default)s"
    )
    analyser = sub.add_parser("analyze", help="the table")
    analyser.add_argument(
        "--update-docs", action="store_true", help="rewrite docs/adam.md's root-floor block"
    )
    args = parser.parse_args()
    if args.command == "run":
        run(dict(args.tree), args.root, tuple(args.seeds))
        return 0
    if args.command == "mlp":
        stamp = provenance.start(seeds=list(SEEDS))
        found = mlp(dict(args.tree))
        (args.root / "mlp.json").write_text(
            json.dumps({"arms": found, "provenance": stamp.finish()}, indent=1) + "\n"
        )
        return 0
    stamp = provenance.start(seeds=list(SEEDS))
    text, report = analyse(args.root)
    report["provenance"] = stamp.finish()
    (args.root / "results.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (args.root / "table.md").write_text(text)
    print(text)
    if args.update_docs:
        analyze44.update_doc(text, DOC, BEGIN, END)
    return 0


if __name__ == "__main__":
    sys.exit(main())
