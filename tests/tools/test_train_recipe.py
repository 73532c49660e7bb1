"""`gradsift train`'s defaults are DGC's recipe; ``--no-recipe`` restores plain SGD momentum."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gradsift.core.errors import InvalidOptionError
from gradsift.hook.adam import WARMUP_FRACTION as ADAM_WARMUP_FRACTION
from gradsift.hook.auto import DECIDE_AT
from gradsift.tools.cli import build_parser
from gradsift.tools.commands.train import config_from_args
from gradsift.tools.train.config import TrainConfig
from gradsift.tools.train.exchange import DENSITY_WARMUP_FRACTION, recipe_options, warms_up_density
from gradsift.tools.train.launcher import run_trainings
from support.train import TINY

WITHOUT_FEEDBACK = {"hook_momentum": None, "momentum_masking": None, "density_warmup_steps": 0,
                    "density_warmup_start": None, "optimizer": "SGD", "adam_warmup_steps": None}  # fmt: skip


def test_density_warmup_applies_to_error_feedback_sparsifiers_with_a_ratio() -> None:
    for name in (
        "topk",
        "randomk",
        "dgc",
        "gaussiank",
        "redsync",
        "sidco-exp",
        "sidco-gpareto",
        "sidco-gamma",
    ):
        assert warms_up_density(name, {}), name
    # no ratio (threshold), no sparsifier (quantizers, low rank), or error feedback turned off
    for name in ("none", "fp16", "bf16", "threshold", "vgc", "qsgd", "terngrad", "efsignsgd", "powersgd"):
        assert not warms_up_density(name, {}), name
    assert not warms_up_density("topk", {"error_feedback": False})


def test_recipe_options_warm_up_a_fortieth_of_the_run_and_explicit_options_win() -> None:
    assert DENSITY_WARMUP_FRACTION == 0.025
    assert recipe_options("topk", {"ratio": 0.01}, 469) == {"ratio": 0.01, "density_warmup_steps": 12}
    assert recipe_options("topk", {"ratio": 0.01}, 1876) == {"ratio": 0.01, "density_warmup_steps": 47}
    assert recipe_options("sidco-exp", {}, 21) == {"density_warmup_steps": 1}
    assert recipe_options("sidco-exp", {}, 20) == {}  # a warm-up that rounds to 0 steps: none
    assert recipe_options("topk", {"density_warmup_steps": 0}, 469) == {"density_warmup_steps": 0}
    assert recipe_options("qsgd", {"levels": 15}, 469) == {"levels": 15}


def test_config_checks_recipe_is_a_bool(tmp_path: Path) -> None:
    with pytest.raises(InvalidOptionError, match="recipe must be True or False, got 'off'"):
        TrainConfig(out=str(tmp_path), recipe="off")  # type: ignore[arg-type]
    assert TrainConfig(out=str(tmp_path)).recipe is True


def _train(home: Path, runs: dict[str, tuple[str, ...]]) -> dict[str, tuple[dict, list[dict], dict]]:
    """Each named run's ``gradsift train`` flags (after TINY and 4 steps), parsed as the
    command line parses them into the config it runs, out in ``home/<name>``; the runs train
    in turn in one launch of the workers (each as in processes of its own: test_train.py's
    launch test). Per run: its summary, step records and saved config."""
    configs = []
    for name, flags in runs.items():
        out = str(home / name)
        args = build_parser().parse_args(["train", *TINY, "--steps", "4", "--out", out, *flags])
        configs.append(config_from_args(args, out, args.workers))
    summaries = run_trainings(configs, home)
    return {
        name: (
            summary,
            [json.loads(line) for line in (home / name / "steps.jsonl").read_text().splitlines()],
            json.loads((home / name / "config.json").read_text()),
        )
        for name, summary in zip(runs, summaries, strict=True)
    }


#: The two-worker runs of this module's tests, which share one launch (:func:`two_workers`).
TWO_WORKER_RUNS = {
    "off": ("--compressor", "topk", "--ratio", "0.01", "--no-recipe"),
    "fp16": ("--compressor", "fp16"),
    "adamw": ("--compressor", "topk", "--ratio", "0.01", "--optimizer", "adamw", "--steps", "10"),
    "auto": ("--steps", "14"),
}


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[dict, list[dict], dict]]:
    return _train(tmp_path_factory.mktemp("recipe"), TWO_WORKER_RUNS)


@pytest.mark.distributed
@pytest.mark.slow
def test_no_recipe_keeps_sgd_momentum_and_the_target_density(two_workers) -> None:
    summary, steps, config = two_workers["off"]
    assert summary["recipe"] == {"enabled": False, "hook_momentum": 0.0, "optimizer_momentum": 0.9,
                                 "momentum_masking": None, "density_warmup_steps": 0,
                                 "density_warmup_start": None, "optimizer": "SGD",
                                 "adam_warmup_steps": None}  # fmt: skip
    assert config["recipe"] is False
    assert all(0.009 <= r["density"] <= 0.011 for r in steps)


@pytest.mark.distributed
@pytest.mark.slow
def test_recipe_leaves_compressors_without_error_feedback_their_sgd_momentum(two_workers) -> None:
    summary, _, _ = two_workers["fp16"]
    assert summary["recipe"] == {"enabled": True, "optimizer_momentum": 0.9, **WITHOUT_FEEDBACK}


def test_recipe_options_give_adam_a_dense_warm_up_of_a_tenth_of_the_run() -> None:
    assert ADAM_WARMUP_FRACTION == 0.1
    assert recipe_options("topk", {"ratio": 0.01}, 300, adam=True) == {
        "ratio": 0.01, "density_warmup_steps": 8, "warmup_steps": 30,
    }  # fmt: skip
    assert recipe_options("topk", {"ratio": 0.01, "warmup_steps": 5}, 300, adam=True)["warmup_steps"] == 5
    assert recipe_options("topk", {}, 4, adam=True)["warmup_steps"] == 1  # at least one dense step
    assert "warmup_steps" not in recipe_options("bf16", {}, 300, adam=True)  # no error feedback
    assert "warmup_steps" not in recipe_options("topk", {}, 300)  # SGD needs none
    assert recipe_options("powersgd", {"rank": 2}, 300, adam=True) == {"rank": 2}  # AdamW keeps its moments


@pytest.mark.distributed
@pytest.mark.slow
def test_adamw_moves_its_first_moment_into_the_hook(two_workers) -> None:
    summary, steps, config = two_workers["adamw"]
    assert summary["recipe"]["optimizer"] == "AdamW" and summary["recipe"]["hook_momentum"] == 0.9
    assert summary["recipe"]["adam_warmup_steps"] == 1 and summary["recipe"]["optimizer_momentum"] is None
    assert (config["optimizer"], config["lr"], config["weight_decay"], config["betas"]) == (
        "adamw",
        3e-3,
        0.1,
        [0.9, 0.99],
    )
    assert [r["density"] for r in steps][:1] == [1.0] and all(r["density"] <= 0.011 for r in steps[1:])


@pytest.mark.distributed
@pytest.mark.slow
def test_clip_grad_norm_bounds_each_step_and_leaves_small_gradients_alone(tmp_path: Path) -> None:
    """Plain SGD (no momentum, constant lr 0.5) over the same batches: clipped to 1e-9 the
    parameters move at most 5e-10 a step, so its losses are those of a run at lr 1e-12 (the
    parameters as initialised); clipped to 1e9 nothing is clipped, and the run is the
    unclipped one exactly. One worker: every rank clips the same averaged gradients after
    the exchange, so one rank's losses say all of it, at half the processes of two."""
    sgd = ("--compressor", "none", "--optimizer", "sgd", "--momentum", "0", "--steps", "3", "--workers", "1")
    runs = {
        "free": ("--lr", "0.5"),
        "tight": ("--lr", "0.5", "--clip-grad-norm", "1e-9"),
        "loose": ("--lr", "0.5", "--clip-grad-norm", "1e9"),
        "still": ("--lr", "1e-12"),
    }
    trained = _train(tmp_path, {name: (*sgd, *flags) for name, flags in runs.items()})
    losses = {name: [r["loss"] for r in steps] for name, (_, steps, _) in trained.items()}
    assert losses["loose"] == losses["free"]
    assert losses["tight"] == pytest.approx(losses["still"], abs=1e-6)
    assert abs(losses["free"][2] - losses["still"][2]) > 1e-3  # lr 0.5 does move the model


def test_config_refuses_a_negative_clip_grad_norm(tmp_path: Path) -> None:
    with pytest.raises(InvalidOptionError, match="clip_grad_norm"):
        TrainConfig(out=str(tmp_path), clip_grad_norm=-1.0)


@pytest.mark.distributed
@pytest.mark.slow
def test_the_default_compressor_is_auto_and_the_summary_says_what_it_chose(two_workers) -> None:
    summary, steps, _ = two_workers["auto"]
    auto = summary["recipe"]["auto"]
    assert summary["compressor"] == "auto" and auto["choice"] in ("none", "bf16", "sidco-exp")
    assert set(auto["predicted_ms"]) == {"none", "bf16", "sidco-exp"}  # SGD's candidates
    assert auto["decided_at"] == DECIDE_AT + 1  # after the optimizer step of step DECIDE_AT
    assert all(r["density"] < 0.05 for r in steps[: DECIDE_AT + 1])  # SGD measures on sidco-exp
    # the summary's steps from the choice on: those records' own means, the measuring steps left out
    chosen = [r for r in steps if r["step"] >= auto["decided_at"]]
    since = summary["since_choice"]
    assert since["from_step"] == auto["decided_at"] and len(chosen) == len(steps) - auto["decided_at"]
    for key, field in (("bytes_sent_per_step", "bytes_sent"), ("achieved_density", "density")):
        assert since[key] == pytest.approx(sum(r[field] for r in chosen) / len(chosen), rel=1e-12)
    assert recipe_options("auto", {}, 300, adam=True) == {"warmup_steps": 30}  # Adam's warm-up only
    # outside Adam: the density warm-up of the start method, as `--compressor sidco-exp` gets it
    assert recipe_options("auto", {"nonfinite": "skip"}, 300) == {
        "nonfinite": "skip",
        "density_warmup_steps": 8,
    }
    assert recipe_options("sidco-exp", {}, 300)["density_warmup_steps"] == 8
