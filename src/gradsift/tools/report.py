"""Compare finished training runs: a table and four plots (``gradsift report``), and for
language-model runs with an fp32 run among them the loss-gap-vs-bytes frontier
(:mod:`gradsift.tools.frontier`).

A run directory holds ``summary.json``, ``steps.jsonl`` (or ``steps.jsonl.gz``, as the
campaigns keep it), ``evals.jsonl`` and ``config.json`` as written by ``gradsift train``
(see :mod:`gradsift.tools.train.summary`). Time to accuracy is *training* time (sum of
step times, evaluation excluded) at the first evaluation whose test accuracy reaches
the target.
"""

from __future__ import annotations

import gzip
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path
from typing import Any

from gradsift.core.errors import InvalidOptionError
from gradsift.tools.frontier import FRONTIER_PLOT, frontier_points, group_by_family
from gradsift.tools.train.summary import (
    PHASES,
    bytes_sent,
    on_the_wire,
    single_worker,
    time_to_accuracy,
    wire_factor,
)

#: The PNG files :func:`plot_runs` always writes (and :data:`FRONTIER_PLOT` when it has points).
PLOTS = ("accuracy_vs_time.png", "accuracy_vs_bytes.png", "density.png", "time_per_phase.png")


@dataclass
class Run:
    """One finished run: its directory, summary, step and eval records."""

    path: Path
    summary: dict[str, Any]
    steps: list[dict[str, Any]]
    evals: list[dict[str, Any]]
    config: dict[str, Any]

    @property
    def label(self) -> str:
        """What ran, its ratio, workers and bandwidth, e.g. ``topk r=0.01 w4 100mbit``; ``auto``
        with its choice (``auto->bf16``), DiLoCo with its round and compressor
        (``diloco-h4 blockquant``)."""
        s = self.summary
        recipe = s.get("recipe") or {}
        outer, auto = recipe.get("diloco"), recipe.get("auto")
        if outer is not None:
            parts = [f"diloco-h{outer['sync_every']}", outer.get("compressor", s["compressor"])]
        elif auto is not None:
            parts = [f"auto->{auto['choice']}"]
        else:
            parts = [s["compressor"]]
        if "ratio" in s.get("options", {}):
            parts.append(f"r={s['options']['ratio']}")
        parts.append(f"w{s['workers']}")
        if s.get("bandwidth"):
            parts.append(str(s["bandwidth"]))
        return " ".join(parts)

    def cumulative_bytes_at(self, step: int) -> float:
        """Bytes this worker sent during the first ``step`` steps (none for a worker alone)."""
        if single_worker(self.summary):
            return 0.0
        totals = list(accumulate(r["bytes_sent"] for r in self.steps))
        return totals[min(step, len(totals)) - 1] if step > 0 and totals else 0.0


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines file, or of its gzipped copy ``path.gz`` when only that exists."""
    text = (
        path.read_text()
        if path.is_file()
        else gzip.decompress(path.with_name(path.name + ".gz").read_bytes()).decode()
    )
    return [
        _parsed(line, f"{path}:{number}") for number, line in enumerate(text.splitlines(), 1) if line.strip()
    ]


def _parsed(text: str, where: str) -> Any:
    """``text`` as JSON; :class:`InvalidOptionError` naming ``where`` when it is not."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise InvalidOptionError(
            f"{where} is not JSON ({error.msg}): a run cut short while writing, or two runs writing "
            "one directory?"
        ) from None


def load_run(path: str | Path) -> Run:
    """Read one run directory; raise :class:`InvalidOptionError` naming a missing file."""
    path = Path(path)
    missing = [
        name
        for name in ("summary.json", "steps.jsonl", "evals.jsonl")
        if not (path / name).is_file() and not (path / f"{name}.gz").is_file()
    ]
    if missing:
        raise InvalidOptionError(f"{path} is not a finished gradsift run: missing {', '.join(missing)}")
    config_file, summary_file = path / "config.json", path / "summary.json"
    config = _parsed(config_file.read_text(), str(config_file)) if config_file.is_file() else {}
    return Run(path, _parsed(summary_file.read_text(), str(summary_file)), _read_jsonl(path / "steps.jsonl"),
               _read_jsonl(path / "evals.jsonl"), config)  # fmt: skip


def find_runs(paths: Sequence[str | Path]) -> list[Run]:
    """Runs in ``paths``: each path is a run directory or a directory of run directories."""
    runs = []
    for path in map(Path, paths):
        if not path.is_dir():
            raise InvalidOptionError(f"run directory {path} does not exist")
        if (path / "summary.json").is_file():
            runs.append(load_run(path))
            continue
        children = sorted(child for child in path.iterdir() if (child / "summary.json").is_file())
        if not children:
            raise InvalidOptionError(f"{path} holds no summary.json, neither directly nor in a subdirectory")
        runs.extend(load_run(child) for child in children)
    return runs


def default_target(runs: Sequence[Run]) -> float | None:
    """The best final accuracy of the fp32 dense (``none``) runs minus one point, else None."""
    dense = [r.summary["final_test_accuracy"] for r in runs if r.summary["compressor"] == "none"]
    dense = [a for a in dense if a is not None]
    return max(dense) - 0.01 if dense else None


def predicted_step_seconds(summary: dict[str, Any], bandwidth: float, workers: int | None = None,
                           latency: float = 0.0) -> float:  # fmt: skip
    """Step time :mod:`gradsift.tools.predictions` predicts for a run's method at ``bandwidth``
    (bytes/s) and ``workers`` (default: the run's), from its measured medians.

    ``T = T_c + T_s + T_comm`` with ``T_c`` the compute median, ``T_s`` the compress +
    decompress medians and ``T_comm`` a ring allreduce of the message for
    methods whose default exchange is an allreduce (``none``, ``bf16``, ``randomk``,
    ``powersgd``) or a ring allgather of it otherwise (sparsifiers, VGC, quantizers).
    """
    from gradsift.compressors.registry import compressor_class
    from gradsift.exchanges.choice import exchange_class
    from gradsift.tools.predictions import allgather_seconds, ring_allreduce_seconds

    workers = workers or summary["workers"]
    message = summary["bytes_sent_per_step"]
    if exchange_class(compressor_class(summary["compressor"]).exchanges[0]).reduces:
        communicate = ring_allreduce_seconds(message, workers, bandwidth, latency)
    else:
        communicate = allgather_seconds(message, workers, bandwidth, latency)
    return (
        summary["compute_median_s"]
        + summary["compress_median_s"]
        + summary["decompress_median_s"]
        + communicate
    )


def distinct_labels(runs: Sequence[Run]) -> list[str]:
    """Each run's :attr:`Run.label`; where runs share one (seeds of one setting, one setting on
    several models), each followed by its directory's name -- by its path where the names
    agree too -- so no two rows, curves or bars of a report read alike."""
    labels = [run.label for run in runs]
    shared = {label for label, count in Counter(labels).items() if count > 1}
    named = [
        f"{label} [{run.path.name}]" if label in shared else label
        for label, run in zip(labels, runs, strict=True)
    ]
    still = {label for label, count in Counter(named).items() if count > 1}
    return [
        f"{label} [{run.path}]" if name in still else name
        for label, name, run in zip(labels, named, runs, strict=True)
    ]


def comparison_rows(runs: Sequence[Run], target: float | None) -> list[dict[str, Any]]:
    """One row per run with the numbers the table and the JSON report show."""
    rows = []
    for run, label in zip(runs, distinct_labels(runs), strict=True):
        s = run.summary
        rows.append({
            "run": label, "path": str(run.path), "compressor": s["compressor"], "workers": s["workers"],
            "bandwidth": s.get("bandwidth"), "steps": s["steps"],
            # a worker alone sends nothing: no factor below fp32 to give
            "bytes_per_step": bytes_sent(s), "compression_factor": None if single_worker(s) else s["compression_factor"],
            "wire_factor": None if single_worker(s) else wire_factor(s),
            "bytes_received_per_step": on_the_wire(s)["bytes_received_per_step"],
            "density": s["achieved_density"],
            "overhead_ms": (s["compress_median_s"] + s["decompress_median_s"]) * 1e3,
            "communicate_ms": s["communicate_median_s"] * 1e3, "step_ms": s["step_time_median_s"] * 1e3,
            "accuracy": s["final_test_accuracy"], "target": target,
            "time_to_accuracy_s": time_to_accuracy(run.evals, target) if target is not None else s["time_to_accuracy_s"],
            "train_time_s": s["train_time_s"], "wall_time_s": s["wall_time_s"],
            "since_choice": s.get("since_choice"),
        })  # fmt: skip
    return rows


def _cell(value: Any, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _mb(value: float | None) -> str:
    return _cell(None if value is None else value / 1e6, ".3f")


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """A fixed-width text table of :func:`comparison_rows`, then a line for each ``auto`` run
    that made its choice during the run (:func:`choice_notes`)."""
    target = next((r["target"] for r in rows if r["target"] is not None), None)
    tta_header = f"t->{target:.3f} s" if target is not None else "t->acc s"
    header = [
        "run",
        "MB/step",
        "fp32/sent",
        "fp32/wire",
        "MB recv",
        "density",
        "overhead ms",
        "comm ms",
        "step ms",
        "test acc",
        tta_header,
        "train s",
    ]
    body = [
        [r["run"], _cell(r["bytes_per_step"] / 1e6, ".3f"), _cell(r["compression_factor"], ".1f"),
         _cell(r["wire_factor"], ".1f"), _mb(r["bytes_received_per_step"]), _cell(r["density"], ".4f"), _cell(r["overhead_ms"], ".1f"), _cell(r["communicate_ms"], ".1f"),
         _cell(r["step_ms"], ".1f"), _cell(r["accuracy"], ".4f"), _cell(r["time_to_accuracy_s"], ".1f"),
         _cell(r["train_time_s"], ".1f")]
        for r in rows
    ]  # fmt: skip
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths, strict=True)))
             for line in [header, *body]]  # fmt: skip
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines + choice_notes(rows))


def choice_notes(rows: Sequence[dict[str, Any]]) -> list[str]:
    """For each row with a ``since_choice`` (``summary.json``'s, under ``compressor="auto"``):
    its bytes, factor and density from the step of the choice on -- the table's are every
    step's, the measuring steps included, which ran another method."""
    notes = []
    for row in rows:
        since = row.get("since_choice")
        if since is None:
            continue
        notes.append(
            f"{row['run']}: the row counts every step, the measuring steps included; from step "
            f"{since['from_step']} on (the choice's): {since['bytes_sent_per_step'] / 1e6:.3f} MB/step, "
            f"fp32/sent {since['compression_factor']:.1f}, {since['bytes_received_per_step'] / 1e6:.3f} MB recv, "
            f"density {since['achieved_density']:.4f}, step {since['step_time_median_s'] * 1e3:.1f} ms"
        )
    return notes


def plot_runs(runs: Sequence[Run], out: str | Path) -> list[Path]:
    """Write the :data:`PLOTS` for ``runs`` into ``out``; return their paths.

    Needs matplotlib (the ``plot`` extra); raises MissingExtraError naming
    ``pip install 'gradsift[plot]'`` without it.
    """
    from gradsift.core.extras import require

    matplotlib = require("matplotlib", "plot", purpose="plots in `gradsift report`")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = []

    def save(figure: Any, name: str) -> None:
        figure.tight_layout()
        figure.savefig(out / name, dpi=120)
        plt.close(figure)
        written.append(out / name)

    names = distinct_labels(runs)

    def curves(name: str, points: Any, marker: str | None, **labels: str) -> None:
        """One line per run; ``points(run)`` gives its ``(xs, ys)``."""
        figure, axes = plt.subplots(figsize=(7, 4.5))
        for run, label in zip(runs, names, strict=True):
            axes.plot(*points(run), marker=marker, label=label)
            if name == "density.png" and "ratio" in run.summary.get("options", {}):
                axes.axhline(run.summary["options"]["ratio"], linestyle=":", color="grey", linewidth=0.8)
        axes.set(**labels)
        axes.grid(alpha=0.3)
        axes.legend(fontsize=8)
        save(figure, name)

    def accuracies(run: Run) -> list[float]:
        return [e["accuracy"] for e in run.evals]

    curves(
        PLOTS[0],
        lambda run: ([e["train_time_s"] for e in run.evals], accuracies(run)),
        "o",
        xlabel="training time (s, evaluation excluded)",
        ylabel="test accuracy",
        title="Time to accuracy",
    )
    curves(
        PLOTS[1],
        lambda run: (
            [max(run.cumulative_bytes_at(e["step"]), 1.0) / 1e6 for e in run.evals],
            accuracies(run),
        ),
        "o",
        xscale="log",
        xlabel="MB sent per worker (cumulative)",
        ylabel="test accuracy",
        title="Accuracy vs bytes sent",
    )
    curves(PLOTS[2], lambda run: ([r["step"] for r in run.steps], [max(r["density"], 1e-6) for r in run.steps]),
           None, yscale="log", xlabel="step", ylabel="achieved density (elements sent / total)",
           title="Achieved density (dotted: target ratio)")  # fmt: skip

    figure, axes = plt.subplots(figsize=(max(6, 1.1 * len(runs) + 2), 4.5))
    bottom = [0.0] * len(runs)
    for phase in PHASES:
        key = f"{phase.removesuffix('_s')}_median_s"
        heights = [run.summary[key] * 1e3 for run in runs]
        axes.bar(names, heights, bottom=bottom, label=phase.removesuffix("_s"))
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    steps_ms = [run.summary["step_time_median_s"] * 1e3 for run in runs]
    axes.scatter(names, steps_ms, marker="_", s=900, color="black", zorder=3, label="measured step time")
    axes.set(ylabel="median ms per step",
             title="Time per phase (hook timers sum overlapping buckets: bars can exceed the step)")  # fmt: skip
    axes.tick_params(axis="x", rotation=30, labelsize=8)
    axes.legend(fontsize=8)
    save(figure, PLOTS[3])

    points = frontier_points(runs)
    if points:
        figure, axes = plt.subplots(figsize=(7, 4.5))
        for family, members in group_by_family(points).items():
            if all(p.bytes_per_step == 0 for p in members):  # the zero-byte control: a level
                axes.axhline(members[0].gap_percent, linestyle="--", color="grey", label=family)
                continue
            axes.errorbar([p.bytes_per_step for p in members], [p.gap_percent for p in members],
                          yerr=[p.gap_sd_percent for p in members], marker="o", capsize=3, label=family)  # fmt: skip
        axes.axhline(0.0, color="black", linewidth=0.8)
        axes.set(xscale="log", xlabel="bytes sent per worker per step (mean over the run)",
                 ylabel="final loss vs fp32 (%), mean +- sd over seeds",
                 title="Loss gap vs bytes: one curve per method family")  # fmt: skip
        axes.grid(alpha=0.3)
        axes.legend(fontsize=7)
        save(figure, FRONTIER_PLOT)
    return written
