"""How many entries each part's payload has room for, step by step.

A sparse payload has a fixed capacity (:mod:`gradsift.compressors.base`): every worker
must know it before any data exists, and it must be the same on every worker. For a
compressor with a ``ratio`` it is ``k = max(1, floor(n ratio))``, known from the options.
A compressor whose count follows the data and has no ratio (a fixed threshold, VGC:
``adaptive_capacity``) starts from its first-step capacity and then follows its own
demand: at every kept step each exchange reports, per part, the most entries any
worker wanted to send (read with the step's checks, the same number on every rank),
and the next capacity is that demand rounded up to a multiple of :data:`QUANTUM` (at
most ``n``), every step. The payload is padded to its capacity, so room kept for a
demand that does not come is sent as zeros, and entries beyond it wait in the residual
for the next step. Following the demand pads least of the rules measured (docs/decisions.md,
``benchmarks/vgc/padding.py``); what is left is VGC's bursts from step to step and the
allgather's padding to the largest worker, which a capacity fixed before the data exists
cannot remove without a host read.

``padding_target=T`` (a hook option) bounds the padding instead, by sending less than
the demand: part ``p``'s capacity is ``c_{t+1} = f_t d_t`` (rounded up as above), where
``d_t`` is the step's largest demand and the factor ``f`` starts at 1 and follows the
padding the step had (from the second kept step on: the first step's room comes from the
options), ``f_t = clip(f_{t-1} (T u_t / c_t)^(1/2), 1/4, 1)`` with ``u_t``
the mean over workers of the entries sent (read with the demand); entries beyond the
room wait in the residual. It reaches the bound but costs accuracy that fewer entries
chosen by a higher ``alpha`` do not, at fewer bytes on the wire (VGG, 3 seeds; the
``padding.*`` arms of ``benchmarks/vgc/padding.py``, docs/decisions.md), so it is off by
default. A new capacity costs nothing: the wire layout is built from each step's
payloads. Capacities and factors are part of the hook's checkpoint.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import Any

from gradsift.compressors.base import Compressor

#: Capacities are multiples of this many entries.
QUANTUM = 16
#: The lowest fraction of the last demand that a padding-bounded capacity falls to.
FLOOR = 0.25
#: How fast the padding bound's factor moves: by ``(target / padding) ** GAIN`` a step.
GAIN = 0.5


class CapacityPlan:
    """Per part key, the capacity of an adaptive-capacity compressor's payload.

    Args:
        padding_target: None (follow the demand), or the room over entries sent that the
            capacities aim for (>= 1; see the module docstring).
    """

    def __init__(self, padding_target: float | None = None) -> None:
        self.padding_target = padding_target
        self.rooms: dict[Hashable, int] = {}
        self.factors: dict[Hashable, float] = {}

    def capacity(self, compressor: Compressor, key: Hashable, numel: int) -> int | None:
        """The entries the payload of part ``key`` (``numel`` elements) has room for this step."""
        base = compressor.capacity(numel)
        if base is None or not compressor.adaptive_capacity:
            return base
        return min(numel, self.rooms.get(key, base))

    def follow(self, key: Hashable, demand: float, used: float, numel: int) -> None:
        """Set part ``key``'s next capacity from a kept step: the largest ``demand`` of any
        worker, and (under a padding target) ``used``, the mean entries the workers sent
        in the room this plan gave (the first step's, from the options, moves no factor)."""
        factor = 1.0
        if self.padding_target is not None:
            factor = self.factors.get(key, 1.0)
            room = self.rooms.get(key)
            if room and used > 0:
                factor *= (self.padding_target * used / room) ** GAIN
                factor = min(1.0, max(FLOOR, factor))
                self.factors[key] = factor
        self.rooms[key] = min(numel, max(QUANTUM, math.ceil(factor * demand / QUANTUM) * QUANTUM))

    def state_dict(self) -> dict[str, Any]:
        return {"rooms": dict(self.rooms), "factors": dict(self.factors)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rooms = {key: int(room) for key, room in state.get("rooms", {}).items()}
        self.factors = {key: float(factor) for key, factor in state.get("factors", {}).items()}
