"""``summary.json`` under ``compressor="auto"``: the whole run's bytes and density include the
measuring steps, which ran another method, so the summary states the steps from the choice on
beside them (``since_choice``), and ``gradsift train``'s lines name both."""

from __future__ import annotations

import pytest

from gradsift.tools.commands.train import format_summary
from gradsift.tools.train.summary import summarize

DENSE = 1_000_000.0


def _steps(measuring: int, total: int) -> list[dict]:
    """``measuring`` steps at density 0.01 (sidco-exp's), then fp32's dense steps."""
    return [
        {
            "step": step, "loss": 1.0, "lr": 0.1, "step_s": 0.5 if step < measuring else 0.1,
            "compute_s": 0.0, "compress_s": 0.0, "communicate_s": 0.0, "decompress_s": 0.0,
            "bytes_sent": 20_000.0 if step < measuring else DENSE,
            "bytes_padded": 25_000.0 if step < measuring else DENSE,
            "bytes_received": 20_000.0 if step < measuring else DENSE,
            "dense_bytes": DENSE, "density": 0.01 if step < measuring else 1.0,
        }
        for step in range(total)
    ]  # fmt: skip


def _summary(steps: list[dict], auto: dict | None) -> dict:
    run = {"compressor": "auto", "model": "mlp", "workers": 2, "recipe": {"auto": auto} if auto else {}}
    return summarize(steps, [], run=run, target_accuracy=None, wall_time_s=1.0)


def test_the_summary_states_the_steps_from_autos_choice_on() -> None:
    summary = _summary(_steps(7, 27), {"choice": "none", "decided_at": 7, "predicted_ms": {}})
    # the whole run: 7 steps at 20 kB and 20 at 1 MB
    assert summary["bytes_sent_per_step"] == pytest.approx((7 * 20_000 + 20 * DENSE) / 27)
    assert summary["achieved_density"] == pytest.approx((7 * 0.01 + 20) / 27)
    assert summary["since_choice"] == {
        "from_step": 7,
        "step_time_median_s": 0.1,
        "bytes_sent_per_step": DENSE,
        "bytes_padded_per_step": DENSE,
        "bytes_received_per_step": DENSE,
        "dense_bytes_per_step": DENSE,
        "compression_factor": 1.0,
        "achieved_density": 1.0,
    }
    lines = format_summary({**summary, "final_test_accuracy": None, "time_to_accuracy_s": None,
                            "target_accuracy": None, "steps": 27}, "runs/x").splitlines()  # fmt: skip
    assert lines[1] == (
        "  every step, the measuring steps included: step time median 100.0 ms, 0.746 MB sent per "
        "step per worker (1.3x less than fp32), 0.746 MB received, density 0.7433"
    )
    assert lines[2] == (
        "  from step 7 on (none, auto's choice): step time median 100.0 ms, 1.000 MB sent per step "
        "per worker (1.0x less than fp32), 1.000 MB received, density 1.0000"
    )


@pytest.mark.parametrize(
    "auto",
    [
        None,  # a named compressor
        {"choice": "measuring", "decided_at": None, "predicted_ms": {}},  # still measuring at the end
        # decided at the first recorded step (every step is the choice's), or after the last
        {"choice": "none", "decided_at": 0, "predicted_ms": {}},
        {"choice": "none", "decided_at": 27, "predicted_ms": {}},
    ],
)
def test_without_steps_on_both_sides_of_a_choice_there_is_no_since_choice(auto) -> None:
    summary = _summary(_steps(7, 27), auto)
    assert "since_choice" not in summary
    line = format_summary({**summary, "final_test_accuracy": None, "time_to_accuracy_s": None,
                           "target_accuracy": None, "steps": 27}, "runs/x").splitlines()[1]  # fmt: skip
    assert line.startswith("  step time median 100.0 ms, 0.746 MB sent per step per worker")


def test_on_the_wire_counts_nothing_for_a_worker_alone() -> None:
    from gradsift.tools.train.summary import on_the_wire

    pair = {"workers": 2, "bytes_sent_per_step": 10.0, "bytes_received_per_step": 15.0}
    assert on_the_wire(pair) == pair and on_the_wire(pair) is not pair  # a copy; the input stays
    alone = {"workers": 1, "bytes_sent_per_step": 10.0, "bytes_received_per_step": 10.0, "seed": 3}
    assert on_the_wire(alone) == {
        "workers": 1,
        "bytes_sent_per_step": 0.0,
        "bytes_received_per_step": 0.0,
        "seed": 3,
    }
    assert alone["bytes_sent_per_step"] == 10.0
    assert (
        on_the_wire({"workers": 2, "bytes_sent_per_step": 4.0})["bytes_received_per_step"] is None
    )  # an old run
