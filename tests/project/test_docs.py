"""Every documented command runs, the CLI lines use real flags, and the site builds strictly.

Which lines are commands, and how they run (shortened lengths, the installed wheel,
shared runs), is defined at the top of ``tests/support/doc_commands.py``.
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

from gradsift.tools.cli import main
from support.doc_commands import (
    EMBEDDED_DATA,
    FENCE,
    ROOT,
    Block,
    command_lines,
    docstring_block,
    documented_blocks,
    run_group,
    shorten,
)

DOCS = ROOT / "docs"
DATA = f"--data-dir {EMBEDDED_DATA}"
BLOCKS = documented_blocks()
RUNNABLE = [block for block in BLOCKS if block.runnable]


# -- the rules of tests/support/doc_commands.py ------------------------------------------------------
def test_command_lines_join_continuations_and_drop_prompts_and_comments() -> None:
    body = "# a comment\n$ gradsift demo   # the demo\n\ntorchrun --nnodes 2 \\\n    x.py --steps 3\n"
    assert command_lines(body) == ["gradsift demo", "torchrun --nnodes 2 x.py --steps 3"]


def test_markers_exempt_blocks_or_prefixes_and_continue_blocks(tmp_path: Path) -> None:
    from support.doc_commands import markdown_blocks

    page = tmp_path / "docs" / "page.md"
    page.parent.mkdir()
    page.write_text(
        "<!-- not-run: needs 2 machines -->\n```bash\nrun a\n```\n\n```python\nx = 1\n```\n"
        "<!-- not-run `./dev test`: the suite itself -->\n```bash\n./dev demo\n./dev test\n```\n"
        "<!-- continues -->\n```sh\ngradsift report runs/\n```\n",
        encoding="utf-8",
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("support.doc_commands.ROOT", tmp_path)
        first, second = markdown_blocks(page)
    assert (
        first.commands == ("run a",) and first.runnable == () and first.exempt("run a") == "needs 2 machines"
    )
    assert second.source == "docs/page.md:10"
    assert second.commands == ("./dev demo", "./dev test", "gradsift report runs/")
    assert second.runnable == ("./dev demo", "gradsift report runs/")


def test_docstring_usage_blocks_form_one_sequence() -> None:
    block = docstring_block(ROOT / "examples" / "ddp_torchrun.py")
    assert block is not None and len(block.commands) == 2
    assert block.commands[1].endswith("--steps 40 --resume checkpoints/step20.pt --checkpoint-dir resumed")


@pytest.mark.parametrize(
    "written,run",
    [
        ("gradsift demo", "gradsift demo --quick"),
        ("./dev demo --localhost", "gradsift demo --localhost --quick"),
        (
            "gradsift train --model vgg --workers 4 --steps 500",
            f"gradsift train --model vgg --workers 2 --steps 2 {DATA}",
        ),
        ("gradsift train --epochs 1 --out runs/x", f"gradsift train --epochs 0.001 --out runs/x {DATA}"),
        ("gradsift train --compressor topk", f"gradsift train --compressor topk {DATA} --steps 2"),
        ("gradsift train --synthetic --steps 9", "gradsift train --synthetic --steps 2"),
        (
            "gradsift bench compress --sizes 1e6 100 --json b.json",
            "gradsift bench compress --sizes 4096 100 --json b.json",
        ),
        (
            "torchrun --nproc-per-node 4 -m gradsift train",
            f"torchrun --nproc-per-node 2 -m gradsift train {DATA} --steps 2",
        ),
        ("gradsift report runs/", "gradsift report runs/"),
        ('python examples/x.py --resume "a=1.ckpt"', 'python examples/x.py --resume "a=1.ckpt"'),
    ],
)
def test_shorten_keeps_the_flags_and_cuts_the_lengths(written: str, run: str) -> None:
    assert shorten(written) == run


def test_every_exemption_gives_a_reason_and_matches_a_command() -> None:
    exemptions = [(block, prefix, reason) for block in BLOCKS for prefix, reason in block.not_run]
    assert exemptions, "the multi-machine commands are documented and exempt"
    for block, prefix, reason in exemptions:
        assert reason, f"{block.source}: not-run without a reason"
        assert any(command.startswith(prefix) for command in block.commands), (
            f"{block.source}: stale {prefix!r}"
        )


def test_the_documentation_offers_commands_from_every_source() -> None:
    sources = {block.source.split(":")[0] for block in RUNNABLE}
    assert {
        "README.md",
        "examples/README.md",
        "docs/quickstart.md",
        "docs/cli.md",
        "docs/integrations.md",
    } <= sources
    assert {f"examples/{p.name}" for p in (ROOT / "examples").glob("*.py")} <= sources


# -- every documented block runs ------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(
    "block", [pytest.param(b, id=b.source, marks=pytest.mark.xdist_group(run_group(b))) for b in RUNNABLE]
)
def test_documented_commands_run(block: Block, documented_runs) -> None:
    result = documented_runs.run(block)
    assert len(result.runs) == len(block.runnable) and result.ok, "\n\n".join(
        r.describe() for r in result.runs
    )


# -- flags of gradsift lines in any fenced block (also synopses that do not run) --------------
def docs_command_lines() -> list[tuple[str, str]]:
    """``(page, line)`` for each ``gradsift ...`` line inside any fenced block of ``docs/*.md``."""
    found = []
    for page in sorted(DOCS.glob("*.md")):
        for block in FENCE.finditer(page.read_text(encoding="utf-8")):
            found += [
                (page.name, line)
                for line in command_lines(block.group("body"))
                if line.startswith("gradsift ")
            ]
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


def test_the_decisions_index_lists_every_decision_and_what_is_superseded() -> None:
    import importlib.util

    script = ROOT / "scripts" / "decisions_index.py"
    spec = importlib.util.spec_from_file_location("decisions_index", script)
    assert spec is not None and spec.loader is not None
    decisions_index = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(decisions_index)
    text = decisions_index.DECISIONS.read_text(encoding="utf-8")
    assert decisions_index.rewritten(text) == text, "run python scripts/decisions_index.py"
    text = "# D\n\nintro\n\n## First: one\n*Superseded by Second below.*\n\n## Second, two\nbody\n"
    once = decisions_index.rewritten(text)
    assert "- [First: one](#first-one) (superseded, see the entry)\n- [Second, two](#second-two)\n" in once
    assert decisions_index.rewritten(once) == once  # the index does not index itself


def test_the_hook_options_table_lists_every_option_with_its_default() -> None:
    """docs/distributed.md's option table against the dataclass the hook validates with."""
    import dataclasses

    from gradsift.hook.options import HookOptions

    table = (ROOT / "docs" / "distributed.md").read_text(encoding="utf-8")
    rows = dict(re.findall(r"^\| `(\w+)` \| `([^`]*)` \|", table, flags=re.MULTILINE))
    for option in dataclasses.fields(HookOptions):
        assert option.name in rows, f"docs/distributed.md's option table lacks {option.name}"
        default = option.default
        shown = f'"{default}"' if isinstance(default, str) else repr(default)
        assert rows[option.name] == shown, (option.name, rows[option.name], shown)
