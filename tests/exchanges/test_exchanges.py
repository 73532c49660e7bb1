"""Every sparse exchange against brute force, on 2 and 4 real gloo ranks.

Oracle per step, from what each rank's compressor really encoded (its payloads): what
each rank's contribution stands for, ``s_w`` (the allgather: its payload; shared-mask: its
own values at the leader's positions; balanced: the entries of its payload that were
delivered); the gradient every rank receives must be ``(1/W) sum_w s_w``, bit-identical
on every rank, and ``c_w = s_w + r_w`` bit for bit (``c`` the compensated gradient handed
to the exchange, ``r`` the residual after the step), with ``s_w`` not empty. Bytes: every collective the exchange calls is tallied
independently (a wrapper around ``torch.distributed``), and the hook's
``bytes_received`` must equal what those calls deliver to this rank under the
bandwidth-optimal algorithms. Plus: a peer that dies inside each exchange gives
``PeerFailureError``; a checkpoint resumes bit for bit with each exchange.
"""

from __future__ import annotations

import copy
import os
import time

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsift
from gradsift.exchanges import available_exchanges
from support.distributed import record_sparse_payloads, run_workers
from support.models import batch, flat_params, make_model
from support.tally import Tally

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

SPARSE = ["allgather", "balanced", "shared-mask"]
CASES = {
    "bucket": {"ratio": 0.1},
    "layer": {"ratio": 0.1, "granularity": "layer"},
    "bf16-values": {"ratio": 0.1, "value_dtype": "bf16"},
}


def recording_compensated(state) -> dict:
    """Wrap error feedback's ``compensate``: every key's compensated gradient ``c`` of the
    step, cloned (``update`` turns it into the residual in place)."""
    seen: dict = {}
    original = state.feedback.compensate

    def recording(key, gradient, out=None):
        c = original(key, gradient, out)
        seen[key] = c.clone()
        return c

    state.feedback.compensate = recording
    return seen


def recording_claims(state) -> dict:
    """Wrap error feedback's ``update``: per key, the entries in use of what the exchange
    said this worker's contribution stood for (``Delivery.sent``) as (indices, values)."""
    claimed: dict = {}
    original = state.feedback.update

    def recording(key, compensated, sent, *args):
        used = sent.trimmed()
        claimed[key] = (used.indices.clone(), used.values.float().clone())
        return original(key, compensated, sent, *args)

    state.feedback.update = recording
    return claimed


def exchange_worker(rank: int, world: int, steps: int = 3) -> dict:
    """Per exchange, case and step: the delivered gradient, and per key ``c``, the residual
    ``r`` after the step, the payload this rank's compressor made and the exchange's claim."""
    out = {}
    for exchange in SPARSE:
        for case, options in CASES.items():
            model = DDP(make_model())
            state = gradsift.register_comm_hook(model, "topk", exchange=exchange, **options)
            records = {
                "compensated": recording_compensated(state),
                "claimed": recording_claims(state),
                "payloads": record_sparse_payloads(state.compressor),
            }
            per_step = []
            for step in range(steps):
                for record in records.values():
                    record.clear()
                model.zero_grad()
                x, y = batch(rank, step)
                with Tally() as tally:
                    torch.nn.functional.mse_loss(model(x), y).backward()
                residuals = state.store.table("residual")
                per_step.append(
                    {
                        "grad": torch.cat([p.grad.reshape(-1) for p in model.module.parameters()]),
                        **{name: dict(record) for name, record in records.items()},
                        "residual": {key: residuals[key].clone() for key in records["compensated"]},
                        "layouts": dict(state.bucket_layouts),
                        "stats": state.stats()["step"],
                        "tallied": tally.received,
                    }
                )
            out[(exchange, case)] = per_step
    return out


def dense(indices: torch.Tensor, values: torch.Tensor, numel: int, dtype=torch.float32) -> torch.Tensor:
    """Entries (indices, values) as a dense vector."""
    return torch.zeros(numel, dtype=dtype).index_put_((indices.long(),), values.to(dtype))


def as_travelled(values: torch.Tensor, case: str) -> torch.Tensor:
    """Sent values as they travel: rounded to bf16 under ``value_dtype="bf16"``."""
    return values.to(torch.bfloat16).float() if CASES[case].get("value_dtype") == "bf16" else values.float()


def stood_for(runs: list, exchange: str, case: str, step: int, rank: int, key) -> tuple:
    """Brute force from the recorded payloads: (indices, values) of what rank ``rank``'s
    contribution to ``key`` stands for. Allgather: its whole payload. Shared-mask: its own
    compensated values at the positions of the one rank that compressed (the leader, rank
    ``step mod W``). Balanced: the entries of its payload the exchange says were delivered
    (which survive is the exchange's choice; they must be entries of the payload, as they
    travelled; the claim lists every payload position, with 0 where nothing was delivered)."""
    record = runs[rank][(exchange, case)][step]
    if exchange == "allgather":
        indices, values, _ = record["payloads"][key]
        return indices, as_travelled(values, case)
    if exchange == "shared-mask":
        leaders = [r for r, ranks in enumerate(runs) if key in ranks[(exchange, case)][step]["payloads"]]
        assert leaders == [step % len(runs)], (key, leaders)
        indices = runs[leaders[0]][(exchange, case)][step]["payloads"][key][0]
        return indices, as_travelled(record["compensated"][key][indices.long()], case)
    indices, values, numel = record["payloads"][key]
    claimed_indices, claimed_values = record["claimed"][key]
    delivered = claimed_values != 0
    claimed_indices, claimed_values = claimed_indices[delivered], claimed_values[delivered]
    payload = dense(indices, as_travelled(values, case), numel)
    assert bool(torch.isin(claimed_indices, indices).all()), f"{key}: delivered entries it never encoded"
    assert torch.equal(claimed_values, payload[claimed_indices.long()]), f"{key}: not the values it encoded"
    return claimed_indices, claimed_values


def in_parameter_order(by_key: dict, layouts: dict) -> torch.Tensor:
    """Per-key flat tensors laid out in parameter order (a bucket key's tensor follows its
    layout), as float64."""
    numels = [p.numel() for p in make_model().parameters()]
    offsets = [sum(numels[:i]) for i in range(len(numels))]
    total = torch.zeros(sum(numels), dtype=torch.float64)
    for key, flat in by_key.items():
        start = 0
        for number in layouts[key] if isinstance(key, tuple) else (key,):
            total[offsets[number] : offsets[number] + numels[number]] = flat[start : start + numels[number]]
            start += numels[number]
    return total


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"{w}ranks")
def exchange_runs(request):
    return run_workers(__file__, "exchange_worker", request.param, timeout=300)


#: Balanced: the share of all ranks' encoded entries (``k`` per part and rank) that were
#: delivered in a step. Measured over these runs (3 steps x 3 cases): 0.48-0.56 at 2
#: ranks, 0.23-0.42 at 4 (a position several ranks sent survives once; a 1-entry part's
#: entry may not survive at all, so no per-rank bound).
BALANCED_DELIVERED_AT_LEAST = 0.15


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("exchange", SPARSE)
def test_exchange_delivers_the_mean_of_what_was_sent(exchange, case, exchange_runs):
    """Against brute force from the recorded payloads (:func:`stood_for`): every rank gets
    ``(1/W) sum_w s_w`` (``s_w`` what rank w's contribution stands for), bit-identical on
    every rank; ``c_w = s_w + r_w`` bit for bit on every rank (error feedback keeps exactly
    what was not sent, so ``sum c = sum s + sum r``); each rank's contribution is the
    exchange's claim; and it is not empty: ``k`` entries per part and rank (balanced: a
    measured share of all ranks' entries)."""
    world = len(exchange_runs)
    for step in range(len(exchange_runs[0][(exchange, case)])):
        sent, entries, capacity = {}, 0, 0
        for rank, rank_result in enumerate(exchange_runs):
            record = rank_result[(exchange, case)][step]
            where = f"{exchange}/{case}/step {step}/rank {rank}"
            for key, c in record["compensated"].items():
                indices, values = stood_for(exchange_runs, exchange, case, step, rank, key)
                s = dense(indices, values, c.numel())
                assert torch.equal(s + record["residual"][key], c), (where, key)
                assert torch.equal(dense(*record["claimed"][key], c.numel()), s), (where, key)
                k = max(1, int(c.numel() * CASES[case]["ratio"]))
                if exchange != "balanced":
                    assert int((s != 0).sum()) == k, (where, key)
                entries, capacity = entries + int((s != 0).sum()), capacity + k
                sent.setdefault(rank, {})[key] = s.double()
        assert entries >= BALANCED_DELIVERED_AT_LEAST * capacity, (exchange, case, step, entries, capacity)
        reference = sum(in_parameter_order(sent[rank], exchange_runs[rank][(exchange, case)][step]["layouts"])
                        for rank in range(world)) / world  # fmt: skip
        for rank, rank_result in enumerate(exchange_runs):
            record = rank_result[(exchange, case)][step]
            where = f"{exchange}/{case}/step {step}/rank {rank}"
            # shared-mask allreduces bf16 values, so the sum itself is rounded (as dense bf16 is):
            # a few bf16 ulps of the largest term
            rounded = (exchange, case) == ("shared-mask", "bf16-values")
            atol = 4 * 2**-8 * float(reference.abs().max()) if rounded else 1e-7
            torch.testing.assert_close(
                record["grad"].double(), reference, rtol=0 if rounded else 1e-5, atol=atol, msg=where
            )
            assert torch.equal(record["grad"], exchange_runs[0][(exchange, case)][step]["grad"]), where
            assert record["stats"]["bytes_received"] == record["tallied"], where
            # the result stays k-sparse: at most ~ratio of the elements, whatever the exchange
            density = float((record["grad"] != 0).double().mean())
            limit = 0.1 * (world if exchange == "allgather" else 1.6) + 0.03
            assert density <= limit, (where, density)


# --- a dead peer inside each exchange ----------------------------------------------------------
#: What each exchange carries in the dead-peer test (top-k at 0.1 unless named here).
CARRIED = {"two-stage": ("efsignsgd", {})}


def dying_worker(rank: int, world: int, exchange: str) -> dict:
    model = DDP(make_model())
    name, options = CARRIED.get(exchange, ("topk", {"ratio": 0.1}))
    state = gradsift.register_comm_hook(model, name, exchange=exchange, **options)
    for step in range(2):
        model.zero_grad()
        torch.nn.functional.mse_loss(model(batch(rank, step)[0]), batch(rank, step)[1]).backward()
    if rank == 1:

        def dying(*args, **kwargs):
            os._exit(3)

        state.compressor.encode = dying  # what the hook calls
    started = time.monotonic()
    try:
        for step in range(2, 5):  # shared-mask: rank 1 compresses only when it leads
            model.zero_grad()
            torch.nn.functional.mse_loss(model(batch(rank, step)[0]), batch(rank, step)[1]).backward()
        return {"error": None}
    except gradsift.core.errors.PeerFailureError as error:
        return {"error": str(error), "seconds": time.monotonic() - started}


@pytest.mark.parametrize("exchange", [*SPARSE, "two-stage"])
def test_a_peer_dying_inside_the_exchange_gives_peer_failure(exchange):
    results = run_workers(
        __file__, "dying_worker", 2, exchange=exchange, group_timeout=5.0, timeout=120, expect_exit={1: 3}
    )
    assert results[0]["error"] is not None and "a peer process is gone" in results[0]["error"]
    assert results[0]["seconds"] < 20


# --- checkpoint and resume with each exchange -------------------------------------------------
def resume_worker(rank: int, world: int) -> dict:
    """Top-k (its selection does not depend on the bucket's flat order: the resumed DDP model's
    first step uses the initial bucket layout, the uninterrupted one the rebuilt layout); the
    two-stage exchange's chunks, cut in parameter-number order, do not depend on it either."""
    out = {}
    for exchange in [*SPARSE, "two-stage"]:
        model = DDP(make_model())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        name, options = CARRIED.get(exchange, ("topk", {"ratio": 0.1}))
        state = gradsift.register_comm_hook(model, name, exchange=exchange, optimizer=optimizer, **options)

        def run(model, optimizer, steps):
            for step in steps:
                optimizer.zero_grad()
                x, y = batch(rank, step)
                torch.nn.functional.mse_loss(model(x), y).backward()
                optimizer.step()

        run(model, optimizer, range(3))
        saved = copy.deepcopy(  # state_dict() holds the live parameters: copy them
            {
                "model": model.module.state_dict(),
                "optimizer": optimizer.state_dict(),
                "hook": state.state_dict(),
            }
        )
        run(model, optimizer, range(3, 6))
        resumed_module = make_model()
        resumed_module.load_state_dict(saved["model"])
        resumed = DDP(resumed_module)
        resumed_optimizer = torch.optim.SGD(resumed.parameters(), lr=0.1, momentum=0.9)
        resumed_optimizer.load_state_dict(saved["optimizer"])
        resumed_state = gradsift.register_comm_hook(
            resumed, name, exchange=exchange, optimizer=resumed_optimizer, **options
        )
        resumed_state.load_state_dict(saved["hook"])
        run(resumed, resumed_optimizer, range(3, 6))
        out[exchange] = (flat_params(model), flat_params(resumed))
    return out


def test_checkpoint_resumes_bit_for_bit_with_every_exchange():
    for out in run_workers(__file__, "resume_worker", 2, timeout=120):
        for exchange in [*SPARSE, "two-stage"]:
            uninterrupted, resumed = out[exchange]
            assert torch.equal(uninterrupted, resumed), exchange


def test_every_exchange_is_tested_here():
    """The sparse ones here; the two-stage compressed allreduce in test_two_stage.py."""
    assert set(available_exchanges()) == {*SPARSE, "allreduce", "delegated", "two-stage"}


# --- canonical positions (the balanced exchange's slices) --------------------------------------
def test_canonical_positions_invert_flat_positions_and_to_flat_writes_in_place():
    """The balanced exchange maps a part's flat positions to canonical ones and back with
    gradsift.core.store.Canonical (a zero-size parameter included); to_flat with ``out`` lays
    the elements back straight into a bucket view."""
    from gradsift.core.store import Canonical

    numels = {0: 2, 1: 3, 2: 1, 3: 0}
    canonical = Canonical((2, 3, 0, 1), numels)
    flat = torch.tensor([20.0, 0.0, 1.0, 10.0, 11.0, 12.0])  # parameter 2, (3 empty), 0, 1
    laid = canonical.to_canonical(flat)
    positions = torch.arange(6)
    assert torch.equal(laid[canonical.canonical_positions(positions)], flat)
    assert torch.equal(canonical.flat_positions(canonical.canonical_positions(positions)), positions)
    out = torch.full((8,), -1.0)
    assert canonical.to_flat(laid, out=out[1:7]).data_ptr() == out[1:].data_ptr()
    assert out.tolist() == [-1.0, *flat.tolist(), -1.0]
    same = Canonical((0, 1, 2, 3), numels)
    assert same.identity and same.canonical_positions(positions) is positions
