"""Write your own compressor: a sparsifier that sends every element above a fraction of the largest.

``FractionOfMax`` sends, of the ``n``-element tensor ``x`` it is given (a DDP bucket's
gradient, or one layer's, with error feedback's residual added),

    S = {i : |x_i| >= alpha * max_j |x_j|},

the values ``x_i`` at the positions ``i`` in ``S``. Under the DDP hook the payload has room
for ``k = max(1, floor(n * ratio))`` entries (``ratio`` is the wire budget); when more than
``k`` elements pass, the ``k`` largest of them go and the rest wait in the residual.
Every rank receives every rank's payload and writes the mean ``(1/W) sum_w x_w[S_w]``
(zero outside ``S_w``) into the bucket. ``max_j |x_j|`` is NaN or Inf exactly when ``x``
holds a NaN or an Inf: that is the non-finite flag the hook needs.

Run it (two gloo processes on this machine; rank 0 prints one JSON line)::

    python examples/extending/my_compressor.py
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch
import toy
from torch.nn.parallel import DistributedDataParallel

import gradsift
from gradsift.compressors.base import Selection, Sparsifier
from gradsift.compressors.threshold import mask_selection
from gradsift.core.readout import Readout
from gradsift.core.validation import check_real
from gradsift.hook.state import GradsiftHookState

NAME = "fraction-of-max"


class FractionOfMax(Sparsifier):
    """Send ``{i : |x_i| >= alpha max_j |x_j|}``, at most ``k = max(1, floor(n ratio))`` of them.

    Options:
        fraction: ``alpha`` in (0, 1]; 1 sends only the largest magnitude.
        ratio: the payload's room as a fraction of the elements, in (0, 1].
    """

    name = NAME

    def __init__(self, fraction: float = 0.5, ratio: float = 0.1) -> None:
        super().__init__(ratio)
        self.fraction = check_real(fraction, "fraction", low=0.0, high=1.0, low_open=True)

    def options(self) -> dict[str, Any]:
        return {"fraction": self.fraction, "ratio": self.ratio}

    def select(self, flat: torch.Tensor, key: Hashable, capacity: int | None, readout: Readout) -> Selection:
        magnitudes = flat.abs()
        largest = magnitudes.max()  # a device scalar: nothing here reads a tensor on the host
        passing = magnitudes >= self.fraction * largest
        return mask_selection(flat, passing, capacity, nonfinite=~torch.isfinite(largest))


# A name for it: get_compressor and register_comm_hook then build it from its options.
# (An instance needs no name: gradsift.register_comm_hook(ddp_model, FractionOfMax(fraction=0.5)).)
gradsift.register_compressor(NAME, FractionOfMax)


def train(rank: int, steps: int = toy.STEPS) -> tuple[torch.nn.Module, GradsiftHookState, list[float]]:
    """``steps`` steps of SGD through ``fraction-of-max`` in the process group already set up:
    the trained model, the hook's state and this rank's losses."""
    ddp_model = DistributedDataParallel(toy.make_model())
    state = gradsift.register_comm_hook(ddp_model, NAME, fraction=0.5, ratio=0.1)
    losses = toy.sgd(ddp_model, rank, steps)
    return ddp_model.module, state, losses


def report(rank: int) -> dict[str, Any]:
    """What rank 0 prints: the first and last loss, and the density the hook sent."""
    _, state, losses = train(rank)
    total = state.stats()["total"]
    return {"compressor": NAME, "losses": [losses[0], losses[-1]], "density": total["density"]}


def main() -> None:
    toy.spawn(report)


if __name__ == "__main__":
    main()
