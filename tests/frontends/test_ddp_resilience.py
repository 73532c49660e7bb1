"""The DDP hook across checkpoints and failures, in real gloo processes.

Checkpoint at step k, resume in fresh processes (state_dict and pickle), compare with
the uninterrupted run; a rank that raises or exits mid-step makes the others fail
within the process group's timeout with PeerFailureError; delegation to PowerSGD.
"""

import pickle
import time
from pathlib import Path

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsift
from support.distributed import run_workers
from support.models import IN, OUT, batch, flat_params, hooked, make_model, train

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS, CHECKPOINT_AT = 6, 3


class ReadyOrdered(torch.nn.Module):
    """make_model's network with its parameters registered in the order backward readies
    their gradients (the last layer first, each bias before its weight): DDP's initial
    bucket then already has the layout it rebuilds to after the first step."""

    def __init__(self) -> None:
        super().__init__()
        first, _, second = make_model()
        for layer in (second, first):
            layer._parameters["weight"] = layer._parameters.pop("weight")  # after the bias
        self.second, self.first = second, first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.tanh(self.first(x)))


# name: (compressor, options, model). make_model's DDP bucket is laid out (0, 1, 2, 3) at
# first and (3, 2, 1, 0) after DDP's rebuild, so a resumed run's first step flattens the
# bucket in another order than the uninterrupted run's: top-k's selection does not depend
# on it; ReadyOrdered keeps the order, so every other method's state is tested on its own.
RESUME_CASES = {
    "topk-momentum": ("topk", {"ratio": 0.05, "momentum": 0.9}, make_model),
    "topk-layer": ("topk", {"ratio": 0.1, "granularity": "layer"}, make_model),
    # state that must come back: SIDCo's adaptation and stage counts, VGC's accumulators
    # and capacity, DGC's sampling generator and velocities, random-k's per-key steps, the
    # quantizers' rounding generators, EF-signSGD's residual
    "sidco-exp": ("sidco-exp", {"ratio": 0.05, "exact_below": 0}, ReadyOrdered),  # the fitted path
    "vgc": ("vgc", {"alpha": 1.0}, ReadyOrdered),
    "dgc-momentum": ("dgc", {"ratio": 0.05, "momentum": 0.9, "sample_ratio": 0.2, "min_sample": 16}, ReadyOrdered),
    "randomk": ("randomk", {"ratio": 0.1}, ReadyOrdered),
    "qsgd": ("qsgd", {}, ReadyOrdered),
    "terngrad": ("terngrad", {}, ReadyOrdered),
    "signsgd": ("signsgd", {}, ReadyOrdered),
    "efsignsgd": ("efsignsgd", {}, ReadyOrdered),
}  # fmt: skip


def wider() -> torch.nn.Module:
    """make_model's network 96 wide: 1,539 elements, over SIDCo's smallest sample (1,024), so
    its fitted threshold reads a strided sample of the bucket."""
    return make_model((IN, 96, OUT))


#: Methods whose arithmetic depends on where an element lies (random positions, a
#: rounding stream, a sum's rounding, QSGD's norms per 512 elements, SIDCo's strided sample,
#: the norm of ``clip_norm=``), resumed across
#: make_model's rebuild: they run on the bucket's parameters in number order
#: (gradsift.core.store.Canonical), so the layout DDP hands the resumed first step does not
#: change a bit.
ACROSS_REBUILD = {
    **{
        f"{name}-rebuilt": (name, options, make_model)
        for name, options in [
            ("randomk", {"ratio": 0.1}), ("qsgd", {}), ("terngrad", {}), ("signsgd", {}), ("efsignsgd", {})
        ]
    },
    "sidco-exp-rebuilt": ("sidco-exp", {"ratio": 0.05, "exact_below": 0, "sample_size": 1024}, wider),
    "clip-norm-rebuilt": ("topk", {"ratio": 0.1, "clip_norm": 0.05}, wider),
}  # fmt: skip


def several_buckets() -> torch.nn.Module:
    """make_model's network with a bucket cap of 200 bytes: DDP (PyTorch 2.13, no unused
    parameters) first puts all four parameters in one bucket; its rebuild closes a bucket
    once it holds the cap, so it makes two -- the last layer's (204 bytes) and the first's --
    and a resumed first step gets one bucket where the uninterrupted run had two."""
    module = make_model()
    module.bucket_cap_mb = 200 / 2**20
    return module


class EmptyFirst(torch.nn.Module):
    """several_buckets' network behind a parameter of no elements: DDP's rebuild puts that
    parameter in the bucket of the last layer, away from it in ``parameters()`` order, and
    it takes no room in the flat bucket, so the resumed first step is cut all the same."""

    def __init__(self) -> None:
        super().__init__()
        self.empty = torch.nn.Parameter(torch.zeros(0))
        self.net = make_model()
        self.bucket_cap_mb = 200 / 2**20

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.net(inputs) + self.empty.sum()


class UnusedLast(torch.nn.Module):
    """Three layers (parameters 0-5: 26, 96 and 99 elements) and a layer never used (6-7),
    registered after them, under DDP's ``static_graph`` with a bucket cap of 300 bytes: the
    rebuild closes the buckets of the last two layers and puts the unused parameters last, in
    the bucket of the first layer, so that saved bucket's parameters lie apart in the resumed
    first step's one bucket (in number order), which the hook regroups to cut it all the same."""

    def __init__(self) -> None:
        super().__init__()
        self.net = make_model((IN, 2, 32, OUT))
        self.unused = torch.nn.Linear(2, 2)
        self.bucket_cap_mb, self.static_graph = 300 / 2**20, True

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.net(inputs)


class Twins(torch.nn.Module):
    """Two layers of the same weights on the same input, summed, then two more layers: the
    twins' gradients are equal element for element at every step (``delta x^T`` for both,
    whatever their weights), so a sparsifier's cut falls between two equal magnitudes in two
    parameters, and which one it keeps follows the layout it is handed. With a bucket cap of
    700 bytes DDP's rebuild makes three buckets, the twins' (parameters 0-3) last, in the
    order backward readies them; the resumed first step's one bucket has them in number order."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.twin = make_model((IN, 4)), make_model((IN, 4))
        self.rest = make_model((4, 64, OUT))
        self.bucket_cap_mb = 700 / 2**20

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.rest(torch.tanh(self.first(inputs) + self.twin(inputs)))


#: Methods that compress a bucket as a whole (a selection, a scale, a capacity, a subset),
#: resumed where the rebuilt buckets are several: the resumed first step's one bucket is cut
#: into the saved buckets (gradsift.hook.layout.saved_runs), each compressed as before.
SEVERAL = {
    f"{case}-several": (case.split("+")[0], options, several_buckets)
    for case, options in [
        ("topk", {"ratio": 0.1, "momentum": 0.9}), ("randomk", {"ratio": 0.1}), ("vgc", {"alpha": 1.0}),
        ("signsgd", {}), ("efsignsgd", {}), ("cocktail", {"subset": 0.5}), ("threshold", {"threshold": 0.05}),
        ("dgc", {"ratio": 0.1}), ("topk+balanced", {"ratio": 0.3, "exchange": "balanced"}),
    ]
}  # fmt: skip
EMPTY = {
    f"{name}-empty": (name, options, EmptyFirst)
    for name, options in [("topk", {"ratio": 0.1, "momentum": 0.9}), ("cocktail", {"subset": 0.5})]
}
APART = {
    f"{case}-apart": (case.split("+")[0], options, UnusedLast)
    for case, options in [
        ("topk", {"ratio": 0.1, "momentum": 0.9}), ("cocktail", {"subset": 0.5}), ("dgc", {"ratio": 0.1}),
        ("topk+balanced", {"ratio": 0.3, "exchange": "balanced"}),
    ]
}  # fmt: skip
TIES = {
    f"{name}-ties": (name, {"ratio": 0.05, "error_feedback": False}, Twins)
    for name in ("topk", "dgc", "gaussiank")
}
CASES = {**RESUME_CASES, **ACROSS_REBUILD, **SEVERAL, **EMPTY, **APART, **TIES}


def ddp(module: torch.nn.Module) -> DDP:
    return DDP(
        module,
        bucket_cap_mb=getattr(module, "bucket_cap_mb", None),
        static_graph=getattr(module, "static_graph", False),
    )


def run_with_optimizer(model: DDP, rank: int, steps: range, opt: torch.optim.Optimizer) -> None:
    for step in steps:
        opt.zero_grad()
        x, y = batch(rank, step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def uninterrupted_worker(rank: int, world: int, directory: str) -> dict:
    out = {}
    for case, (name, options, factory) in CASES.items():
        model = ddp(factory())
        state = gradsift.register_comm_hook(model, name, **options)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        run_with_optimizer(model, rank, range(CHECKPOINT_AT), opt)
        torch.save(
            {
                "model": model.module.state_dict(),
                "opt": opt.state_dict(),
                "hook": state.state_dict(),
                "pickled": pickle.dumps(state),
            },
            f"{directory}/{case}-{rank}.pt",
        )
        layout = dict(state.bucket_layouts)
        run_with_optimizer(model, rank, range(CHECKPOINT_AT, STEPS), opt)
        out[case] = (flat_params(model), layout)
    return out


def resumed_worker(rank: int, world: int, directory: str) -> dict:
    out = {}
    for case, (name, options, factory) in CASES.items():
        checkpoint = torch.load(f"{directory}/{case}-{rank}.pt", weights_only=False)
        for how in ("state_dict", "pickle"):
            module = factory()
            module.load_state_dict(checkpoint["model"])
            model = ddp(module)
            if how == "state_dict":
                state = gradsift.register_comm_hook(model, name, **options)
                state.load_state_dict(checkpoint["hook"])
            else:
                restored = pickle.loads(checkpoint["pickled"])
                assert restored.process_group is None  # pickled without its group
                state = gradsift.register_comm_hook(model, restored)
            assert state.step == CHECKPOINT_AT
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            opt.load_state_dict(checkpoint["opt"])
            run_with_optimizer(model, rank, range(CHECKPOINT_AT, CHECKPOINT_AT + 1), opt)
            first_layout = dict(state.bucket_layouts)  # the layout of the resumed first step
            run_with_optimizer(model, rank, range(CHECKPOINT_AT + 1, STEPS), opt)
            out[f"{case}/{how}"] = (flat_params(model), first_layout)
    return out


@pytest.fixture(scope="module")
def resume_runs(tmp_path_factory) -> tuple[list, list]:
    directory = str(tmp_path_factory.mktemp("checkpoints"))
    return (
        run_workers(__file__, "uninterrupted_worker", 2, directory=directory),
        run_workers(__file__, "resumed_worker", 2, directory=directory),
    )


def differing(resume_runs: tuple[list, list], cases: dict) -> list[tuple[str, str, int]]:
    """The (case, how, rank) whose resumed parameters differ from the uninterrupted run's."""
    whole, resumed = resume_runs
    return [
        (case, how, rank)
        for rank in range(2)
        for case in cases
        for how in ("state_dict", "pickle")
        if not torch.equal(resumed[rank][f"{case}/{how}"][0], whole[rank][case][0])
    ]


def test_checkpoint_resume_in_fresh_processes_matches_uninterrupted_run(resume_runs):
    """Every method's state resumes bit for bit, by state_dict and by pickle; ReadyOrdered's
    resumed first step sees the layout the uninterrupted run had (make_model's does not)."""
    whole, resumed = resume_runs
    for case, (_, options, factory) in RESUME_CASES.items():
        if options.get("granularity") != "layer":  # per-layer keys have no bucket layout
            layouts = (resumed[0][f"{case}/state_dict"][1], whole[0][case][1])
            assert (layouts[0] == layouts[1]) == (factory is ReadyOrdered), (case, layouts)
    assert not differing(resume_runs, RESUME_CASES)


def test_resume_across_a_bucket_rebuild_is_bit_for_bit_for_order_dependent_methods(resume_runs):
    """The resumed first step gets make_model's initial layout, the uninterrupted run the
    rebuilt one: random-k picks the same elements, the quantizers sum, draw and (QSGD)
    group their norms alike, and decode back into the bucket's layout."""
    whole, resumed = resume_runs
    for case in ACROSS_REBUILD:
        assert resumed[0][f"{case}/state_dict"][1] != whole[0][case][1], case  # the layouts differ
    assert not differing(resume_runs, ACROSS_REBUILD)


def test_resume_over_several_rebuilt_buckets_is_bit_for_bit(resume_runs):
    """The uninterrupted run's buckets at the checkpoint are two, the resumed first step's
    one (DDP's first bucketing, in number order): cut into the saved two, each laid out as it
    was saved, it repeats the uninterrupted step."""
    whole, resumed = resume_runs
    for case in SEVERAL:
        assert whole[0][case][1] == {(0, 1): (1, 0), (2, 3): (3, 2)}, case  # the rebuilt buckets
        assert resumed[0][f"{case}/state_dict"][1] == whole[0][case][1], (
            case
        )  # the resumed first step's parts
    assert not differing(resume_runs, SEVERAL)


def test_resume_is_bit_for_bit_past_a_parameter_of_no_elements(resume_runs):
    """The rebuilt bucket holding the empty parameter is no run of the resumed first bucket by
    parameter numbers, but is one by elements: cut into the saved buckets all the same."""
    whole, resumed = resume_runs
    for case in EMPTY:
        (with_empty,) = [key for key in whole[0][case][1] if 0 in key]
        assert with_empty != tuple(range(len(with_empty))), with_empty  # not a run by numbers
        assert resumed[0][f"{case}/state_dict"][1].keys() == whole[0][case][1].keys(), case
    assert not differing(resume_runs, EMPTY)


def test_resume_is_bit_for_bit_where_a_saved_buckets_parameters_lie_apart(resume_runs):
    """Under ``static_graph`` the saved bucket of the first layer holds the unused layer too,
    apart from it by number: the resumed first steps (two: a static graph rebuilds a step
    later) regroup the one bucket into the saved ones and repeat the uninterrupted run."""
    whole, resumed = resume_runs
    for case in APART:
        (apart,) = [key for key in whole[0][case][1] if 0 in key]
        assert apart == (0, 1, 6, 7), apart  # not a run by numbers
        assert resumed[0][f"{case}/state_dict"][1].keys() == whole[0][case][1].keys(), case
    assert not differing(resume_runs, APART)


def test_resume_is_bit_for_bit_where_equal_magnitudes_tie(resume_runs):
    """Where a sparsifier's cut falls between equal magnitudes in two parameters (Twins; in
    bfloat16 often), the resumed first step's parts are laid out as the saved buckets were,
    so it keeps what the uninterrupted run kept."""
    whole, resumed = resume_runs
    for case in TIES:
        (twins,) = [key for key in whole[0][case][1] if 0 in key]
        assert twins == (0, 1, 2, 3) and whole[0][case][1][twins] != twins, whole[0][case][1]
        assert resumed[0][f"{case}/state_dict"][1] == whole[0][case][1], case
    assert not differing(resume_runs, TIES)


# --- a rank that fails mid-step -------------------------------------------------------------
def failing_worker(rank: int, world: int, how: str, survivor_done: str, patience: float) -> dict:
    model, state = hooked("topk", ratio=0.1)
    train(model, rank, range(2))
    if rank == 1:

        def broken(tensor, **kw):
            if how == "exit":
                import os

                os._exit(3)
            raise RuntimeError("simulated failure inside compress")

        state.compressor.encode = broken  # what the hook calls
        try:
            train(model, rank, range(2, 3))
        except RuntimeError:
            # Stay alive without taking part until the survivor has ended (at most
            # ``patience``): it must time out on the group, not see this rank exit, nor hang.
            deadline = time.monotonic() + patience
            while not Path(survivor_done).exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        return {}
    started = time.monotonic()
    try:
        train(model, rank, range(2, 4))
        return {"error": None}
    except gradsift.core.errors.PeerFailureError as error:
        return {"error": str(error), "seconds": time.monotonic() - started}
    finally:
        Path(survivor_done).touch()


@pytest.mark.parametrize("how", ["exit", "raise"])
def test_surviving_rank_fails_with_clear_error_instead_of_hanging(how, tmp_path):
    timeout = 5.0
    results = run_workers(
        __file__,
        "failing_worker",
        2,
        how=how,
        survivor_done=str(tmp_path / "survivor-done"),
        patience=4 * timeout,
        group_timeout=timeout,
        timeout=120,
        expect_exit={1: 3} if how == "exit" else None,
    )
    survivor = results[0]
    assert survivor["error"] is not None
    assert "failed on rank 0 of 2: a peer process is gone" in survivor["error"]
    assert survivor["seconds"] < 4 * timeout


# --- delegation to a compressor's own DDP hook (PowerSGD) -------------------------------------
def delegation_worker(rank: int, world: int) -> dict:
    model, state = hooked("powersgd", rank=1, start_iter=2)
    train(model, rank, range(4))
    return {"params": flat_params(model), "stats": state.stats()}


def test_powersgd_delegation_is_timed_and_counted():
    runs = run_workers(__file__, "delegation_worker", 2)
    assert torch.equal(runs[0]["params"], runs[1]["params"])
    step, total = runs[0]["stats"]["step"], runs[0]["stats"]["total"]
    assert 0 < step["bytes_sent"] < step["dense_bytes"] and step["communicate_ms"] > 0
    # density counts the values sent (P, Q and the layers sent whole), all float32 here
    assert step["density"] == pytest.approx(step["bytes_sent"] / step["dense_bytes"])
    assert (step["compressed_tensors"], step["dense_tensors"]) == (1, 0)
    assert (total["compressed_tensors"], total["dense_tensors"]) == (2, 2)  # start_iter=2: two dense steps
