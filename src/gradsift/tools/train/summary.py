"""Per-step records -> the run's ``summary.json`` (pure functions, no torch.distributed).

A step record (one JSON line of ``steps.jsonl``, written by rank 0) holds ``step``,
``loss``, ``lr``, ``step_s`` (wall time of forward + backward + exchange + optimizer
step), ``compress_s``, ``communicate_s``, ``decompress_s`` (the DDP hook's phase
timers for that step, summed over buckets), ``compute_s = step_s - compress_s -
communicate_s - decompress_s`` (floored at 0; the hook's phases overlap backward, so
this is a lower bound of the compute time), ``bytes_sent`` (bytes of this worker's
message), ``bytes_padded`` (plus the padding an allgather adds to match the longest
worker), ``bytes_received`` (what arrives at this worker), ``dense_bytes`` (the uncompressed gradient, what an fp32 allreduce carries)
and ``density`` (achieved fraction of gradient elements sent). An eval record (``evals.jsonl``) holds ``step``,
``accuracy``, ``loss`` (mean per prediction: per image, or per byte for the language
model), ``train_time_s`` (sum of ``step_s`` so far: evaluation time
excluded) and ``wall_time_s`` (since training started, evaluation included).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from gradsift.core.errors import InvalidOptionError

PHASES = ("compute_s", "compress_s", "communicate_s", "decompress_s")


def time_to_accuracy(evals: Sequence[dict[str, Any]], target: float | None) -> float | None:
    """Training time (``train_time_s``) of the first evaluation with accuracy >= ``target``.

    None when ``target`` is None or never reached.
    """
    if target is None:
        return None
    reached = (e["train_time_s"] for e in evals if e["accuracy"] >= target)
    return next(reached, None)


def time_to_loss(evals: Sequence[dict[str, Any]], target: float | None) -> float | None:
    """Training time of the first evaluation with loss <= ``target`` (None: no target / never)."""
    if target is None:
        return None
    return next((e["train_time_s"] for e in evals if e["loss"] <= target), None)


def single_worker(summary: dict[str, Any]) -> bool:
    """One worker alone: its hook counts the dense message DDP would send, but nothing
    leaves the process (the zero-communication control)."""
    return bool(summary["workers"] == 1)


def bytes_sent(summary: dict[str, Any]) -> float:
    """Bytes each worker sends per step: ``bytes_sent_per_step``, and 0 for a worker alone."""
    return 0.0 if single_worker(summary) else float(summary["bytes_sent_per_step"])


def on_the_wire(summary: dict[str, Any]) -> dict[str, Any]:
    """``summary`` with the bytes each worker sent and received per step as they crossed the
    wire: :func:`bytes_sent`, and 0 received for a worker alone (None where a run recorded
    before the received bytes were has none)."""
    lone = single_worker(summary)
    return {**summary, "bytes_sent_per_step": bytes_sent(summary),
            "bytes_received_per_step": 0.0 if lone else summary.get("bytes_received_per_step")}  # fmt: skip


def wire_factor(summary: dict[str, Any]) -> float:
    """fp32's bytes over the bytes on the wire, padding to capacity included (``compression_factor``
    divides by the bytes sent instead)."""
    return summary["dense_bytes_per_step"] / max(summary["bytes_padded_per_step"], 1.0)


def traffic(steps: Sequence[dict[str, Any]], first: int = 0) -> dict[str, float]:
    """The mean bytes per step of the step records numbered ``first`` or later (sent,
    padded, received, fp32's), fp32's bytes over those sent (``compression_factor``) and
    the mean density (``achieved_density``)."""

    def mean(key: str) -> float:
        return statistics.fmean(r[key] for r in steps if r["step"] >= first)

    sent, dense = mean("bytes_sent"), mean("dense_bytes")
    return {
        "bytes_sent_per_step": sent,
        "bytes_padded_per_step": mean("bytes_padded"),
        # 0 for records written before the key was
        "bytes_received_per_step": statistics.fmean(
            r.get("bytes_received", 0.0) for r in steps if r["step"] >= first
        ),
        "dense_bytes_per_step": dense,
        "compression_factor": dense / max(sent, 1.0),
        "achieved_density": mean("density"),
    }


def choice_step(run: dict[str, Any], steps: Sequence[dict[str, Any]]) -> int | None:
    """The step from which ``compressor="auto"`` ran its last choice (``recipe.auto.decided_at``),
    when steps before it (its measuring steps) and after it were recorded; else None."""
    auto = (run.get("recipe") or {}).get("auto") or {}
    decided = auto.get("decided_at")
    if not isinstance(decided, int) or decided <= steps[0]["step"] or decided > steps[-1]["step"]:
        return None
    return decided


def summarize(
    steps: Sequence[dict[str, Any]],
    evals: Sequence[dict[str, Any]],
    *,
    run: dict[str, Any],
    target_accuracy: float | None,
    wall_time_s: float,
    target_loss: float | None = None,
) -> dict[str, Any]:
    """Build the summary: ``run`` (fixed facts: compressor, options, workers, ...) plus
    medians of the step and phase times, mean bytes and density per step (:func:`traffic`),
    the final accuracy and loss, and the times to ``target_accuracy`` and ``target_loss``.
    Under ``compressor="auto"`` with a choice made during the run, ``since_choice`` holds
    the median step time and :func:`traffic` of the steps from :func:`choice_step` on
    (``from_step``): the whole run's include the measuring steps, which ran another method."""
    if not steps:
        raise InvalidOptionError("summarize needs at least one step record")
    summary = dict(run)
    summary["steps"] = len(steps)
    summary["step_time_median_s"] = statistics.median(r["step_s"] for r in steps)
    for phase in PHASES:
        summary[f"{phase.removesuffix('_s')}_median_s"] = statistics.median(r[phase] for r in steps)
    summary.update(traffic(steps))
    chosen_from = choice_step(run, steps)
    if chosen_from is not None:
        chosen = (r["step_s"] for r in steps if r["step"] >= chosen_from)
        summary["since_choice"] = {
            "from_step": chosen_from,
            "step_time_median_s": statistics.median(chosen),
            **traffic(steps, chosen_from),
        }
    summary["final_loss"] = steps[-1]["loss"]
    summary["final_test_accuracy"] = evals[-1]["accuracy"] if evals else None
    summary["final_test_loss"] = evals[-1].get("loss") if evals else None
    summary["target_accuracy"] = target_accuracy
    summary["time_to_accuracy_s"] = time_to_accuracy(evals, target_accuracy)
    summary["target_loss"] = target_loss
    summary["time_to_loss_s"] = time_to_loss(evals, target_loss)
    summary["train_time_s"] = sum(r["step_s"] for r in steps)
    summary["wall_time_s"] = wall_time_s
    summary["evals"] = list(evals)
    return summary
