"""Random-k with a shared seed: every worker picks the same k positions, so it fits allreduce.

Indices are a pure function of ``(seed, key, step)`` -- the same on the CPU and on any GPU
model (counter-based draws, :mod:`gradsift.compressors.draws`) -- where ``step`` counts the
calls made with that ``key``; they are drawn over the key's parameters in number order
(:meth:`gradsift.core.store.TensorStore.canonical`), so DDP's bucket layout, which changes when
it rebuilds its buckets and again when a run resumes, does not change which elements
are picked. Workers that compress the same tensors in the same
order therefore select the same positions without sending them: only the ``k``
values cross the wire, and summing them with an allreduce is the aggregation.

How the DDP hook uses it (the ``allreduce`` exchange): allreduce
``payload.values`` (the only field in ``payload.fields()``), divide by the world
size, and scatter at the *local* ``payload.indices`` -- ``decompress([payload], n)``
with the reduced values does exactly that. ``payload.nbytes`` is ``k`` values and
no header (``variable_size=False``).
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch

from gradsift.compressors import draws
from gradsift.compressors.base import Selection, Sparsifier, target_count
from gradsift.compressors.draws import stream_seed
from gradsift.core.payload import Payload, index_dtype
from gradsift.core.readout import Readout
from gradsift.core.validation import check_int


@dataclass
class SharedIndexPayload(Payload):
    """A sparse payload whose indices every worker regenerates from a shared seed.

    The indices stay in the payload (for scatter and error feedback) but are not
    a wire field: :meth:`fields` -- and hence :attr:`nbytes` and the wire format --
    carry only the values.
    """

    def fields(self) -> dict[str, torch.Tensor]:
        return {name: t for name, t in super().fields().items() if name != "indices"}


def first_distinct(draws: torch.Tensor) -> torch.Tensor:
    """Mask of the draws that are the first appearance of their value.

    A stable sort groups equal values with the earliest draw first; the first of each
    group is marked and mapped back to draw order. ``O(m log m)`` for ``m`` draws, no
    memory proportional to the range of the values.
    """
    ordered, order = torch.sort(draws, stable=True)
    starts = torch.ones_like(ordered, dtype=torch.bool)
    starts[1:] = ordered[1:] != ordered[:-1]
    first = torch.zeros_like(starts)
    first.index_put_((order,), starts)
    return first


def sample_without_replacement(n: int, k: int, key: int, device: torch.device) -> torch.Tensor:
    """``k`` distinct positions of ``[0, n)``, every ``k``-subset equally likely, in draw order,
    a function of ``(n, k, key)`` only: the same on every device (:mod:`gradsift.compressors.draws`).

    For ``k <= n/2``: the first ``k`` distinct values of an i.i.d. uniform stream
    (sequential sampling without replacement by rejection). The stream length ``m``
    solves ``n (1 - exp(-m/n)) = k + 8 sqrt(k) + 32``: the number of distinct values in
    ``m`` draws has mean ``n (1 - e^(-m/n))`` and a standard deviation below
    ``sqrt(k)``, so falling short of ``k`` is an 8-sigma event (the first ``k`` distinct
    are found by ``nonzero_static``, without reading the count on the host; in that
    event the missing positions are 0, the same on every worker).
    For ``k > n/2`` the stream would need up to ``n ln n`` draws, so a random
    permutation is cut instead.
    """
    if 2 * k > n:
        return draws.permutation(n, key, device)[:k]
    wanted = min(n - 0.5, k + 8 * math.sqrt(k) + 32)
    length = math.ceil(-n * math.log1p(-wanted / n))
    # int32 positions when they fit: the sort is the cost, and it is several times faster.
    drawn = draws.below(n, key, length, device).to(index_dtype(n))
    first = torch.nonzero_static(first_distinct(drawn), size=k, fill_value=-1).view(-1)
    return torch.where(first >= 0, drawn.index_select(0, first.clamp_min(0)), 0).long()


class RandomK(Sparsifier):
    """Send ``k = max(1, floor(n * ratio))`` positions chosen uniformly at random.

    The positions depend only on ``(seed, key, step)`` (see the module docstring),
    so they are identical on every worker and the payload goes through a plain
    allreduce of ``k`` values. The values are sent unscaled (biased by ``k/n``):
    meant for error feedback like the other sparsifiers.

    Its error feedback forgets (``residual_decay = 0.95``, the hook's default for it):
    a position waits ``1/ratio`` steps on average whatever its size, so a plain residual
    hands over, at once, about ``1/ratio`` stale gradients (``1 / (ratio (1 - m))`` under
    momentum correction) -- a delayed step that diverges where the largest-first
    sparsifiers, which send a large residual early, train. With ``beta = 0.95`` a residual
    holds about the last ``1 / (1 - beta) = 20`` steps' worth (docs/decisions.md).

    Options:
        ratio: target density in (0, 1].
        seed: integer >= 0 shared by all workers (default 0).

    State (``state_dict``): the per-key step counters -- restore them to resume
    the same index stream after a checkpoint.

    Cost: ``O(k log k)`` to draw the indices plus one read pass (``aminmax``)
    over the gradient: random-k reads no other reduction of all ``n`` elements, so
    the non-finite check pays for one.
    """

    name = "randomk"
    exchanges = ("allreduce",)
    residual_decay = 0.95  # bounded staleness (class docstring)

    def __init__(self, ratio: float = 0.01, seed: int = 0) -> None:
        super().__init__(ratio)
        self.seed = check_int(seed, "seed", low=0)
        self.steps: dict[Hashable, int] = {}

    def options(self) -> dict[str, Any]:
        return {"ratio": self.ratio, "seed": self.seed}

    def select(self, flat: torch.Tensor, key: Hashable, capacity: int | None, readout: Readout) -> Selection:
        smallest, largest = torch.aminmax(flat)
        step = self.steps.get(key, 0)
        self.steps[key] = step + 1
        stream = stream_seed(self.seed, key, step)
        drawn = sample_without_replacement(
            flat.numel(), target_count(flat.numel(), self.ratio), stream, flat.device
        )
        canonical = self.store.canonical(key)
        if canonical is not None:  # drawn in parameter order: a rebuilt bucket picks the same elements
            drawn = canonical.flat_positions(drawn)
        return Selection(drawn, None, ~torch.isfinite(smallest + largest))

    def encode(
        self, flat: torch.Tensor, *, key: Hashable, capacity: int | None, readout: Readout, **extra: Any
    ) -> Payload:
        payload = super().encode(flat, key=key, capacity=capacity, readout=readout, **extra)
        return SharedIndexPayload(
            numel=payload.numel,
            dtype=payload.dtype,
            values=payload.values,
            indices=payload.indices,
            variable_size=False,
            nonfinite=payload.nonfinite,
        )

    def state_dict(self) -> dict[str, Any]:
        return {"steps": dict(self.steps)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = {key: check_int(step, f"steps[{key!r}]", low=0) for key, step in state["steps"].items()}
