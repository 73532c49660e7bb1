"""Run a plain two-rank user script many times per compressor and count abnormal exits.

Each run starts ``scripts/exit_user_script.py`` on 2 gloo ranks (by hand: two processes
with ``RANK``/``WORLD_SIZE``/``MASTER_*`` set, or through ``torchrun``), lets it train and
``destroy_process_group()`` without a barrier, and records how every rank ended. A rank
ended *abnormally* when its exit status is not 0 (a negative status is a signal, e.g.
SIGABRT), when its output holds ``terminate called`` (C++ ``std::terminate``), or when
it was still running after ``--timeout`` seconds (it is then aborted, so that its output
holds every thread's stack). A run is abnormal when any of its ranks is. Compressors are
interleaved run by run, so a change in machine load hits them all alike.

    python scripts/exit_stress.py --runs 200 --jobs 2 --json results/exit/results.json

``--jobs N`` runs N at a time (more load on the machine: a harsher test, not a gentler one).
``--json`` is rewritten after every run; ``--resume`` continues its tallies up to ``--runs``.

Exit status: 0 when no run was abnormal, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm import tqdm

# benchmarks/: the shared provenance stamp
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import provenance

USER_SCRIPT = Path(__file__).with_name("exit_user_script.py")
DEFAULT_COMPRESSORS = ("stock", "sidco-exp", "fp16", "vgc", "powersgd")
WORLD_SIZE = 2
ABORT_MARKER = "terminate called"


@dataclass
class RankEnd:
    """How one rank of one run ended.

    A rank still running at the timeout gets SIGABRT, so that Python's fault handler
    (``PYTHONFAULTHANDLER``) writes every thread's stack into its output; ``cpu_s`` is the
    CPU time it had used by then (little on a starved machine, the whole wait when it spins).
    """

    rank: int
    returncode: int | None  # None: still running at the timeout
    output_tail: str
    elapsed_s: float
    cpu_s: float | None = None

    @property
    def signal(self) -> str | None:
        if self.returncode is None or self.returncode >= 0:
            return None
        return signal.Signals(-self.returncode).name

    @property
    def abnormal(self) -> bool:
        return self.returncode != 0 or ABORT_MARKER in self.output_tail


@dataclass
class Tally:
    """Every run of one compressor; ``timed_out`` of the ``abnormal`` ones hung; ``failures``
    lists the abnormal ranks."""

    runs: int = 0
    abnormal: int = 0
    timed_out: int = 0
    failures: list[dict] = field(default_factory=list)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_commands(compressor: str, steps: int, launcher: str) -> list[tuple[list[str], dict[str, str]]]:
    """The processes of one run: one per rank by hand, or a single torchrun."""
    script = [str(USER_SCRIPT), "--compressor", compressor, "--steps", str(steps)]
    base = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    if launcher == "torchrun":
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        command += ["--nproc-per-node", str(WORLD_SIZE), *script]
        return [(command, base)]
    rendezvous = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(WORLD_SIZE)}
    return [
        ([sys.executable, *script], {**base, **rendezvous, "RANK": str(rank), "LOCAL_RANK": str(rank)})
        for rank in range(WORLD_SIZE)
    ]


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a live process (Linux ``/proc``); None when unavailable."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_once(compressor: str, steps: int, launcher: str, timeout: float) -> list[RankEnd]:
    """Start one run and wait for every process; after ``timeout`` seconds abort the ones left."""
    procs = [
        subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for cmd, env in launch_commands(compressor, steps, launcher)
    ]
    started = time.monotonic()
    outputs: list[str | None] = [None] * len(procs)
    try:
        for rank, proc in enumerate(procs):
            outputs[rank] = proc.communicate(timeout=max(0.1, started + timeout - time.monotonic()))[0]
    except subprocess.TimeoutExpired:
        pass
    hung = {proc.pid: cpu_seconds(proc.pid) for proc in procs if proc.poll() is None}
    for proc in procs:
        if proc.pid in hung:
            proc.send_signal(signal.SIGABRT)
    for rank, proc in enumerate(procs):
        if outputs[rank] is None:
            try:
                outputs[rank] = proc.communicate(timeout=30)[0]
            except subprocess.TimeoutExpired:
                proc.kill()
                outputs[rank] = proc.communicate()[0]
    elapsed = round(time.monotonic() - started, 1)
    return [
        RankEnd(rank, None if proc.pid in hung else proc.returncode, outputs[rank][-4000:], elapsed, hung.get(proc.pid))
        for rank, proc in enumerate(procs)
    ]  # fmt: skip


def stress(
    compressors: list[str],
    runs: int,
    *,
    steps: int = 120,
    launcher: str = "env",
    timeout: float = 900.0,
    jobs: int = 1,
    progress: bool = True,
    tallies: dict[str, Tally] | None = None,
    on_run: Callable[[dict[str, Tally]], None] | None = None,
) -> dict[str, Tally]:
    """Bring every compressor to ``runs`` runs (counting those already in ``tallies``),
    interleaved, ``jobs`` at a time; ``on_run(tallies)`` after each run. The tally per compressor."""
    tallies = {name: Tally() for name in compressors} | (tallies or {})
    remaining = {name: max(0, runs - tallies[name].runs) for name in compressors}
    schedule = [
        (tallies[name].runs + i, name) for i in range(max(remaining.values(), default=0)) for name in compressors
        if i < remaining[name]
    ]  # fmt: skip
    bar = tqdm(total=len(schedule), desc="runs", unit="run", disable=not progress, file=sys.stderr)
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        started = {pool.submit(run_once, name, steps, launcher, timeout): (i, name) for i, name in schedule}
        for done in as_completed(started):
            index, name = started[done]
            tally = tallies[name]
            tally.runs += 1
            bad = [end for end in done.result() if end.abnormal]
            if bad:
                tally.abnormal += 1
                tally.timed_out += any(end.returncode is None for end in bad)
                tally.failures += [{"run": index, **asdict(end), "signal": end.signal} for end in bad]
            if on_run is not None:
                on_run(tallies)
            bar.update()
            bar.set_postfix_str(" ".join(f"{n}:{t.abnormal}/{t.runs}" for n, t in tallies.items()))
    bar.close()
    return tallies


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=8, help="runs per compressor (default 8)")
    parser.add_argument(
        "--compressors",
        nargs="+",
        default=list(DEFAULT_COMPRESSORS),
        help="registry names, 'stock' (DDP without a hook) or 'torch-allreduce-hook' "
        f"(PyTorch's Python allreduce hook); default: {' '.join(DEFAULT_COMPRESSORS)}",
    )
    parser.add_argument("--steps", type=int, default=120, help="training steps per run (default 120)")
    parser.add_argument(
        "--launcher",
        choices=("env", "torchrun"),
        default="env",
        help="env: one process per rank started by hand (default); torchrun: python -m torch.distributed.run",
    )
    parser.add_argument(
        "--timeout", type=float, default=900.0, help="seconds before a run counts as hung (default 900)"
    )
    parser.add_argument("--jobs", type=int, default=1, help="runs at the same time (default 1)")
    parser.add_argument(
        "--json", type=Path, help="write the tallies and the machine's load here (rewritten after every run)"
    )
    parser.add_argument(
        "--resume", action="store_true", help="continue the tallies in --json up to --runs per compressor"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if min(args.runs, args.steps, args.jobs) < 1:
        parser.error("--runs, --steps and --jobs must be at least 1")
    if args.resume and (args.json is None or not args.json.exists()):
        parser.error("--resume needs an existing --json file")

    report = json.loads(args.json.read_text()) if args.resume else {"sessions": [], "results": {}}
    if args.resume and (report["steps"], report["launcher"]) != (args.steps, args.launcher):
        parser.error(
            f"--resume: {args.json} was made with --steps {report['steps']} --launcher {report['launcher']}"
        )
    stamp = provenance.start()  # the training seeds are exit_user_script.py's own
    session = {"jobs": args.jobs, "provenance": stamp.record}
    report["sessions"].append(session)
    report |= {"launcher": args.launcher, "steps": args.steps}

    def write(tallies: dict[str, Tally]) -> None:
        if args.json is None:
            return
        session["provenance"] = stamp.finish()  # the load and the code as of this run's end
        report["results"] = {name: asdict(tally) for name, tally in tallies.items()}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")

    tallies = stress(
        args.compressors,
        args.runs,
        steps=args.steps,
        launcher=args.launcher,
        timeout=args.timeout,
        jobs=args.jobs,
        progress=not args.no_progress,
        tallies={name: Tally(**tally) for name, tally in report["results"].items()},
        on_run=write,
    )
    write(tallies)
    for name, tally in tallies.items():
        print(f"{name:>22}: {tally.abnormal} abnormal of {tally.runs} ({tally.timed_out} timed out)")
    return 1 if any(t.abnormal for t in tallies.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
