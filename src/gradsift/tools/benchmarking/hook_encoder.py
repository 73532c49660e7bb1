"""What ``compress`` and ``decompress`` time: the DDP hook's own calls, not the public API.

``compress`` times ``Compressor.encode`` with the part's capacity and the step's readout
(what :meth:`gradsift.exchanges.base.Codec.encode` calls during backward; no host read),
``decompress`` times ``decompress_into([payload], out)``. After each call, untimed, the
step closes as in the hook (the readout's one host read, the commit of the compressor's
state and adaptation, the capacity following the demand): the hook pays that once per
step, not per bucket. The public ``compress()`` reads the count and the non-finite flag
on the host and trims the payload, so on a GPU it waits for the device every call, which
the hook never does.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from gradsift.compressors.base import Compressor
from gradsift.core.errors import GradsiftError
from gradsift.core.payload import Count, Payload
from gradsift.core.readout import Readout
from gradsift.hook.capacity import CapacityPlan


class HookEncoder:
    """One flat tensor encoded step after step as the DDP hook encodes a bucket's part.

    :meth:`encode` is the hook's call during backward (the one
    :meth:`gradsift.exchanges.base.Codec.encode` makes): ``Compressor.encode`` with the
    part's capacity from a :class:`~gradsift.hook.capacity.CapacityPlan` (``compressor.capacity(n)``;
    for an adaptive-capacity compressor, the demand of the last kept step) and the step's
    :class:`~gradsift.core.readout.Readout`, inside the state store's transaction; no host read.
    :meth:`close` is the step's close: the readout's one host read, the commit of the
    store and of the compressor's deferred updates (SIDCo's stage choice), the capacity
    following the demand. Time :meth:`encode` alone and :meth:`close` between timings:
    the hook closes once per step, not once per bucket.
    """

    def __init__(self, compressor: Compressor, key: Hashable = 0) -> None:
        self.compressor = compressor
        self.key = key
        self.capacities = CapacityPlan()
        self._open: tuple[Readout, Count, int] | None = None  # the open step: readout, demand, numel

    def encode(self, flat: torch.Tensor) -> Payload:
        """Open a step and encode ``flat`` (1-D) in it, as the hook does; the payload keeps its padding."""
        if self._open is not None:
            raise GradsiftError("HookEncoder.encode: the previous step is still open; close() it first")
        numel = flat.numel()
        readout = Readout()
        store = self.compressor.store
        store.begin()
        try:
            payload = self.compressor.encode(
                flat,
                key=self.key,
                capacity=self.capacities.capacity(self.compressor, self.key, numel),
                readout=readout,
            )
        except BaseException:
            store.rollback()
            raise
        self._open = (readout, payload.entries() if payload.demand is None else payload.demand, numel)
        return payload

    def close(self) -> None:
        """Close the step :meth:`encode` opened, as the hook's step close keeps a step."""
        if self._open is None:
            raise GradsiftError("HookEncoder.close: no step is open; encode() opens one")
        (readout, demand, numel), self._open = self._open, None
        read = readout.slot(torch.as_tensor(demand))  # a host count stays on the host
        readout.read()  # the step's one host read
        self.compressor.store.commit()
        readout.commit()
        self.capacities.follow(self.key, read[0], numel)
