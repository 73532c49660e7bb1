"""Where the benchmarks live and where their results go.

``benchmarks/<area>/`` holds an area's scripts and their docs; everything they write (JSON,
JSONL, logs, run folders, plots) goes under ``results/<area>/`` at the repository root,
the same area name. A script names its default output with :func:`results_dir`::

    parser.add_argument("--out", type=Path, default=results_dir(__file__) / "results.json")
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"


def results_dir(script: str | Path) -> Path:
    """``results/<area>/`` for a script of ``benchmarks/<area>/`` (pass its ``__file__``)."""
    return RESULTS / Path(script).resolve().parent.name
