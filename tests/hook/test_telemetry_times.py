"""The hook's phase times measure their phases, each moment once: a compressor that sleeps
in ``encode`` shows it in ``compress_ms`` only, one that sleeps in ``decompress_into`` in
``decompress_ms`` only -- not in ``communicate_ms`` too, whose wait runs the decode (a 1-rank gloo group in this process; CPU times are host
wall-clock around each phase, ``gradsift.core.telemetry``).

The sleeps (0.2 s per step) dwarf the phases' own cost on this tiny model (< 1 ms), so
the lower bounds hold by construction and the other phase stays far below them.
"""

from __future__ import annotations

import time

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsift
from gradsift.compressors.topk import TopK

pytestmark = pytest.mark.distributed
STEPS, SLEEP_S = 3, 0.2


class SlowEncode(TopK):
    def encode(self, *args, **kwargs):
        time.sleep(SLEEP_S)
        return super().encode(*args, **kwargs)


class SlowDecode(TopK):
    def decompress_into(self, *args, **kwargs):
        time.sleep(SLEEP_S)
        return super().decompress_into(*args, **kwargs)


def phase_totals(compressor: TopK) -> dict[str, float]:
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)))
    state = gradsift.register_comm_hook(model, compressor)
    for _ in range(STEPS):
        model(torch.randn(8, 64)).square().mean().backward()
    total = state.stats()["total"]
    return {key: total[key] for key in ("compress_ms", "communicate_ms", "decompress_ms")}


@pytest.mark.parametrize(("compressor", "slow", "fast"), [
    (SlowEncode, "compress_ms", "decompress_ms"),
    (SlowDecode, "decompress_ms", "compress_ms"),
])  # fmt: skip
def test_each_phase_time_holds_its_phase_and_only_it(one_process_group: None, compressor, slow, fast):
    times = phase_totals(compressor(ratio=0.1))
    slept_ms = 1000 * STEPS * SLEEP_S
    assert times[slow] >= slept_ms
    assert times[fast] < slept_ms / 2
    assert times["communicate_ms"] < slept_ms / 2  # the decode ran inside the wait: not counted twice
    plain = phase_totals(TopK(ratio=0.1))  # positive control: the same run without the sleeps
    assert plain[slow] < slept_ms / 2
