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
