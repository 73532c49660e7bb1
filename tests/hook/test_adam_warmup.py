"""The frozen-variance Adam methods' measured warm-up (gradsift.hook.adam_warmup).

The oracle is the rule computed by hand on the second moments the run recorded: after every
optimizer step the per-tensor totals ``S_p = sum(v_p) / (1 - beta2^t)`` are read here, in
Python floats and Python's own bias correction; the expected end is the first ``t``, a
multiple of WINDOW with a previous window, where ``sum_p |S_p(t) - S_p(t - WINDOW)| /
sum_p S_p(t) < SETTLED``, or the cap ``round(1 / (1 - beta2))`` -- but no step whose learning
rate is above the previous step's. On a 1-rank gloo group.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsift
from gradsift.core.errors import InvalidOptionError
from gradsift.hook.adam_warmup import RECORD_KEY, SETTLED, WINDOW, relative_change
from support.host_reads import HostReads
from support.models import batch, flat_params, make_model

pytestmark = pytest.mark.distributed

BETAS, STEPS = (0.9, 0.99), 60


def hooked(**options):
    model = DDP(make_model())
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=BETAS, weight_decay=0.1)
    state = gradsift.register_comm_hook(model, "topk", ratio=0.25, optimizer=optimizer, **options)
    return model, optimizer, state


def step(model, optimizer, t: int, lr: float | None = None) -> None:
    if lr is not None:
        optimizer.param_groups[0]["lr"] = lr
    optimizer.zero_grad()
    x, y = batch(0, t)
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()


def totals_by_hand(optimizer) -> list[float]:
    out = []
    for p in (p for group in optimizer.param_groups for p in group["params"]):
        state = optimizer.state[p]
        t = float(state["step"])
        out.append(float(state["exp_avg_sq"].double().sum()) / (1.0 - BETAS[1] ** t))
    return out


def expected_end(recorded: list[list[float]], rates: list[float] | None = None) -> tuple[int, str]:
    cap = round(1 / (1 - BETAS[1]))
    for t in range(1, len(recorded) + 1):
        if rates is not None and t >= 2 and rates[t - 1] > rates[t - 2]:
            continue  # the learning rate rose at step t
        if t >= cap:
            return t, "cap"
        if t % WINDOW == 0 and t >= 2 * WINDOW:
            now, before = recorded[t - 1], recorded[t - 1 - WINDOW]
            if len(now) != len(before):
                continue  # parameters joined between the windows: nothing to compare
            change = sum(abs(a - b) for a, b in zip(now, before, strict=True)) / sum(now)
            if change < SETTLED:
                return t, "settled"
    raise AssertionError("the recording is too short")


def test_relative_change_is_the_formula():
    assert relative_change([2.0, 2.0], [1.0, 4.0]) == (1.0 + 2.0) / 4.0
    assert relative_change([0.0, 0.0], [1.0, 1.0]) == float("inf")  # no second moment: not settled
    assert relative_change([2.0, 2.0, 1.0], [1.0, 4.0]) == float("inf")  # a group added: not settled


def test_a_group_added_between_windows_restarts_the_comparison(one_process_group):
    """The first layer's group added at step 12, between the checks at 8 and 16: at 16 the totals
    hold parameters the window before did not, so nothing has settled there (it raised, the lists'
    lengths differing); the warm-up ends where the rule says on the recorded moments."""
    model = DDP(make_model())
    body, head = list(model.module[0].parameters()), list(model.module[2].parameters())
    optimizer = torch.optim.AdamW(head, lr=3e-3, betas=BETAS, weight_decay=0.1)
    state = gradsift.register_comm_hook(model, "topk", ratio=0.25, optimizer=optimizer)
    recorded = []
    for t in range(STEPS):
        if t == 12:
            optimizer.add_param_group({"params": body})
        step(model, optimizer, t)
        recorded.append(totals_by_hand(optimizer))
    end, reason = expected_end(recorded)
    report = state.stats()["adam_warmup"]
    assert 16 < end < STEPS and (report["end"], report["reason"]) == (end, reason)


def test_the_warm_up_ends_where_the_rule_says_on_the_recorded_moments(one_process_group):
    model, optimizer, state = hooked()
    recorded, density = [], []
    for t in range(STEPS):
        step(model, optimizer, t)
        density.append(state.stats()["step"]["density"])
        recorded.append(totals_by_hand(optimizer))
    end, reason = expected_end(recorded)
    assert 2 * WINDOW < end < STEPS  # neither the first possible check nor the cap
    report = state.stats()["adam_warmup"]
    assert (report["end"], report["reason"], report["steps"]) == (end, reason, end)
    assert density[:end] == [1.0] * end and max(density[end:]) < 0.5  # dense, then compressed
    assert (
        state.options.warmup_steps is None
        and state.adam.compressing(end)
        and not state.adam.compressing(end - 1)
    )


def test_no_end_while_the_learning_rate_rises(one_process_group):
    """A linear learning-rate warm-up over RISING steps (set by hand, as scripts do): the rule
    on the recorded moments alone would end inside it; the warm-up ends after it."""
    rising, steps = 45, 90
    rates = [3e-3 * min(1.0, (t + 1) / rising) for t in range(steps)]
    model, optimizer, state = hooked()
    recorded = []
    for t in range(steps):
        step(model, optimizer, t, lr=rates[t])
        recorded.append(totals_by_hand(optimizer))
    end, reason = expected_end(recorded, rates)
    assert expected_end(recorded)[0] < rising < end  # the rising rate is what moved it
    report = state.stats()["adam_warmup"]
    assert (report["end"], report["reason"]) == (end, reason)
    state.adam.detach()


def test_warmup_steps_given_overrides_the_measure(one_process_group):
    model, optimizer, state = hooked(warmup_steps=5)
    density = []
    for t in range(12):
        step(model, optimizer, t)
        density.append(state.stats()["step"]["density"])
    assert density[:5] == [1.0] * 5 and max(density[5:]) < 0.5
    assert state.stats()["adam_warmup"] == {"end": 5, "reason": "warmup_steps"}
    assert RECORD_KEY not in optimizer.param_groups[0]  # nothing measured


def test_warmup_steps_zero_is_refused(one_process_group):
    with pytest.raises(InvalidOptionError, match="warmup_steps=0 .* leave it unset"):
        hooked(warmup_steps=0)


@pytest.mark.parametrize("cut", [12, 24])  # inside a window before the end; past the end
def test_resume_equals_the_uninterrupted_run_bit_for_bit(one_process_group, cut):
    model, optimizer, state = hooked()
    for t in range(STEPS):
        step(model, optimizer, t)
    straight, report = flat_params(model), state.stats()["adam_warmup"]
    state.adam.detach()

    model, optimizer, state = hooked()
    for t in range(cut):
        step(model, optimizer, t)
    saved = copy.deepcopy((model.state_dict(), optimizer.state_dict(), state.state_dict()))
    state.adam.detach()

    model, optimizer, state = hooked()
    model.load_state_dict(saved[0])
    optimizer.load_state_dict(saved[1])
    state.load_state_dict(saved[2])
    for t in range(cut, STEPS):
        step(model, optimizer, t)
    assert torch.equal(flat_params(model), straight)
    assert state.stats()["adam_warmup"] == report
    state.adam.detach()


def counted_reads(**options) -> tuple[list[int], list[int], int]:
    model, optimizer, state = hooked(**options)
    backward, at_step = [], []
    for t in range(STEPS):
        optimizer.zero_grad()
        x, y = batch(0, t)
        loss = torch.nn.functional.mse_loss(model(x), y)
        with HostReads() as reads:
            loss.backward()
        backward.append(reads.count)
        with HostReads() as reads:
            optimizer.step()
        at_step.append(reads.count)
    state.adam.detach()
    return backward, at_step, state.adam.warmup_end


def test_no_host_read_in_backward_one_per_check_at_the_step(one_process_group):
    """Backward reads nothing; the optimizer's step reads what the same run with the warm-up
    given reads (the settle's readout, CPU Adam's own step counts), plus one at each window's
    end until the warm-up has ended."""
    backward, measured, end = counted_reads()
    _, given, _ = counted_reads(warmup_steps=end)
    assert backward == [0] * STEPS
    checks = [int(t + 1 <= end and (t + 1) % WINDOW == 0) for t in range(STEPS)]
    assert [a - b for a, b in zip(measured, given, strict=True)] == checks
