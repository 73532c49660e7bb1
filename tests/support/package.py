"""Build gradsift from this tree and install it the way a user gets it, in seconds, offline.

:func:`build_distributions` copies the files git would commit (tracked and new, not the
ignored ones) to a scratch directory and runs ``python -m build --no-isolation``: the
sdist, then the wheel built *from the sdist*, so a file missing from the sdist breaks the
wheel too. ``--no-isolation`` takes setuptools from the test environment (the ``test``
extra installs it) instead of downloading it.

:func:`fresh_environment` makes a virtual environment outside the source tree in which
gradsift is not installed, and lets it see the test environment's packages -- torch,
numpy, ... -- without copying them: one ``.pth`` line names a folder of links to every
package of the test environment's site-packages except gradsift itself (so neither the
editable install nor its metadata leaks in). Its ``bin/pip`` runs that pip; with
:func:`pip_offline_env`, ``pip install gradsift`` then installs the built wheel and finds
every dependency already satisfied.

:func:`read_pyproject` parses the tree's ``pyproject.toml`` on every Python gradsift supports.
"""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import venv
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from support import ROOT

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10 (requires-python >= 3.10) has no tomllib; pytest itself depends on tomli there
    import tomli as tomllib


def read_pyproject(root: Path = ROOT) -> dict[str, Any]:
    """``root/pyproject.toml`` as a dict (tomllib, or the same parser as tomli on Python 3.10)."""
    return tomllib.loads((root / "pyproject.toml").read_text())


@dataclass(frozen=True)
class Distributions:
    sdist: Path
    wheel: Path

    @property
    def folder(self) -> Path:
        return self.wheel.parent


@dataclass(frozen=True)
class Environment:
    """A fresh virtual environment: ``bin`` goes first on ``PATH``, ``python`` is its interpreter."""

    prefix: Path

    @property
    def bin(self) -> Path:
        return self.prefix / "bin"

    @property
    def python(self) -> Path:
        return self.bin / "python"


def committable_files(root: Path = ROOT) -> list[str]:
    """Paths (relative to ``root``) that git tracks or would add: the tree minus what .gitignore hides."""
    listed = subprocess.run(
        ["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [name for name in listed.split("\0") if name and (root / name).is_file()]


def build_distributions(scratch: Path, root: Path = ROOT) -> Distributions:
    """Build the sdist and wheel of ``root`` into ``scratch/dist``; return their paths."""
    source = scratch / "source"
    for name in committable_files(root):
        target = source / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / name, target)
    out = scratch / "dist"
    result = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    (sdist,) = out.glob("*.tar.gz")
    (wheel,) = out.glob("*.whl")
    return Distributions(sdist, wheel)


def fresh_environment(prefix: Path) -> Environment:
    """A venv at ``prefix`` without gradsift that sees the test environment's other packages."""
    venv.EnvBuilder(with_pip=False, symlinks=True).create(prefix)
    environment = Environment(prefix)
    links = prefix / "test-dependencies"
    links.mkdir()
    for site_packages in site.getsitepackages():  # this venv's first, then the system's
        for entry in sorted(Path(site_packages).iterdir()):
            name = entry.name.lower()
            hidden = name.startswith(("gradsift", "__editable__")) or name.endswith(".pth")
            if not hidden and entry.name != "__pycache__" and not (links / entry.name).exists():
                (links / entry.name).symlink_to(entry)
    (own_site_packages,) = prefix.glob("lib/python*/site-packages")
    (own_site_packages / "test-dependencies.pth").write_text(f"{links}\n")
    # The console scripts a user's venv would hold for the packages it sees: without its own
    # torchrun, PATH would reach a system torchrun whose python has no gradsift.
    for script, module in (("pip", "pip._internal.cli.main"), ("torchrun", "torch.distributed.run")):
        launcher = environment.bin / script
        launcher.write_text(
            f"#!{environment.python}\nimport sys\nfrom {module} import main\nsys.exit(main())\n"
        )
        launcher.chmod(0o755)
    return environment


def pip_offline_env(distributions: Distributions) -> dict[str, str]:
    """Environment variables that make ``pip install`` take packages from the built ones only."""
    return {
        "PIP_NO_INDEX": "1",
        "PIP_FIND_LINKS": str(distributions.folder),
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    }


def command_path(environment: Environment) -> str:
    """``PATH`` for commands run as a user would: the fresh venv first, then the test environment's tools."""
    return os.pathsep.join(
        [str(environment.bin), str(Path(sys.executable).parent), os.environ.get("PATH", "")]
    )
