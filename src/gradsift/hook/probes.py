"""What ``compressor="auto"`` measures of each candidate: its whole route, on the deciding
step's own buckets (:mod:`gradsift.hook.auto`, step 1).

A candidate's probe is what its hook would do with the step's gradients, end to end: every
kept bucket (:class:`KeptBucket`, copied before its exchange) through
:func:`gradsift.hook.route.route_bucket` of a probe state of that method -- its parts,
compensation, encode, the real collectives on this group, validation, decode, the step's
close on the device and its settle on the host -- and, for ``none``, stock DDP's
``allreduce(g / W)`` of each bucket, as auto's dense steps run it. So the time includes what
a codec probe on one bucket misses: the route's Python per bucket and part, error feedback,
the payloads' padding to the largest rank's, and the contention of every rank running it on
shared cores (docs/decisions.md has the case a codec probe got wrong).

A probe state is built as the method would be registered (its compressor options, the hook
options auto passes on), without the optimizer: it takes no optimizer over and never steps
one; under SGD with momentum, its error feedback runs the momentum correction at the
optimizer's momentum, as the method would. It is thrown away after the probes (its
residuals with it); the model's parameters and the run's state are never touched.

The probes share a budget of :data:`PROBE_SECONDS`, a candidate's share ``B`` its part.
Each probe first routes the smallest kept bucket once, untimed (the gauge); a candidate
whose gauge, scaled to the kept buckets, exceeds ``B`` probes only the smallest buckets
that fit in ``B`` by that scale (at least the smallest; :func:`probe_subset`) -- on a slow
link a dense probe of the whole model would cost a dense step, which the run may never
otherwise take. A probe on more than the smallest bucket runs once more untimed on its
buckets. Then :data:`PROBES` rounds time each probe in turn (each round starting one
later), so load that comes and goes hits them alike; each timing starts from the kept
gradients (copied in, untimed). A slow probe is timed fewer times: as many calls as fit in
``B`` with its untimed one (at least one), none when that one alone took longer (its time
stands). The ranks agree on the gauges and on the untimed calls' times (one ``max`` each),
so every rank makes the same calls. The median of each is scaled linearly from its
buckets' elements to the model's. Probes run outside backward (after the optimizer's step);
every rank runs the same probes, collectives included.
"""

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from gradsift.core.collectives import agreed_max
from gradsift.hook.layout import FlatBucket
from gradsift.hook.route import route_bucket
from gradsift.hook.state import GradsiftHookState

#: Timed calls per probe, after one untimed (the median is kept), at most ...
PROBES = 5
#: ... and as many as fit in the candidate's share of this many seconds with the untimed one
#: (:func:`timed_calls`), the share bounding its buckets too (:func:`probe_subset`).
PROBE_SECONDS = 0.3
#: Elements of the deciding step's buckets kept for the probes at most (the first buckets
#: of the step up to this many; a larger model's times are scaled linearly).
PROBE_ELEMENTS = 1 << 24


def kept_elements(numel: int, step_s: float) -> int:
    """How many elements of a step's buckets to keep for the probes, for a model of ``numel``
    and a step of ``step_s`` seconds (the ranks' agreed): at most :data:`PROBE_ELEMENTS`, and
    on a step longer than :data:`PROBE_SECONDS` the share ``PROBE_SECONDS / step_s`` of the
    model, so that the dense probe -- a step's time at most, for the whole model -- takes
    about :data:`PROBE_SECONDS` (times scale linearly to the model; the step's first bucket is
    kept whatever its size)."""
    share = min(1.0, PROBE_SECONDS / step_s) if step_s > 0 else 1.0
    return min(PROBE_ELEMENTS, max(1, int(numel * share)))


@dataclass
class KeptBucket:
    """A bucket of the deciding step, copied before its exchange: its flat gradient and
    parameters, as DDP's ``GradBucket`` gave them."""

    flat: torch.Tensor
    params: list[torch.Tensor]


@dataclass
class Setting:
    """What the probes run in: the wrapped module (its parameter numbers), the process group,
    the hook options auto passes on, and the optimizer's SGD momentum (0: none or another
    optimizer), which a momentum-corrected candidate's error feedback runs at."""

    module: torch.nn.Module
    group: Any
    hook_options: dict[str, Any]
    momentum: float = 0.0


def route_costs(
    candidates: tuple[tuple[str, dict[str, Any]], ...],
    kept: list[KeptBucket],
    numel: int,
    setting: Setting,
) -> list[float]:
    """Seconds of each candidate's route over the model's ``numel`` gradient elements: its
    route over its share of the ``kept`` buckets (module docstring), the median of up to
    :data:`PROBES` timed rounds, scaled by ``numel`` over those buckets' elements."""
    work = [bucket.flat.clone() for bucket in kept]
    device = kept[0].flat.device
    sizes = [bucket.flat.numel() for bucket in kept]
    budget = PROBE_SECONDS / len(candidates)

    def call(run: Callable[[list[int]], None], buckets: list[int]) -> float:
        for index in buckets:
            work[index].copy_(kept[index].flat)
        return _seconds(lambda: run(buckets), device)

    runs = [_route(name, options, work, kept, setting) for name, options in candidates]
    smallest = [min(range(len(kept)), key=sizes.__getitem__)]
    gauges = agreed_max([call(run, smallest) for run in runs], setting.group, "probe gauges")
    subsets = [probe_subset(sizes, seconds, budget) for seconds in gauges]
    first = [
        gauge if subset == smallest else call(run, subset)
        for run, subset, gauge in zip(runs, subsets, gauges, strict=True)
    ]
    agreed = agreed_max(first, setting.group, "probe agreement")  # every rank makes the same calls
    counts = [timed_calls(seconds, budget) for seconds in agreed]
    times: list[list[float]] = [[] for _ in runs]
    for round_ in range(PROBES):
        for offset in range(len(runs)):
            index = (round_ + offset) % len(runs)
            if round_ < counts[index]:
                times[index].append(call(runs[index], subsets[index]))
    return [
        statistics.median(seconds or [once]) * numel / sum(sizes[i] for i in subset)
        for seconds, once, subset in zip(times, agreed, subsets, strict=True)
    ]


def probe_subset(sizes: list[int], gauge: float, budget: float) -> list[int]:
    """The kept buckets (indices, in their order) a probe runs on, from the bucket ``sizes``
    and the seconds ``gauge`` its route took on the smallest: every bucket when the gauge,
    scaled linearly to all of them, fits in ``budget``; else the smallest buckets, taken
    smallest first, while their elements stay within the share ``budget`` of that scaled
    time (at least the smallest)."""
    total, smallest = sum(sizes), min(sizes)
    estimate = gauge * total / smallest
    if estimate <= budget:
        return list(range(len(sizes)))
    allowed = max(smallest, total * budget / estimate)
    chosen, elements = [], 0
    for index in sorted(range(len(sizes)), key=sizes.__getitem__):
        if elements + sizes[index] > allowed:
            break
        chosen.append(index)
        elements += sizes[index]
    return sorted(chosen)


def timed_calls(first: float, budget: float = PROBE_SECONDS) -> int:
    """Timed calls of a probe whose untimed call took ``first`` seconds (the ranks' largest):
    :data:`PROBES`, or as many as fit in ``budget`` seconds with the untimed one (at least
    one), or none when the untimed call alone took that long (its time then stands)."""
    if first >= budget:
        return 0
    return max(1, min(PROBES, int((budget - first) / max(first, 1e-9))))


def _route(
    name: str, options: dict[str, Any], work: list[torch.Tensor], kept: list[KeptBucket], setting: Setting
) -> Callable[[list[int]], None]:
    """Candidate ``name``'s route over the buffers ``work`` (the kept buckets' gradients) of
    the buckets it is called with (indices, in order; the last ends the step)."""
    if name == "none":
        world = dist.get_world_size(setting.group)

        def stock(buckets: list[int]) -> None:
            pending = [
                dist.all_reduce(work[i].div_(world), group=setting.group, async_op=True) for i in buckets
            ]
            for handle in pending:
                handle.wait()

        return stock
    state = GradsiftHookState.build(
        name, **options, **setting.hook_options, warmup_steps=0, process_group=setting.group
    )
    state.layout.bind(setting.module)
    if state.feedback is not None and state.compressor.momentum_correction:
        state.feedback.momentum = setting.momentum

    def route(buckets: list[int]) -> None:
        futures = [
            route_bucket(state, FlatBucket(work[i], kept[i].params, last=i == buckets[-1])) for i in buckets
        ]
        torch.futures.wait_all(futures)
        state.settle()

    return route


def _seconds(run: Callable[[], None], device: torch.device) -> float:
    """The wall time of one call of ``run`` (the device synchronised around it)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started
