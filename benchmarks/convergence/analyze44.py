"""Issue 44's controls: paired per-seed gaps with 95 % t-intervals, and bytes sent and received.

    python benchmarks/convergence/analyze44.py                 # results/convergence/issue44/{results.json,table.md}
    python benchmarks/convergence/analyze44.py --update-docs   # also docs/adam.md between its issue44 markers

Reads the runs of ``campaign44.py`` (``results/convergence/issue44/runs/``: the fp32 lr screen,
the dense frozen-variance arm, the reproduction checks) and the protocol's own runs of the same
workloads (``results/convergence/runs/``: fp32 at lr 3e-3, bf16, one worker alone, the 1-bit arms).

Statistics. Every arm is paired with fp32 at lr 3e-3 *of the same seed* (same data order, same
initialisation): ``d_s = loss_arm(s) - loss_fp32(s)`` over the seeds both have, and the gap is
``mean(d) +- t_{0.975, n-1} * sd(d) / sqrt(n)`` (sd with n - 1); the relative gap is the same
interval of ``100 (loss_arm(s) / loss_fp32(s) - 1)``. One seed gives no interval.

Bytes. Per worker and per step, averaged over every step of the run (dense warm-up steps,
padding, headers and indices included, as ``gradsift train`` counts them in ``steps.jsonl``):
bytes sent and bytes received. The factor is against stock DDP's ring allreduce on the
*received* measure: a ring allreduce of N fp32 values receives ``2 (W - 1) / W * 4 N`` bytes per
worker per step (1.916 MB at W = 2 for this model), divided by the arm's mean received bytes.
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the intervals
import analyze
import campaign44
from intervals import Interval, paired_gap
from protocol import RUNS, WORKLOADS

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "adam.md"
BEGIN, END = "<!-- issue44-table:begin -->", "<!-- issue44-table:end -->"
REFERENCE = "none"  # fp32 at the protocol's lr 3e-3, from the protocol's runs


def ring_received(dense_bytes: float, workers: int) -> float:
    """Bytes one worker receives in a ring allreduce of ``dense_bytes``: ``2 (W - 1) / W`` of it."""
    return 2.0 * (workers - 1) / workers * dense_bytes


@dataclass(frozen=True)
class Row:
    arm: str
    source: str  # "protocol" (results/convergence/runs/) or "issue44"
    setting: str


ROWS = (
    Row("fp32-lr1.5e-3", "issue44", "stock DDP, fp32, lr 1.5e-3"),
    Row("none", "protocol", "stock DDP, fp32, lr 3e-3 (the protocol's; the reference)"),
    Row("fp32-lr6e-3", "issue44", "stock DDP, fp32, lr 6e-3"),
    Row("bf16", "protocol", "bf16 allreduce, lr 3e-3"),
    Row("alone", "protocol", "one worker alone at the per-worker batch (no communication)"),
    Row("dense-fv", "issue44", "frozen-variance AdamW, dense exchange (topk ratio 1: values + indices)"),
    Row("onebit-adam", "protocol", "frozen-variance AdamW + efsignsgd (the 1-bit arm)"),
    Row("onebit-adam-server", "protocol", "1-bit Adam as written (onebit, server feedback)"),
    Row("onebit-adam-w50", "issue44", "the 1-bit arm, a 50-step fp32 warm-up (the short freeze's control)"),
    Row(
        "onebit-adam-q4w50",
        "issue44",
        "the 1-bit arm, its 50-step warm-up in 4-bit codes with error feedback",
    ),
    Row("onebit-adam-q4w100", "issue44", "the 1-bit arm, its 100-step warm-up in 4-bit codes"),
    Row(
        campaign44.REFRESH_ARM,
        "issue44",
        "the 1-bit arm, a 25-step warm-up in 4-bit codes, its variance estimated again over steps 280-299",
    ),
    *(Row(arm, "issue44", campaign44.ARMS[arm].setting) for arm in campaign44.LION_ARMS),
    Row(
        f"{campaign44.REFRESH_ARM}-2s",
        "issue44",
        "the variance refresh's arm (25 coded warm-up steps, steps 280-299 estimate the variance), two-stage exchange",
    ),
    Row(
        "onebit-adam-q4w150-2s",
        "issue44",
        "the 1-bit arm, 150 warm-up steps in 4-bit codes, two-stage exchange",
    ),
    *(Row(arm, "issue44", campaign44.method(arm).setting) for arm in campaign44.ZERO_ONE),
)
WORKLOAD_LABELS = {
    "gpt-adamw": "314 steps",
    "gpt-adamw-3k": "3,000 steps",
    "gpt-adamw-6k": "6,000 steps",
    "gpt-adamw-w4-3k": "3,000 steps",
}


def run_directory(workload: str, arm: str, seed: int, source: str, issue44: Path) -> Path:
    """Where a run lies: the protocol's runs, or this campaign's (the protocol's arms at lengths
    the protocol never ran, 6,000 steps, were run by ``campaign44.py --longer``)."""
    name = f"{arm}-e{WORKLOADS[workload].epochs:g}-s{seed}"
    protocol, campaign = RUNS / workload / name, issue44 / "runs" / workload / name
    if source == "protocol":
        return protocol if protocol.exists() or not campaign.exists() else campaign
    return campaign


def load_run(directory: Path) -> dict[str, Any] | None:
    """A finished run's numbers (None if unfinished)."""
    summary_path, steps_path = directory / "summary.json", directory / "steps.jsonl.gz"
    if not (summary_path.is_file() and steps_path.is_file()):
        return None
    summary = json.loads(summary_path.read_text())
    with gzip.open(steps_path, "rt") as handle:
        steps = [json.loads(line) for line in handle if line.strip()]
    tail = steps[-max(1, len(steps) // 10) :]
    stamp = summary.get("provenance", {})
    return {
        "directory": str(directory.relative_to(ROOT)) if directory.is_relative_to(ROOT) else str(directory),
        "seed": summary["seed"],
        "workers": summary["workers"],
        "steps": len(steps),
        "final_val_loss": summary["final_test_loss"],
        "train_loss_last_10pct": statistics.fmean(s["loss"] for s in tail),
        "bytes_sent_per_step": statistics.fmean(s["bytes_sent"] for s in steps),
        "bytes_received_per_step": statistics.fmean(s["bytes_received"] for s in steps),
        "dense_bytes_per_step": summary["dense_bytes_per_step"],
        "loss_curve": [s["loss"] for s in steps],
        "commit": stamp.get("commit"),
        "dirty": stamp.get("dirty"),
        "command": stamp.get("command"),
        "load_before": stamp.get("load_before"),
        "load_after": stamp.get("load_after"),
    }


def collect(issue44: Path) -> dict[str, dict[str, dict[int, dict[str, Any]]]]:
    """``{workload: {arm: {seed: run}}}`` of every finished run the tables use."""
    found: dict[str, dict[str, dict[int, dict[str, Any]]]] = {}
    for workload in WORKLOAD_LABELS:
        for row in ROWS:
            for seed in campaign44.SEEDS + campaign44.EXTRA_SEEDS:
                run = load_run(run_directory(workload, row.arm, seed, row.source, issue44))
                if run is not None:
                    found.setdefault(workload, {}).setdefault(row.arm, {})[seed] = run
    return found


def signed(value: float, digits: int) -> str:
    return f"{value:+.{digits}f}"


def ci_text(gap: Interval, digits: int, unit: str = "") -> str:
    if gap.half is None:
        return f"{signed(gap.mean, digits)}{unit} (1 seed, no interval)"
    return f"{signed(gap.mean, digits)}{unit} [{signed(gap.low, digits)}, {signed(gap.high, digits)}]"


def arm_stats(runs: dict[int, dict[str, Any]], reference: dict[int, dict[str, Any]]) -> dict[str, Any]:
    losses = {s: r["final_val_loss"] for s, r in runs.items()}
    ref = {s: r["final_val_loss"] for s, r in reference.items()}
    workers = next(iter(runs.values()))["workers"]
    dense = next(iter(runs.values()))["dense_bytes_per_step"]
    received = statistics.fmean(r["bytes_received_per_step"] for r in runs.values())
    sent = statistics.fmean(r["bytes_sent_per_step"] for r in runs.values())
    paired = sorted(set(losses) & set(ref))
    stats: dict[str, Any] = {
        "seeds": sorted(losses),
        "final_val_loss": losses,
        "mean": statistics.fmean(losses.values()),
        "sd": statistics.stdev(losses.values()) if len(losses) > 1 else None,
        "train_loss_last_10pct": statistics.fmean(r["train_loss_last_10pct"] for r in runs.values()),
        "workers": workers,
        "bytes_sent_per_step": sent,
        "bytes_received_per_step": received,
        "ring_allreduce_received_per_step": ring_received(dense, workers) if workers > 1 else None,
        "factor_received": ring_received(dense, workers) / received if workers > 1 and received > 0 else None,
        "paired_seeds": paired,
    }
    if paired:
        for key, relative in (("gap", False), ("gap_pct", True)):
            gap = paired_gap(losses, ref, relative)
            stats[key] = {"n": gap.n, "mean": gap.mean, "sd": gap.sd, "half": gap.half,
                          "low": gap.low, "high": gap.high}  # fmt: skip
    return stats


def table(workload: str, arms: dict[str, dict[int, dict[str, Any]]]) -> tuple[str, dict[str, Any]]:
    """One workload's markdown table and its numbers."""
    reference = arms.get(REFERENCE, {})
    workers = WORKLOADS[workload].workers
    some = next(iter(next(iter(arms.values())).values()))
    ring = ring_received(some["dense_bytes_per_step"], workers)
    lines = [
        f"**{workload}** ({WORKLOAD_LABELS[workload]}, {workers} workers; final validation loss in nats/byte; "
        f"gaps paired by seed with fp32 at lr 3e-3, mean [95 % t-interval]; bytes per worker per step averaged "
        f"over the whole run, dense warm-up included; the factor is stock DDP's ring allreduce's received bytes, "
        f"2(W-1)/W x {some['dense_bytes_per_step'] / 1e6:.3f} MB = {ring / 1e6:.3f} MB, over the arm's received bytes)",
        "",
        "| arm | setting | seeds | final loss (mean ± sd) | paired gap to fp32 @ 3e-3 (nats) | same in % "
        "| training loss, last 10 % of steps | MB sent / received per step | fewer bytes received than ring allreduce |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    numbers: dict[str, Any] = {}
    for row in ROWS:
        runs = arms.get(row.arm)
        if not runs:
            continue
        stats = arm_stats(runs, reference) if reference else arm_stats(runs, {})
        numbers[row.arm] = stats
        spread = f" ± {stats['sd']:.3f}" if stats["sd"] is not None else ""
        if row.arm == REFERENCE:
            gap, pct = "reference", "reference"
        elif "gap" in stats:
            gap = ci_text(paired_gap({s: r["final_val_loss"] for s, r in runs.items()},
                                     {s: r["final_val_loss"] for s, r in reference.items()}), 3)  # fmt: skip
            pct = ci_text(paired_gap({s: r["final_val_loss"] for s, r in runs.items()},
                                     {s: r["final_val_loss"] for s, r in reference.items()}, relative=True), 1, " %")  # fmt: skip
        else:
            gap = pct = "no fp32 run of these seeds"
        if stats["workers"] == 1:
            traffic, factor = "none: one process", "no communication"
        else:
            traffic = (
                f"{stats['bytes_sent_per_step'] / 1e6:.3f} / {stats['bytes_received_per_step'] / 1e6:.3f}"
            )
            factor = f"{stats['factor_received']:.2f}x"
        seeds = ",".join(str(s) for s in stats["seeds"])
        lines.append(
            f"| {row.arm} | {row.setting} | {seeds} | {stats['mean']:.3f}{spread} | {gap} | {pct} "
            f"| {stats['train_loss_last_10pct']:.3f} | {traffic} | {factor} |"
        )
    decomposition = split(arms)
    if decomposition:
        lines += ["", "Paired by seed, the same intervals:"]
        for key, (label, gap, pct) in decomposition.items():
            numbers.setdefault("decomposition", {})[key] = {"n": gap.n, "mean": gap.mean, "half": gap.half,
                                                            "pct_mean": pct.mean, "pct_half": pct.half}  # fmt: skip
            lines.append(f"- {label}: {ci_text(gap, 3)} nats, {ci_text(pct, 1, ' %')}")
    return "\n".join(lines) + "\n", numbers


#: The two effects the controls separate: (key, arm, baseline arm, label).
EFFECTS = (
    ("optimizer", "dense-fv", REFERENCE, "the optimizer's effect (dense-fv - fp32 at 3e-3: frozen variance, "
                                         "clipping on the exchanged moment, no compression)"),
    ("compression", "onebit-adam", "dense-fv", "the compression's effect (onebit-adam - dense-fv: the same "
                                               "optimizer, 1-bit codes with error feedback)"),
    ("compression-server", "onebit-adam-server", "dense-fv", "1-bit Adam as written - dense-fv (its momentum "
                                                             "restart and server residual as well as the codes)"),
    ("short-freeze", "onebit-adam-w50", "onebit-adam", "a 50-step warm-up instead of the trainer's 10 % "
                                                       "(onebit-adam-w50 - onebit-adam, both in fp32)"),
    ("coded-warmup", "onebit-adam-q4w50", "onebit-adam-w50", "the warm-up's code (onebit-adam-q4w50 - "
                                                             "onebit-adam-w50: the same 50 steps in 4-bit codes)"),
    ("variance-refresh", campaign44.REFRESH_ARM, "onebit-adam-q4w50", "the variance estimated again at steps "
                                                                     "280-299 (onebit-adam-q4w25-r280 - "
                                                                     "onebit-adam-q4w50: about the same bytes)"),
    ("coded-freeze", "onebit-adam-q4w100", "onebit-adam", "a 100-step warm-up in 4-bit codes instead of the "
                                                         "trainer's 10 % in fp32 (onebit-adam-q4w100 - onebit-adam)"),
    *((f"local-steps-{arm}", arm, "onebit-adam", f"0/1 Adam's local steps and the warm-up's code ({arm} - "
                                                 "onebit-adam: both freeze the variance at the same step)")
      for arm in campaign44.ZERO_ONE),
)  # fmt: skip

#: Reruns on a campaign's own commit of a protocol run: (workload, the rerun's arm, the protocol's arm).
RERUNS = (("gpt-adamw", "fp32-repro", REFERENCE), ("gpt-adamw-w4", "fp32-repro-w4", REFERENCE))


def split(arms: dict[str, dict[int, dict[str, Any]]]) -> dict[str, tuple[str, Interval, Interval]]:
    """Each effect of :data:`EFFECTS` whose two arms share two seeds or more."""
    found = {}
    for key, arm, base, label in EFFECTS:
        a = {s: r["final_val_loss"] for s, r in arms.get(arm, {}).items()}
        b = {s: r["final_val_loss"] for s, r in arms.get(base, {}).items()}
        if len(set(a) & set(b)) >= 2:
            found[key] = (f"{label}, seeds {','.join(map(str, sorted(set(a) & set(b))))}",
                          paired_gap(a, b), paired_gap(a, b, relative=True))  # fmt: skip
    return found


def reproduction(issue44: Path) -> list[dict[str, Any]]:
    """The campaign's reruns of protocol runs on its own commit, against the protocol's runs."""
    checks = []
    pairs = [(w, arm, arm) for w in WORKLOAD_LABELS for arm in (REFERENCE, "onebit-adam")] + list(RERUNS)
    for (workload, rerun, original), seed in itertools.product(pairs, campaign44.SEEDS):
        rerun_at = run_directory(workload, rerun, seed, "issue44", issue44)
        original_at = run_directory(workload, original, seed, "protocol", issue44)
        new, old = load_run(rerun_at), load_run(original_at)
        if new is None or old is None or rerun_at == original_at:  # not a rerun: the run itself
            continue
        curve = max(
            (abs(a - b) for a, b in zip(new["loss_curve"], old["loss_curve"], strict=False)),
            default=None,
        )
        checks.append({
            "workload": workload, "arm": rerun, "protocol_arm": original, "seed": seed,
            "old": {"commit": old["commit"], "final_val_loss": old["final_val_loss"]},
            "new": {"commit": new["commit"], "final_val_loss": new["final_val_loss"]},
            "final_val_loss_difference": new["final_val_loss"] - old["final_val_loss"],
            "max_training_loss_difference_over_steps": curve,
            "bitwise_equal_curve": new["loss_curve"] == old["loss_curve"],
        })  # fmt: skip
    return checks


def unfinished(issue44: Path) -> list[str]:
    from run import finished

    return [str(r.directory.relative_to(issue44)) for r in campaign44.plan(issue44) if not finished(r)]


def whole_runs() -> tuple[str, list[dict[str, Any]]]:
    """Item 5's check: each whole emulated run of ``run.py validation`` on the AdamW GPT against
    the time composed for the localhost run of its seed (``analyze.composed_times``)."""
    rows = [r for r in analyze.validation(analyze.load_results()) if r["workload"] == "gpt-adamw-3k"]
    composed = {(r["method"], r["link"]) for r in rows}
    for path in sorted((analyze.VALIDATION / "gpt-adamw-3k").glob("*/summary.json")):
        method, _, link = path.parent.name.rpartition("-")
        if (method, link) not in composed:  # a campaign44 arm: no localhost timing runs to compose from
            measured = json.loads(path.read_text())["train_time_s"]
            rows.append({"workload": "gpt-adamw-3k", "method": method, "link": link,
                         "measured_train_time_s": measured, "composed_train_time_s": None, "ratio": None})  # fmt: skip
    if not rows:
        return "", rows
    lines = [
        "**Whole emulated runs** (`run.py validation`: seed 0, 3,000 steps, 2 workers, each link emulated "
        "between network namespaces) against the training time composed for the localhost run of the "
        "same seed from 40-step shaped timings:",
        "",
        "| arm | link | measured training time | composed | composed / measured |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for r in sorted(rows, key=lambda r: (r["link"], r["method"] != "none", r["method"])):
        composed_text = "not composed" if r["ratio"] is None else f"{r['composed_train_time_s']:.0f} s"
        ratio_text = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"
        lines.append(
            f"| {r['method']} | {r['link']} | {r['measured_train_time_s']:.0f} s | {composed_text} | {ratio_text} |"
        )
    return "\n".join(lines) + "\n", rows


def analyse(issue44: Path) -> tuple[str, dict[str, Any]]:
    found = collect(issue44)
    parts, numbers = [], {}
    for workload in WORKLOAD_LABELS:
        if workload in found:
            text, numbers[workload] = table(workload, found[workload])
            parts.append(text)
    measured, validation = whole_runs()
    if measured:
        parts.append(measured)
    runs = [
        {"workload": w, "arm": a, **{k: v for k, v in r.items() if k != "loss_curve"}}
        for w, arms in found.items() for a, seeds in arms.items() for r in seeds.values()
    ]  # fmt: skip
    report = {
        "description": "issue 44's controls on gpt-adamw: paired per-seed gaps to fp32 at lr 3e-3 (95 % t-intervals) "
        "and bytes per worker per step, sent and received; factor = ring allreduce received / arm received",
        "campaign_command": "PYTHONPATH=$PWD/src nohup nice -n 19 python benchmarks/convergence/campaign44.py run "
        "--root <repo>/results/convergence/issue44 (from a clean worktree of the commit in each run's provenance)",
        "analysis_command": "python benchmarks/convergence/analyze44.py --update-docs",
        "tables": numbers,
        "reproduction": reproduction(issue44),
        "planned_not_finished": unfinished(issue44),
        "whole_emulated_runs": validation,
        "runs": runs,
    }
    return "\n".join(parts), report


def update_doc(text: str, doc: Path = DOC, opening: str = BEGIN, closing: str = END) -> None:
    """Write ``text`` between the markers ``opening`` and ``closing`` of ``doc``."""
    page = doc.read_text()
    head, begin, rest = page.partition(opening)
    _, end, tail = rest.partition(closing)
    if not begin or not end:
        raise SystemExit(f"{doc} has no {opening} ... {closing} block")
    doc.write_text(f"{head}{opening}\n{text}{closing}{tail}")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--root", type=Path, default=campaign44.ISSUE44, help="the campaign's folder")
    parser.add_argument("--update-docs", action="store_true", help="rewrite docs/adam.md's issue44 block")
    args = parser.parse_args()
    text, report = analyse(args.root)
    (args.root / "results.json").write_text(json.dumps(report, indent=1) + "\n")
    (args.root / "table.md").write_text(text)
    print(text)
    print(f"reproduction: {json.dumps(report['reproduction'], indent=1)}")
    print(f"planned, not finished: {report['planned_not_finished']}")
    if args.update_docs:
        update_doc(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
