"""Which parameters a DDP bucket holds, as the parts the hook exchanges.

Parameters are numbered once, in ``module.parameters()`` order; the numbers are the
stable keys of all per-tensor state (they do not depend on the bucket a parameter
lands in, nor on the process). A bucket is cut into parts: the whole bucket, keyed by
the sorted tuple of its parameter numbers (``granularity="bucket"``), or one part per
parameter, keyed by its number (``"layer"``). Each part's layout (the order of its
parameters in the flat tensor) is declared to the state store, which re-lays stored
state when DDP rebuilds its buckets.

One exception to the whole bucket: a bucket the store holds no state for, whose parameters
the buckets it does hold state for cover in contiguous runs (:func:`saved_runs`), is cut
into those runs, each keyed as its bucket was. That is a resumed run's first step: DDP starts
it from its first bucketing again (in PyTorch 2.13 one bucket holding every parameter), while
the checkpoint's state was kept for the rebuilt buckets, so the step compresses the groups the
uninterrupted run compressed, with their own state.

A bucket is anything with DDP's ``GradBucket`` reading interface (:class:`BucketLike`);
the frontends without DDP buckets (an FSDP unit, a DiLoCo round) hand a
:class:`FlatBucket`.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from gradsift.core.errors import InvalidOptionError
from gradsift.core.parts import Part
from gradsift.core.store import TensorStore

GRANULARITIES = ("bucket", "layer")


class BucketLike(Protocol):
    """What the hook reads of a bucket: DDP's ``GradBucket`` interface, as far as it goes."""

    def buffer(self) -> torch.Tensor: ...  # the flat gradient; the mean is written over it

    def parameters(self) -> list[torch.Tensor]: ...  # its parameters, in flattening order

    def is_last(self) -> bool: ...  # the step's last bucket: the route closes the step


@dataclass
class FlatBucket:
    """A flat gradient handed to the hook as a bucket by a frontend without DDP buckets:
    an FSDP unit (one placeholder "parameter", not the step's last), a DiLoCo round (every
    trainable parameter, always the last). :meth:`gradients` gives the per-parameter views
    that a delegated compressor (PowerSGD) reads, as ``GradBucket.gradients()`` does."""

    flat: torch.Tensor
    params: list[torch.Tensor]
    last: bool = False

    def buffer(self) -> torch.Tensor:
        return self.flat

    def parameters(self) -> list[torch.Tensor]:
        return self.params

    def gradients(self) -> list[torch.Tensor]:
        return list(self.flat.split([p.numel() for p in self.params]))

    def is_last(self) -> bool:
        return self.last

    def index(self) -> int:
        return 0


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

    def numbers_of(self, bucket: BucketLike) -> tuple[int, ...]:
        """The numbers of ``bucket``'s parameters, in the bucket's order."""
        try:
            return tuple(self.numbers[id(p)] for p in bucket.parameters())
        except KeyError:
            raise InvalidOptionError(
                "a DDP bucket holds a parameter of another module: register the hook on the model it runs"
            ) from None

    def parts(
        self, bucket: BucketLike, granularity: str, store: TensorStore, regroup: bool = True
    ) -> tuple[list[Part], tuple[int, ...]]:
        """The parts of ``bucket``, their layouts declared to ``store``, and the bucket's
        parameter numbers in its flat order. ``regroup``: a bucket may be cut into the
        buckets of the stored state (module docstring; False for an exchange that takes
        whole buckets)."""
        params = list(bucket.parameters())
        ids = self.numbers_of(bucket)
        buffer = bucket.buffer()
        runs: list[tuple[int, ...]]
        keys: list[int | tuple[int, ...]]
        if granularity == "layer":
            runs, keys = [(number,) for number in ids], list(ids)
        else:
            whole = tuple(sorted(ids))
            cut = (
                saved_runs(ids, store.layouts, self.numels)
                if regroup and whole not in store.layouts
                else None
            )
            runs, keys = (cut, [tuple(sorted(run)) for run in cut]) if cut else ([ids], [whole])
        by_number = dict(zip(ids, params, strict=True))
        parts, offset = [], 0
        for run, key in zip(runs, keys, strict=True):
            numel = sum(self.numels[i] for i in run)
            if granularity == "bucket":
                store.follow(key, run, self.numels)
            flat = buffer if numel == buffer.numel() else buffer[offset : offset + numel]
            parts.append(Part(key, offset, flat, [by_number[i] for i in run]))
            offset += numel
        return parts, ids


def saved_runs(
    ids: tuple[int, ...], layouts: Mapping[Hashable, tuple[int, ...]], numels: Mapping[int, int]
) -> list[tuple[int, ...]] | None:
    """``ids`` (a bucket's parameter numbers, in its order) cut into contiguous runs, one per
    bucket key of ``layouts`` (a store's: sorted tuples of numbers), when two or more of those
    keys cover it exactly, each in one run; None otherwise (the bucket stays whole; the caller
    keeps a bucket that is one of the keys whole before asking). A parameter of no elements
    (``numels[i] == 0``) takes no room in the flat bucket, so wherever it lies it joins its
    key's run (a key of such parameters alone is a run of its own, last)."""
    members = set(ids)
    owner = {i: key for key in layouts if isinstance(key, tuple) and members.issuperset(key) for i in key}
    if owner.keys() != members:
        return None
    runs: list[list[int]] = []
    for number in (i for i in ids if numels[i]):
        if runs and owner[runs[-1][0]] == owner[number]:
            runs[-1].append(number)
        else:
            runs.append([number])
    run_of = {owner[run[0]]: run for run in runs}
    for number in (i for i in ids if not numels[i]):
        if owner[number] not in run_of:
            runs.append(run_of.setdefault(owner[number], []))
        run_of[owner[number]].append(number)
    keys = [owner[run[0]] for run in runs]
    if (
        len(runs) < 2
        or len(set(keys)) != len(runs)
        or any(len(run) != len(key) for run, key in zip(runs, keys, strict=True))
    ):
        return None
    return [tuple(run) for run in runs]
