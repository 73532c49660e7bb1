"""Phase times on CUDA without a GPU: fake ``torch.cuda.Event`` and streams that behave as
PyTorch's do -- ``elapsed_time`` raises unless both events completed -- so the CPU suite
holds the CUDA branch of :mod:`gradsift.core.telemetry` to never asking too early, never
waiting in a step's close or in ``stats()``, counting a late phase in its own step, and
recording on the stream of the bucket's device."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch

from gradsift.core.readout import Readout
from gradsift.core.telemetry import BucketRecord, Telemetry


class FakeStream:
    def __init__(self, device: torch.device) -> None:
        self.device = device


class FakeEvent:
    """A CUDA event: complete once marked ``done`` (the fake device passed it, or
    ``synchronize``) or once a later event of its stream is (streams run in order)."""

    clock: ClassVar[float] = 0.0  # the fake device's progress, in ms
    made: ClassVar[list[FakeEvent]] = []
    waits: ClassVar[int] = 0  # synchronize() calls: the host waited for the device

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.at: float | None = None
        self.stream: FakeStream | None = None
        self.done = False
        FakeEvent.made.append(self)

    def record(self, stream: FakeStream | None = None) -> None:
        self.stream, self.at = stream, FakeEvent.clock
        FakeEvent.clock += 5.0

    def query(self) -> bool:
        return self.done or any(
            later.done and later.stream is self.stream and later.at >= self.at for later in FakeEvent.made
        )

    def synchronize(self) -> None:
        FakeEvent.waits += 1
        self.done = True

    def elapsed_time(self, end: FakeEvent) -> float:
        if not (self.query() and end.query()):
            raise RuntimeError("Both events must be completed before calculating elapsed time.")
        assert self.at is not None and end.at is not None
        return end.at - self.at


@pytest.fixture
def fake_cuda(monkeypatch):
    FakeEvent.clock, FakeEvent.made, FakeEvent.waits = 0.0, [], 0
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    streams: dict[torch.device, FakeStream] = {}
    monkeypatch.setattr(
        torch.cuda,
        "current_stream",
        lambda device=None: streams.setdefault(torch.device(device), FakeStream(torch.device(device))),
    )
    return FakeEvent


def timed_step(device: torch.device) -> BucketRecord:
    record = BucketRecord()
    with record.timed("compress_ms", device):
        pass
    record.register(Readout())  # nothing device-valued: the step reads nothing on the host
    return record


def test_a_step_with_nothing_to_read_never_asks_a_running_event(fake_cuda):
    telemetry = Telemetry()
    record = timed_step(torch.device("cuda", 0))
    running = record.settle()  # the old code asked elapsed_time here: "Both events must be completed"
    telemetry.end_step(0, [record], skipped=False, running=running)
    first = telemetry.last
    assert first["compress_ms"] == 0.0 and len(telemetry.running) == 1
    for event in fake_cuda.made:  # the device passes them before the next step closes
        event.done = True
    later = timed_step(torch.device("cuda", 0))
    telemetry.end_step(1, [later], skipped=False, running=later.settle())
    # step 0's phase, found complete now, lands in step 0 -- not in step 1, whose own is running
    assert first["compress_ms"] == 5.0 and telemetry.last["compress_ms"] == 0.0
    assert telemetry.total["compress_ms"] == 5.0
    stats = telemetry.summary()  # what state.stats() returns: no wait for the running step
    assert fake_cuda.waits == 0 and len(telemetry.running) == 1
    assert stats["total"]["compress_ms"] == 5.0 and stats["step"]["compress_ms"] == 0.0
    final = telemetry.summary(wait=True)  # a final report may wait
    assert fake_cuda.waits == 1 and telemetry.running == []
    assert final["total"]["compress_ms"] == 10.0 and final["step"]["compress_ms"] == 5.0


def test_a_phase_completed_before_stats_is_counted_without_a_wait(fake_cuda):
    telemetry = Telemetry()
    record = timed_step(torch.device("cuda", 0))
    telemetry.end_step(0, [record], skipped=False, running=record.settle())
    for event in fake_cuda.made:
        event.done = True
    assert telemetry.summary()["step"]["compress_ms"] == 5.0 and fake_cuda.waits == 0


def test_completed_events_count_in_their_own_step(fake_cuda):
    record = timed_step(torch.device("cuda", 0))
    for event in fake_cuda.made:  # the step's host read waited for the stream
        event.done = True
    assert record.settle() == []
    assert record.compress_ms == 5.0


def test_events_are_recorded_on_the_stream_of_the_buckets_device(fake_cuda):
    timed_step(torch.device("cuda", 1))
    assert [event.stream.device for event in fake_cuda.made] == [torch.device("cuda", 1)] * 2
