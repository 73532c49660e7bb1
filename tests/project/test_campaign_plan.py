"""The convergence campaign plans each workload's runs with methods made for its optimizer.

benchmarks/convergence/protocol.py names the SGD methods (the VGG plan, its timing runs)
and the AdamW campaign's own methods (local-AdamW modes with ``--sync-every``, the Adam
anchors, the zero-communication control). Oracle: the ``gradsift train`` arguments each
planned run would pass.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "convergence"))
import protocol

ADAMW_ONLY_FLAGS = ("--sync-every", "--optimizer", "--workers")


def test_the_sgd_plan_runs_no_method_of_the_adamw_campaign() -> None:
    vgg = [run for run in protocol.accuracy_runs() if run.workload == "vgg"]
    assert vgg, "the SGD plan has VGG runs"
    for run in vgg:
        method_flags = protocol.METHODS[run.method].train_arguments()
        assert not set(ADAMW_ONLY_FLAGS) & set(method_flags), run.name
        assert not any(o in protocol.METHODS[run.method].options for o in ("adam", "outer_lr")), run.name


def test_the_adamw_campaigns_methods_are_planned_only_on_adamw_workloads() -> None:
    for run in protocol.adamw_runs():
        workload = protocol.WORKLOADS[run.workload]
        assert workload.optimizer == "adamw", run
    timed = {(t.workload, t.method) for t in protocol.timing_runs() if t.workload == "vgg"}
    assert not {m for _, m in timed} & (set(protocol.ADAMW) - set(protocol.HEADLINE))


def test_both_3000_step_adamw_workloads_get_a_time_axis_on_both_links() -> None:
    for workload, methods in (("gpt-adamw-3k", protocol.ADAMW_3K), ("gpt-adamw-w4-3k", protocol.ADAMW_W4_3K)):
        timed = {(t.method, t.link) for t in protocol.timing_runs() if t.workload == workload}
        expected = {(m, link) for m in methods if m != "alone" for link in ("100mbit", "1gbit")}
        assert timed == expected, workload
