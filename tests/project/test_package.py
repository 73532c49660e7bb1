"""The package as released: sdist and wheel build, pass ``twine check``, carry the licenses,
have one version, and the wheel installed outside the source tree runs the demo.

The build (``python -m build --no-isolation``) and the fresh environment are session
fixtures of ``tests/conftest.py`` (helpers in ``tests/support/package.py``); the documented
commands (``tests/support/doc_commands.py``) run against the same installed wheel, so the demo
that ``docs/quickstart.md`` shows after ``pip install gradsift`` is the run checked here.
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
import zipfile
from email.parser import HeaderParser
from pathlib import Path

import pytest

import gradsift
from support.doc_commands import COMMANDS_GROUP, ROOT, DocumentedRuns
from support.package import Distributions, Environment, read_pyproject

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group(COMMANDS_GROUP)]
LICENSES = ("LICENSE", "NOTICE", "src/gradsift/data/LICENSE-fashion-mnist.txt")


def wheel_metadata(wheel: Path) -> tuple[list[str], dict[str, str]]:
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        (metadata,) = (n for n in names if n.endswith(".dist-info/METADATA"))
        headers = HeaderParser().parsestr(archive.read(metadata).decode())
    return names, dict(headers.items())


def test_license_notice_and_the_datasets_license_are_in_wheel_and_sdist(built_package: Distributions) -> None:
    names, metadata = wheel_metadata(built_package.wheel)
    dist_info = f"gradsift-{gradsift.__version__}.dist-info"
    for license_file in LICENSES:
        assert f"{dist_info}/licenses/{license_file}" in names
    assert "gradsift/data/LICENSE-fashion-mnist.txt" in names  # beside the data it covers
    with zipfile.ZipFile(built_package.wheel) as archive:
        shipped = archive.read(f"{dist_info}/licenses/LICENSE").decode()
    assert (
        shipped == (ROOT / "LICENSE").read_text() and "Apache License" in shipped and "Version 2.0" in shipped
    )
    assert metadata["License-Expression"] == "Apache-2.0"
    # no tests/, benchmarks/ or results/ in the wheel
    assert {n.split("/")[0] for n in names} == {"gradsift", dist_info}
    with tarfile.open(built_package.sdist) as sdist:
        members = {m.name.split("/", 1)[1] for m in sdist.getmembers() if "/" in m.name}
    assert set(LICENSES) <= members and "CHANGELOG.md" in members


def test_twine_check_passes_on_sdist_and_wheel(built_package: Distributions) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "twine",
            "check",
            "--strict",
            str(built_package.sdist),
            str(built_package.wheel),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("PASSED") == 2, result.stdout


def test_the_version_is_written_once_in_gradsift_init(built_package: Distributions) -> None:
    project = read_pyproject()
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "gradsift.__version__"}
    _, metadata = wheel_metadata(built_package.wheel)
    assert metadata["Version"] == gradsift.__version__
    assert built_package.wheel.name == f"gradsift-{gradsift.__version__}-py3-none-any.whl"
    assert f"## [{gradsift.__version__}]" in (ROOT / "CHANGELOG.md").read_text()


def test_the_installed_wheel_is_what_runs_outside_the_source_tree(
    user_environment: Environment, documented_runs: DocumentedRuns
) -> None:
    probe = (
        "import gradsift, importlib.metadata as m, importlib.resources as r; "
        "data = r.files('gradsift') / 'data'; "
        "print(gradsift.__file__, m.version('gradsift'), gradsift.__version__, "
        "sorted(p.name for p in data.iterdir() if p.name.endswith('.gz')))"
    )
    done = subprocess.run(
        [str(user_environment.python), "-c", probe],
        cwd=user_environment.prefix,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    location, installed, version, data = done.stdout.split(" ", 3)
    assert Path(location).is_relative_to(user_environment.prefix) and not Path(location).is_relative_to(ROOT)
    assert installed == version == gradsift.__version__
    assert data.count(".gz") == 4  # the embedded Fashion-MNIST subset ships in the wheel
    version_line = subprocess.run(
        [str(user_environment.python), "-m", "gradsift", "--version"],
        cwd=user_environment.prefix,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert version_line.stdout.strip() == f"gradsift {gradsift.__version__}"

    # docs/quickstart.md: `gradsift demo --quick`, run by the installed console script
    demo = documented_runs.run(documented_runs.find("gradsift demo --quick", source="docs/quickstart.md"))
    assert demo.ok, "\n\n".join(r.describe() for r in demo.runs)
    assert demo.directory.is_relative_to(user_environment.prefix.parents[1])  # the test's scratch, not ROOT
    assert (demo.directory / "gradsift-demo" / "demo.json").is_file()
