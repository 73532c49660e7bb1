"""benchmarks/provenance.py: the stamp every benchmark result carries (in-process; git only)."""

from __future__ import annotations

import argparse
import fcntl
import json
import shlex
import subprocess
import sys
from pathlib import Path

import provenance
import pytest


def git(root: Path, *args: str) -> str:
    done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=True)
    return done.stdout.strip()


@pytest.fixture
def checkout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A committed checkout with code and a result; gradsift counts as imported from it."""
    for path in ("src/gradsift/core.py", "benchmarks/x/run.py", "results/x/results.json", "scripts/a.sh"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("1\n")
    git(tmp_path, "init", "-q")
    git(tmp_path, "add", ".")
    git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "code")
    monkeypatch.setattr(provenance, "imported_code", lambda root: [])
    return tmp_path


def test_a_clean_checkout_gives_its_commit_and_no_dirty_paths(checkout: Path) -> None:
    assert provenance.code_state(checkout) == (git(checkout, "rev-parse", "HEAD"), [])


def test_results_and_docs_are_not_code_but_scripts_and_any_source_are(checkout: Path) -> None:
    (checkout / "results/x/results.json").write_text("2\n")
    (checkout / "results/x/plot.png").write_text("new\n")
    (checkout / "benchmarks/x/README.md").write_text("new\n")
    assert provenance.code_state(checkout)[1] == []
    (checkout / "benchmarks/x/run.py").write_text("2\n")
    (checkout / "src/gradsift/new.txt").write_text("untracked\n")
    git(checkout, "mv", "scripts/a.sh", "scripts/b.sh")
    assert provenance.code_state(checkout)[1] == [
        "benchmarks/x/run.py",
        "scripts/b.sh",
        "src/gradsift/new.txt",
    ]


def test_outside_a_checkout_there_is_no_commit_and_the_result_is_dirty(tmp_path: Path) -> None:
    assert provenance.code_state(tmp_path) == (None, ["<no git checkout>"])


def test_gradsift_imported_from_elsewhere_is_dirty(tmp_path: Path) -> None:
    (reason,) = provenance.imported_code(tmp_path)
    assert "gradsift imported from" in reason and str(tmp_path) in reason


def test_the_stamp_records_commit_command_seeds_machine_and_load(checkout: Path) -> None:
    stamp = provenance.start(seeds=[0, 1], root=checkout, lock=checkout / "no-lock")
    record = stamp.finish()
    assert record["commit"] == git(checkout, "rev-parse", "HEAD") and record["dirty"] is False
    assert record["command"] == shlex.join(sys.orig_argv)
    assert record["seeds"] == [0, 1] and record["cpus"] and record["torch"] and record["python"]
    assert len(record["load_before"]) == len(record["load_after"]) == 3 and record["wall_s"] >= 0
    assert record["cpu_lock"] == {"path": str(checkout / "no-lock"), "held": False, "holder": None}


def test_a_report_holds_the_arguments_the_fields_and_the_finished_stamp(checkout: Path) -> None:
    stamp = provenance.start(seeds=[3], root=checkout, lock=checkout / "no-lock")
    path = checkout / "results" / "new" / "report.json"  # the folder does not exist yet
    stamp.write(path, argparse.Namespace(steps=5), results={"a": 1.5}, world_size=2)
    report = json.loads(path.read_text())
    assert list(report) == ["args", "results", "world_size", "provenance"]
    assert report["args"] == {"steps": 5, "json": str(path)}
    assert report["results"] == {"a": 1.5} and report["world_size"] == 2
    assert report["provenance"]["seeds"] == [3] and "finished" in report["provenance"]


def test_uncommitted_code_is_stamped_dirty_loudly(checkout: Path, capsys: pytest.CaptureFixture) -> None:
    (checkout / "src/gradsift/core.py").write_text("changed\n")
    record = provenance.start(root=checkout).finish()
    assert record["dirty"] is True and record["dirty_paths"] == ["src/gradsift/core.py"]
    assert "DIRTY" in capsys.readouterr().err


def test_code_that_changes_during_the_run_makes_it_dirty(
    checkout: Path, capsys: pytest.CaptureFixture
) -> None:
    stamp = provenance.start(root=checkout)
    (checkout / "benchmarks/x/run.py").write_text("edited mid-run\n")
    record = stamp.finish()
    assert record["dirty"] is True
    assert record["dirty_paths"] == ["<code changed during the run>", "benchmarks/x/run.py"]
    assert "DIRTY" in capsys.readouterr().err


def test_a_commit_during_the_run_makes_it_dirty(checkout: Path) -> None:
    stamp = provenance.start(root=checkout)
    git(checkout, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "later")
    assert stamp.finish()["dirty"] is True


def test_the_lock_counts_as_held_only_when_this_process_holds_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lock = tmp_path / "cpu.lock"
    lock.write_text("")
    assert provenance.lock_state(lock) == {"path": str(lock), "held": False, "holder": None}
    with open(lock) as held:  # as `flock LOCK COMMAND` passes it: a locked descriptor of ours
        fcntl.flock(held, fcntl.LOCK_EX)
        state = provenance.lock_state(lock)
        assert state["held"] is True and state["holder"] == "this process" and state["fd"] == held.fileno()
        monkeypatch.setattr(provenance, "_descriptors_of", lambda path: [])  # the holder is someone else
        assert provenance.lock_state(lock) == {"path": str(lock), "held": False, "holder": "another process"}
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # still ours: probing released nothing


def test_the_wrapper_stamps_the_json_its_command_wrote(
    checkout: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = checkout / "out.json"

    def command(argv: list[str]) -> int:
        out.write_text(json.dumps({"rows": [1]}))
        return 0

    monkeypatch.setattr(provenance, "ROOT", checkout)
    monkeypatch.setattr(provenance, "run_command", command)
    assert provenance.main(["--json", str(out), "--seed", "0", "--", "gradsift", "bench", "compress"]) == 0
    result = json.loads(out.read_text())
    assert result["rows"] == [1] and result["provenance"]["seeds"] == [0]
    assert result["provenance"]["commit"] == git(checkout, "rev-parse", "HEAD")


def test_the_wrapper_leaves_a_failed_command_unstamped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out.json"
    out.write_text("{}")
    monkeypatch.setattr(provenance, "run_command", lambda argv: 3)
    assert provenance.main(["--json", str(out), "--", "false"]) == 3
    assert json.loads(out.read_text()) == {}
