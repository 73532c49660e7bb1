"""The convergence analysis's generated markdown for workloads and tables with no run yet."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "convergence"))
import analyze
from protocol import WORKLOADS


def test_a_planned_workload_without_runs_is_one_line_not_an_empty_table() -> None:
    text = analyze.markdown({"workloads": {}, "trainer_defaults": {}})
    for name, workload in WORKLOADS.items():
        assert (
            f"**{name}** ({workload.epochs:g} epochs, {analyze.metric_name(name)}): {analyze.NOT_RUN}" in text
        )
    assert (
        f"defaults** (constant lr 0.05, seed 3; target: within 0.5 point of fp32): {analyze.NOT_RUN}" in text
    )
    assert "|" not in text  # no table header without rows


def test_only_the_chosen_workloads_and_no_defaults_line_when_some_are_chosen() -> None:
    name = next(iter(WORKLOADS))
    text = analyze.markdown({"workloads": {}}, workloads=(name,))
    assert (
        text.strip()
        == f"**{name}** ({WORKLOADS[name].epochs:g} epochs, {analyze.metric_name(name)}): {analyze.NOT_RUN}"
    )
