"""A frozen-variance Adam method's second moment, estimated again over windows of later steps.

The frozen-variance methods (:mod:`gradsift.hook.adam`) divide every compressed step's first
moment by ``D = sqrt(v) + eps`` with ``v`` Adam's bias-corrected second moment at the end of
the warm-up. A short warm-up freezes the early gradients' ``v`` for the rest of the run.
``variance_refresh=((start, steps), ...)`` estimates ``v`` again, after 0/1 Adam's idea of
updating the variance at growing intervals (Lu et al. 2022), without pausing the method:
during hook steps ``start .. start + steps - 1`` each worker also sends its gradient (divided
by the loss scale) the way the warm-up sent it -- in the warm-up's code
(``warmup_compressor=``), else by fp32 allreduce -- beside the method's own message, and every
rank sums the squares of the delivered means ``gbar``. From the window's last step on, per
element,

    v <- beta2^e v + (1 - beta2^e) sum(gbar^2) / steps    where that sum is positive,

with ``e`` the steps since the last estimate (the freeze, or the previous window's end): Adam's
own exponential average over those steps, the window's mean standing for each of them, so the
estimate keeps the history Adam's ``v`` keeps (``beta2^e`` of it) instead of replacing it.
The code travels without error feedback (the estimate is a statistic, not gradient mass to
deliver later); an element a code rounded to zero throughout the window keeps its ``v``.

Bytes: each window step sends the code's message on top of the method's.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Sequence
from typing import Any

import torch

from gradsift.core.collectives import Pending
from gradsift.core.errors import InvalidOptionError
from gradsift.core.mean import unscaled
from gradsift.core.parts import Context, Outcome, Part
from gradsift.exchanges.base import Codec, Exchange
from gradsift.hook.adam import AdamStep, FrozenVarianceStep

#: The state-store table of the window's summed squared means.
SQUARES = "adam.refresh_squares"

logger = logging.getLogger("gradsift.hook")

Windows = tuple[tuple[int, int], ...]


def parse_windows(windows: Any) -> Windows:
    """``variance_refresh`` as sorted ``(start, steps)`` pairs of ints (``start >= 1``,
    ``steps >= 1``) that do not overlap; a clear error otherwise."""
    usage = "variance_refresh= takes (start, steps) pairs of hook steps, e.g. ((300, 25),)"
    if not isinstance(windows, Sequence) or isinstance(windows, str):
        raise InvalidOptionError(f"{usage}; got {windows!r}")
    pairs = []
    for window in windows:
        if (
            not isinstance(window, Sequence)
            or len(window) != 2
            or not all(isinstance(n, int) and not isinstance(n, bool) for n in window)
            or window[0] < 1
            or window[1] < 1
        ):
            raise InvalidOptionError(f"{usage} with start >= 1 and steps >= 1; got {window!r}")
        pairs.append((int(window[0]), int(window[1])))
    pairs.sort()
    for (start, steps), (following, _) in itertools.pairwise(pairs):
        if start + steps > following:
            raise InvalidOptionError(
                f"variance_refresh windows overlap: {(start, steps)} runs past step {following}"
            )
    return tuple(pairs)


def refuse_unsupported(adam: AdamStep | None, windows: Windows) -> None:
    """Refuse ``variance_refresh`` without a frozen-variance method whose warm-up length is
    given (``warmup_steps=``), or with a window that starts inside the warm-up."""
    if not windows:
        return
    if not isinstance(adam, FrozenVarianceStep):
        raise InvalidOptionError(
            "variance_refresh= estimates again the second moment a frozen-variance Adam method froze "
            "(optimizer= an Adam or AdamW, adam='frozen-variance' or 'onebit'); this hook runs none"
        )
    if adam.warmup_steps is None:
        raise InvalidOptionError(
            "variance_refresh= needs the warm-up's length: pass warmup_steps= (a measured warm-up ends "
            "at a step the windows cannot be placed after)"
        )
    if windows[0][0] < adam.warmup_steps:
        raise InvalidOptionError(
            f"variance_refresh window {windows[0]} starts inside the warm-up of {adam.warmup_steps} steps: "
            "start it at warmup_steps or later"
        )


def window_of(windows: Windows, step: int) -> tuple[int, int] | None:
    """The window holding hook step ``step`` (0-based), or None."""
    return next(((s, n) for s, n in windows if s <= step < s + n), None)


def start_trip(
    state: Any,
    large: list[Part],
    context: Context,
    loss_scale: torch.Tensor | None,
    warmup: tuple[Exchange, Codec],
) -> Pending[Outcome] | None:
    """In a window, start the side trip of ``large``'s gradients (divided by ``loss_scale``)
    by the ``warmup``'s exchange and codec (the warm-up's code, or stock DDP's allreduce) into
    a bucket-sized result of its own, its bytes in the bucket's record; its outcome adds each
    part's squared mean to :data:`SQUARES` (fresh at the window's first step). None outside
    a window. Start it before the method's compensation, which may write ``c`` over the
    gradient, and before its trip, which may write the mean there."""
    window = window_of(state.options.variance_refresh, context.step)
    if window is None or not large:
        return None
    side = dataclasses.replace(context, result=torch.empty_like(context.result))
    parts = [
        Part(p.key, p.offset, p.flat if loss_scale is None else unscaled(p.flat, loss_scale), p.params)
        for p in large
    ]
    exchange, codec = warmup
    first = context.step == window[0]

    def accumulate(outcome: Outcome) -> Outcome:
        for part in parts:
            mean = part.view(side.result).float()
            held = None if first else state.store.get(SQUARES, part.key)
            state.store.put(
                SQUARES, part.key, mean * mean if held is None else torch.addcmul(held, mean, mean)
            )
        return Outcome(nonfinite=outcome.nonfinite, malformed=outcome.malformed, error=outcome.error)

    return exchange.start(parts, codec, side).then(accumulate)


def settled(state: Any, step: int) -> None:
    """After hook step ``step`` was kept: at a window's last step, Adam's second moment becomes
    the window's estimate (module docstring) and the sums are dropped."""
    window = window_of(state.options.variance_refresh, step)
    if window is None or step != sum(window) - 1 or not isinstance(state.adam, FrozenVarianceStep):
        return
    earlier = [s + n for s, n in state.options.variance_refresh if s + n <= window[0]]
    elapsed = step + 1 - max(earlier, default=state.adam.warmup_steps or 0)  # given: refused otherwise
    sums = state.store.per_parameter(SQUARES)
    state.adam.renew_second_moment({n: s / window[1] for n, s in sums.items()}, elapsed)
    for key in list(state.store.table(SQUARES)):
        state.store.discard(key, [SQUARES])
    logger.info("second moment estimated again from hook steps %d-%d", window[0], step)
