"""1-bit Adam with both residuals: ``onebit``, ``adam="onebit"`` and ``server_feedback=True``.

The oracle is 1-bit Adam written out in this file from its formulas (docs/adam.md, Tang et al.
2021), on two simulated workers in one process, in the first moment's units:

* steps ``< T``: dense AdamW on the mean gradient;
* at ``T``: ``D = sqrt(v / (1 - beta2^t)) + eps`` and ``m = m / (1 - beta1^t)`` from AdamW's state;
* then, per worker ``k``: ``m_k = beta1 m + (1 - beta1) g_k``, ``c_k = C(m_k + e_k)``,
  ``e_k <- m_k + e_k - c_k``; the server: ``s = mean_k c_k``, ``m = C(s + e)``, ``e <- s + e - m``;
  ``theta <- theta (1 - lr wd) - lr m / D``;

with ``C(x) = (||x||_2 / sqrt(d)) sign(x)`` (``sign(0) = +1``) per tensor: the DDP bucket
(``granularity="bucket"``: the model's parameters concatenated) or each parameter
(``"layer"``). The hook runs on real gloo processes and must match it, give every rank the
same bits, resume bit for bit through its state dict (and through the checkpoint helpers),
send no more bytes than without the server stage, make no extra host read, raise when a
peer dies, and refuse what it cannot honour.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsift
from gradsift.compressors.casts import Float16
from gradsift.core.errors import InvalidOptionError
from gradsift.core.readout import Readout
from gradsift.core.store import TensorStore
from gradsift.hook.feedback import SERVER_RESIDUAL, server_stage
from gradsift.hook.state import GradsiftHookState
from gradsift.integrations.checkpoint import gather_hook_states, load_hook_state
from support.distributed import run_workers
from support.host_reads import HostReads
from support.models import flat_params, loss_of, make_model
from support.steps import assert_the_survivor_raised, train_until_peer_failure

STEPS, WARMUP, LR, WD, BETAS, EPS = 10, 3, 0.01, 0.1, (0.9, 0.99), 1e-8
#: 1-bit Adam's line (with ``optimizer=`` the AdamW).
ONEBIT = {"warmup_steps": WARMUP, "adam": "onebit", "server_feedback": True}


def onebit_by_definition(x: torch.Tensor) -> torch.Tensor:
    """``(||x||_2 / sqrt(d)) sign(x)``, ``sign(0) = +1``."""
    scale = torch.linalg.vector_norm(x) / math.sqrt(x.numel())
    return torch.where(x < 0, -scale, scale)


def reference_run(per_layer: bool, workers: int = 2) -> torch.Tensor:
    """1-bit Adam on ``workers`` simulated workers (module docstring); the final parameters."""
    model = make_model()
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    beta1, beta2 = BETAS

    def gradients(step: int) -> list[list[torch.Tensor]]:
        out = []
        for k in range(workers):
            model.zero_grad()
            loss_of(model, k, step).backward()
            out.append([p.grad.clone() for p in params])
        return out

    def compress(pieces: list[torch.Tensor]) -> list[torch.Tensor]:
        """``C`` per parameter, or over their concatenation."""
        if per_layer:
            return [onebit_by_definition(x) for x in pieces]
        flat = onebit_by_definition(torch.cat([x.reshape(-1) for x in pieces]))
        chunks = torch.split(flat, [x.numel() for x in pieces])
        return [chunk.view_as(x) for chunk, x in zip(chunks, pieces, strict=True)]

    m = precondition = None
    worker_error = [[torch.zeros_like(p) for p in params] for _ in range(workers)]
    server_error = [torch.zeros_like(p) for p in params]
    for step in range(STEPS):
        g = gradients(step)
        if step < WARMUP:
            for i, p in enumerate(params):
                p.grad = sum(g[k][i] for k in range(workers)) / workers
            optimizer.step()
            continue
        with torch.no_grad():
            if m is None:  # the freeze
                state = [optimizer.state[p] for p in params]
                t = float(state[0]["step"])
                m = [s["exp_avg"] / (1 - beta1**t) for s in state]
                precondition = [(s["exp_avg_sq"] / (1 - beta2**t)).sqrt() + EPS for s in state]
            sent = []
            for k in range(workers):
                local = [
                    beta1 * m[i] + (1 - beta1) * g[k][i] + worker_error[k][i] for i in range(len(params))
                ]
                c = compress(local)
                worker_error[k] = [x - y for x, y in zip(local, c, strict=True)]
                sent.append(c)
            s = [sum(sent[k][i] for k in range(workers)) / workers for i in range(len(params))]
            total = [x + e for x, e in zip(s, server_error, strict=True)]
            m = compress(total)
            server_error = [x - y for x, y in zip(total, m, strict=True)]
            for p, moment, d in zip(params, m, precondition, strict=True):
                p.mul_(1 - LR * WD).sub_(LR * moment / d)
    return flat_params(model)


def hooked_run(
    rank: int, options: dict, resume_at: int | None = None, helpers: bool = False, takeover: bool = True
) -> dict:
    """The user's loop with the one line (``optimizer=`` the AdamW, or with ``takeover`` False
    ``optimizer=False``: none, not looked for); with
    ``resume_at`` a checkpoint there and a restart into fresh objects (through ``state_dict``, or
    with ``helpers`` through ``gather_hook_states`` / ``load_hook_state``)."""

    def fresh():
        model = DDP(make_model())
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
        hook_options = {**options, "optimizer": optimizer if takeover else False}
        return model, optimizer, gradsift.register_comm_hook(model, "onebit", **hook_options)

    model, optimizer, state = fresh()
    reads = []
    for step in range(STEPS):
        if step == resume_at:
            saved = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
            hook = gather_hook_states(state) if helpers else state.state_dict()
            if helpers:  # what a checkpoint on rank 0 would hold, read back on every rank
                box = [hook]
                dist.broadcast_object_list(box, src=0)
                hook = box[0]
            model, optimizer, state = fresh()
            model.load_state_dict(saved["model"])
            optimizer.load_state_dict(saved["optimizer"])
            if helpers:
                load_hook_state(state, hook)
            else:
                state.load_state_dict(hook)
        optimizer.zero_grad()
        loss = loss_of(model, rank, step)
        counter = HostReads()
        with counter:  # the hook's whole step: every bucket's route, and the close
            loss.backward()
        reads.append(counter.count)
        optimizer.step()
    return {
        "params": flat_params(model),
        "server": state.store.table(SERVER_RESIDUAL),
        "bytes": state.stats()["total"]["bytes_sent"],
        "reads": reads,
    }


def runs_worker(rank: int, world: int) -> dict:
    return {
        "bucket": hooked_run(rank, ONEBIT),
        "layer": hooked_run(rank, {**ONEBIT, "granularity": "layer"}),
        "resumed": hooked_run(rank, ONEBIT, resume_at=WARMUP + 2)["params"],
        "across_freeze": hooked_run(rank, ONEBIT, resume_at=WARMUP - 1)["params"],
        "helpers": hooked_run(rank, ONEBIT, resume_at=WARMUP + 3, helpers=True)["params"],
        "worker_only": hooked_run(rank, {**ONEBIT, "server_feedback": False}),
        "own_momentum": hooked_run(rank, {**ONEBIT, "adam": "frozen-variance"}),
        "sgd_server": hooked_run(rank, {"server_feedback": True}, takeover=False),
    }


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_workers(__file__, "runs_worker", 2, timeout=240)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("granularity", ["bucket", "layer"])
def test_the_hook_is_one_bit_adam_written_out(runs, granularity):
    expected = reference_run(per_layer=granularity == "layer")
    for result in runs:
        torch.testing.assert_close(result[granularity]["params"], expected, rtol=1e-5, atol=1e-6)
    # without the server residual, or with each worker's own momentum, the run is another one
    for other in ("worker_only", "own_momentum"):
        assert not torch.allclose(runs[0][other]["params"], expected, rtol=1e-3, atol=1e-4), other


@pytest.mark.slow
@pytest.mark.distributed
def test_every_rank_holds_the_same_bits(runs):
    for case in ("bucket", "layer", "sgd_server"):
        first, second = (result[case] for result in runs)
        assert torch.equal(first["params"], second["params"]), case
        assert first["server"].keys() == second["server"].keys() and first["server"], case
        for key, residual in first["server"].items():
            assert torch.equal(residual, second["server"][key]), (case, key)
            assert residual.abs().sum() > 0, (case, key)


@pytest.mark.slow
@pytest.mark.distributed
def test_resume_is_bit_for_bit_across_the_server_residual(runs):
    for result in runs:
        whole = result["bucket"]["params"]
        assert torch.equal(result["resumed"], whole)
        assert torch.equal(result["across_freeze"], whole)
        assert torch.equal(result["helpers"], whole)


@pytest.mark.slow
@pytest.mark.distributed
def test_the_server_stage_sends_nothing_and_reads_nothing_on_the_host(runs):
    for result in runs:
        assert result["bucket"]["bytes"] == result["worker_only"]["bytes"] > 0
        assert not result["worker_only"]["server"]
        # the step's one read of its checks (and one spare: tests/hook/test_host_reads.py's budget);
        # the freeze reads Adam's step count once per parameter (gradsift.hook.adam)
        assert max(result["bucket"]["reads"][WARMUP + 1 :]) <= 2, result["bucket"]["reads"]
        assert max(result["sgd_server"]["reads"]) <= 2, result["sgd_server"]["reads"]


# --- a peer that dies ----------------------------------------------------------------------------
def dying_worker(rank: int, world: int) -> dict:
    model = DDP(make_model())
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    state = gradsift.register_comm_hook(model, "onebit", optimizer=optimizer, **ONEBIT)
    for step in range(WARMUP + 1):
        optimizer.zero_grad()
        loss_of(model, rank, step).backward()
        optimizer.step()
    if rank == 1:

        def dying(*args, **kwargs):
            import os

            os._exit(3)

        state.compressor.encode = dying  # what the hook calls, on the worker and on the server
    return train_until_peer_failure(
        model, optimizer, lambda m, step: loss_of(m, rank, step), range(WARMUP + 1, WARMUP + 4)
    )


@pytest.mark.slow
@pytest.mark.distributed
def test_a_dead_peer_raises_instead_of_hanging():
    results = run_workers(__file__, "dying_worker", 2, group_timeout=5.0, timeout=120, expect_exit={1: 3})
    assert_the_survivor_raised(results[0])


# --- the pieces, in one process ------------------------------------------------------------------
def test_the_server_stage_keeps_what_it_did_not_send():
    """``s + e_old == c + e_new`` and ``c = C(s + e_old)``, over three steps, for fp32 and bf16 means."""
    compressor = gradsift.get_compressor("onebit")
    generator = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16):
        store, residual = TensorStore(), torch.zeros(300)
        for _ in range(3):
            mean = torch.randn(300, generator=generator).to(dtype)
            target = mean.float() + residual
            server_stage(store, "key", mean, compressor, Readout())
            sent = onebit_by_definition(target)
            assert torch.equal(mean, sent.to(dtype))
            residual = store.get(SERVER_RESIDUAL, "key")
            assert residual.dtype == torch.float32
            torch.testing.assert_close(sent + residual, target, rtol=0, atol=1e-6)


class ReplicableCast(Float16):
    """A compressor that claims the server stage but travels by an allreduce."""

    server_stage = True


@pytest.mark.parametrize(
    ("compressor", "options", "message"),
    [
        ("topk", {"ratio": 0.1}, "'topk' is not one"),
        ("qsgd", {}, "deterministic, stateless compressor (blockquant, signsgd, efsignsgd, onebit)"),
        ("powersgd", {}, "'powersgd' is not one"),
        (ReplicableCast(), {}, "travels by 'allreduce'"),
    ],
)
def test_settings_it_cannot_honour_are_refused(compressor, options, message):
    with pytest.raises(InvalidOptionError, match="server_feedback=True") as raised:
        GradsiftHookState.build(compressor, server_feedback=True, **options)
    assert message in str(raised.value)


def test_bad_values_and_a_checkpoint_of_the_other_kind_are_refused():
    with pytest.raises(InvalidOptionError, match="server_feedback must be True or False"):
        GradsiftHookState.build("onebit", server_feedback=1)
    with pytest.raises(InvalidOptionError, match="frozen-variance, update, onebit"):
        GradsiftHookState.build("onebit", adam="one-bit")
    on, off = GradsiftHookState.build("onebit", server_feedback=True), GradsiftHookState.build("onebit")
    for saved, loading in ((on, off), (off, on)):
        with pytest.raises(InvalidOptionError, match="disagree on server_feedback"):
            loading.load_state_dict(saved.state_dict())
