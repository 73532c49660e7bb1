"""Hook options against references computed in the same run (real gloo ranks).

* momentum correction with nothing dropped equals stock DDP + SGD momentum;
* every part's result equals the mean over ranks of what each rank sent for it
  (bucket and layer granularity, ``min_numel`` parts, ``value_dtype``), with every
  part at the right offset;
* error feedback conserves: per rank and parameter, the sum of the gradients equals
  the sum of what was sent plus the residual left (through a bucket rebuild);
* ``warmup_steps`` is stock DDP; the density warm-up follows its schedule;
* ``clip_norm`` scales each part (bucket or layer) by DGC's local threshold, against the
  rule written out in float64 from each rank's own gradient.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsift
from gradsift.hook import recipe
from support.distributed import record_sparse_payloads, run_workers
from support.models import NUMELS, batch, flat_params, make_model

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS = 5


def sgd_run(
    model: DDP, rank: int, optimizer: torch.optim.Optimizer, register_at: int = -1, hook: dict | None = None
) -> torch.Tensor:
    """``STEPS`` steps; at step ``register_at`` the hook is registered with ``hook``'s arguments."""
    for step in range(STEPS):
        if step == register_at:
            gradsift.register_comm_hook(model, **(hook or {}))
        optimizer.zero_grad()
        x, y = batch(rank, step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return flat_params(model)


def momentum_worker(rank: int, world: int) -> dict:
    out = {}
    stock = DDP(make_model())
    out["stock"] = sgd_run(
        stock, rank, torch.optim.SGD(stock.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    )
    plain = DDP(make_model())
    out["plain"] = sgd_run(plain, rank, torch.optim.SGD(plain.parameters(), lr=0.1, weight_decay=0.01))
    for label, options in {
        "bucket": {},
        "layer": {"granularity": "layer"},
        "masked": {"momentum_masking": True},
        "warmup": {"warmup_steps": 2},
    }.items():
        model = DDP(make_model())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
        state = gradsift.register_comm_hook(
            model, "topk", ratio=1.0, optimizer=optimizer, **{"momentum_masking": False, **options}
        )
        out[label] = sgd_run(model, rank, optimizer)
        out[label + "_momentum"] = state.feedback.momentum
        out[label + "_group"] = dict(optimizer.param_groups[0], params=None)
    for label, passed in (("late", True), ("late-discovered", False)):  # after two stock steps
        model = DDP(make_model())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
        hook = {"compressor": "topk", "ratio": 1.0, "momentum_masking": False}
        out[label] = sgd_run(
            model, rank, optimizer, 2, {**hook, **({"optimizer": optimizer} if passed else {})}
        )
        out[label + "_buffers"] = sum("momentum_buffer" in optimizer.state[p] for p in model.parameters())
    return out


def test_momentum_correction_with_nothing_dropped_equals_stock_sgd_momentum():
    for out in run_workers(__file__, "momentum_worker", 2):
        for label in ("bucket", "layer", "warmup"):
            # mean_w(m u_w + g_w + wd x) = m mean_w(u_w) + mean_w(g_w) + wd x: equal up to rounding
            torch.testing.assert_close(out[label], out["stock"], rtol=1e-5, atol=1e-6)
            assert out[label + "_momentum"] == 0.9
            group = out[label + "_group"]
            assert (group["momentum"], group["weight_decay"]) == (0.0, 0.0)
            assert (group[recipe.MOMENTUM_KEY], group[recipe.WEIGHT_DECAY_KEY]) == (0.9, 0.01)
        # Registered after SGD stepped, the velocity starts from SGD's momentum buffers, which
        # leave the optimizer's state: the run goes on as stock DDP's.
        for label in ("late", "late-discovered"):
            torch.testing.assert_close(out[label], out["stock"], rtol=1e-5, atol=1e-6)
            assert out[label + "_buffers"] == 0
        # With masking every sent element's velocity is zeroed: at ratio 1 that is plain SGD.
        torch.testing.assert_close(out["masked"], out["plain"], rtol=1e-5, atol=1e-6)
        assert not torch.allclose(out["plain"], out["stock"], rtol=1e-3)  # the two references differ


# --- every part at its offset, equal to the mean of what the ranks sent -----------------------
PART_CASES = {
    "bucket": {"ratio": 0.25},
    "layer": {"ratio": 0.25, "granularity": "layer"},
    "layer-min-numel": {"ratio": 0.25, "granularity": "layer", "min_numel": 20},
    "bf16-values": {"ratio": 0.25, "value_dtype": "bf16"},
}


def parts_worker(rank: int, world: int) -> dict:
    out = {}
    for label, options in PART_CASES.items():
        model = DDP(make_model())
        state = gradsift.register_comm_hook(model, "topk", **options)
        sent = record_sparse_payloads(state.compressor)
        grads = []
        for step in range(3):
            model.zero_grad()
            x, y = batch(rank, step)
            local = torch.autograd.grad(
                torch.nn.functional.mse_loss(model.module(x), y), list(model.module.parameters())
            )
            grads.append(torch.cat([g.reshape(-1) for g in local]))
            torch.nn.functional.mse_loss(model(x), y).backward()
        everyone_sent, everyone_grads = [None] * world, [None] * world
        dist.all_gather_object(everyone_sent, sent)
        dist.all_gather_object(everyone_grads, grads[-1])
        out[label] = {
            "grad": torch.cat([p.grad.reshape(-1) for p in model.module.parameters()]),
            "sent": everyone_sent,
            "local_grads": everyone_grads,
            "layouts": dict(state.bucket_layouts),
            "stats": state.stats()["step"],
        }
    return out


def reference_gradient(result: dict, options: dict, world: int) -> torch.Tensor:
    """The mean of every rank's sent parts (and dense parts), in parameter order."""
    offsets = [sum(NUMELS[:i]) for i in range(len(NUMELS))]
    reference = torch.zeros(sum(NUMELS), dtype=torch.float64)
    dtype = torch.bfloat16 if options.get("value_dtype") == "bf16" else torch.float64
    for rank_sent in result["sent"]:
        for key, (indices, values, numel) in rank_sent.items():
            values = values.to(dtype).double()
            if isinstance(key, tuple):  # a bucket: its flat order is the recorded layout
                order = result["layouts"][key]
                positions = torch.cat([torch.arange(offsets[i], offsets[i] + NUMELS[i]) for i in order])
                reference.index_add_(0, positions[indices], values)
            else:
                assert numel == NUMELS[key]
                reference.index_add_(0, offsets[key] + indices, values)
    for number in range(len(NUMELS)):
        if NUMELS[number] < options.get("min_numel", 0):  # dense parts: the plain mean
            dense = sum(g[offsets[number] : offsets[number] + NUMELS[number]] for g in result["local_grads"])
            reference[offsets[number] : offsets[number] + NUMELS[number]] = dense.double()
    return reference / world


@pytest.fixture(scope="module")
def part_runs():
    return run_workers(__file__, "parts_worker", 2)


@pytest.mark.parametrize("label", list(PART_CASES))
def test_every_part_lands_at_its_offset_as_the_mean_of_what_the_ranks_sent(label, part_runs):
    options = PART_CASES[label]
    for out in part_runs:
        result = out[label]
        reference = reference_gradient(result, options, 2)
        torch.testing.assert_close(result["grad"].double(), reference, rtol=1e-6, atol=1e-7)
        small = [n for n in NUMELS if n < options.get("min_numel", 0)]
        assert result["stats"]["dense_tensors"] == len(small)
    assert torch.equal(part_runs[0][label]["grad"], part_runs[1][label]["grad"])


# --- DGC's local gradient clipping -------------------------------------------------------------
#: clip_norm for the clipping test. At make_model's gradients on batch(rank, 0) a part is
#: clipped below these values of clip_norm (measured): the bucket 1.64 (rank 0) and 1.34
#: (rank 1), the layers 1.25/1.66/2.19/6.36 and 0.88/1.20/2.05/5.47: at 1.5 some parts
#: are clipped and some not, in both granularities (the test checks both kinds occur).
CLIP_NORM = 1.5


def clip_worker(rank: int, world: int, granularity: str) -> dict:
    """One step with ratio 1 (everything is sent: the result is the mean of what each rank
    compensated); each rank's local gradient, computed apart, for the oracle."""
    model = DDP(make_model())
    gradsift.register_comm_hook(model, "topk", ratio=1.0, clip_norm=CLIP_NORM, granularity=granularity)
    x, y = batch(rank, 0)
    local = torch.autograd.grad(
        torch.nn.functional.mse_loss(model.module(x), y), list(model.module.parameters())
    )
    torch.nn.functional.mse_loss(model(x), y).backward()
    everyone: list = [None] * world
    dist.all_gather_object(everyone, [g.detach().clone() for g in local])
    return {"grad": [p.grad.clone() for p in model.module.parameters()], "local": everyone}


def clipped(gradients: list[torch.Tensor], world: int) -> tuple[list[torch.Tensor], list[bool]]:
    """DGC's local clipping (Lin et al. 2018, as docs/distributed.md and recipe's docstring
    state it) of one rank's parts, in float64: a part of ``n_i`` of the model's ``n``
    elements is scaled by ``min(1, t_i / ||g_i||)``, ``t_i = clip_norm sqrt(n_i / n) /
    sqrt(W)``. Also whether each part was clipped."""
    total = sum(g.numel() for g in gradients)
    out, clipped_parts = [], []
    for g in gradients:
        threshold = CLIP_NORM * math.sqrt(g.numel() / total) / math.sqrt(world)
        norm = float(g.double().norm())
        out.append(g.double() * min(1.0, threshold / norm))
        clipped_parts.append(norm > threshold)
    return out, clipped_parts


@pytest.mark.parametrize("granularity", ["bucket", "layer"])
def test_clip_norm_scales_each_part_by_dgcs_threshold(granularity):
    ranks = run_workers(__file__, "clip_worker", 2, granularity=granularity)
    world = len(ranks)
    expected, kinds = [torch.zeros(n, dtype=torch.float64) for n in NUMELS], set()
    for local in ranks[0]["local"]:
        flat = [g.reshape(-1) for g in local]
        parts = [torch.cat(flat)] if granularity == "bucket" else flat
        scaled, was_clipped = clipped(parts, world)
        kinds |= set(was_clipped)
        scaled = scaled[0].split(NUMELS) if granularity == "bucket" else scaled
        expected = [e + c / world for e, c in zip(expected, scaled, strict=True)]
    assert kinds == {True, False}  # some parts clipped, some not
    for out in ranks:
        for got, want in zip(out["grad"], expected, strict=True):
            torch.testing.assert_close(got.reshape(-1).double(), want, rtol=1e-5, atol=1e-8)


# --- error feedback conserves, through DDP's bucket rebuild -----------------------------------
class Reordered(torch.nn.Module):
    """Parameters defined in another order than the forward uses them: DDP's rebuild after
    the first step regroups them (bucket_cap_mb tiny: one layer per bucket after it)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.head = torch.nn.Linear(16, 3)
        self.body = torch.nn.Linear(12, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x)))


def sent_by_definition(payload) -> torch.Tensor:
    """What a payload sends, dense in float64, read from its documented format (not with the
    compressor's decoder): sparse entries ``(indices, values)``; VGC's 32-bit words
    (docs/vgc.md: per word a 28-bit index, a sign bit and a 3-bit level ``l``, the value
    ``sign M 2^-l`` for the message's scale ``M``, after one chunk count per 2^28 elements)."""
    dense = torch.zeros(payload.numel, dtype=torch.float64)
    if payload.codes is None:
        used = payload.indices.numel() if payload.length is None else int(payload.length)
        return dense.index_put_((payload.indices[:used].long(),), payload.values[:used].double())
    chunks = -(-payload.numel // 2**28)
    words = payload.codes[chunks:].long() & 0xFFFFFFFF
    words = words if payload.length is None else words[: int(payload.length)]
    sign = 1.0 - 2.0 * ((words >> 3) & 1).double()
    values = sign * float(payload.scales[0]) * torch.pow(2.0, -(words & 7).double())
    return dense.index_put_((words >> 4,), values)


def conservation_worker(rank: int, world: int, name: str, options: dict) -> dict:
    model = Reordered()
    ddp = DDP(model, bucket_cap_mb=0.0001)
    state = gradsift.register_comm_hook(ddp, name, **options)
    params = list(model.parameters())
    copy = Reordered()
    layouts, total_grad = [], torch.zeros(sum(p.numel() for p in params), dtype=torch.float64)
    sent_total = torch.zeros_like(total_grad)
    offsets = dict(
        zip(range(len(params)), [sum(p.numel() for p in params[:i]) for i in range(len(params))], strict=True)
    )
    numels = [p.numel() for p in params]
    original = state.compressor.encode  # what the hook calls

    def recording(tensor, *, key, **kw):
        payload = original(tensor, key=key, **kw)
        own = sent_by_definition(payload)
        order = state.bucket_layouts[key] if isinstance(key, tuple) else (key,)
        start = 0
        for number in order:
            sent_total[offsets[number] : offsets[number] + numels[number]] += own[
                start : start + numels[number]
            ]
            start += numels[number]
        return payload

    state.compressor.encode = recording
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for step in range(4):
        copy.load_state_dict(model.state_dict())
        x, y = batch(rank, step)
        local = torch.autograd.grad(torch.nn.functional.mse_loss(copy(x), y), list(copy.parameters()))
        total_grad += torch.cat([g.reshape(-1) for g in local]).double()
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        optimizer.step()
        layouts.append(dict(state.bucket_layouts))
    left = torch.zeros_like(total_grad)
    tables = [t for t in ("residual", "vgc.residual") if state.store.table(t)]
    for table in tables:
        for key, residual in state.store.table(table).items():
            start = 0
            for number in state.bucket_layouts[key] if isinstance(key, tuple) else (key,):
                left[offsets[number] : offsets[number] + numels[number]] += residual[
                    start : start + numels[number]
                ].double()
                start += numels[number]
    return {"grad": total_grad, "sent": sent_total, "left": left, "layouts": layouts}


@pytest.mark.parametrize(
    ("name", "options"),
    [("topk", {"ratio": 0.2}), ("sidco-exp", {"ratio": 0.2}), ("vgc", {"alpha": 2.0})],
    ids=["topk", "sidco", "vgc"],
)
def test_error_feedback_conserves_every_parameter_through_a_bucket_rebuild(name, options):
    for out in run_workers(__file__, "conservation_worker", 2, name=name, options=options):
        assert out["layouts"][0] != out["layouts"][-1], (
            "the buckets were not rebuilt: the test would be vacuous"
        )
        # sum of gradients = sum of what was sent + what is left, per element of every parameter
        torch.testing.assert_close(out["sent"] + out["left"], out["grad"], rtol=1e-5, atol=1e-5)
        assert out["left"].abs().sum() > 0 and out["sent"].abs().sum() > 0


# --- the density warm-up follows its schedule -------------------------------------------------
def schedule_worker(rank: int, world: int) -> dict:
    model = DDP(make_model())
    state = gradsift.register_comm_hook(
        model, "topk", ratio=0.01, density_warmup_steps=4, density_warmup_start=0.5
    )
    counts = []
    for step in range(6):
        model.zero_grad()
        x, y = batch(rank, step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        counts.append(state.stats()["step"]["elements_sent"])
    return {"counts": counts}


def test_density_warmup_sends_the_scheduled_counts():
    """DGC's exponential warm-up (docs/distributed.md; recipe's docstring): the ratio at step
    ``t < T`` is ``d0 (d / d0)^(t / T)``, then ``d``; each step sends ``max(1, floor(n ratio))``."""
    total = sum(NUMELS)
    ratios = [0.5 * (0.01 / 0.5) ** (t / 4) if t < 4 else 0.01 for t in range(6)]
    expected = [max(1, math.floor(total * ratio)) for ratio in ratios]
    for out in run_workers(__file__, "schedule_worker", 2):
        assert out["counts"] == expected
    assert expected[0] == total // 2 and expected[-1] == 2  # 50 % at first, 1 % of 259 after
