"""``scripts/search_low_comm.py``: DiLoCo's and the exchanging optimizers' cases are functions of
their seeds and cover both frontends (its short search runs in tests/project/test_random_search.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import gradsift
from gradsift.compressors.registry import compressor_options
from gradsift.hook.options import HOOK_OPTIONS

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import search_low_comm  # noqa: E402


def test_a_seed_draws_one_configuration_of_each_frontend() -> None:
    names = gradsift.available_compressors()
    for frontend in search_low_comm.FRONTENDS:
        drawn = [search_low_comm.draw(seed, names, frontend) for seed in range(200)]
        assert drawn == [search_low_comm.draw(seed, names, frontend) for seed in range(200)]
        assert {config["model"] for config in drawn} == set(search_low_comm.MODELS)
        assert {config["poison"] for config in drawn} == {None, "inf", "nan"}
    rounds = [search_low_comm.draw(seed, names, "diloco") for seed in range(200)]
    assert {config["compressor"] for config in rounds} == {*names, "auto"}
    for config in rounds:
        own = set() if config["compressor"] == "auto" else set(compressor_options(config["compressor"]))
        assert set(config["options"]) <= own | set(HOOK_OPTIONS), config
        assert config["sync_every"] in (1, 2, 3, 4)
    assert {r["outer"].get("unsent") for r in rounds} == {None, "model"}
    optimizers = {search_low_comm.draw(seed, names, "exchanging")["optimizer"] for seed in range(200)}
    assert optimizers == {"demo", "lion"}
