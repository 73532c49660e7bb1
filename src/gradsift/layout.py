"""Which parameters a DDP bucket holds, as the parts the hook exchanges.

Parameters are numbered once, in ``module.parameters()`` order; the numbers are the
stable keys of all per-tensor state (they do not depend on the bucket a parameter
lands in, nor on the process). A bucket is cut into parts: the whole bucket, keyed by
the sorted tuple of its parameter numbers (``granularity="bucket"``), or one part per
parameter, keyed by its number (``"layer"``). Each part's layout (the order of its
parameters in the flat tensor) is declared to the state store, which re-lays stored
state when DDP rebuilds its buckets. :meth:`ParameterLayout.trip` builds, once per
bucket and step, the parts and the one frozen :class:`~gradsift.exchanges.Context`
their exchange takes.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch

from gradsift.errors import InvalidOptionError
from gradsift.exchanges.base import Context, Part
from gradsift.readout import Readout
from gradsift.state import TensorStore
from gradsift.telemetry import BucketRecord

GRANULARITIES = ("bucket", "layer")


class ParameterLayout:
    """Parameter numbers of one module and the parts of its DDP buckets."""

    def __init__(self) -> None:
        self.numbers: dict[int, int] = {}
        self.numels: dict[int, int] = {}

    def bind(self, module: torch.nn.Module) -> None:
        """Number ``module``'s parameters (in ``parameters()`` order)."""
        params = list(module.parameters())
        self.numbers = {id(p): i for i, p in enumerate(params)}
        self.numels = {i: p.numel() for i, p in enumerate(params)}

    def numbers_of(self, bucket: Any) -> tuple[int, ...]:
        """The numbers of ``bucket``'s parameters, in the bucket's order."""
        try:
            return tuple(self.numbers[id(p)] for p in bucket.parameters())
        except KeyError:
            raise InvalidOptionError(
                "a DDP bucket holds a parameter of another module: register the hook on the model it runs"
            ) from None

    def parts(self, bucket: Any, granularity: str, store: TensorStore) -> list[Part]:
        """The parts of ``bucket`` (a ``GradBucket``), their layouts declared to ``store``."""
        params = list(bucket.parameters())
        ids = self.numbers_of(bucket)
        buffer = bucket.buffer()
        if granularity == "bucket":
            key = tuple(sorted(ids))
            store.follow(key, ids, self.numels)
            return [Part(key, 0, buffer, params)]
        parts, offset = [], 0
        for number, param in zip(ids, params, strict=True):
            parts.append(Part(number, offset, buffer[offset : offset + param.numel()], [param]))
            offset += param.numel()
        return parts

    def trip(
        self,
        bucket: Any,
        granularity: str,
        store: TensorStore,
        *,
        group: Any,
        world: int,
        rank: int,
        readout: Readout,
        step: int,
        capacity: Callable[[Hashable, int], int | None],
    ) -> tuple[list[Part], Context]:
        """The parts of ``bucket`` and the :class:`Context` of their trip (``capacity(key, numel)``
        gives each part's payload capacity)."""
        parts = self.parts(bucket, granularity, store)
        buffer = bucket.buffer()
        order = self.numbers_of(bucket)
        record = BucketRecord(dense_bytes=buffer.numel() * buffer.element_size(), elements=buffer.numel())
        capacities = {}
        for part in parts:
            room = capacity(part.key, part.numel)
            if room is not None:
                capacities[part.key] = room
        context = Context(
            group=group,
            world=world,
            rank=rank,
            result=buffer,
            record=record,
            readout=readout,
            store=store,
            key=tuple(sorted(order)),
            order=order,
            numels=self.numels,
            capacities=capacities,
            step=step,
            bucket=bucket,
        )
        return parts, context
