"""Provenance stamps for benchmark results: which code, which command, which machine, how loaded.

A number is only as good as what is known about the run that produced it. Every script
that writes a result under ``results/`` calls :func:`start` before it measures and
stores ``stamp.finish()`` in its result under the key ``"provenance"``::

    stamp = provenance.start(seeds=[args.seed])
    ...                                       # measure
    report["provenance"] = stamp.finish()

A command that is not such a script (``gradsift bench compress --json OUT``, a
``gradsift train --out DIR`` run) is wrapped, and its JSON stamped after it ends::

    flock /tmp/gradsift-cpu.lock python benchmarks/provenance.py --json OUT --seed 0 -- COMMAND...

The stamp records the commit of this checkout (HEAD) and whether code under ``src/``,
``benchmarks/`` or ``scripts/`` differed from it -- at the start or at any point up to
the end -- (``dirty``, with the paths, and a warning on stderr: a dirty result cannot
back a published number, ``tests/project/test_claims.py`` refuses it); where ``gradsift`` is
imported from (a result measured with another checkout's code is dirty too); the exact
command line; the seeds; Python, torch, CPU and GPU models; the 1/5/15-minute load
averages before and after; and whether ``/tmp/gradsift-cpu.lock`` was held by this
process (inherited from ``flock LOCK COMMAND``) when the measurement started.
"""

from __future__ import annotations

import argparse
import datetime
import errno
import fcntl
import importlib.util
import json
import os
import platform
import shlex
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from paths import ROOT

CPU_LOCK = Path("/tmp/gradsift-cpu.lock")
CODE_DIRS = ("src", "benchmarks", "scripts")
SCRIPT_SUFFIXES = (".py", ".sh")  # under benchmarks/ and scripts/: code; the rest (READMEs) is not


def _git(root: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=False)
    except FileNotFoundError:
        return None
    return done.stdout if done.returncode == 0 else None


def code_state(root: Path = ROOT) -> tuple[str | None, list[str]]:
    """``(HEAD's commit, uncommitted code paths)`` of the checkout at ``root``.

    Code is everything under ``src/`` and the ``.py``/``.sh`` files under ``benchmarks/`` and
    ``scripts/``; their READMEs are not, nor the results a run writes (under ``results/``).
    The commit is None outside a git checkout, and the result then counts as dirty
    (``["<no git checkout>"]``).
    """
    head = _git(root, "rev-parse", "HEAD")
    status = _git(root, "status", "--porcelain=v1", "-z", "--untracked-files=all", "--", *CODE_DIRS)
    if head is None or status is None:
        return None, ["<no git checkout>"]
    entries, dirty = iter(status.split("\0")), []
    for entry in entries:
        if entry[:1] in ("R", "C"):
            next(entries)  # a rename or copy: its source path follows as the next entry
        path = entry[3:]
        if path.startswith("src/") or path.endswith(SCRIPT_SUFFIXES):
            dirty.append(path)
    return head.strip(), sorted(dirty)


def imported_code(root: Path = ROOT) -> list[str]:
    """Why the ``gradsift`` that would be imported is not this checkout's ``src/`` (empty if it is)."""
    spec = importlib.util.find_spec("gradsift")
    origin = Path(spec.origin).resolve() if spec is not None and spec.origin else None
    source = (root / "src" / "gradsift").resolve()
    if origin is None or source not in origin.parents:
        return [f"<gradsift imported from {origin}, not {source}>"]
    return []


def lock_state(path: Path = CPU_LOCK) -> dict[str, Any]:
    """Whether this process holds ``flock(path)``.

    ``flock LOCK COMMAND`` passes its locked descriptor to COMMAND. The lock is ours when a
    fresh descriptor of the file cannot take it (someone holds it) while one of our own
    inherited descriptors can (a second ``flock`` on the same open file succeeds at once and
    changes nothing; nothing is ever unlocked here, which would release the holder's lock).
    """
    state: dict[str, Any] = {"path": str(path), "held": False, "holder": None}
    try:
        probe = os.open(path, os.O_RDONLY)
    except OSError:
        return state
    try:
        fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise
        state["holder"] = "another process"
    else:
        os.close(probe)  # nobody held it; closing our only descriptor of it releases the probe
        return state
    os.close(probe)
    for fd in _descriptors_of(path):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue
        state.update(held=True, holder="this process", fd=fd)
        break
    return state


def _descriptors_of(path: Path) -> list[int]:
    target = str(path.resolve())
    found = []
    for entry in Path("/proc/self/fd").iterdir():
        try:
            if os.readlink(entry) == target:
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def machine() -> dict[str, Any]:
    """Python, torch, CPU and GPU models, host. CUDA is only asked for after the run (see finish)."""
    cpu = platform.processor() or platform.machine()
    try:
        names = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")]  # fmt: skip
        cpu = names[0] if names else cpu
    except OSError:
        pass
    facts: dict[str, Any] = {"python": platform.python_version(), "cpu": cpu, "cpus": os.cpu_count(),
                             "host": socket.gethostname()}  # fmt: skip
    try:
        import torch

        facts["torch"] = torch.__version__
    except ImportError:
        facts["torch"] = None
    return facts


def _gpus() -> list[str]:
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


@dataclass
class Stamp:
    """What :func:`start` saw; :meth:`finish` adds the end of the run and returns the record."""

    record: dict[str, Any]
    code: tuple[str | None, list[str]]
    root: Path = ROOT
    started: float = field(default_factory=time.monotonic)

    def finish(self) -> dict[str, Any]:
        commit, dirty = code_state(self.root)
        if (commit, dirty) != self.code:
            self.record["dirty_paths"] = sorted(
                {*self.record["dirty_paths"], *dirty, "<code changed during the run>"}
            )
            self.record["dirty"] = True
            _warn(self.record)
        self.record.update(
            load_after=list(os.getloadavg()), finished=_now(), wall_s=round(time.monotonic() - self.started, 3),
            gpus=_gpus(),
        )  # fmt: skip
        return self.record

    def write(self, path: Path, args: Any, **fields: Any) -> None:
        """Finish the stamp and write ``{"args": vars(args), **fields, "provenance": ...}`` to
        ``path`` as indented JSON (its folder made): a harness's report."""
        report = {"args": {**vars(args), "json": str(path)}, **fields, "provenance": self.finish()}
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2) + "\n")


def start(seeds: list[int] | None = None, root: Path | None = None, lock: Path = CPU_LOCK) -> Stamp:
    """Stamp a run that starts now; ``seeds``: every seed the run uses (None: it draws none);
    ``root``: the checkout (default: this one)."""
    root = ROOT if root is None else root
    commit, code = code_state(root)
    dirty = code + imported_code(root)
    record = {
        "commit": commit,
        "dirty": bool(dirty),
        "dirty_paths": dirty,
        "command": shlex.join(sys.orig_argv),
        "cwd": os.getcwd(),
        "seeds": seeds,
        **machine(),
        "cpu_lock": lock_state(lock),
        "load_before": list(os.getloadavg()),
        "started": _now(),
    }
    if dirty:
        _warn(record)
    return Stamp(record, (commit, code), root)


def _warn(record: dict[str, Any]) -> None:
    print(
        f"provenance: DIRTY -- code differs from {record['commit']}: {', '.join(record['dirty_paths'])}\n"
        "provenance: this result is stamped dirty: true and cannot back a published number; "
        "commit first, then run.",
        file=sys.stderr,
        flush=True,
    )


def stamp_file(path: Path, record: dict[str, Any]) -> None:
    """Add ``record`` to the JSON object in ``path`` under ``"provenance"``."""
    result = json.loads(path.read_text())
    result["provenance"] = record
    path.write_text(json.dumps(result, indent=2) + "\n")


def run_command(command: list[str]) -> int:
    """Run the wrapped command in the foreground (it inherits the lock); its exit status."""
    return subprocess.run(command, check=False).returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog="usage: ... -- COMMAND ARGS"
    )
    parser.add_argument("--json", type=Path, required=True, help="the JSON object COMMAND writes")
    parser.add_argument("--seed", type=int, action="append", help="a seed COMMAND uses (repeatable)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ARGS")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command after --")
    stamp = start(seeds=args.seed)
    returncode = run_command(command)
    record = stamp.finish()
    if returncode != 0:
        print(f"provenance: {command[0]} exited {returncode}; {args.json} not stamped", file=sys.stderr)
        return returncode
    stamp_file(args.json, record)
    print(
        f"provenance: stamped {args.json} (commit {record['commit']}, dirty {record['dirty']})",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
