"""The sparsifiers' state kept without the compensated gradient under momentum correction
(hook.feedback, step 3), both ways: *in the result* (the allgather's default once the state
is stored: the new velocity waits in the bucket's gradient memory and the close commits it
and the residual in place, gated on the step's flag, before the mean is written there) and
*lazily* (an exchange that writes its means at once: ``c`` is written over the bucket and the
residual made in place at the commit).

Oracle: the same training with ``c`` kept (the allgather declared as an exchange that reads
its input late, so the route keeps ``c`` and error feedback consumes it), which the tests of
tests/hook and tests/exchanges check against brute force: the same bits in the parameters
and the hook's state after every step, a step dropped for a NaN included. And what each way
promises during a step: lazily, the old residual stays the stored one, unchanged, until the
step settles; in the result, the stored velocity and residual are changed in place (the same
tensors) at the close of a kept step and left bit for bit as they were by a dropped one --
reading the flag at once (CPU memory) or, as on a GPU, by ``torch.where`` on it.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsift
from gradsift.exchanges.allgather import Allgather
from gradsift.hook import feedback
from support.distributed import run_workers
from support.models import batch, flat_params, hook_state, make_model, same

STEPS, DROPPED = 6, 3
#: A sparsifier (its residual also kept lazily elsewhere) and a code (the 1-bit method's).
RATIO = {"topk": {"ratio": 0.1}, "efsignsgd": {}}
#: Per optimizer family: its optimizer, the hook's options, and the first step whose state is
#: stored before it (SGD: the third, the second re-laying it into DDP's rebuilt buckets; the
#: frozen-variance Adam method: after 2 dense steps, its first compressed step makes the residual).
FAMILIES = {
    "sgd": (lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9), {}, 2),
    "adamw": (lambda params: torch.optim.AdamW(params, lr=1e-3), {"warmup_steps": 2}, 3),
}


def train(
    granularity: str, way: str, family: str = "sgd", compressor: str = "topk"
) -> list[tuple[torch.Tensor, dict]]:
    """Per step, the parameters and the hook's state; step ``DROPPED`` holds a NaN. From the
    family's first step with stored state check what ``way`` promises between backward (the
    close) and the optimizer's step (the settle)."""
    make_optimizer, options, first = FAMILIES[family]
    model = DDP(make_model())
    optimizer = make_optimizer(model.parameters())
    state = gradsift.register_comm_hook(
        model,
        compressor,
        granularity=granularity,
        optimizer=optimizer,
        nonfinite="skip",
        **RATIO[compressor],
        **options,
    )
    after = []
    for step in range(STEPS):
        optimizer.zero_grad()
        x, y = batch(0, step)
        if step == DROPPED:
            x[0, 0] = float("nan")
        stored = {table: dict(state.store.tables.get(table, {})) for table in ("residual", "velocity")}
        saved = {table: {k: t.clone() for k, t in tensors.items()} for table, tensors in stored.items()}
        torch.nn.functional.mse_loss(model(x), y).backward()
        if step >= first and way != "c kept":
            for table in ("residual", "velocity") if way == "in result" else ("residual",):
                for key, tensor in state.store.table(table).items():  # closed, not settled
                    assert tensor is stored[table][key], (step, table)
                    changed = not torch.equal(tensor, saved[table][key])
                    assert changed == (way == "in result" and step != DROPPED), (step, table)
        optimizer.step()
        if step >= first and way == "in result":  # no velocity was put: the stored one changed in place
            assert all(t is stored["velocity"][k] for k, t in state.store.table("velocity").items())
        after.append((flat_params(model), hook_state(state)))
    assert state.step == STEPS - 1
    return after


@pytest.mark.parametrize("compressor", list(RATIO))
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("granularity", ["bucket", "layer"])
def test_state_kept_in_the_result_or_lazily_trains_bit_for_bit_as_with_c_kept(
    granularity: str, family: str, compressor: str, one_process_group: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    in_result = train(granularity, "in result", family, compressor)
    with monkeypatch.context() as device_gate:  # the GPU's way: every write a torch.where on the flag
        device_gate.setattr(feedback, "host_value", lambda flag: None)
        gated = train(granularity, "in result", family, compressor)
    monkeypatch.setattr(Allgather, "defers_mean", False)
    # a code's residual is never kept lazily: without the deferred mean it keeps ``c``
    lazy = train(granularity, "lazily" if compressor == "topk" else "c kept", family, compressor)
    monkeypatch.setattr(Allgather, "copies_input", False)
    kept = train(granularity, "c kept", family, compressor)
    for step, runs in enumerate(zip(in_result, gated, lazy, kept, strict=True)):
        params_kept, state_kept = runs[-1]
        for way, (params, state) in zip(("in result", "gated on the device", "lazily"), runs, strict=False):
            assert torch.equal(params, params_kept), (step, way)
            assert same(state, state_kept), (step, way)


def two_rank_worker(rank: int, world: int) -> dict[str, list[tuple[torch.Tensor, dict]]]:
    """Rank ``rank``'s per-step parameters and hook state, each way (rank 1's step
    ``DROPPED`` holds a NaN: every rank drops it)."""
    runs = {}
    for way in ("in result", "c kept"):
        Allgather.copies_input = way != "c kept"
        model = DDP(make_model())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        state = gradsift.register_comm_hook(
            model, "sidco-exp", ratio=0.1, optimizer=optimizer, nonfinite="skip"
        )
        after = []
        for step in range(STEPS):
            optimizer.zero_grad()
            x, y = batch(rank, step)
            if step == DROPPED and rank == 1:
                x[0, 0] = float("nan")
            velocities = state.store.table("velocity")
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            if step >= 2:  # kept in the result: changed in place, never put
                now = state.store.table("velocity")
                assert all(
                    (now[key] is tensor) == (way == "in result" or step == DROPPED)
                    for key, tensor in velocities.items()
                ), (way, step)
            after.append((flat_params(model), hook_state(state)))
        assert state.step == STEPS - 1
        runs[way] = after
    return runs


@pytest.mark.slow
@pytest.mark.distributed
def test_on_two_ranks_a_nan_on_one_is_dropped_alike_and_the_bits_are_c_kept_ones() -> None:
    for rank, runs in enumerate(run_workers(__file__, "two_rank_worker", 2)):
        for step, ((params, state), (params_kept, state_kept)) in enumerate(
            zip(runs["in result"], runs["c kept"], strict=True)
        ):
            assert torch.equal(params, params_kept), (rank, step)
            assert same(state, state_kept), (rank, step)


def test_a_compressor_whose_decode_flags_says_so() -> None:
    """The route defers a bucket's mean only where the decode flags nothing
    (``Compressor.decode_checks``): every registry compressor, on a decode of its own payload."""
    x = torch.randn(300)
    for name in gradsift.available_compressors():
        compressor = gradsift.get_compressor(name, **({"threshold": 0.01} if name == "threshold" else {}))
        if type(compressor).__name__ == "PowerSGD":  # runs PyTorch's own hook: no payload decode
            continue
        variance = {"variance": torch.full_like(x, 1e-4)} if compressor.needs_parameters else {}  # VGC's
        payload = compressor.compress(x.clone(), **variance)
        flag = compressor.decompress_into([payload, payload], torch.empty(300))
        assert (flag is not None) == compressor.decode_checks, name
