"""The demo behind ``gradsift demo``: five short runs of one model, compared.

fp32 dense (``none``), ``bf16``, ``sidco-exp`` and ``topk`` at ratio 0.01, and ``vgc``
(default alpha=1, zeta=0.999) each train the MLP on the embedded Fashion-MNIST
subset with 2 workers, same seed and steps, one after another in one launch of the
workers (:func:`~gradsift.tools.train.launcher.run_trainings`). As root with iproute2 the
workers talk over emulated links (default 100 Mbit/s); otherwise over localhost, and the table
adds the step times :mod:`gradsift.tools.predictions` predicts at 1 Gbit/s and 100 Mbit/s,
labelled "predicted". With CUDA and a GPU for each worker the workers train on the GPUs
with NCCL; otherwise (no CUDA, or fewer GPUs than workers) on the CPU with gloo.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from gradsift.compressors.registry import compressor_class
from gradsift.compressors.sidco import SIDCoExponential
from gradsift.tools.report import (
    comparison_rows,
    default_target,
    find_runs,
    format_table,
    predicted_step_seconds,
)
from gradsift.tools.train.config import TrainConfig
from gradsift.tools.train.data import EMBEDDED_DIR
from gradsift.tools.train.devices import fallback_device
from gradsift.tools.train.launcher import run_trainings
from gradsift.tools.train.netem import missing_prerequisites, parse_rate

DEMO_RUNS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("none", {}),
    ("bf16", {}),
    ("sidco-exp", {"ratio": 0.01}),
    ("topk", {"ratio": 0.01}),
    ("vgc", {}),
)
DEMO_MODEL = "mlp"
DEMO_WORKERS = 2
PREDICTED_BANDWIDTHS = {"1gbit": 1e9, "100mbit": 1e8}
#: (steps, eval_every) of the full demo and of ``--quick``.
LENGTHS = {False: (400, 50), True: (8, 0)}


def available(name: str) -> bool:
    """Whether compressor ``name``'s module can be imported in this installation."""
    try:
        compressor_class(name)
    except ImportError:
        return False
    return True


def run_demo(out: Path, *, quick: bool = False, bandwidth: str = "100mbit", emulate: bool = True,
             progress: bool = True) -> dict[str, Any]:  # fmt: skip
    """Run the demo into ``out``; print the table; return what ``demo.json`` holds."""
    out = Path(out)
    steps, eval_every = LENGTHS[quick]
    missing_tools = missing_prerequisites()
    emulated = emulate and not missing_tools
    network = (
        f"emulated {bandwidth} links (tc tbf, network namespaces)" if emulated else "localhost (no emulation)"
    )
    device, device_note = fallback_device(DEMO_WORKERS)
    print(f"gradsift demo: {DEMO_MODEL} on the embedded Fashion-MNIST subset, {DEMO_WORKERS} workers "
          f"on {'CUDA (NCCL)' if device == 'cuda' else 'the CPU (gloo)'}, {steps} steps per run, "
          f"over {network}")  # fmt: skip
    if device_note is not None:
        print(f"  {device_note}")
    if emulate and missing_tools:
        print(
            "  network emulation unavailable (needs "
            + "; ".join(missing_tools)
            + "): step times are localhost's"
        )
    missing = [name for name, _ in DEMO_RUNS if not available(name)]
    if missing:
        print(f"  NOTE: compressor(s) {', '.join(missing)} are not available in this installation; skipped")
    started = time.perf_counter()
    configs = []
    for name, options in DEMO_RUNS:
        if name in missing:
            continue
        configs.append(TrainConfig(
            out=str(out / name), model=DEMO_MODEL, compressor=name, options=options, workers=DEMO_WORKERS,
            batch_size=32, lr=0.05, warmup_steps=min(10, steps // 4), steps=steps, eval_every=eval_every,
            seed=0, data_dir=str(EMBEDDED_DIR), bandwidth=bandwidth if emulated else None,
            bandwidth_bps=parse_rate(bandwidth) if emulated else None, device=device, progress=progress,
        ))  # fmt: skip
    run_trainings(configs, out)  # one launch: the workers train the runs in turn
    runs = find_runs([out / name for name, _ in DEMO_RUNS if name not in missing])
    rows = comparison_rows(runs, default_target(runs))
    print()
    print(format_table(rows))
    if (note := exact_note(runs[0].summary["parameters"])) is not None:  # every run's model
        print(note)
    if not emulated:
        _add_predictions(rows, runs)
        print()
        print(format_predictions(rows))
    result = {"network": network, "emulated": emulated, "bandwidth": bandwidth if emulated else None,
              "model": DEMO_MODEL, "workers": DEMO_WORKERS, "device": device, "steps": steps, "missing_compressors": missing,
              "wall_time_s": time.perf_counter() - started, "rows": rows}  # fmt: skip
    (out / "demo.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nresults: {out / 'demo.json'} (and one run directory per compressor)")
    _plot(runs, out / "plots")
    return result


def exact_note(parameters: int) -> str | None:
    """Why the ``sidco-exp`` row equals ``topk``'s on a model of ``parameters`` elements, or None
    when it need not: no DDP bucket holds more than the model, and below its ``exact_below``
    (by default the variant's CPU crossover) SIDCo takes the exact top-k (docs/sidco.md)."""
    threshold = SIDCoExponential(**dict(DEMO_RUNS)["sidco-exp"]).exact_below
    if parameters >= threshold:
        return None
    return (
        f"note: sidco-exp selected as topk does: this model's {parameters:,} parameters are below its "
        f"exact_below ({threshold:,} elements), its CPU crossover with a fitted threshold rounded up to a "
        "power of two, under which it takes the exact top-k (docs/sidco.md); `gradsift train --compressor "
        "sidco-exp --option exact_below=0` fits at any size"
    )


def _plot(runs: list, out: Path) -> None:
    from gradsift.core.errors import MissingExtraError
    from gradsift.tools.report import plot_runs

    try:
        for path in plot_runs(runs, out):
            print(f"plot: {path}")
    except MissingExtraError as error:
        print(f"no plots: {error}")


def _add_predictions(rows: list[dict[str, Any]], runs: list) -> None:
    """Add ``predicted_step_ms`` (bandwidth name -> ms) to every row, from the cost model."""
    for row, run in zip(rows, runs, strict=True):
        row["predicted_step_ms"] = {
            name: predicted_step_seconds(run.summary, bits / 8) * 1e3
            for name, bits in PREDICTED_BANDWIDTHS.items()
        }


def format_predictions(rows: list[dict[str, Any]]) -> str:
    """The predicted step times, clearly labelled as predictions."""
    names = list(PREDICTED_BANDWIDTHS)
    lines = [
        "PREDICTED step time (cost model from the measured compute, compression and bytes; not measured):"
    ]
    lines.append(f"  {'run':<24}" + "".join(f"{'predicted ms @' + n:>24}" for n in names))
    for row in rows:
        lines.append(f"  {row['run']:<24}" + "".join(f"{row['predicted_step_ms'][n]:>24.1f}" for n in names))
    return "\n".join(lines)
