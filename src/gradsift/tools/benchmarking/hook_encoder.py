"""What ``compress`` and ``decompress`` time: the DDP hook's own calls, not the public API.

``compress`` times ``Compressor.encode`` with the part's capacity and the step's readout
(what :meth:`gradsift.exchanges.base.Codec.encode` calls during backward; no host read),
``decompress`` times ``decompress_into([payload], out)``. After each call, untimed, the
step closes as in the hook (the readout's one host read, the commit of the compressor's
state and adaptation, the capacity following the demand) and the next one opens (its
:class:`~gradsift.core.transaction.Transaction`): the hook pays both once per step, not
per bucket. The public ``compress()`` reads the count and the non-finite flag on the
host and trims the payload, so on a GPU it waits for the device every call, which the
hook never does.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from gradsift.compressors.base import Compressor
from gradsift.core.errors import GradsiftError
from gradsift.core.payload import Count, Payload
from gradsift.core.transaction import Transaction
from gradsift.hook.capacity import CapacityPlan


class HookEncoder:
    """One flat tensor encoded step after step as the DDP hook encodes a bucket's part.

    :meth:`encode` is the hook's call during backward (the one
    :meth:`gradsift.exchanges.base.Codec.encode` makes): ``Compressor.encode`` with the
    part's capacity from a :class:`~gradsift.hook.capacity.CapacityPlan` (``compressor.capacity(n)``;
    for an adaptive-capacity compressor, the demand of the last kept step) and the readout
    of the step's :class:`~gradsift.core.transaction.Transaction`; no host read.
    :meth:`close` is the step's close, the transaction's ``settle`` as in the public
    ``Compressor.compress``: the readout's one host read, the commit (the store, then the
    compressor's deferred updates such as SIDCo's stage choice); then the capacity follows
    the demand and the next step opens, as the hook opens one per step and not per
    bucket. Time :meth:`encode` alone and :meth:`close` between timings. From construction on, the compressor's store is in the open step's
    transaction.
    """

    def __init__(self, compressor: Compressor, key: Hashable = 0) -> None:
        self.compressor = compressor
        self.key = key
        self.capacities = CapacityPlan()
        self._step = Transaction(compressor.store, compressor)
        self._encoded: tuple[Count, Count, int] | None = None  # the open step's demand, entries sent, numel

    def encode(self, flat: torch.Tensor) -> Payload:
        """Encode ``flat`` (1-D) in the open step, as the hook does; the payload keeps its padding."""
        if self._encoded is not None:
            raise GradsiftError("HookEncoder.encode: the previous step is still open; close() it first")
        numel = flat.numel()
        try:
            payload = self.compressor.encode(
                flat,
                key=self.key,
                capacity=self.capacities.capacity(self.compressor, self.key, numel),
                readout=self._step.readout,
            )
        except BaseException:
            self._step.roll_back()
            self._step = Transaction(self.compressor.store, self.compressor)
            raise
        entries = payload.entries()
        self._encoded = (entries if payload.demand is None else payload.demand, entries, numel)
        return payload

    def close(self) -> None:
        """Close the step :meth:`encode` encoded in, as the hook's step close keeps a step; open the next."""
        if self._encoded is None:
            raise GradsiftError("HookEncoder.close: no step is open; encode() opens one")
        (demand, entries, numel), self._encoded = self._encoded, None
        wanted = self._step.readout.slot(torch.as_tensor(demand))  # a host count stays on the host
        used = self._step.readout.slot(torch.as_tensor(entries))
        self._step.settle()  # the step's one host read, then the commit (nothing here drops it)
        self.capacities.follow(self.key, wanted[0], used[0], numel)
        self._step = Transaction(self.compressor.store, self.compressor)
