"""A NaN/Inf gradient on ONE rank, on every path of the hook, under each ``nonfinite`` policy.

Oracle: the step must leave no trace. On every rank the hook's state after the bad
step equals its state before it (residuals, velocities, VGC's accumulators, the
compressor's adaptation and generators, the step counter), the step's gradients are
NaN (``propagate``) or zero (``skip``) on every rank alike, or every rank raises
(``raise``); and a run that then continues ends bit-identical to a run that never saw
the bad step at all.
"""

from __future__ import annotations

import math
from collections.abc import Hashable

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsift
from gradsift.compressors import draws
from gradsift.compressors.dgc import DGC
from gradsift.hook.options import HOOK_OPTIONS
from support.distributed import run_workers
from support.models import batch, flat_params, hook_state, make_model, same

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

BAD_STEP = 2
# name, options, parameter number whose gradient is poisoned on rank 1, poison value
CASES = {
    "allgather": ("topk", {"ratio": 0.1}, 0, float("nan")),
    "allgather-momentum": ("topk", {"ratio": 0.1, "momentum": 0.9}, 2, float("inf")),
    "allreduce-randomk": ("randomk", {"ratio": 0.1}, 0, float("nan")),
    "allreduce-fp16": ("fp16", {}, 0, float("inf")),
    "allreduce-bf16": ("bf16", {}, 2, float("nan")),
    "dense-in-place": ("none", {}, 0, float("nan")),
    "warm-up": ("topk", {"ratio": 0.1, "warmup_steps": 5}, 0, float("nan")),
    "layer": ("topk", {"ratio": 0.1, "granularity": "layer"}, 2, float("nan")),
    "min-numel-part": ("topk", {"ratio": 0.1, "granularity": "layer", "min_numel": 20}, 1, float("nan")),
    "value-dtype-overflow": ("topk", {"ratio": 0.1, "value_dtype": "fp16"}, 0, 1e6),
    "sidco": ("sidco-exp", {"ratio": 0.1}, 0, float("nan")),
    "dgc": ("dgc", {"ratio": 0.1}, 0, float("inf")),
    # DGC's threshold comes from a random sample of the bucket (259 draws over its 259
    # elements; seed 0, call BAD_STEP): parameter 2's column 0 (positions 3, 19, 35) is in it
    # (eta is NaN), parameter 1's first element (position 51) is not; at ratio 0.01 the
    # sample's 3 largest are Infs of parameter 0's column 0 (eta is Inf) -- SAMPLED checks
    "dgc-nan-in-sample": ("dgc", {"ratio": 0.1, "momentum": 0.9}, 2, float("nan")),
    "dgc-nan-out-of-sample": ("dgc", {"ratio": 0.1, "momentum": 0.9}, 1, float("nan")),
    "dgc-inf-threshold": ("dgc", {"ratio": 0.01}, 0, float("inf")),
    # the fixed fit samples every element of a small bucket: its threshold is NaN
    "sidco-fixed-fit": ("sidco-exp", {"ratio": 0.1, "adapt": False}, 0, float("nan")),
    "vgc": ("vgc", {}, 2, float("nan")),
    "qsgd": ("qsgd", {}, 0, float("nan")),
    "powersgd": ("powersgd", {"start_iter": 2}, 0, float("nan")),
}
POLICIES = ("propagate", "skip", "raise")
#: Whether rank 1's poison falls in DGC's sample at BAD_STEP, per DGC case.
SAMPLED = {"dgc": True, "dgc-nan-in-sample": True, "dgc-nan-out-of-sample": False, "dgc-inf-threshold": True}


class SampleWatch(DGC):
    """DGC that records, per call, whether its sample holds a NaN or an Inf."""

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self.sampled: list[bool] = []

    def select(self, flat: torch.Tensor, key: Hashable, capacity, readout):
        n, call = flat.numel(), self.calls.get(key, 0)
        size = min(n, max(self.min_sample, math.ceil(n * self.sample_ratio)))
        positions = draws.below(n, draws.stream_seed(self.seed, key, call), size, flat.device)
        self.sampled.append(not bool(flat.index_select(0, positions).isfinite().all()))
        return super().select(flat, key, capacity, readout)


def hooked(name: str, options: dict) -> tuple[DDP, gradsift.hook.state.GradsiftHookState]:
    """The model and its hook; DGC as a :class:`SampleWatch`."""
    model = DDP(make_model())
    if name != "dgc":
        return model, gradsift.register_comm_hook(model, name, **options)
    hook = {key: value for key, value in options.items() if key in HOOK_OPTIONS}
    compressor = SampleWatch(**{key: value for key, value in options.items() if key not in hook})
    return model, gradsift.register_comm_hook(model, compressor, **hook)


def run(
    name: str, options: dict, rank: int, steps: list[int], poison: tuple[int, float] | None = None
) -> dict:
    """Train on ``steps`` (batch numbers); poison rank 1's gradient at step BAD_STEP."""
    model, state = hooked(name, options)
    params = list(model.module.parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    out = {}
    for step in steps:
        optimizer.zero_grad()
        x, y = batch(rank, step)
        handle = None
        if poison is not None and step == BAD_STEP and rank == 1:
            number, value = poison
            handle = params[number].register_hook(lambda g, v=value: g.index_fill(-1, torch.tensor([0]), v))
        if step == BAD_STEP:
            out["before"] = hook_state(state)
        try:
            torch.nn.functional.mse_loss(model(x), y).backward()
            grads = torch.cat([p.grad.reshape(-1) for p in params])  # what DDP wrote at the close
            skipped = state.last_step_skipped  # a read of the state settles the step
        except gradsift.NonFiniteGradientError as error:
            out["raised"] = str(error)
            out["after"] = hook_state(state)
            out["sampled"] = sampled(state)
            return out
        finally:
            if handle is not None:
                handle.remove()
        if step == BAD_STEP:
            out["after"] = hook_state(state)
            out["grads"] = grads
            out["skipped"] = skipped
        if not skipped:
            optimizer.step()
    out["params"] = flat_params(model)
    out["final"] = hook_state(state)
    out["stats"] = state.stats()["total"]
    out["sampled"] = sampled(state)
    return out


def sampled(state) -> bool | None:
    """Whether some call of DGC's sampled a NaN or an Inf (None: not DGC)."""
    return any(state.compressor.sampled) if isinstance(state.compressor, SampleWatch) else None


def nonfinite_worker(rank: int, world: int, cases: list[str]) -> dict:
    results = {}
    for case in cases:
        name, options, number, value = CASES[case]
        results[case] = {"reference": run(name, options, rank, [0, 1, 3])}
        for policy in POLICIES:
            results[case][policy] = run(
                name, {**options, "nonfinite": policy}, rank, [0, 1, 2, 3], (number, value)
            )
    return results


def check(runs: list[dict], case: str) -> None:
    for rank, result in enumerate(runs):
        reference = result[case]["reference"]
        for policy in POLICIES:
            got = result[case][policy]
            where = f"{case}/{policy}/rank {rank}"
            if not (case == "dense-in-place" and policy == "propagate"):
                assert same(got["before"], got["after"]), f"{where}: the dropped step changed the hook state"
            if policy == "raise":
                assert "NaN or Inf on at least one rank" in got["raised"], where
                continue
            assert "raised" not in got, where
            if case == "dense-in-place" and policy == "propagate":
                # `none` under the default policy is stock DDP: nothing to roll back, so the
                # hook reads no flag; the NaN reaches every rank through the allreduce.
                assert torch.isnan(got["grads"]).any() and got["skipped"] is False, where
                continue
            assert got["skipped"] is True, where
            if policy == "propagate":
                assert torch.isnan(got["grads"]).all(), where
            else:
                assert not got["grads"].any(), where
            assert got["stats"]["skipped_steps"] == 1 and got["stats"]["steps"] == 4, where
            # as if the step never happened: bit-identical to the run without it
            assert torch.equal(got["params"], reference["params"]), f"{where}: parameters differ"
            assert same(got["final"], reference["final"]), f"{where}: state differs from the clean run"
    for policy in ("propagate", "skip") if case != "dense-in-place" else ("skip",):
        for other in runs[1:]:
            assert torch.equal(other[case][policy]["params"], runs[0][case][policy]["params"])


@pytest.fixture(scope="module")
def two_ranks():
    return run_workers(__file__, "nonfinite_worker", 2, timeout=300, cases=list(CASES))


@pytest.fixture(scope="module")
def four_ranks():
    return run_workers(
        __file__, "nonfinite_worker", 4, timeout=300, cases=["allgather-momentum", "allreduce-randomk", "vgc"]
    )


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_step_on_one_rank_leaves_no_trace_on_two_ranks(case, two_ranks):
    check(two_ranks, case)


@pytest.mark.parametrize("case", list(SAMPLED))
def test_the_dgc_cases_poison_in_and_out_of_the_sample(case, two_ranks):
    for rank, result in enumerate(two_ranks):
        assert result[case]["reference"]["sampled"] is False
        for policy in POLICIES:
            assert result[case][policy]["sampled"] is (SAMPLED[case] and rank == 1), f"{case}/{policy}/{rank}"


@pytest.mark.parametrize("case", ["allgather-momentum", "allreduce-randomk", "vgc"])
def test_a_bad_step_on_one_rank_leaves_no_trace_on_four_ranks(case, four_ranks):
    check(four_ranks, case)
