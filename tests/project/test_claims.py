"""Published numbers equal their JSON, and every result names a commit of main's history.

The registry is benchmarks/registry.py, the checks benchmarks/claims.py, the list of stale
results benchmarks/stale.py. In-process (git only); the second half doctors numbers,
results and commits in a scratch tree to show that each check can fail.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import claimmodel
import claims
import pytest
import stale
from claimmodel import Claim, Result, lookup, spanned

ROOT = claimmodel.ROOT
ESTIMATION, PREDICTIONS = "results/estimation/results.json", "results/scaling/predictions.json"
ESTIMATION_STAT = "results/estimation/results-statistical.json"


# -- the repository as committed --------------------------------------------------------------
def test_every_published_number_equals_its_result() -> None:
    assert claims.document_problems() == []


def test_every_claimed_result_exists() -> None:
    assert claims.missing_results() == []


def test_every_result_names_a_commit_of_this_history_or_is_listed_stale() -> None:
    commits = claims.history()
    if commits is None:
        pytest.skip("no git history here (an sdist or a shallow clone): commits cannot be checked")
    assert claims.provenance_problems(ROOT, commits) == []


def test_the_registry_covers_readme_and_docs() -> None:
    published = {m["id"] for path in claims.documents() for m in claims.INLINE.finditer(path.read_text())}
    assert {"est.default.range", "compress.sidco.count", "train.sidco.compress"} <= published
    for page in ("README.md", "docs/choosing.md", "docs/training.md", "docs/vgc.md"):
        assert "<!-- claim:" in (ROOT / page).read_text(), page


# -- each check fails on a doctored number, result or commit ------------------------------------
@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A scratch root with two results and a README quoting them (numbers and a table)."""
    (tmp_path / "docs").mkdir()
    for result in (ESTIMATION, ESTIMATION_STAT, PREDICTIONS):
        (tmp_path / result).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / result, tmp_path / result)
    (tmp_path / "README.md").write_text(
        "cases: <!-- claim:est.cases -->324<!-- /claim -->, in band <!-- claim:est.statistical.median_in -->324/324"
        "<!-- /claim -->\n\n<!-- claims-table:choosing-crossover -->\n"
        + claims.BLOCKS["choosing-crossover"].render()
        + "\n<!-- /claims-table -->\n"
    )
    return tmp_path


def readme_problems(root: Path) -> list[str]:
    return [p for p in claims.document_problems(root) if p.startswith("README.md")]


def test_a_faithful_copy_passes(tree: Path) -> None:
    assert readme_problems(tree) == []


def test_a_doctored_number_in_the_text_fails(tree: Path) -> None:
    readme = tree / "README.md"
    readme.write_text(readme.read_text().replace("-->324<!-- /claim -->", "-->325<!-- /claim -->"))
    (problem,) = readme_problems(tree)
    assert "README.md:1: claim est.cases says '325'" in problem and "gives '324'" in problem


def test_a_doctored_result_fails(tree: Path) -> None:
    data = json.loads((tree / ESTIMATION_STAT).read_text())
    data["summary"]["median_in_0.8_1.25"] = 321
    (tree / ESTIMATION_STAT).write_text(json.dumps(data))
    (problem,) = readme_problems(tree)
    assert "est.statistical.median_in says '324/324'" in problem and "gives '321/324'" in problem


def test_a_doctored_table_cell_and_an_unknown_claim_fail(tree: Path) -> None:
    readme = tree / "README.md"
    readme.write_text(
        readme.read_text().replace("| 406 |", "| 407 |") + "<!-- claim:no.such -->1<!-- /claim -->\n"
    )
    assert sorted(p.split(": ", 1)[1][:25] for p in readme_problems(tree)) == [
        "block choosing-crossover ",
        "unknown claim 'no.such'",
    ]


def test_write_regenerates_what_was_doctored(tree: Path) -> None:
    readme = tree / "README.md"
    faithful = readme.read_text()
    readme.write_text(faithful.replace("324/324", "1/2").replace("| 406 |", "| 1 |"))
    assert readme in claims.write(tree) and readme.read_text() == faithful


def test_a_claim_nobody_publishes_is_reported(tree: Path) -> None:
    assert "est.sample16k.p10p90_in: in the registry but in no document" in claims.document_problems(tree)


def stamped(commit: str, dirty: bool = False) -> dict:
    return {"provenance": {"commit": commit, "dirty": dirty, "dirty_paths": []}}


@pytest.fixture
def commits() -> set[str]:
    found = claims.history()
    if found is None:
        pytest.skip("no git history here")
    return found


def write_json(root: Path, path: str, data: dict) -> str:
    (root / path).parent.mkdir(parents=True, exist_ok=True)
    (root / path).write_text(json.dumps(data))
    return path


def test_a_doctored_commit_fails_unless_listed_stale(tmp_path: Path, commits: set[str]) -> None:
    head = next(iter(commits))
    good = write_json(tmp_path, "results/a/results.json", {"run": {"commit": head[:9]}})
    bad = write_json(tmp_path, "results/b/results.json", {"runs": [{"gradsift_commit": "0123456789abcdef"}]})
    problems = [
        p for p in claims.provenance_problems(tmp_path, commits, [good, bad], ()) if p.startswith((good, bad))
    ]
    assert problems == [f"{bad}: names '0123456789abcdef', not a commit of this history; re-run it or list it in "
                        "benchmarks/stale.py"]  # fmt: skip
    listed = (stale.Stale((bad,), "provenance", "why", "command", "1 min"),)
    assert not [p for p in claims.provenance_problems(tmp_path, commits, [good, bad], listed) if bad in p]


def test_a_claimed_result_needs_a_clean_stamp_or_a_stale_entry(tmp_path: Path, commits: set[str]) -> None:
    head = next(iter(commits))

    def problems(data: dict) -> list[str]:
        write_json(tmp_path, ESTIMATION, data)
        return [
            p
            for p in claims.provenance_problems(tmp_path, commits, [ESTIMATION], ())
            if p.startswith(ESTIMATION)
        ]

    assert problems(stamped(head)) == []
    assert "no provenance stamp" in problems({"summary": {}})[0]
    assert "stamped dirty" in problems(stamped(head, dirty=True))[0]
    assert any("not in this history" in p for p in problems(stamped("fedcba9876543210")))


def test_stale_entries_that_match_nothing_or_are_no_longer_needed_fail(
    tmp_path: Path, commits: set[str]
) -> None:
    path = write_json(tmp_path, "results/a/results.json", stamped(next(iter(commits))))
    entries = (
        stale.Stale((path,), "provenance", "w", "c", "t"),
        stale.Stale(("results/z/*",), "code", "w", "c", "t"),
    )
    found = [
        p for p in claims.provenance_problems(tmp_path, commits, [path], entries) if p.startswith("stale")
    ]
    assert found == [
        f"stale entry ('{path}',): every result is validly stamped now; remove the entry",
        "stale entry ('results/z/*',): matches no result",
    ]


def test_without_git_history_commits_are_not_checked(tmp_path: Path) -> None:
    assert claims.history(tmp_path) is None


def test_commits_are_found_at_any_depth_and_matched_by_prefix() -> None:
    data = {"a": [{"commit": "abc1234"}, {"x": {"gradsift_commit": "def5678 (a note)"}}], "commit_count": 3}
    assert list(claims.named_commits(data)) == ["abc1234", "def5678 (a note)"]
    assert claims.in_history("def5678 (a note)", {"def5678" + "0" * 33})
    assert not claims.in_history("def56", {"def5678" + "0" * 33}) and not claims.in_history(
        "unknown", {"0" * 40}
    )


# -- the field paths and computations ----------------------------------------------------------
def test_field_paths_select_rows_keys_and_spans() -> None:
    data = {"rows": [{"name": "a", "r": 0.1, "v": 1}, {"name": "ab", "r": 0.01, "v": 3}],
            "k": {"x/y": 5}, "list": [7, 8]}  # fmt: skip
    assert lookup(data, "rows/[name=a,r=0.1]/v") == 1 and lookup(data, "rows/{name^=a}/v") == [1, 3]
    assert (
        lookup(data, "k/x\\/y") == 5
        and lookup(data, "list/-1") == 8
        and lookup(data, "*") == [data["rows"], data["k"], data["list"]]
    )
    for bad in ("rows/[name^=a]/v", "rows/{name=c}/v", "nope"):
        with pytest.raises(KeyError):
            lookup(data, bad)
    assert (
        spanned(".1f")([1.04, 1.01]) == "1.0" and spanned(".2f", scale=-100)([-0.012, -0.0119]) == "1.19-1.20"
    )


def test_a_claim_formats_its_value_and_refuses_a_silent_null(tmp_path: Path) -> None:
    result = Result("r.json", "make it")
    (tmp_path / "r.json").write_text(json.dumps({"a": 3.0, "b": 2.0, "none": None}))
    assert Claim("x", result, ("a", "b"), "{:.1f}x", compute=claimmodel.ratio).text(tmp_path) == "1.5x"
    assert Claim("y", result, ("none",), "{}", missing="never").text(tmp_path) == "never"
    with pytest.raises(ValueError, match="is null"):
        Claim("z", result, ("none",)).text(tmp_path)


def test_a_file_of_runs_is_backed_when_every_run_is_stamped_validly() -> None:
    good = {"commit": "a" * 40, "dirty": False}
    commits = {"a" * 40}
    assert claims.stamp_problem({"runs": [{"provenance": good}, {"provenance": good}]}, commits) is None
    dirty = {"commit": "a" * 40, "dirty": True, "dirty_paths": ["src/x.py"]}
    assert claims.stamp_problem({"runs": [{"provenance": good}, {"provenance": dirty}]}, commits) == (
        "run 1: stamped dirty: ['src/x.py']"
    )
    assert claims.stamp_problem({"runs": [{"provenance": good}, {}]}, commits) == "run 1: no provenance stamp"
    assert claims.stamp_problem({"runs": []}, commits) == "no provenance stamp"


def test_a_file_of_sessions_is_backed_when_every_session_is_stamped_validly() -> None:
    # scripts/exit_stress.py --resume appends one stamped session per invocation
    good = {"commit": "a" * 40, "dirty": False}
    commits = {"a" * 40}
    assert claims.stamp_problem({"sessions": [{"provenance": good}], "results": {}}, commits) is None
    lost = {"commit": "b" * 40, "dirty": False}
    assert claims.stamp_problem({"sessions": [{"provenance": good}, {"provenance": lost}]}, commits) == (
        f"session 1: stamped with {'b' * 40}, not in this history"
    )
    assert claims.stamp_problem({"sessions": []}, commits) == "no provenance stamp"


def test_a_table_cell_joins_text_and_claims(tmp_path: Path) -> None:
    result = Result("r.json", "make it")
    (tmp_path / "r.json").write_text(json.dumps({"a": 3.0, "b": 2.0}))
    a, b = Claim("a", result, ("a",), "{:.1f}x"), Claim("b", result, ("b",), "{:.0f} s")
    table = claimmodel.Table("t", ("setting", "buys"), ("---", "---"), (("slow", (a, " sooner, in ", b)),))
    assert table.claims == (a, b)
    assert table.render(tmp_path).splitlines()[-1] == "| slow | 3.0x sooner, in 2 s |"
