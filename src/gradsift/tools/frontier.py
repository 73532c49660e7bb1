"""The loss-gap-vs-bytes frontier of language-model runs (``gradsift report``'s fifth plot).

Among the runs handed in, the fp32 reference is the mean final test loss of the dense
per-step runs (compressor ``none``, more than one worker, no ``sync_every``, not DeMo, whose
compressor is ``none`` because it exchanges by itself). Every other
setting -- the runs that differ only in their seed -- is one point:

    gap = mean_seeds(loss / reference - 1) * 100 %,   sd over the seeds (0 for one seed),
    bytes = mean_seeds(bytes sent per worker per step, averaged over the run),

so a periodic method's bytes are per inner step, comparable with a per-step method's.
Points form one curve per *family*: how often the workers exchange (every step, or every
``H`` steps) and with which compressor, the curve running over the family's settings
(ratio, bits, ``H``, warm-up). A run of one worker alone sends nothing: it is the zero-byte
control, drawn as a level rather than a point on the log axis.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from gradsift.tools.train.summary import bytes_sent, single_worker

#: The PNG the frontier is drawn into.
FRONTIER_PLOT = "loss_gap_vs_bytes.png"


class RunLike(Protocol):
    summary: dict[str, Any]
    config: dict[str, Any]


@dataclass(frozen=True)
class FrontierPoint:
    """One setting's mean over its seeds."""

    family: str
    setting: str
    seeds: int
    bytes_per_step: float
    gap_percent: float
    gap_sd_percent: float


def _sync_every(run: RunLike) -> int:
    return int(run.config.get("sync_every") or 1)


def _demo(run: RunLike) -> bool:
    """Whether the run trained with ``--optimizer demo`` (DeMo's own exchange)."""
    return run.config.get("optimizer") == "demo"


def _family(run: RunLike) -> str:
    if single_worker(run.summary):
        return "one worker alone (no communication)"
    if _demo(run):
        return "every step: DeMo"
    every = _sync_every(run)
    return f"{'every step' if every == 1 else 'every H steps'}: {run.summary['compressor']}"


def _setting(run: RunLike) -> str:
    options = json.dumps(run.summary.get("options", {}), sort_keys=True)  # the dense warm-up too
    return f"{_family(run)} {options} H{_sync_every(run)}"


def frontier_points(runs: Sequence[RunLike]) -> list[FrontierPoint]:
    """The points of the language-model runs (those that report a perplexity), against their
    fp32 reference; empty without a reference (no dense per-step run) or without another setting."""
    scored = [
        r
        for r in runs
        if r.summary.get("final_perplexity") is not None and r.summary.get("final_test_loss") is not None
    ]
    reference_losses = [
        r.summary["final_test_loss"]
        for r in scored
        if r.summary["compressor"] == "none"
        and r.summary["workers"] > 1
        and _sync_every(r) == 1
        and not _demo(r)
    ]
    if not reference_losses:
        return []
    reference = statistics.fmean(reference_losses)
    settings: dict[str, list[RunLike]] = defaultdict(list)
    for run in scored:
        settings[_setting(run)].append(run)
    points = []
    for setting, members in settings.items():
        gaps = [100.0 * (r.summary["final_test_loss"] / reference - 1.0) for r in members]
        points.append(
            FrontierPoint(
                family=_family(members[0]),
                setting=setting,
                seeds=len(members),
                bytes_per_step=statistics.fmean(bytes_sent(r.summary) for r in members),
                gap_percent=statistics.fmean(gaps),
                gap_sd_percent=statistics.stdev(gaps) if len(gaps) > 1 else 0.0,
            )
        )
    return points if len(points) > 1 else []


def group_by_family(points: Sequence[FrontierPoint]) -> dict[str, list[FrontierPoint]]:
    """The points of each family in increasing bytes: one curve each."""
    families: dict[str, list[FrontierPoint]] = defaultdict(list)
    for point in sorted(points, key=lambda p: p.bytes_per_step):
        families[point.family].append(point)
    return dict(families)
