"""``scripts/random_search.py``: each case's configuration is a function of its seed, drawn from
the installed registry, and a short search on 2 real gloo ranks writes every case once per rank
and finds nothing on the current code; so does a short one of ``scripts/search_low_comm.py``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import gradsift
from gradsift.compressors.registry import compressor_options
from gradsift.core.errors import GradsiftError, NonFiniteGradientError
from gradsift.hook.options import HOOK_OPTIONS

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import random_search  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def test_a_seed_draws_one_configuration_of_the_registry_and_the_hook() -> None:
    names = gradsift.available_compressors()
    drawn = [random_search.draw(seed, names) for seed in range(200)]
    assert drawn == [random_search.draw(seed, names) for seed in range(200)]
    assert {config["compressor"] for config in drawn} == {*names, "auto"}
    for config in drawn:
        own = set() if config["compressor"] == "auto" else set(compressor_options(config["compressor"]))
        assert set(config["options"]) <= own | set(HOOK_OPTIONS), config
        assert not (config["static_graph"] and config["micro_batches"] > 1)  # PyTorch's own failure
        assert not (config["static_graph"] and config["model"] == "routed")  # routing skips layers
    assert {config["model"] for config in drawn} == set(random_search.MODELS)
    assert {config["poison"] for config in drawn} == {None, "inf", "nan"}
    assert {config["dtype"] for config in drawn} == {"float32", "bfloat16", "float64"}
    assert {config["layout"] for config in drawn} == {"row-major", "channels_last"}
    assert {config["weight_decay"] for config in drawn} == {0.0, 0.01}
    assert {config["groups"] for config in drawn} == {"one", "two"}
    assert {config["set_to_none"] for config in drawn} == {True, False}
    assert {config["schedule"] for config in drawn} == {
        True,
        False,
        "one-cycle",
        "one-cycle, cycling momentum",
    }
    assert {config["checkpoint"] for config in drawn} == {"state_dict", "gathered", "dcp"}
    assert {config["decay_schedule"] for config in drawn} == {True, False}
    assert {config["recompute"] for config in drawn} == {None, "reentrant", "non-reentrant"}
    flags = {str(config["optimizer_flags"]) for config in drawn}
    assert flags == {"{}"} | {str(f) for family in random_search.OPTIMIZER_FLAGS.values() for f in family}
    assert {config["sync_each_backward"] for config in drawn if config["micro_batches"] > 1} == {True, False}


@pytest.mark.parametrize("frontend", ["fsdp1", "fsdp2"])
def test_an_fsdp_case_is_its_ddp_case_in_fsdp_without_what_fsdp_refuses_by_design(frontend: str) -> None:
    names = gradsift.available_compressors()
    for seed in range(200):
        ddp, fsdp = random_search.draw(seed, names), random_search.draw(seed, names, frontend)
        assert fsdp["frontend"] == frontend and not {"static_graph", "bucket_cap_mb", "bucket_view"} & set(
            fsdp
        )
        assert not set(random_search.FSDP_REFUSED) & set(fsdp["options"])
        assert fsdp["options"].items() <= ddp["options"].items()
        for key in ("compressor", "optimizer", "scaler", "model", "dtype", "poison"):
            assert fsdp[key] == ddp[key], (seed, key)
        if fsdp["model"] == "routed":  # FSDP pairs units' collectives by order
            assert fsdp["units"] == "model"
            assert frontend == "fsdp1" or fsdp["micro_batches"] == 1
        if frontend == "fsdp2" or fsdp["orig_params"]:
            assert not fsdp["pass_optimizer"]
        assert frontend == "fsdp1" or not fsdp["orig_params"]
        assert frontend == "fsdp1" or fsdp["layout"] == "row-major"
        if frontend == "fsdp1" and fsdp["model"] == "frozen":
            assert fsdp["orig_params"]  # FSDP1 flattens mixed requires_grad only with it


def test_the_losses_that_must_be_finite_follow_the_poisoned_steps_policy() -> None:
    losses = [1.0, float("nan"), 0.7, 0.5]  # the poisoned step is the second
    plain = {"poison": None, "scaler": None, "options": {}}
    assert random_search.expected_finite(losses, plain) == losses
    spread = {**plain, "poison": "nan"}  # propagate without a scaler: NaN parameters, as stock DDP
    assert random_search.expected_finite(losses, spread) == [1.0]
    for held in ({**spread, "scaler": "found"}, {**spread, "options": {"nonfinite": "skip"}}):
        assert random_search.expected_finite(losses, held) == [1.0, 0.7, 0.5]


def test_a_refusal_after_the_first_step_is_a_finding(one_process_group: None) -> None:
    def refused_at(step: int, error: type[Exception]) -> tuple[dict[str, Any], int]:
        stepped: list[float] = []

        def training() -> None:
            for index in range(4):
                if index == step:
                    raise error("cannot go on")
                stepped.append(1.0)

        _, verdict = random_search.attempt("training", 1, training)
        assert verdict is not None
        return verdict, len(stepped)

    at_first, steps = refused_at(0, GradsiftError)
    assert random_search.late(at_first, steps, poisoned=False)["outcome"] == "refused"
    later, steps = refused_at(2, GradsiftError)
    assert random_search.late(later, steps, poisoned=False)["outcome"] == "refused late"
    assert random_search.late(later, steps, poisoned=True)["outcome"] == "refused late"
    nonfinite, steps = refused_at(1, NonFiniteGradientError)  # nonfinite="raise" at the poisoned step
    assert random_search.late(nonfinite, steps, poisoned=True)["outcome"] == "refused"
    assert random_search.late(nonfinite, steps, poisoned=False)["outcome"] == "refused late"
    crashed, steps = refused_at(2, RuntimeError)
    assert random_search.late(crashed, steps, poisoned=False)["outcome"] == "finding"


@pytest.mark.parametrize(
    ("script", "frontend", "stop"),
    [("random_search.py", "ddp", 6), ("random_search.py", "fsdp2", 4),
     ("search_low_comm.py", "diloco", 5), ("search_low_comm.py", "exchanging", 5)],
)  # fmt: skip
def test_a_short_search_finds_nothing(tmp_path: Path, script: str, frontend: str, stop: int) -> None:
    out = tmp_path / "search"
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / script), "--frontend", frontend,
         "--seeds", "0", str(stop), "--out", str(out)],
        capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    for rank in range(2):
        results = [json.loads(line) for line in Path(f"{out}-r{rank}.jsonl").read_text().splitlines()]
        assert [r["seed"] for r in results] == list(range(stop))
        assert {r["outcome"] for r in results} <= {"ok", "refused"}, results  # not "refused late"
        assert any(r["outcome"] == "ok" for r in results)
