"""gradsift.diloco (gradsift/frontends/diloco.py): DiLoCo's outer steps on compressed pseudo-gradients,
in real gloo processes at 2 and 4 ranks.

The oracle is DiLoCo written out here from its definition (Douillard et al. 2023): every
worker takes ``H`` inner steps on its own data; the pseudo-gradients
``Delta_k = theta - theta_k`` are averaged with a plain ``all_reduce``; an SGD with Nesterov
momentum (PyTorch's) steps the shared parameters with that mean as their gradient; every
worker restarts from them. ``none`` (dense) must match it; with a sparsifier the shared
parameters must agree on every rank after every round, resume bit for bit, survive a
non-finite round and raise on a dead peer.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import gradsift
from gradsift.core.errors import InvalidOptionError
from support.diloco import INNER_LR, inner, survivors_raised, trained
from support.diloco import dying_worker as dying_worker  # the ranks look it up by name
from support.distributed import run_workers
from support.models import flat_params, make_model

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

H, ROUNDS = 3, 4


def reference(rank: int, world: int) -> list[torch.Tensor]:
    """DiLoCo by hand: the shared parameters after every round."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=INNER_LR)
    shared = [p.detach().clone() for p in model.parameters()]
    outer = torch.optim.SGD(shared, lr=0.7, momentum=0.9, nesterov=True)
    rounds = []
    for step in range(H * ROUNDS):
        inner(model, optimizer, rank, step)
        if (step + 1) % H == 0:
            with torch.no_grad():
                for s, p in zip(shared, model.parameters(), strict=True):
                    delta = s - p
                    dist.all_reduce(delta)
                    s.grad = delta / world
                outer.step()
                for s, p in zip(shared, model.parameters(), strict=True):
                    p.copy_(s)
            rounds.append(torch.cat([s.reshape(-1) for s in shared]).clone())
    return rounds


def hooked(rank: int, compressor: str, resume_at: int | None = None, **options) -> tuple[list, object]:
    return trained(
        lambda model, optimizer: gradsift.diloco(model, optimizer, sync_every=H, compressor=compressor, **options),
        rank, H * ROUNDS, H, resume_at=resume_at,
    )  # fmt: skip


def dense_worker(rank: int, world: int) -> dict:
    expected = reference(rank, world)
    got, state = hooked(
        rank, "none", outer_lr=0.7, outer_momentum=0.9
    )  # DiLoCo's outer step, as the reference
    return {"expected": expected, "got": got, "stats": state.stats()}


@pytest.mark.parametrize("world", [2, 4])
def test_dense_diloco_equals_the_method_written_out(world):
    results = run_workers(__file__, "dense_worker", world, timeout=120)
    for result in results:
        for got, expected in zip(result["got"], result["expected"], strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)
        total = result["stats"]["total"]
        numel = sum(p.numel() for p in make_model().parameters())
        assert total["steps"] == ROUNDS and total["inner_steps"] == H * ROUNDS
        assert total["dense_bytes"] == ROUNDS * H * 4 * numel  # H allreduces of DDP per round


def sparse_worker(rank: int, world: int) -> dict:
    whole, state = hooked(rank, "sidco-exp", ratio=0.1)
    resumed, _ = hooked(rank, "sidco-exp", resume_at=H + 1, ratio=0.1)
    sparseloco, _ = hooked(rank, "topk", ratio=0.1, outer_momentum=0.0, residual_decay=0.9)
    return {"whole": whole, "resumed": resumed, "sparseloco": sparseloco, "stats": state.stats()}


@pytest.mark.parametrize("world", [2, 4])
def test_compressed_rounds_agree_on_every_rank_and_resume_bit_for_bit(world):
    results = run_workers(__file__, "sparse_worker", world, timeout=180)
    for result in results:
        assert all(torch.equal(a, b) for a, b in zip(result["resumed"], result["whole"], strict=True))
        total = result["stats"]["total"]
        # ratio 0.1: 10% of the values plus their int32 indices (20% of fp32), once per H inner steps
        assert 0 < total["bytes_sent"] < 0.25 * total["dense_bytes"] / H
    for name in ("whole", "sparseloco"):
        for other in results[1:]:
            assert all(torch.equal(a, b) for a, b in zip(other[name], results[0][name], strict=True)), name
    moved = [
        float((b - a).norm()) for a, b in zip(results[0]["whole"][:-1], results[0]["whole"][1:], strict=True)
    ]
    assert all(m > 0 for m in moved)  # every round changed the shared parameters


def nonfinite_worker(rank: int, world: int) -> dict:
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=INNER_LR)
    state = gradsift.diloco(model, optimizer, sync_every=H, compressor="topk", ratio=0.1)
    for step in range(H):
        inner(model, optimizer, rank, step)
    before = flat_params(model)
    for step in range(H, 2 * H):
        if rank == 1 and step == 2 * H - 1:
            with torch.no_grad():
                next(model.parameters()).view(-1)[0] = float("nan")  # poison the round's last step
        inner(model, optimizer, rank, step)
    # the last inner step synced (the post-hook): the round was dropped on every rank
    skipped = state.hook.last_step_skipped
    after = flat_params(model)
    return {
        "skipped": skipped,
        "unchanged": torch.equal(before, after),
        "finite": bool(after.isfinite().all()),
    }


@pytest.mark.parametrize("world", [2, 4])
def test_a_non_finite_round_is_skipped_on_every_rank(world):
    for result in run_workers(__file__, "nonfinite_worker", world, timeout=60):
        assert result == {"skipped": True, "unchanged": True, "finite": True}


@pytest.mark.parametrize("world", [2, 4])
def test_a_dead_peer_raises_instead_of_hanging(world):
    results = run_workers(
        __file__, "dying_worker", world, group_timeout=10.0, timeout=60, expect_exit={1: 3},
        sync_every=H, compressor="sidco-exp",
    )  # fmt: skip
    assert survivors_raised(results, world)


def rebuilt_worker(rank: int, world: int, keep_old: bool) -> dict:
    """The inner optimizer built again after the first round (a new learning rate, as a script's
    stage does), the old one dropped or kept alive."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=INNER_LR)
    state = gradsift.diloco(model, optimizer, sync_every=H, compressor="none")
    kept = []
    try:
        for step in range(H * ROUNDS):
            if step == H:
                kept.append(optimizer) if keep_old else None
                optimizer = torch.optim.SGD(model.parameters(), lr=INNER_LR / 2)
            inner(model, optimizer, rank, step)
    except InvalidOptionError as error:
        return {"error": str(error), "rounds": state.rounds}
    every = [torch.empty_like(flat_params(model)) for _ in range(world)]
    dist.all_gather(every, flat_params(model))
    return {"rounds": state.rounds, "equal": all(torch.equal(every[0], other) for other in every)}


@pytest.mark.parametrize("keep_old", [False, True], ids=["old-dropped", "old-kept"])
def test_an_inner_optimizer_built_again_is_counted_or_refused(keep_old):
    """DiLoCo counts the inner optimizer's steps; one built again mid-run was never counted, so
    no round ended and the workers trained apart without a word. Dropped by the script, the old
    one is gone and the new one counted: every round ends, the ranks equal after the last. Kept
    alive, the new one's steps are refused after ``H`` of them, naming both."""
    for result in run_workers(__file__, "rebuilt_worker", 2, timeout=60, keep_old=keep_old):
        if keep_old:
            assert result["rounds"] == 1 and "has not stepped for 3 steps of another" in result["error"]
        else:
            assert result == {"rounds": ROUNDS, "equal": True}


def options_worker(rank: int, world: int) -> dict:
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=INNER_LR)
    errors = {}
    for label, call in {
        "ddp": lambda: gradsift.diloco(torch.nn.parallel.DistributedDataParallel(make_model()), optimizer),
        "sync_every": lambda: gradsift.diloco(model, optimizer, sync_every=0),
        "outer_lr": lambda: gradsift.diloco(model, optimizer, outer_lr=-1.0),
        "buffers": lambda: gradsift.diloco(model, optimizer, buffers="sum"),
        "warmup": lambda: gradsift.diloco(model, optimizer, warmup_steps=3),
        "auto": lambda: gradsift.diloco(model, optimizer, compressor="auto"),
        "vgc": lambda: gradsift.diloco(model, optimizer, compressor="vgc"),
        "vgc instance": lambda: gradsift.diloco(model, optimizer, compressor=gradsift.get_compressor("vgc")),
        "other model's optimizer": lambda: gradsift.diloco(
            model, torch.optim.SGD(make_model().parameters(), lr=INNER_LR)
        ),
    }.items():
        try:
            call()
            errors[label] = None
        except InvalidOptionError as error:
            errors[label] = str(error)
    return errors


def test_bad_options_are_clear_errors():
    (errors,) = run_workers(__file__, "options_worker", 1)
    assert "not a DistributedDataParallel" in errors["ddp"]
    assert "sync_every" in errors["sync_every"] and "outer_lr" in errors["outer_lr"]
    assert "buffers" in errors["buffers"] and "warmup_steps" in errors["warmup"]
    assert "holds none of the model's parameters" in errors["other model's optimizer"]
    assert "'auto' chooses the DDP hook's method" in errors["auto"] and "'blockquant'" in errors["auto"]
    # VGC's test reads the variance backward records per gradient, not a round's pseudo-gradient's
    # (and what it recorded within a round was in no checkpoint: a mid-round resume differed)
    assert "'vgc' tests each value against the variance" in errors["vgc"]
    assert errors["vgc instance"] == errors["vgc"]


def mismatched_load_worker(rank: int, world: int) -> dict:
    """A state whose shared parameters have other shapes (each one row, which ``copy_`` would
    broadcast over the model's rows): refused before anything loads."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=INNER_LR)
    state = gradsift.diloco(model, optimizer, sync_every=H, compressor="topk", ratio=0.1)
    for step in range(H):
        inner(model, optimizer, rank, step)
    saved = state.state_dict()
    before = [s.clone() for s in state.shared]
    try:
        state.load_state_dict({**saved, "shared": [s[:1] for s in saved["shared"]]})
        error = None
    except InvalidOptionError as refused:
        error = str(refused)
    unchanged = all(torch.equal(a, b) for a, b in zip(before, state.shared, strict=True))
    return {"error": error, "unchanged": unchanged, "rounds": state.rounds}


def test_a_state_of_other_shapes_is_refused_before_anything_loads():
    (result,) = run_workers(__file__, "mismatched_load_worker", 1)
    assert result["unchanged"] and result["rounds"] == 1, result
    assert (
        "shared parameter 0 is (1, " in result["error"]
        and "a state saved for another model" in result["error"]
    )


def defaults_worker(rank: int, world: int) -> dict:
    """What ``gradsift.diloco`` sets up with each way of naming the compressor."""
    from gradsift.compressors.topk import TopK

    seen = {}
    for label, compressor, options in (
        ("default", None, {}),
        ("instance", TopK(ratio=0.1), {}),
        ("dense", "none", {}),
        ("explicit", "topk", {"ratio": 0.1, "residual_decay": 0.5}),
    ):
        model = make_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=INNER_LR)
        args = () if compressor is None else (10, compressor)
        state = gradsift.diloco(model, optimizer, *args, **options)
        group = state.outer_optimizer.param_groups[0]
        seen[label] = {
            "sync_every": state.sync_every,
            "compressor": state.hook.compressor.name,
            "options": state.hook.compressor.options(),
            "decay": state.hook.options.residual_decay,
            "outer": (group["lr"], group["momentum"]),
        }
        state.detach()
    return seen


def test_the_defaults_are_quantized_averaging():
    """H 10, blockquant's 4-bit codes, outer lr 1 without momentum, and error feedback decayed
    by 0.95 wherever the compressor runs it (by name or as an instance), unless given."""
    (seen,) = run_workers(__file__, "defaults_worker", 1)
    assert seen["default"] == {"sync_every": 10, "compressor": "blockquant", "options": {"bits": 4, "block_size": 64},
                               "decay": 0.95, "outer": (1.0, 0.0)}  # fmt: skip
    assert seen["instance"]["decay"] == 0.95
    assert seen["dense"]["decay"] is None  # no error feedback: nothing to decay, left unset
    assert seen["explicit"]["decay"] == 0.5


def test_the_trainer_runs_diloco_with_sync_every(tmp_path, capsys):
    """``gradsift train --sync-every H``: no DDP; bytes only on the steps that end a round
    (the last, unfinished round is ended by the run's last step); DDP's bytes every step."""
    import json

    from gradsift.tools.cli import main as cli_main
    from support.train import TINY

    out = tmp_path / "diloco"
    flags = [
        "--compressor",
        "topk",
        "--ratio",
        "0.1",
        "--sync-every",
        "3",
        "--steps",
        "7",
        "--option",
        "outer_lr=0.5",
    ]
    assert cli_main(["train", *TINY, "--out", str(out), *flags]) == 0
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    sending = [r["step"] for r in steps if r["bytes_sent"] > 0]
    assert sending == [2, 5, 6]
    assert len({r["dense_bytes"] for r in steps}) == 1 and steps[0]["dense_bytes"] > 0
    summary = json.loads((out / "summary.json").read_text())
    assert "diloco" in json.dumps(summary) and '"outer_lr": 0.5' in json.dumps(summary)
    assert cli_main(["train", *TINY, "--out", str(tmp_path / "x"), "--option", "outer_lr=0.5"]) != 0
    assert "need --sync-every" in capsys.readouterr().err
