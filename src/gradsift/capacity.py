"""How many entries each part's payload has room for, step by step.

A sparse payload has a fixed capacity (:mod:`gradsift.compressors.base`): every worker
must know it before any data exists, and it must be the same on every worker. For a
compressor with a ``ratio`` it is ``k = max(1, floor(n ratio))``, known from the options.
A compressor whose count follows the data and has no ratio (a fixed threshold, VGC:
``adaptive_capacity``) starts from its first-step capacity and then follows its own
demand: at every kept step each exchange reports, per part, the most entries any
worker wanted to send (read with the step's checks, the same number on every rank),
and the next capacity is

    ``grow`` when ``1.25 * demand`` exceeds it, ``shrink`` when it falls below half of it,
    each to ``1.25 * demand`` rounded up to a multiple of :data:`QUANTUM` (at most ``n``),

so the message size changes rarely and the entries that did not fit wait in the
residual for at most a few steps. Capacities are part of the hook's checkpoint.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import Any

from gradsift.compressors.base import Compressor

#: Headroom over the largest demand.
GROWTH = 1.25
#: Capacities are multiples of this many entries (fewer changes of the message size).
QUANTUM = 64


class CapacityPlan:
    """Per part key, the capacity of an adaptive-capacity compressor's payload."""

    def __init__(self) -> None:
        self.rooms: dict[Hashable, int] = {}

    def capacity(self, compressor: Compressor, key: Hashable, numel: int) -> int | None:
        """The entries the payload of part ``key`` (``numel`` elements) has room for this step."""
        base = compressor.capacity(numel)
        if base is None or not compressor.adaptive_capacity:
            return base
        return min(numel, self.rooms.get(key, base))

    def follow(self, key: Hashable, demand: float, numel: int) -> None:
        """Adjust part ``key``'s capacity to the largest ``demand`` of a kept step."""
        current = self.rooms.get(key)
        wanted = min(numel, max(QUANTUM, math.ceil(GROWTH * demand / QUANTUM) * QUANTUM))
        if current is None or wanted > current or wanted < current / 2:
            self.rooms[key] = wanted

    def state_dict(self) -> dict[str, Any]:
        return {"rooms": dict(self.rooms)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rooms = {key: int(room) for key, room in state.get("rooms", {}).items()}
