"""gradsift.tools.simulate against real gloo processes: the same run, bit for bit.

Oracle: the multi-process hook. The same model, data, seeds and options trained by real
gloo ranks (``run_workers``, a plain DDP loop written here) must end with parameters,
per-step losses and per-step byte counts equal (``torch.equal``, ``==``) to the
simulation's, at 2, 4 and 8 workers, for sidco-exp and topk at ratio 0.01 through the
allgather, balanced and shared-mask exchanges (and shared-mask with bf16 values, whose
allreduce sums in bf16). The simulated allreduce's order of summation is checked apart,
against gloo's own allreduce on vectors whose sum depends on the order.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsift
from gradsift.core.errors import InvalidOptionError
from gradsift.tools.simulate import ring_allreduce_sum, simulate
from support.distributed import run_workers

SEED, STEPS, BATCH = 3, 6, 8
IN, HIDDEN, OUT = 32, 96, 10

#: (compressor, hook options) per case; every case at ratio 0.01.
CASES = {
    f"{compressor}/{exchange}": (compressor, {"exchange": exchange})
    for compressor in ("sidco-exp", "topk")
    for exchange in ("allgather", "balanced", "shared-mask")
}
CASES["topk/shared-mask/bf16"] = ("topk", {"exchange": "shared-mask", "value_dtype": "bf16"})


def model_fn() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(IN, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, OUT),
    )  # fmt: skip


def data_fn(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(10_000 * rank + step)
    return torch.randn(BATCH, IN, generator=gen), torch.randint(0, OUT, (BATCH,), generator=gen)


def optimizer_fn(parameters) -> torch.optim.Optimizer:
    return torch.optim.SGD(parameters, lr=0.1, momentum=0.9, weight_decay=1e-4)


def gloo_worker(rank: int, world: int) -> dict:
    """Per case: the parameters after ``STEPS`` steps, each step's loss and bytes (real gloo)."""
    out = {}
    for case, (compressor, options) in CASES.items():
        torch.manual_seed(SEED)
        model = model_fn()
        ddp = DDP(model)
        optimizer = optimizer_fn(ddp.parameters())
        state = gradsift.register_comm_hook(ddp, compressor, ratio=0.01, optimizer=optimizer, **options)
        losses, sent, received = [], [], []
        for step in range(STEPS):
            x, y = data_fn(rank, step)
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(ddp(x), y)
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
            sent.append(int(state.stats()["step"]["bytes_sent"]))
            received.append(int(state.stats()["step"]["bytes_received"]))
        out[case] = {"parameters": model.state_dict(), "losses": losses, "sent": sent, "received": received}
    return out


@pytest.fixture(scope="module", params=[2, 4, 8], ids=lambda w: f"{w}ranks")
def gloo_runs(request):
    return run_workers(__file__, "gloo_worker", request.param, timeout=600)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("case", list(CASES))
def test_the_simulation_is_the_gloo_run_bit_for_bit(case, gloo_runs):
    world = len(gloo_runs)
    compressor, options = CASES[case]
    sim = simulate(
        model_fn, data_fn, workers=world, steps=STEPS, compressor=compressor, optimizer_fn=optimizer_fn,
        seed=SEED, ratio=0.01, **options,
    )  # fmt: skip
    assert sim.ranks_agree
    real = [ranks[case] for ranks in gloo_runs]
    for name, value in real[0]["parameters"].items():
        assert torch.equal(sim.parameters[name], value), (
            case,
            world,
            name,
            (sim.parameters[name] - value).abs().max(),
        )
    for step in range(STEPS):
        assert sim.losses[step] == [rank["losses"][step] for rank in real], (case, world, step)
        assert sim.bytes_sent[step] == [rank["sent"][step] for rank in real], (case, world, step)
        assert sim.bytes_received[step] == [rank["received"][step] for rank in real], (case, world, step)
    # the run moved: a case that trained nothing would pass the comparison vacuously
    torch.manual_seed(SEED)
    initial = model_fn().state_dict()
    assert not all(torch.equal(initial[name], value) for name, value in sim.parameters.items())


#: Sizes of the allreduce check: tiny (fewer elements than segments), uneven, and large
#: enough (10 MB at fp32) for gloo to cut more than 2 segments per rank.
SIZES = [1, 7, 1000, 300_001, 2_500_000]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def addends(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Values of many magnitudes (so the sum's rounding depends on the order), finite in fp16."""
    gen = torch.Generator().manual_seed(7919 * rank + numel)
    return (torch.randn(numel, generator=gen) * torch.exp(2 * torch.randn(numel, generator=gen))).to(dtype)


def allreduce_worker(rank: int, world: int) -> dict | None:
    out = {}
    for numel in SIZES:
        for dtype in DTYPES:
            tensor = addends(rank, numel, dtype)
            dist.all_reduce(tensor)
            out[numel, dtype] = tensor
    return out if rank == 0 else None


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3, 4])
def test_the_simulated_allreduce_sums_in_gloos_order(world):
    """``ring_allreduce_sum`` equals gloo's allreduce bit for bit; summing in rank order
    does not (so the comparison can tell orders apart)."""
    gloo = run_workers(__file__, "allreduce_worker", world, timeout=300)[0]
    in_rank_order = 0
    for (numel, dtype), summed in gloo.items():
        xs = [addends(rank, numel, dtype) for rank in range(world)]
        assert torch.equal(ring_allreduce_sum(xs), summed), (world, numel, dtype)
        in_rank_order += not torch.equal(sum(xs[1:], xs[0]), summed)
    assert in_rank_order > 0 if world > 2 else in_rank_order == 0  # 2 addends: one order


def test_evaluate_runs_on_rank_0_every_eval_every_steps_and_after_the_last():
    seen = []

    def evaluate(model):
        seen.append(torch.is_grad_enabled())
        return sum(float(p.sum()) for p in model.parameters())

    sim = simulate(
        model_fn, data_fn, workers=2, steps=5, compressor="topk", ratio=0.01, evaluate=evaluate, eval_every=2
    )
    assert list(sim.evaluations) == [2, 4, 5] and seen == [False] * 3
    assert sim.evaluations[5] == sum(float(p.sum()) for p in sim.parameters.values())


def test_a_failing_rank_ends_the_simulation_with_its_error():
    def failing(rank, step):
        if rank == 1 and step == 2:
            raise ValueError("no batch")
        return data_fn(rank, step)

    with pytest.raises(RuntimeError, match=r"simulated rank 1 of 3 failed: ValueError\('no batch'\)"):
        simulate(model_fn, failing, workers=3, steps=4, compressor="topk", ratio=0.01)
    # the process is usable again: a new simulation runs
    assert simulate(model_fn, data_fn, workers=2, steps=1, compressor="topk", ratio=0.01).ranks_agree


def test_drawing_from_the_global_generator_is_reported():
    def noisy(rank, step):
        x, y = data_fn(rank, step)
        return x + torch.randn(x.shape), y

    with pytest.warns(UserWarning, match="global generator"):
        simulate(model_fn, noisy, workers=2, steps=1, compressor="topk", ratio=0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        simulate(model_fn, data_fn, workers=2, steps=1, compressor="topk", ratio=0.01)


def test_auto_is_refused_naming_what_runs() -> None:
    with pytest.raises(InvalidOptionError, match="compressor='auto' measures the link.*registry name"):
        simulate(
            lambda: torch.nn.Linear(4, 2),
            lambda rank, step: (None, None),
            workers=2,
            steps=1,
            compressor="auto",
        )


def test_the_simulated_hooks_do_not_walk_the_live_objects(monkeypatch) -> None:
    """Each rank's hook gets a disabled GradScaler, so none looks for one (a walk of the live
    objects in one rank's thread can hold a tuple another is building: SystemError)."""
    from gradsift.hook import discovery

    walks = []
    monkeypatch.setattr(discovery, "find", lambda *args: walks.append(args) or (None, None))
    assert simulate(model_fn, data_fn, workers=2, steps=2, compressor="topk", ratio=0.01).ranks_agree
    assert walks == []
