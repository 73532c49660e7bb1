"""The device branch of the selection selects what the CPU branch selects, on real gradients.

On a GPU the kernels of :mod:`gradsift.compressors.kernels` take their PyTorch branch
(fixed shapes, no host read); :func:`kernels.device_branch` forces it on CPU tensors here.
The buckets are the flat gradients of a small MLP at ten training steps; every threshold
sparsifier and VGC encodes each at a fixed capacity (ratios 0.01 and 0.001) through both
branches, and the payloads -- positions and values -- must be equal. The hard threshold
runs at a threshold that lets far more than twice the capacity through (the case where
the old device branch kept the largest of the first ``2 capacity`` positions only), and
that case is checked against a brute-force oracle too.
"""

import math

import pytest
import torch

import gradsift
from gradsift.compressors import kernels
from gradsift.compressors.base import target_count
from gradsift.core.readout import Readout
from support.models import make_model

STEPS = 10
WIDTHS = (32, 256, 256, 10)


def gradient_buckets() -> list[torch.Tensor]:
    """The MLP's flat gradient at ten SGD steps on random regression batches (~76k elements)."""
    model = make_model(WIDTHS, seed=7)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(3)
    buckets = []
    for _ in range(STEPS):
        x = torch.randn(64, WIDTHS[0], generator=generator)
        y = torch.randn(64, WIDTHS[-1], generator=generator)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        buckets.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone())
        optimizer.step()
    return buckets


BUCKETS = gradient_buckets()


def build(name: str, ratio: float):
    if name == "threshold":  # far more than 2x the capacity pass: the median magnitude
        return gradsift.get_compressor(name, threshold=float(BUCKETS[0].abs().median()))
    if name == "vgc":
        return gradsift.get_compressor(name, alpha=0.5)
    return gradsift.get_compressor(name, ratio=ratio)


def encode_steps(name: str, ratio: float, dtype: torch.dtype, on_device: bool) -> list[tuple]:
    """``(positions, values, demand)`` of every step's payload, the in-use entries only."""
    compressor = build(name, ratio)
    sent = []
    for bucket in BUCKETS:
        flat = bucket.to(dtype)
        capacity = target_count(flat.numel(), ratio)
        readout = Readout()
        extra = {"variance": flat.float().square() * 0.01} if name == "vgc" else {}
        if on_device:
            with kernels.device_branch():
                payload = compressor.encode(flat, key="b", capacity=capacity, readout=readout, **extra)
        else:
            payload = compressor.encode(flat, key="b", capacity=capacity, readout=readout, **extra)
        readout.read()
        readout.commit()
        used = int(payload.entries())
        demand = -1 if payload.demand is None else int(payload.demand)  # SIDCo's exact first step: none
        if name == "vgc":
            words = payload.codes[-capacity:][:used]
            sent.append((words.clone(), payload.scales.clone(), demand))
        else:
            sent.append((payload.indices[:used].clone(), payload.values[:used].clone(), demand))
    return sent


SELECTORS = ["threshold", "dgc", "redsync", "gaussiank", "sidco-exp", "sidco-gamma", "sidco-gpareto", "vgc"]


@pytest.mark.parametrize("ratio", [0.01, 0.001])
@pytest.mark.parametrize("name", SELECTORS)
def test_both_branches_send_the_same_payloads(name, ratio):
    on_cpu = encode_steps(name, ratio, torch.float32, on_device=False)
    on_device = encode_steps(name, ratio, torch.float32, on_device=True)
    for step, (cpu, device) in enumerate(zip(on_cpu, on_device, strict=True)):
        assert cpu[2] == device[2], f"{name} step {step}: demand {cpu[2]} vs {device[2]}"
        assert torch.equal(cpu[0], device[0]), f"{name} step {step}: other positions"
        assert torch.equal(cpu[1], device[1]), f"{name} step {step}: other values"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_more_than_twice_the_capacity_passing_keeps_the_largest_of_all(dtype):
    ratio = 0.001
    on_cpu = encode_steps("threshold", ratio, dtype, on_device=False)
    on_device = encode_steps("threshold", ratio, dtype, on_device=True)
    for bucket, cpu, device in zip(BUCKETS, on_cpu, on_device, strict=True):
        flat = bucket.to(dtype)
        capacity = target_count(flat.numel(), ratio)
        assert cpu[2] > 10 * capacity  # the case under test
        # brute force: sort by (|x| descending, position ascending), keep capacity, in position order
        magnitudes = flat.abs().tolist()
        order = sorted(range(flat.numel()), key=lambda i: (-magnitudes[i], i))[:capacity]
        assert cpu[0].tolist() == device[0].tolist() == sorted(order)
        assert torch.equal(cpu[1], device[1])


def test_vgc_scale_and_demand_come_from_every_passing_element():
    # a large element far along the bucket: the old device branch never saw it (it kept
    # the first 2 capacity candidates), so its scale M and its demand missed it
    flat = torch.full((4000,), 0.01)
    flat[3999] = 5.0
    variance = torch.full((4000,), 1e-8)
    payloads = []
    for on_device in (False, True):
        vgc = gradsift.get_compressor("vgc", alpha=1.0)
        readout = Readout()
        if on_device:
            with kernels.device_branch():
                payloads.append(vgc.encode(flat, key=0, capacity=40, readout=readout, variance=variance))
        else:
            payloads.append(vgc.encode(flat, key=0, capacity=40, readout=readout, variance=variance))
    for payload in payloads:
        assert float(payload.scales) == 5.0
        # every element passes; those >= 5 * 2^-7.5 are sendable: only the large one
        assert int(payload.demand) == 1 and int(payload.entries()) == 1
    assert math.isclose(float(payloads[0].scales), float(payloads[1].scales))
