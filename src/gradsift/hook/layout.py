"""Which parameters a DDP bucket holds, as the parts the hook exchanges.

Parameters are numbered once, in ``module.parameters()`` order; the numbers are the
stable keys of all per-tensor state (they do not depend on the bucket a parameter
lands in, nor on the process). A bucket is cut into parts: the whole bucket, keyed by
the sorted tuple of its parameter numbers (``granularity="bucket"``), or one part per
parameter, keyed by its number (``"layer"``). Each part's layout (the order of its
parameters in the flat tensor) is declared to the state store, which re-lays stored
state when DDP rebuilds its buckets.

One exception to the whole bucket: a bucket the store holds no state for, whose parameters
the buckets it does hold state for cover (:func:`saved_runs`), is cut into those buckets'
runs, each keyed as its bucket was. That is a resumed run's first step: DDP starts it from its
first bucketing again (in PyTorch 2.13 one bucket holding every parameter), while the
checkpoint's state was kept for the rebuilt buckets, so the step compresses the groups the
uninterrupted run compressed, with their own state. The route hands the parts a copy of the
bucket laid out as the saved buckets were, each one's parameters together in its saved order
(:meth:`ParameterLayout.parts`), and lays the mean back in DDP's order
(:meth:`Grouped.laid_back`): so the compressors see what they saw in the uninterrupted run,
ties among equal magnitudes included, also where a saved bucket's parameters lie apart in
the bucket (a compiled model's backward readies its gradients in another order; under
``static_graph`` DDP rebuilds with the unused parameters last, so the last saved bucket holds
the first parameters by number and the unused ones).

A bucket is anything with DDP's ``GradBucket`` reading interface (:class:`BucketLike`);
the frontends without DDP buckets (an FSDP unit, a DiLoCo round) hand a
:class:`FlatBucket`.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import torch

from gradsift.core.bucket_order import memory_order
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


@dataclass
class Grouped(FlatBucket):
    """A copy of a bucket's flat gradient with its parameters in another order
    (:meth:`ParameterLayout.parts`); ``numels``: the parameters' sizes in the bucket's order,
    ``back``: the bucket's place of each grouped parameter."""

    numels: list[int] = field(default_factory=list)
    back: list[int] = field(default_factory=list)

    def laid_back(self, mean: torch.Tensor) -> torch.Tensor:
        """``mean`` (in this order) in the bucket's order, a new tensor."""
        pieces = mean.split([self.numels[j] for j in self.back])
        order = sorted(range(len(self.back)), key=self.back.__getitem__)
        return torch.cat([pieces[i] for i in order])


class ParameterLayout:
    """Parameter numbers of one module and the parts of its DDP buckets."""

    def __init__(self) -> None:
        self.numbers: dict[int, int] = {}
        self.numels: dict[int, int] = {}
        #: Per parameter number, the memory order DDP's bucket holds it in, where not row-major.
        self.orders: dict[int, list[int]] = {}
        #: The numbered parameters, in number order.
        self.params: list[torch.nn.Parameter] = []

    def bind(self, module: torch.nn.Module, ignored: Collection[str] = ()) -> None:
        """Number ``module``'s parameters (in ``parameters()`` order) but those named in ``ignored``
        (DDP's ``parameters_to_ignore``: it never exchanges them, so nothing of theirs is the hook's)."""
        self.params = params = [p for name, p in module.named_parameters() if name not in ignored]
        self.numbers = {id(p): i for i, p in enumerate(params)}
        self.numels = {i: p.numel() for i, p in enumerate(params)}
        self.orders = {i: order for i, p in enumerate(params) if (order := memory_order(p)) is not None}

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
    ) -> tuple[list[Part], tuple[int, ...], BucketLike]:
        """The parts of ``bucket``, their layouts declared to ``store``, the parameter numbers in
        the flat order of the bucket they slice, and that bucket: ``bucket`` itself, or where it
        is cut into saved buckets laid out otherwise than they were saved (apart, or in another
        order), a :class:`Grouped` copy holding each one's parameters together in its saved
        order (module docstring). ``regroup``: a bucket may be cut into the buckets of the
        stored state (False for an exchange that takes whole buckets)."""
        ids = self.numbers_of(bucket)
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
            as_saved = [store.layouts[key] for key in keys] if cut else []
            if cut and _with_elements(as_saved, self.numels) != _with_elements(cut, self.numels):
                order = tuple(i for run in as_saved for i in run)
                bucket, runs, ids = self._grouped(bucket, ids, order), as_saved, order
        buffer, by_number = bucket.buffer(), dict(zip(ids, bucket.parameters(), strict=True))
        parts, offset = [], 0
        for run, key in zip(runs, keys, strict=True):
            numel = sum(self.numels[i] for i in run)
            if granularity == "bucket":
                store.follow(key, run, self.numels)
            flat = buffer if numel == buffer.numel() else buffer[offset : offset + numel]
            parts.append(Part(key, offset, flat, [by_number[i] for i in run]))
            offset += numel
        return parts, ids, bucket

    def _grouped(self, bucket: BucketLike, ids: tuple[int, ...], order: tuple[int, ...]) -> Grouped:
        """A copy of ``bucket`` (parameters ``ids``) with its parameters in ``order``."""
        place = {number: j for j, number in enumerate(ids)}
        back = [place[i] for i in order]
        numels = [self.numels[i] for i in ids]
        pieces, params = bucket.buffer().split(numels), list(bucket.parameters())
        return Grouped(
            torch.cat([pieces[j] for j in back]), [params[j] for j in back], bucket.is_last(), numels, back
        )


def _with_elements(runs: list[tuple[int, ...]], numels: Mapping[int, int]) -> list[int]:
    """The parameters of ``runs`` in order, but those of no elements (they take no room)."""
    return [i for run in runs for i in run if numels[i]]


def saved_runs(
    ids: tuple[int, ...], layouts: Mapping[Hashable, tuple[int, ...]], numels: Mapping[int, int]
) -> list[tuple[int, ...]] | None:
    """``ids`` (a bucket's parameter numbers, in its order) cut into runs, one per bucket key of
    ``layouts`` (a store's: sorted tuples of numbers), when two or more of those keys cover it
    exactly; None otherwise (the bucket stays whole; the caller keeps a bucket that is one of
    the keys whole before asking). A run holds its key's parameters in the bucket's order; the
    runs come in the order of their first parameter with elements in the bucket, so they lie
    together in it unless a key's parameters lie apart (then :meth:`ParameterLayout.parts`
    regroups the bucket first). A parameter of no elements (``numels[i] == 0``) takes no room
    in the flat bucket, so wherever it lies it joins its key's run (a key of such parameters
    alone is a run of its own, last)."""
    members = set(ids)
    owner = {i: key for key in layouts if isinstance(key, tuple) and members.issuperset(key) for i in key}
    if owner.keys() != members:
        return None
    runs: dict[Hashable, list[int]] = {}
    for number in sorted(ids, key=lambda i: not numels[i]):  # stable: with elements first
        runs.setdefault(owner[number], []).append(number)
    if len(runs) < 2 or any(len(run) != len(key) for key, run in runs.items()):  # type: ignore[arg-type]
        return None
    return [tuple(run) for run in runs.values()]
