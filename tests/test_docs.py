"""The documentation site builds with warnings as errors, and its CLI lines are real.

Every ``gradsift ...`` line inside a fenced code block of ``docs/*.md`` is split into its
subcommand path and its flags; each flag must appear in that subcommand's ``--help``.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from gradsift.cli import main

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
FENCE = re.compile(r"^(?P<indent>[ \t]*)```[^\n]*\n(?P<body>.*?)^(?P=indent)```", re.S | re.M)


def docs_command_lines() -> list[tuple[str, str]]:
    """``(page, command line)`` for each ``gradsift ...`` line in a fenced block of the docs."""
    found = []
    for page in sorted(DOCS.glob("*.md")):
        for block in FENCE.finditer(page.read_text(encoding="utf-8")):
            body = block.group("body").replace("\\\n", " ")  # join shell continuations
            for line in body.splitlines():
                line = line.strip().removeprefix("$ ")
                if line.startswith("gradsift "):
                    found.append((page.name, line.split(" #")[0]))
    return found


def split_command(line: str) -> tuple[list[str], list[str]]:
    """``gradsift bench compress --sizes 1e6 --json r.json`` -> (["bench", "compress"], ["--sizes", "--json"])."""
    tokens = shlex.split(line)[1:]
    path = []
    for token in tokens:
        if token.startswith("-"):
            break
        path.append(token)
    flags = [t.split("=")[0] for t in tokens if t.startswith("-") and not _is_number(t)]
    return path, flags


def _is_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


def help_text(path: list[str]) -> str:
    """What ``gradsift PATH... --help`` prints (the deepest subcommand named in ``path``)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_info:
        main([*path, "--help"])
    assert exit_info.value.code == 0, f"`gradsift {' '.join(path)} --help` failed"
    return out.getvalue()


def test_split_command_separates_path_and_flags() -> None:
    line = "gradsift bench compress --sizes 1e6 -0.5 --ratio=0.01 --json out.json"
    assert split_command(line) == (["bench", "compress"], ["--sizes", "--ratio", "--json"])


def test_docs_show_cli_commands() -> None:
    pages = {page for page, _ in docs_command_lines()}
    assert {"cli.md", "quickstart.md"} <= pages


@pytest.mark.parametrize("page,line", docs_command_lines())
def test_every_documented_flag_is_in_help(page: str, line: str) -> None:
    path, flags = split_command(line)
    text = help_text(path)
    missing = [f for f in flags if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", text)]
    assert not missing, f"{page}: `{line}` uses {missing}, absent from `gradsift {' '.join(path)} --help`"


@pytest.mark.slow
def test_docs_site_builds_strict(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs", reason="install the docs extra: pip install 'gradsift[docs]'")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "-f",
            str(ROOT / "mkdocs.yml"),
            "-d",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert (tmp_path / "api" / "index.html").exists()
    assert "register_comm_hook" in (tmp_path / "api" / "index.html").read_text(encoding="utf-8")
