"""Shared test settings: fixed seeds and a hypothesis profile without deadlines."""

import os

import pytest
import torch
from hypothesis import settings

settings.register_profile("ci", deadline=None, derandomize=True, max_examples=60)
settings.register_profile("dev", deadline=None, max_examples=30)
settings.load_profile("ci" if os.environ.get("CI") else "dev")

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


# -- the package as a user installs it, and the documented commands run against it ---------
# Session-wide, shared by test_package.py, test_docs.py and test_examples.py: the wheel is
# built once and each documented block runs once (tests/doc_commands.py has the rules).
@pytest.fixture(scope="session")
def built_package(tmp_path_factory: pytest.TempPathFactory):
    from package_utils import build_distributions

    return build_distributions(tmp_path_factory.mktemp("build"))


@pytest.fixture(scope="session")
def user_environment(built_package, tmp_path_factory: pytest.TempPathFactory):
    """A fresh venv outside the source tree with the built wheel installed (``pip install gradsift``)."""
    import subprocess

    from package_utils import fresh_environment, pip_offline_env

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
    from doc_commands import DocumentedRuns, command_env, documented_blocks
    from package_utils import command_path, pip_offline_env

    env = command_env(command_path(user_environment), pip_offline_env(built_package))
    return DocumentedRuns(documented_blocks(), tmp_path_factory.mktemp("documented"), env)
