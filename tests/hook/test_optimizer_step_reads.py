"""Host reads the hook makes around the optimizer (issue 43): the first step's scaler check
(gradsift.hook.first_step) reads the host once per check and stops within
UNDECIDED_CHECKS checks even when the gradients stay zero; Adam's takeover
(gradsift.hook.adam) reads no step count on the host, in backward or in the optimizer's
step, and its bias corrections are Python's own to the bit. Counted with the suite's
host-read counter (tests/support/host_reads.py), on a 1-rank gloo group in this process."""

from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsift
from gradsift.hook.adam import bias_correction
from gradsift.hook.before_step import BEFORE_STEP
from gradsift.hook.first_step import UNDECIDED_CHECKS, _scaled_by
from support.host_reads import HostReads

pytestmark = pytest.mark.distributed


def model() -> DDP:
    torch.manual_seed(0)
    return DDP(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)))


def watched(state) -> bool:
    return BEFORE_STEP.holds(state.first_step)


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda d: d / 2**12, 12),  # a scaler's unscale_
        (lambda d: d * 4, -2),
        (lambda d: d.clone(), 0),  # what the hook delivered
        (lambda d: d * 3, 0),  # not a power of two
        (lambda d: -d / 2, 0),  # a negative ratio
        (lambda d: torch.where(torch.arange(d.numel()) == 7, d + 1, d) / 8, 0),  # one element off
        (lambda d: torch.zeros_like(d), 0),
    ],
)
def test_the_scale_check_reads_the_host_once(make, expected):
    delivered = torch.randn(300, generator=torch.Generator().manual_seed(1))
    gradient = make(delivered)
    with HostReads() as reads:
        assert _scaled_by(gradient, delivered) == expected
    assert reads.count == 1, reads.sites
    brute = next((k for k in range(-30, 31) if torch.equal(gradient * 2.0**k, delivered)), 0)
    assert brute == expected  # the oracle: every exponent tried on the host


def test_a_reference_that_says_nothing_is_undecided_in_one_read():
    for delivered in (torch.zeros(50), torch.full((50,), float("nan"))):
        with HostReads() as reads:
            assert _scaled_by(delivered.clone(), delivered) is None
        assert reads.count == 1


def test_zero_gradients_end_the_scaler_watch_within_its_bound(one_process_group):
    """A loss of zero gives the hook zeros to deliver on every step: the check says nothing,
    one host read per step, and after UNDECIDED_CHECKS steps it stops (no reads after but
    the step's own settle, which the optimizer's step also runs)."""
    ddp = model()
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    state = gradsift.register_comm_hook(ddp, "topk", ratio=0.5, optimizer=False)
    assert state.first_step.check_scaler and watched(state)
    counts = []
    for _ in range(UNDECIDED_CHECKS + 3):
        optimizer.zero_grad()
        (ddp(torch.randn(4, 16)) * 0).sum().backward()
        with HostReads() as reads:
            optimizer.step()
        counts.append(reads.count)
    settle = 1
    assert counts == [1 + settle] * UNDECIDED_CHECKS + [settle] * 3
    assert not state.first_step.check_scaler and not watched(state)


def adam_run(rank: int, compressor: str, method: str, steps: int = 5, warmup: int = 2) -> dict:
    ddp = model()
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-2, weight_decay=0.1)
    local = {"local_steps": (1, 2)} if method == "zero-one" else {}  # steps 2 and 4 sync, 3 is local
    gradsift.register_comm_hook(
        ddp, compressor, optimizer=optimizer, warmup_steps=warmup, adam=method, **local
    )
    generator = torch.Generator().manual_seed(rank)
    backward, step = [], []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = ddp(torch.randn(8, 16, generator=generator)).square().mean()
        with HostReads() as reads:
            loss.backward()
        backward.append(reads.count)
        with HostReads() as reads:
            optimizer.step()
        step.append(reads.count)
    return {"backward": backward, "step": step}


@pytest.mark.parametrize("method", ["frozen-variance", "onebit", "zero-one"])
def test_adam_reads_no_step_count_when_it_starts_compressing(one_process_group, method):
    """Step 2 is the first compressed one: its backward starts the velocities from Adam's
    first moments and its optimizer step computes the frozen preconditioners; neither may
    add a host read to what every later compressed step makes: none in backward, the step's
    one readout at its settle, which the optimizer's step runs first."""
    counts = adam_run(0, "topk", method)
    assert counts["backward"] == [0] * 5, counts
    assert counts["step"][2:] == [1] * 3, counts


@pytest.mark.parametrize("beta", [0.9, 0.95, 0.99, 0.999])
def test_bias_corrections_on_the_device_are_the_host_formula_to_the_bit(beta):
    values = torch.randn(64, dtype=torch.float32)
    for t in (1, 2, 7, 64, 1000, 123_457):
        step = torch.tensor(float(t))  # Adam's own: a float32 tensor
        with HostReads() as reads:
            correction = bias_correction(beta, step)
        assert reads.count == 0
        host = 1.0 - beta ** float(t)
        assert correction.item() == host
        assert torch.equal(values / correction, values / host)
        assert torch.equal(values / ((1.0 - beta) * correction), values / ((1.0 - beta) * host))


def test_an_optimizer_settles_only_the_hook_of_the_parameters_it_steps(one_process_group):
    """Two hooked models in one process (``gradsift.tools.simulate`` runs its ranks as threads):
    the first model's optimizer step settles the first hook's closed step and leaves the
    second's for its own optimizer."""
    models = [model(), model()]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    states = [
        gradsift.register_comm_hook(m, "topk", ratio=0.5, optimizer=o)
        for m, o in zip(models, optimizers, strict=True)
    ]
    for m in models:
        m(torch.randn(4, 16)).square().mean().backward()
    assert all(state.ledger.closed is not None for state in states)
    optimizers[0].step()
    assert states[0].ledger.closed is None and states[1].ledger.closed is not None
    optimizers[1].step()
    assert states[1].ledger.closed is None
