"""The shell commands and Python blocks of the documentation, and how the suite runs them.

What a documented command is
----------------------------
Sources: ``README.md``, ``examples/README.md``, ``docs/*.md`` and the usage blocks of the
example scripts' docstrings (``examples/*.py``).

- Markdown: every line of a fenced block whose language is ``bash``, ``sh``, ``shell`` or
  ``console`` is a command. A trailing backslash continues it on the next line, a
  leading ``$ `` is dropped, `` #`` starts a comment; empty and comment-only lines are
  skipped. Inline code in prose is not a command, nor is a block of another language
  (``python``, or an unlabelled synopsis).
- Docstrings: the indented lines after a line ending in ``::``, with the same rules; all
  blocks of one script form one sequence (the resume line uses the first line's output).
- ``<!-- not-run: REASON -->`` as the last line before a fence exempts that block, and
  ``<!-- not-run `PREFIX`: REASON -->`` only its commands that start with ``PREFIX``. Only
  for what one CPU machine cannot do (several machines, a GPU) or what would recurse (the
  test suite itself); the reason is required.
- ``<!-- continues -->`` as the last line before a fence makes that block continue the
  previous block of its page (same directory, its commands appended): for a page whose
  later block uses what an earlier one wrote (``gradsift report`` on earlier runs).

Python blocks
-------------
Sources: the same Markdown pages. A fenced block whose language is ``python`` (or ``py``)
is one Python program, run as written (:func:`python_blocks`; how, and with which names
given, is ``tests/support/doc_python.py``'s docstring).

- ``<!-- not-run: REASON -->`` as the last line before the fence exempts the block, for
  the same reasons as a shell block (a GPU, several machines) or a package the test
  environment does not install. The prefix form is for shell blocks only.
- ``<!-- continues -->`` as the last line before the fence appends the block to the
  previous Python block of its page: one program, run in one namespace (a block that uses
  what the block before it defined).
- A block right after a line that is only a repository file's path in backticks, with
  an optional colon (as each of ``examples/extending/``'s files is named on
  docs/extending.md), shows that file: it must equal the file, character for character,
  and is not run as a block; the file runs where its own tests run it
  (tests/project/test_extending.py trains ``examples/extending/``'s examples).

How the suite runs shell commands (:class:`DocumentedRuns`)
-----------------------------------------------------------
- Each block runs in a fresh directory outside the source tree that holds a link to
  ``examples/``; its commands run in order with ``bash -c`` (a later one may use what an
  earlier one wrote), and each must exit 0.
- ``PATH`` starts with a fresh virtual environment whose gradsift is the wheel built from
  this tree (``tests/support/package.py``): ``gradsift``, ``python`` and ``pip`` are the
  installed package's, and ``pip install`` takes gradsift from the built wheel (no index)
  and finds its dependencies installed. ``torchrun`` and ``accelerate`` are the test
  environment's.
- Lengths shrink, flags stay (:func:`shorten`): ``gradsift train`` runs 2 steps (or 0.001
  epochs) on at most 2 workers (and 2 ``--nodes``), on the Fashion-MNIST subset embedded in the package
  (``--data-dir``; evaluating on the full test set would cost most of the run where the
  full dataset is installed), ``gradsift bench compress`` uses tensors of at most 4096
  elements, ``gradsift demo`` gets ``--quick``, and ``torchrun ... -m gradsift`` starts at
  most 2 processes. Example scripts run exactly as written: their models are tiny.
- ``./dev demo ARGS`` runs as ``gradsift demo ARGS``: that is what the dev script runs after
  its setup, and the setup runs before every ``./dev test``.
- Runs are shared where the commands are the same: a block whose (shortened) commands are
  the first commands of another block shares that block's run, and a command that repeats
  the one just before it in its block shares that one's.
- Under pytest-xdist each worker has its own runs, so every test that reads runs is in one
  of two groups (:func:`run_group`, ``pytest.mark.xdist_group``): the example scripts' runs
  and the other documented commands' runs, each about half of the work; a group's tests
  run on one worker, which builds the wheel once and runs each of its blocks once.
"""

from __future__ import annotations

import json
import os
import re
import resource
import shlex
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from support import ROOT

SHELL_LANGUAGES = {"bash", "sh", "shell", "console"}
PYTHON_LANGUAGES = {"python", "py"}
FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[^\n]*)\n(?P<body>.*?)^(?P=indent)```", re.S | re.M)
CONTINUES = "<!-- continues -->"
NOT_RUN = re.compile(r"<!--\s*not-run(?:\s+`(?P<prefix>[^`]+)`)?\s*:\s*(?P<reason>.*?)\s*-->")
#: The line before a block that shows a file of the repository: its path in backticks.
SHOWN_FILE = re.compile(r"^`(?P<path>[\w./-]+\.\w+)`:?$")
COMMAND_TIMEOUT_S = 300

#: ``gradsift train`` length flags and the values the suite runs them with.
TRAIN_LENGTHS = {"--steps": "2", "--epochs": "0.001"}
MAX_WORKERS = 2
MAX_BENCH_SIZE = 4096
EMBEDDED_DATA = ROOT / "src" / "gradsift" / "data"
#: The xdist groups of the tests that read documented runs (see :func:`run_group`).
EXAMPLES_GROUP = "documented-examples"
COMMANDS_GROUP = "documented-commands"


@dataclass(frozen=True)
class Block:
    """One sequence of documented commands that share a working directory."""

    source: str  # "docs/cli.md:12": the file and the line of the fence or docstring
    commands: tuple[str, ...]  # as written (continuations joined, comments dropped)
    not_run: tuple[tuple[str, str], ...] = ()  # (command prefix, reason); "" = the whole block

    def exempt(self, command: str) -> str | None:
        """The reason ``command`` is not run, or None."""
        return next((reason for prefix, reason in self.not_run if command.startswith(prefix)), None)

    @property
    def runnable(self) -> tuple[str, ...]:
        return tuple(c for c in self.commands if self.exempt(c) is None)


def command_lines(body: str) -> list[str]:
    """The commands of a shell block: continuations joined, prompts and comments removed."""
    commands = []
    for line in body.replace("\\\n", " ").splitlines():
        line = line.strip().removeprefix("$ ")
        line = re.split(r"\s+#", line, maxsplit=1)[0].strip()
        if line and not line.startswith("#"):
            commands.append(re.sub(r"\s+", " ", line))
    return commands


@dataclass(frozen=True)
class Fence:
    """One fenced block of a Markdown page."""

    source: str  # "docs/cli.md:12": the page and the line of the opening fence
    body: str  # the lines between the fences
    before: str  # the last non-empty line before the fence (where the markers are)

    @property
    def line(self) -> int:
        return int(self.source.rsplit(":", 1)[1])

    @property
    def not_run(self) -> tuple[tuple[str, str], ...]:
        """(command prefix, reason) of each ``not-run`` marker; prefix "" = the whole block."""
        return tuple((m.group("prefix") or "", m.group("reason")) for m in NOT_RUN.finditer(self.before))

    @property
    def continues(self) -> bool:
        return CONTINUES in self.before


def fences(path: Path, languages: set[str]) -> list[Fence]:
    """The fenced blocks of the page at ``path`` whose language is one of ``languages``."""
    text = path.read_text(encoding="utf-8")
    found = []
    for fence in FENCE.finditer(text):
        if fence.group("lang").strip().lower() not in languages:
            continue
        before = text[: fence.start()].rstrip().splitlines()
        line = text.count("\n", 0, fence.start()) + 1
        found.append(
            Fence(f"{path.relative_to(ROOT)}:{line}", fence.group("body"), before[-1] if before else "")
        )
    return found


def markdown_blocks(path: Path) -> list[Block]:
    blocks: list[Block] = []
    for fence in fences(path, SHELL_LANGUAGES):
        commands = tuple(command_lines(fence.body))
        if fence.continues and blocks:
            previous = blocks.pop()
            blocks.append(
                Block(previous.source, previous.commands + commands, previous.not_run + fence.not_run)
            )
            continue
        blocks.append(Block(fence.source, commands, fence.not_run))
    return blocks


def docstring_block(path: Path) -> Block | None:
    """The ``::`` usage blocks of a script's module docstring, as one sequence."""
    text = path.read_text(encoding="utf-8")
    match = re.match(r'\s*(?:"""|\'\'\')(?P<doc>.*?)(?:"""|\'\'\')', text, re.S)
    if match is None:
        return None
    lines, body, inside = match.group("doc").splitlines(), [], False
    for line in lines:
        if inside and (line.startswith((" ", "\t")) or not line.strip()):
            body.append(line)
            continue
        inside = line.rstrip().endswith("::")
    commands = command_lines("\n".join(body))
    return Block(f"{path.relative_to(ROOT)}:1", tuple(commands)) if commands else None


def documented_blocks(root: Path = ROOT) -> list[Block]:
    """Every block of commands in the sources named in the module docstring."""
    pages = [root / "README.md", root / "examples" / "README.md", *sorted((root / "docs").glob("*.md"))]
    blocks = [block for page in pages for block in markdown_blocks(page) if block.commands]
    scripts = sorted((root / "examples").glob("*.py"))
    return blocks + [block for block in map(docstring_block, scripts) if block is not None]


@dataclass(frozen=True)
class PythonBlock:
    """One Python program of the documentation: a block and the blocks that continue it."""

    source: str  # "README.md:58": the page and the line of the (first) opening fence
    parts: tuple[tuple[int, str], ...]  # (the page's line of the first code line, the code) per block
    not_run: str = ""  # why the block is not run ("" = it runs)
    shows: str = ""  # the repository file the block shows ("" = none)

    @property
    def page(self) -> str:
        return self.source.rsplit(":", 1)[0]

    @property
    def code(self) -> str:
        return "".join(code for _, code in self.parts)


def python_blocks(root: Path = ROOT) -> list[PythonBlock]:
    """Every Python block of the Markdown pages named in the module docstring."""
    pages = [root / "README.md", root / "examples" / "README.md", *sorted((root / "docs").glob("*.md"))]
    return [block for page in pages for block in page_python_blocks(page)]


def page_python_blocks(path: Path) -> list[PythonBlock]:
    blocks: list[PythonBlock] = []
    for fence in fences(path, PYTHON_LANGUAGES):
        if any(prefix for prefix, _ in fence.not_run):
            raise ValueError(
                f"{fence.source}: `not-run `PREFIX`` is for shell blocks; exempt the whole block"
            )
        reason = fence.not_run[0][1] if fence.not_run else ""
        part = (fence.line + 1, fence.body)
        if fence.continues and blocks:
            previous = blocks.pop()
            blocks.append(
                PythonBlock(
                    previous.source, (*previous.parts, part), previous.not_run or reason, previous.shows
                )
            )
            continue
        shown = SHOWN_FILE.match(fence.before.strip())
        blocks.append(PythonBlock(fence.source, (part,), reason, shown.group("path") if shown else ""))
    return blocks


def run_group(block: Block) -> str:
    """The xdist group of the test that runs ``block``: :data:`EXAMPLES_GROUP` when its first
    command runs an example script, else :data:`COMMANDS_GROUP`. Blocks that share a run
    start with the same command, so they are in the same group."""
    return EXAMPLES_GROUP if "examples/" in block.runnable[0] else COMMANDS_GROUP


# -- shortening ----------------------------------------------------------------------------
def shorten(command: str) -> str:
    """``command`` as the suite runs it: shorter lengths, the same flags (see the module docstring)."""
    tokens = shlex.split(command)
    if tokens[:2] == ["./dev", "demo"]:
        tokens = ["gradsift", *tokens[1:]]
    if tokens and tokens[0] == "gradsift":
        shortened = ["gradsift", *_shorten_gradsift(tokens[1:])]
    elif (
        tokens and tokens[0] == "torchrun" and "-m" in tokens and tokens[tokens.index("-m") + 1] == "gradsift"
    ):
        at = tokens.index("-m") + 2
        launcher = _cap_value(tokens[:at], ("--nproc-per-node", "--nproc_per_node"), MAX_WORKERS)
        shortened = [*launcher, *_shorten_gradsift(tokens[at:])]
    else:
        return command
    return command if shortened == tokens else shlex.join(shortened)


def _shorten_gradsift(args: list[str]) -> list[str]:
    if args[:1] == ["demo"]:
        return args if "--quick" in args else [*args, "--quick"]
    if args[:1] == ["train"]:
        args = _cap_value(args, ("--workers", "--nodes"), MAX_WORKERS)
        image_model = "gpt" not in args  # --data-dir means a folder of text files for gpt
        if image_model and "--data-dir" not in args and "--synthetic" not in args:
            args = [*args, "--data-dir", str(EMBEDDED_DATA)]
        if not any(flag in args for flag in TRAIN_LENGTHS):
            return [*args, "--steps", TRAIN_LENGTHS["--steps"]]
        return [
            TRAIN_LENGTHS[args[i - 1]] if i and args[i - 1] in TRAIN_LENGTHS else a
            for i, a in enumerate(args)
        ]
    if args[:2] == ["bench", "compress"] and "--sizes" in args:
        start = args.index("--sizes") + 1
        end = next((i for i in range(start, len(args)) if args[i].startswith("-")), len(args))
        sizes = [str(min(int(float(size)), MAX_BENCH_SIZE)) for size in args[start:end]]
        return [*args[:start], *sizes, *args[end:]]
    return args


def _cap_value(args: list[str], flags: tuple[str, ...], cap: int) -> list[str]:
    """``args`` with the integer after any of ``flags`` lowered to at most ``cap``."""
    return [str(min(int(a), cap)) if i and args[i - 1] in flags else a for i, a in enumerate(args)]


# -- running ---------------------------------------------------------------------------------
@dataclass
class CommandRun:
    command: str  # as run (shortened)
    returncode: int
    output: str
    seconds: float  # wall time
    cpu_seconds: float  # user + system time of the command and every process it started

    def describe(self) -> str:
        took = f"{self.seconds:.1f} s, {self.cpu_seconds:.1f} CPU-s"
        return f"$ {self.command}\n(exit {self.returncode} after {took})\n{self.output[-6000:]}"


@dataclass
class BlockRun:
    directory: Path
    runs: list[CommandRun] = field(default_factory=list)
    shared_with: str | None = None  # the block whose run this one reuses

    @property
    def ok(self) -> bool:
        return all(run.returncode == 0 for run in self.runs)

    def output_of(self, fragment: str) -> str:
        """The output of the first command run here that contains ``fragment``."""
        return next(run.output for run in self.runs if fragment in run.command)


class DocumentedRuns:
    """Runs documented blocks on demand, once each, sharing runs as the module docstring says."""

    def __init__(self, blocks: list[Block], scratch: Path, env: dict[str, str]) -> None:
        self.blocks = blocks
        self.scratch = scratch
        self.env = env
        self._done: dict[tuple[str, ...], tuple[Block, BlockRun]] = {}

    def keys(self, block: Block) -> tuple[str, ...]:
        return tuple(shorten(command) for command in block.runnable)

    def run(self, block: Block) -> BlockRun:
        key = self.keys(block)
        for done_key, (owner, run) in self._done.items():
            if done_key[: len(key)] == key:
                if owner is block:
                    return run
                return BlockRun(run.directory, run.runs[: len(key)], shared_with=owner.source)
        # run the longest block that starts with these commands, so the others can share it
        longest = max(
            (b for b in self.blocks if self.keys(b)[: len(key)] == key), key=lambda b: len(self.keys(b))
        )
        self._done[self.keys(longest)] = (longest, self._execute(longest))
        return self.run(block)

    def find(self, *fragments: str, source: str = "") -> Block:
        """The first block from ``source`` having a command that contains every fragment."""
        return next(
            b
            for b in self.blocks
            if b.source.startswith(source) and any(all(f in c for f in fragments) for c in b.runnable)
        )

    def _execute(self, block: Block) -> BlockRun:
        directory = self.scratch / re.sub(r"[^\w.-]+", "_", block.source)
        directory.mkdir(parents=True)
        (directory / "examples").symlink_to(ROOT / "examples")
        result = BlockRun(directory)
        for command in self.keys(block):
            if result.runs and result.runs[-1].command == command:
                result.runs.append(result.runs[-1])
                continue
            result.runs.append(self._run_command(command, directory))
            if result.runs[-1].returncode != 0:
                break
        return result

    def _run_command(self, command: str, directory: Path) -> CommandRun:
        started, cpu_before = time.monotonic(), _children_cpu_seconds()
        try:
            done = subprocess.run(
                ["bash", "-c", command],
                cwd=directory,
                env=self.env,
                capture_output=True,
                text=True,
                timeout=COMMAND_TIMEOUT_S,
            )
            returncode, output = done.returncode, done.stdout + done.stderr
        except subprocess.TimeoutExpired as expired:
            partial = expired.stdout.decode() if isinstance(expired.stdout, bytes) else expired.stdout or ""
            returncode, output = -1, f"timed out after {COMMAND_TIMEOUT_S} s\n{partial}"
        cpu = _children_cpu_seconds() - cpu_before
        return CommandRun(command, returncode, output, time.monotonic() - started, cpu)


def _children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def command_env(path: str, extra: dict[str, str]) -> dict[str, str]:
    """The environment documented commands run in: the user's, one thread per process, no GPU."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "PIP_", "VIRTUAL_ENV"))}
    return {**env, **extra, "PATH": path, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}


def summary_line(output: str) -> dict[str, Any]:
    """The one ``gradsift-example {json}`` line an example prints on rank 0, parsed."""
    lines = [line for line in output.splitlines() if line.startswith("gradsift-example ")]
    assert len(lines) == 1, output[-6000:]
    return json.loads(lines[0].removeprefix("gradsift-example "))
