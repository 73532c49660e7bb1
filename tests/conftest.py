"""Shared test settings: fixed seeds, a hypothesis profile without deadlines, the session's
package fixtures, the rule that a test that starts a process is marked ``slow``, and the
real dataset's presence said at the start and the end of a run."""

import gc
import multiprocessing.util
import os
import sys
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import settings

from support.distributed import RUN_WORKERS_EVENT
from support.doc_commands import COMMANDS_GROUP, EXAMPLES_GROUP
from support.start_order import group_of, start_order

settings.register_profile("ci", deadline=None, derandomize=True, max_examples=60)
settings.register_profile("dev", deadline=None, max_examples=30)
settings.load_profile("ci" if os.environ.get("CI") else "dev")

# One torch thread per xdist worker (two workers share the 2 cores ./dev test is sized for;
# two threads each would spin against each other), at most two in one process.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else max(1, min(2, torch.get_num_threads())))
# The processes tests start get one OpenMP thread too, unless the test sets it (with the
# other core busy, a second thread makes every small operation wait on it).
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_finish(session: pytest.Session) -> None:
    """Freeze what collection built (modules, parameters: about 200,000 objects) out of the
    garbage collector's and the hook's discovery scans, which would walk it again each time."""
    gc.freeze()


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


# -- a test that starts a process is marked slow (and distributed if it runs gloo workers) ---
# ``-m "not slow"`` is the quick in-process suite: it must start no interpreter and no
# process group. Every way a test can start a program is recorded while it runs (its
# setup included): the audit events of subprocess and os.fork/posix_spawn/system, the
# fork server's launches (``support.distributed`` raises RUN_WORKERS_EVENT), and
# multiprocessing's spawn and forkserver, which raise no event (``spawnv_passfds``).
# System tools that take milliseconds and run no other program (``platform.processor()``
# runs ``uname -p``; ``ip`` builds network namespaces, and counts when it execs a command;
# matplotlib's first import on a fresh machine lists the fonts with ``fc-list`` to build its
# cache) are not counted.
PROCESS_EVENTS = {"subprocess.Popen", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.system"}
QUICK_TOOLS = {"uname", "git", "ip", "tc", "fc-list"}
STARTED: list[str] = []  # what the running test started: the event, and the program when known


def _program(event: str, args: tuple) -> str | None:
    """The program an audit event starts, or None when it starts nothing worth a marker."""
    argv = {"subprocess.Popen": 1, "os.posix_spawn": 1}.get(event)
    if argv is None or not args[argv]:
        return event
    command = [os.fsdecode(arg) for arg in args[argv]]
    name = os.path.basename(command[0])
    return None if name in QUICK_TOOLS and "exec" not in command else f"{event} {name}"


def _record_process_events(event: str, args: tuple) -> None:
    if event in PROCESS_EVENTS and (program := _program(event, args)) is not None:
        STARTED.append(program)
    elif event == RUN_WORKERS_EVENT:
        STARTED.append(event)


def _recording_spawn(spawnv_passfds):
    """multiprocessing's ``spawnv_passfds``, recording that it starts an interpreter."""

    def spawnv_passfds_recorded(path, args, passfds):
        STARTED.append(f"multiprocessing {os.path.basename(path)}")
        return spawnv_passfds(path, args, passfds)

    return spawnv_passfds_recorded


sys.addaudithook(_record_process_events)
multiprocessing.util.spawnv_passfds = _recording_spawn(multiprocessing.util.spawnv_passfds)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    STARTED.clear()


@pytest.fixture(autouse=True)
def _processes_are_marked(request: pytest.FixtureRequest):
    """Fail a test that starts a process without ``slow``, or gloo workers without ``distributed``."""
    yield
    missing = [
        marker
        for marker, needed in (("slow", STARTED), ("distributed", RUN_WORKERS_EVENT in STARTED))
        if needed and request.node.get_closest_marker(marker) is None
    ]
    if missing:
        pytest.fail(f"starts processes ({', '.join(sorted(set(STARTED)))}) but is not marked {missing}")


# -- parallel runs (opt-in): pytest -n 2 --dist loadgroup --no-loadscope-reorder -----------
# A test without an xdist group is grouped with its module, so module-scoped fixtures (one
# run_workers launch shared by a module's tests) run once, not once per worker. On a
# worker the groups start in tests/support/start_order.py's order: the two groups of documented
# runs (tests/support/doc_commands.py, run_group) first, then the slow ones, then the quick.
DOCUMENTED_GROUPS = (EXAMPLES_GROUP, COMMANDS_GROUP)


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
    if hasattr(config, "workerinput"):  # an xdist worker
        order = start_order(items, DOCUMENTED_GROUPS)
        items.sort(key=lambda item: order[group_of(item)])  # stable: a group's tests keep their order


# -- the package as a user installs it, and the documented commands run against it ---------
# Session-wide, shared by test_package.py, test_docs.py and test_examples.py: the wheel is
# built once and each documented block runs once (tests/support/doc_commands.py has the rules).
@pytest.fixture(scope="session")
def built_package(tmp_path_factory: pytest.TempPathFactory):
    from support.package import build_distributions

    return build_distributions(tmp_path_factory.mktemp("build"))


@pytest.fixture(scope="session")
def user_environment(built_package, tmp_path_factory: pytest.TempPathFactory):
    """A fresh venv outside the source tree with the built wheel installed (``pip install gradsift``)."""
    import subprocess

    from support.package import fresh_environment, pip_offline_env

    environment = fresh_environment(tmp_path_factory.mktemp("user") / "venv")
    installed = subprocess.run(
        [str(environment.bin / "pip"), "install", "gradsift"],
        env={**os.environ, **pip_offline_env(built_package)},
        cwd=environment.prefix,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert installed.returncode == 0, installed.stdout + installed.stderr
    return environment


@pytest.fixture(scope="session")
def documented_runs(built_package, user_environment, tmp_path_factory: pytest.TempPathFactory):
    from support.doc_commands import DocumentedRuns, command_env, documented_blocks
    from support.package import command_path, pip_offline_env

    env = command_env(command_path(user_environment), pip_offline_env(built_package))
    return DocumentedRuns(documented_blocks(), tmp_path_factory.mktemp("documented"), env)


# -- the real dataset: its absence is said, not only skipped --------------------------------
def pytest_report_header(config: pytest.Config) -> str:
    """The first lines of every run say whether the real Fashion-MNIST is installed: without
    it the tests marked ``needs_real`` skip (``./dev setup`` installs Debian's package as root)."""
    from gradsift.tools.train import data

    if data.has_dataset(data.SYSTEM_DIR):
        return f"real Fashion-MNIST: {data.SYSTEM_DIR}"
    return (
        f"real Fashion-MNIST: ABSENT from {data.SYSTEM_DIR} -- the tests that read it skip "
        "(apt-get install dataset-fashion-mnist)"
    )


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """Repeat the dataset's absence at the end of the run, where a reader looks."""
    from gradsift.tools.train import data

    if not data.has_dataset(data.SYSTEM_DIR):
        terminalreporter.write_line(
            f"WARNING: real Fashion-MNIST absent from {data.SYSTEM_DIR}: its tests were skipped", red=True
        )


# -- a one-process gloo group, for tests of code that needs torch.distributed initialised -----
@pytest.fixture(scope="module")
def one_process_group(tmp_path_factory: pytest.TempPathFactory):
    """World size 1 on gloo in this process, for one test module (file rendezvous)."""
    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
