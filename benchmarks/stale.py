"""Committed results that cannot back a number as they stand: why, and what regenerates them.

``STALE`` is the list ``tests/project/test_claims.py`` reads. A ``"provenance"`` entry covers
results that name no commit of this history (none at all, or one lost to a rebase), or are
stamped dirty: the test accepts such a result -- one that names a commit, or one a
published claim reads -- only while an entry covers it, and fails an entry whose results
all carry a valid stamp (re-run: remove the entry). A ``"code"`` entry covers results
with a valid stamp whose code has moved since; it documents, nothing enforces it. Both
kinds say why, the command that regenerates the result and its estimated time on this
project's 2-core machine. ``benchmarks/STALE.md`` shows the list (generated from here by
``python benchmarks/claims.py --write``).

``python benchmarks/stale.py`` prints the live audit: for every committed result, the
commit that last wrote it and the commits since then to the code that moves it
(``MOVED_BY``), from ``git log`` (across renames: a move writes nothing).
"""

from __future__ import annotations

import fnmatch
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from paths import ROOT

SRC = "src/gradsift"

# Result files (globs, first match wins) -> the source paths whose changes move their numbers.
MOVED_BY: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("results/compress/randomk_sampling.json", (f"{SRC}/compressors/randomk.py",)),
    (
        "results/compress/*",
        (f"{SRC}/compressors", f"{SRC}/tools/benchmarking"),
    ),
    (
        "results/estimation/*",
        (
            f"{SRC}/compressors/sidco.py",
            f"{SRC}/compressors/stats.py",
            f"{SRC}/compressors/kernels.py",
            f"{SRC}/hook/feedback.py",
        ),
    ),
    ("results/quantizers/bitpack_speed.json", (f"{SRC}/compressors/bitpack.py",)),
    (
        "results/quantizers/terngrad_variance.json",
        (f"{SRC}/compressors/terngrad.py", f"{SRC}/compressors/quantization.py"),
    ),
    ("results/vgc/hook_overhead.json", (f"{SRC}/compressors/variance.py",)),
    ("results/scaling/predictions.json", (f"{SRC}/exchanges/costmodel.py", f"{SRC}/tools/predictions.py")),
    ("results/*", (SRC,)),  # the hook, the exchanges, the trainer: everything
)


@dataclass(frozen=True)
class Stale:
    """Results (repository-relative globs) that cannot back a number as they stand."""

    files: tuple[str, ...]
    kind: str  # "provenance": no valid commit stamp (enforced); "code": stamped, but the code moved
    why: str
    regenerate: str
    cpu_time: str

    def covers(self, path: str) -> bool:
        return any(fnmatch.fnmatchcase(path, pattern) for pattern in self.files)


STALE: tuple[Stale, ...] = ()  # 3 December: the last entries (exit, scaling) re-run with stamps


def covering(path: str) -> Stale | None:
    """The entry that covers ``path`` (repository-relative), if any."""
    return next((entry for entry in STALE if entry.covers(path)), None)


def moved_by(path: str) -> tuple[str, ...]:
    return next(paths for pattern, paths in MOVED_BY if fnmatch.fnmatchcase(path, pattern))


class StaleList:
    """The generated part of ``benchmarks/STALE.md``: every entry of ``STALE``."""

    name = "stale"
    claims = ()

    def render(self, root: Path = ROOT) -> str:
        lines = []
        for entry in STALE:
            lines += [
                f"### {', '.join(f'`{f}`' for f in entry.files)}",
                "",
                f"- **Why** ({entry.kind}): {entry.why}",
                f"- **Regenerate**: `{entry.regenerate}`",
                f"- **Estimated time here**: {entry.cpu_time}",
                "",
            ]
        return "\n".join(lines).rstrip() or "None: every committed result carries a valid stamp."


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True).stdout


def report() -> None:
    """Print, per committed result, the commit that last wrote it and the code commits since (``MOVED_BY``)."""
    results = [p for p in _git("ls-files", "results/*.json").split() if "/convergence/runs/" not in p]
    for path in results:
        written = _git("log", "-1", "--follow", "--diff-filter=AM", "--format=%h %cs", "--", path).split()
        since = _git("log", "--format=%h %s", f"{written[0]}..HEAD", "--", *moved_by(path)).splitlines()
        entry = covering(path)
        print(f"{path}  written {' '.join(written)}  code commits since: {len(since)}"
              f"  [{entry.kind if entry else 'not listed'}]")  # fmt: skip
        for line in since[:3]:
            print(f"    {line[:100]}")


if __name__ == "__main__":
    report()
    sys.exit(0)
