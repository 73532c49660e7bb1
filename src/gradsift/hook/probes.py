"""What ``compressor="auto"`` measures of each candidate: its message on this group's link
and its codec on the step's first bucket (:mod:`gradsift.hook.auto`, step 1).

Each candidate has two probes: a real collective of its message's size and kind (an
allreduce of fp32 or bf16 values for ``none`` and ``bf16``; for a compressed candidate an
allgather of its payload's wire bytes -- the largest rank's, agreed by one ``max``
allreduce, since a payload's size may follow each rank's data) and its encode + decode of
the sample. Every probe runs once untimed, then :data:`PROBES` rounds time each probe in
turn (each round starting one later), so load that comes and goes hits them alike; the
median of each is scaled linearly from at most :data:`PROBE_ELEMENTS` elements to the
model's size. Probes run outside backward (after the optimizer's step).
"""

import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from gradsift.compressors.registry import get_compressor

#: Timed calls per probe, after one untimed (the median is kept).
PROBES = 5
#: Elements of the probe messages and codec runs at most (larger models scale linearly).
PROBE_ELEMENTS = 1 << 24


def costs(
    candidates: tuple[tuple[str, dict[str, Any]], ...],
    sample: torch.Tensor,
    numel: int,
    world: int,
    group: Any,
) -> list[float]:
    """``[message seconds, codec seconds]`` per candidate, flattened, for the model's ``numel``
    gradient elements: its collective on this group (``none``/``bf16``: an allreduce of fp32 /
    bf16 values; otherwise an allgather of the payload's wire bytes, the largest rank's) and its encode + decode
    of ``sample`` (the step's first bucket), scaled from at most :data:`PROBE_ELEMENTS`
    elements. Every probe runs once untimed, then :data:`PROBES` rounds time each probe in
    turn (each round starting one later), so load that comes and goes hits them alike."""
    probes: list[tuple[Any, float]] = []
    for name, options in candidates:
        probes += _probes(name, options, sample, numel, world, group)
    for run, _ in probes:
        run()
    times: list[list[float]] = [[] for _ in probes]
    for round_ in range(PROBES):
        for offset in range(len(probes)):
            index = (round_ + offset) % len(probes)
            times[index].append(_seconds(probes[index][0], sample.device))
    return [statistics.median(seconds) * scale for seconds, (_, scale) in zip(times, probes, strict=True)]


def _probes(
    name: str, options: dict[str, Any], sample: torch.Tensor, numel: int, world: int, group: Any
) -> list[tuple[Any, float]]:
    """Candidate ``name``'s two probes, each a call and the factor from its time to the model's."""
    size = min(numel, PROBE_ELEMENTS)
    device = sample.device
    if name in ("none", "bf16"):
        message = torch.zeros(size, dtype=torch.float32 if name == "none" else torch.bfloat16, device=device)
        cast = (lambda: None) if name == "none" else (lambda: sample.to(torch.bfloat16).float())
        return [(lambda: dist.all_reduce(message, group=group), numel / size), (cast, numel / sample.numel())]
    compressor = get_compressor(name, **options)
    flat = sample.detach().reshape(-1).float().clone()
    # a payload's size follows each rank's data: the allgather moves the largest, on every rank
    per_element = torch.tensor(
        [compressor.compress(flat).nbytes / flat.numel()], dtype=torch.float64, device=device
    )
    dist.all_reduce(per_element, op=dist.ReduceOp.MAX, group=group)
    wire = torch.zeros(max(1, round(per_element.item() * size)), dtype=torch.uint8, device=device)
    gathered = [torch.empty_like(wire) for _ in range(world)]

    def codec() -> None:
        compressor.decompress([compressor.compress(flat)] * world, flat.numel())

    return [
        (lambda: dist.all_gather(gathered, wire, group=group), numel / size),
        (codec, numel / flat.numel()),
    ]


def _seconds(run: Any, device: torch.device) -> float:
    """The wall time of one call of ``run`` (the device synchronised around it)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started
