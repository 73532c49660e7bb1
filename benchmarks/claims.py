"""Published numbers, generated from the committed results, and the checks that keep them honest.

    python benchmarks/claims.py --write    # rewrite every marked number and table from its JSON
    python benchmarks/claims.py --check    # list what disagrees, and what no valid commit backs
    python benchmarks/claims.py --list     # every claim: id, text, file, fields, command

In README.md, docs/*.md and benchmarks/**/*.md a number quoted from a result sits between
``<!-- claim:<id> -->`` and ``<!-- /claim -->``, a generated block between
``<!-- claims-table:<name> -->`` and ``<!-- /claims-table -->`` (the claims and tables are in
``registry.py``; the stale list, ``stale.py``; the convergence tables, its ``analyze.py``; the
scaling tables, ``scaling/analyze.py`` and ``scaling/predict.py``).

Provenance: every JSON file under ``results/`` that names a commit (a ``commit`` or
``gradsift_commit`` key anywhere in it) must name one in this checkout's history, and every
result a claim reads must carry a ``provenance`` stamp (``provenance.py``) with such a
commit and ``dirty: false`` -- unless ``stale.STALE`` lists it, with the reason and the
command that regenerates it. ``tests/project/test_claims.py`` runs these checks.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import re
import subprocess
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

import registry
import stale
from claimmodel import ROOT, Claim, Result

INLINE = re.compile(r"<!-- claim:(?P<id>[\w.@\-]+) -->(?P<text>(?:(?!<!--).)*?)<!-- /claim -->")  # one line
BLOCK = re.compile(  # the lines between the markers (none of them a marker: blocks never nest or overlap)
    r"(?P<open><!-- claims-table:(?P<name>[\w.\-]+) -->)\n(?P<text>(?:(?!<!-- /?claims-table).*\n)*?)"
    r"(?P<close><!-- /claims-table -->)"
)
COMMIT_KEYS = ("commit", "gradsift_commit")
HEX = re.compile(r"^[0-9a-f]{7,40}")


class Block(Protocol):
    name: str
    claims: tuple[Claim, ...]

    def render(self, root: Path = ROOT) -> str: ...


class ConvergenceTables:
    """The convergence tables, rendered by ``convergence/analyze.py`` from its results.json:
    every workload's but the AdamW ones (``convergence``; those are printed once, in
    docs/adam.md), or one workload's (``convergence.<workload>``)."""

    claims = ()
    result = Result(
        "results/convergence/results.json", "python benchmarks/convergence/analyze.py --update-docs"
    )

    def __init__(self, workload: str | None = None) -> None:
        self.workload = workload
        self.name = "convergence" if workload is None else f"convergence.{workload}"

    def render(self, root: Path = ROOT) -> str:
        sys.path.insert(0, str(ROOT / "benchmarks" / "convergence"))
        from analyze import markdown

        only = None if self.workload is None else (self.workload,)
        skip = () if self.workload is not None else ("gpt-adamw",)
        return markdown(self.result.load(root), only, skip=skip).rstrip()


class LengthTables:
    """How each AdamW gap moves with the run's length (``convergence/lengths.py``), from the
    same results.json as the convergence tables."""

    claims = ()
    name = "convergence.lengths"
    result = ConvergenceTables.result

    def render(self, root: Path = ROOT) -> str:
        sys.path.insert(0, str(ROOT / "benchmarks" / "convergence"))
        from lengths import markdown

        return markdown(self.result.load(root)["lengths"])


class ScriptTable:
    """A table a benchmark script renders from its result file: ``function`` of the script at
    ``script`` (loaded under a name of its own, so that two scripts of one file name do not meet
    in ``sys.modules``), given the result, or its value at ``key``."""

    claims = ()

    def __init__(self, name: str, result: Result, script: str, function: str, key: str | None = None) -> None:
        self.name, self.result, self.script, self.function, self.key = name, result, script, function, key

    def render(self, root: Path = ROOT) -> str:
        data = self.result.load(root)
        return getattr(_script(self.script), self.function)(data if self.key is None else data[self.key])


@functools.cache
def _script(path: str) -> Any:
    """The benchmark script at ``path`` (from the repository's root), imported once."""
    location = ROOT / path
    spec = importlib.util.spec_from_file_location(
        f"table_script_{location.parent.name}_{location.stem}", location
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SCALING_SCRIPT, PREDICTION_SCRIPT = "benchmarks/scaling/analyze.py", "benchmarks/scaling/predict.py"
SCALING_TABLES = (
    ScriptTable("scaling.traffic", registry.SCALING, SCALING_SCRIPT, "traffic_table"),
    ScriptTable("scaling.time", registry.SCALING, SCALING_SCRIPT, "time_table"),
    ScriptTable("scaling.targets", registry.SCALING, SCALING_SCRIPT, "targets_table", "targets"),
    ScriptTable(
        "scaling.accuracy", registry.SCALING, SCALING_SCRIPT, "accuracy_table", "accuracy_at_equal_steps"
    ),
    ScriptTable("scaling.predictions", registry.PREDICTIONS, PREDICTION_SCRIPT, "times_table"),
    ScriptTable("scaling.crossover", registry.PREDICTIONS, PREDICTION_SCRIPT, "crossover_table"),
)


BLOCKS: dict[str, Block] = {
    b.name: b
    for b in (
        *registry.TABLES,
        stale.StaleList(),
        ConvergenceTables(),
        ConvergenceTables("gpt-adamw"),
        ConvergenceTables("gpt-adamw-w4"),
        ConvergenceTables("gpt-adamw-1k"),
        ConvergenceTables("gpt-adamw-3k"),
        ConvergenceTables("gpt-adamw-w4-1k"),
        ConvergenceTables("gpt-adamw-w4-3k"),
        LengthTables(),
        *SCALING_TABLES,
    )
}
CLAIMS: dict[str, Claim] = {c.id: c for c in registry.CLAIMS}


def documents(root: Path = ROOT) -> list[Path]:
    """The Markdown files whose markers are generated."""
    return [
        root / "README.md",
        *sorted((root / "docs").glob("*.md")),
        *sorted((root / "benchmarks").rglob("*.md")),
    ]


def rewrite(text: str, root: Path = ROOT) -> str:
    """``text`` with every marked claim and block regenerated (unknown names left as they are)."""
    text = INLINE.sub(lambda m: m[0] if m["id"] not in CLAIMS else
                      f"<!-- claim:{m['id']} -->{CLAIMS[m['id']].text(root)}<!-- /claim -->", text)  # fmt: skip
    return BLOCK.sub(lambda m: m[0] if m["name"] not in BLOCKS else
                     f"{m['open']}\n{BLOCKS[m['name']].render(root)}\n{m['close']}", text)  # fmt: skip


def document_problems(root: Path = ROOT) -> list[str]:
    """Markers whose text is not what the result says, unknown names, and claims or blocks no
    document uses (a claim that is never published is dead)."""
    problems, used = [], set()
    for path in documents(root):
        text, where = path.read_text(encoding="utf-8"), path.relative_to(root)
        for match in INLINE.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            claim = CLAIMS.get(match["id"])
            used.add(match["id"])
            if claim is None:
                problems.append(f"{where}:{line}: unknown claim {match['id']!r}")
            elif (expected := claim.text(root)) != match["text"]:
                problems.append(f"{where}:{line}: claim {match['id']} says {match['text']!r}, "
                                f"{claim.result.path} gives {expected!r}")  # fmt: skip
        for match in BLOCK.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            block = BLOCKS.get(match["name"])
            used.add(match["name"])
            if block is None:
                problems.append(f"{where}:{line}: unknown block {match['name']!r}")
            elif f"{block.render(root)}\n" != match["text"]:
                problems.append(f"{where}:{line}: block {match['name']} differs from its results "
                                "(python benchmarks/claims.py --write)")  # fmt: skip
    in_blocks = {c.id for b in BLOCKS.values() for c in b.claims}
    unused = ((set(CLAIMS) - in_blocks) | set(BLOCKS)) - used
    problems += [f"{name}: in the registry but in no document" for name in sorted(unused)]
    return problems


def claimed_results() -> list[Result]:
    """Every result file a published claim or block reads."""
    read_by_blocks = [
        block.result for block in BLOCKS.values() if isinstance(getattr(block, "result", None), Result)
    ]
    results = [r for claim in CLAIMS.values() for r in claim.results] + read_by_blocks
    return list(dict.fromkeys(results))


def missing_results(root: Path = ROOT) -> list[str]:
    return [
        f"{r.path}: claimed, but no such file" for r in claimed_results() if not (root / r.path).is_file()
    ]


# -- provenance ---------------------------------------------------------------------------------
def history(root: Path = ROOT) -> set[str] | None:
    """Every commit reachable from HEAD, or None where that cannot be known (no git, no
    .git -- an sdist -- or a shallow clone)."""

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", "-C", str(root), *args], capture_output=True, text=True, check=False
            )
        except FileNotFoundError:
            return None
        return done.stdout if done.returncode == 0 else None

    if not (root / ".git").exists() or git("rev-parse", "--is-shallow-repository") != "false\n":
        return None
    commits = git("rev-list", "HEAD")
    return None if commits is None else set(commits.split())


def in_history(commit: str, commits: set[str]) -> bool:
    """Whether ``commit`` (full or abbreviated, at least 7 hex digits) is one of ``commits``."""
    found = HEX.match(commit)
    return found is not None and any(c.startswith(found[0]) for c in commits)


def named_commits(data: Any) -> Iterator[str]:
    """The values of every ``commit``/``gradsift_commit`` key in a JSON document."""
    if isinstance(data, dict):
        for key, value in data.items():
            if key in COMMIT_KEYS and isinstance(value, str):
                yield value
            else:
                yield from named_commits(value)
    elif isinstance(data, list):
        for value in data:
            yield from named_commits(value)


def stamp_problem(data: Any, commits: set[str]) -> str | None:
    """Why a result's ``provenance`` stamp does not back a number (None: it does). A file of
    ``runs`` or ``sessions`` without a stamp of its own (a resumable campaign's rows, a resumed
    stress test's sessions, each written by its own invocation) is backed when every one's
    stamp is."""
    stamp = data.get("provenance") if isinstance(data, dict) else None
    for key in ("runs", "sessions"):
        if stamp is None and isinstance(data, dict) and isinstance(data.get(key), list) and data[key]:
            problems = (stamp_problem(part, commits) for part in data[key])
            return next((f"{key[:-1]} {i}: {p}" for i, p in enumerate(problems) if p is not None), None)
    if not isinstance(stamp, dict) or not isinstance(stamp.get("commit"), str):
        return "no provenance stamp"
    if not in_history(stamp["commit"], commits):
        return f"stamped with {stamp['commit']}, not in this history"
    if stamp.get("dirty") is not False:
        return f"stamped dirty: {stamp.get('dirty_paths')}"
    return None


def result_files(root: Path = ROOT) -> list[str]:
    """The committed JSON files under results/ (all of them outside a git checkout)."""
    try:
        done = subprocess.run(["git", "-C", str(root), "ls-files", "results/*.json"], capture_output=True,
                              text=True, check=True)  # fmt: skip
        return done.stdout.split()
    except (OSError, subprocess.CalledProcessError):
        return sorted(str(p.relative_to(root)) for p in (root / "results").rglob("*.json"))


def provenance_problems(root: Path, commits: set[str], files: Iterable[str] | None = None,
                        entries: tuple[stale.Stale, ...] = stale.STALE) -> list[str]:  # fmt: skip
    """Results whose commit is not in ``commits`` and that no stale entry covers; claimed
    results without a valid stamp and not covered; entries that match nothing; provenance
    entries whose results are all validly stamped now (re-run: remove the entry)."""
    files = result_files(root) if files is None else list(files)
    covered = {path: next((e for e in entries if e.covers(path)), None) for path in files}
    problems, valid = [], set()
    for path in files:
        data = json.loads((root / path).read_text(encoding="utf-8"))
        unknown = [c for c in named_commits(data) if not in_history(c, commits)]
        if stamp_problem(data, commits) is None:
            valid.add(path)
        if unknown and covered[path] is None:
            problems.append(f"{path}: names {unknown[0]!r}, not a commit of this history; re-run it or list it "
                            "in benchmarks/stale.py")  # fmt: skip
    for result in claimed_results():
        if result.path not in covered:
            problems.append(f"{result.path}: a published claim reads it, but it is not a committed result")
        elif result.path not in valid and covered[result.path] is None:
            why = stamp_problem(json.loads((root / result.path).read_text(encoding="utf-8")), commits)
            problems.append(f"{result.path}: a published claim reads it, but {why}; re-run it or list it in "
                            "benchmarks/stale.py")  # fmt: skip
    for entry in entries:
        matched = [p for p in files if covered[p] is entry]
        if not matched:
            problems.append(f"stale entry {entry.files}: matches no result")
        elif entry.kind == "provenance" and all(p in valid for p in matched):
            problems.append(
                f"stale entry {entry.files}: every result is validly stamped now; remove the entry"
            )
    return problems


def write(root: Path = ROOT) -> list[Path]:
    """Regenerate every document; the ones that changed."""
    changed = []
    for path in documents(root):
        text = path.read_text(encoding="utf-8")
        if (new := rewrite(text, root)) != text:
            path.write_text(new, encoding="utf-8")
            changed.append(path)
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--write", action="store_true", help="regenerate the marked numbers and tables")
    action.add_argument("--check", action="store_true", help="exit 1 if a document or a result disagrees")
    action.add_argument("--list", action="store_true", help="print every claim and its source")
    args = parser.parse_args(argv)
    if args.list:
        for claim in CLAIMS.values():
            fields = ", ".join(f if isinstance(f, str) else f"{f[0].path}:{f[1]}" for f in claim.fields)
            print(f"{claim.id}\t{claim.text()}\t{claim.result.path}\t{fields}\t"
                  f"{claim.result.command}")  # fmt: skip
        return 0
    if args.write:
        for path in write():
            print(f"updated {path.relative_to(ROOT)}")
        return 0
    commits = history()
    problems = document_problems() + missing_results()
    problems += (
        ["(provenance not checked: no git history here)"]
        if commits is None
        else provenance_problems(ROOT, commits)
    )
    print("\n".join(problems) or "claims: every published number agrees with its result")
    return 1 if any(not p.startswith("(") for p in problems) else 0


if __name__ == "__main__":
    sys.exit(main())
