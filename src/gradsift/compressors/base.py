"""The compressor protocol and the payload it produces.

A compressor turns one flat gradient into a :class:`Payload` (``compress``) and a
list of payloads, one per worker, back into the dense mean (``decompress``). It
never talks to the network and never keeps error-feedback residuals: those are
:mod:`gradsift.feedback`'s job. Per-tensor state (stage counts, thresholds, RNG
streams) is kept per ``key`` inside the compressor *instance* and exported with
``state_dict()`` -- never in class attributes or module globals.
"""

from __future__ import annotations

import abc
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from gradsift.errors import InvalidOptionError
from gradsift.state import TensorStore
from gradsift.validation import as_flat_gradient, check_ratio

#: Bytes of the length header the wire format sends for every variable-size field.
FIELD_HEADER_NBYTES = 4

#: Largest position an int32 index can hold; longer tensors send int64 indices.
INT32_LIMIT = 2**31 - 1

_WIRE_FIELDS = ("values", "indices", "codes", "scales")


@dataclass
class Payload:
    """What one worker contributes for one flat gradient.

    Attributes:
        numel: length of the dense gradient this payload encodes.
        dtype: dtype of that dense gradient (``decompress`` returns it).
        values: sent values (sparsifiers: ``values[j]`` belongs at ``indices[j]``).
        indices: 1-D integer positions in ``[0, numel)``, unique within a payload.
        codes: packed integer codes (quantizers, VGC's 32-bit words).
        scales: a small 1-D float tensor of per-message scalars (norms, scales).
        variable_size: True when the payload travels by allgather, whose framing
            carries a 4-byte length per field (lengths may differ between workers,
            and the hook's non-finite flag rides in them); False for payloads that
            go through a plain allreduce (dense casts, seeded random-k).
        info: local facts about the compression (not sent), e.g. the threshold used.
    """

    numel: int
    dtype: torch.dtype
    values: torch.Tensor | None = None
    indices: torch.Tensor | None = None
    codes: torch.Tensor | None = None
    scales: torch.Tensor | None = None
    variable_size: bool = True
    info: dict[str, Any] = field(default_factory=dict)

    def fields(self) -> dict[str, torch.Tensor]:
        """The tensors that cross the wire, by field name, in a fixed order."""
        return {name: t for name in _WIRE_FIELDS if (t := getattr(self, name)) is not None}

    @property
    def header_nbytes(self) -> int:
        """Bytes of framing the wire format adds (one length per variable-size field)."""
        return FIELD_HEADER_NBYTES * len(self.fields()) if self.variable_size else 0

    @property
    def nbytes(self) -> int:
        """Exact bytes this payload puts on the wire: data plus headers.

        Indices are counted at their wire width, :func:`index_dtype` of ``numel``
        (int32 below 2^31 elements), whatever dtype the compressor produced them in.
        """
        fields = self.fields()
        data = sum(t.numel() * t.element_size() for name, t in fields.items() if name != "indices")
        if "indices" in fields:
            data += fields["indices"].numel() * index_dtype(self.numel).itemsize
        return data + self.header_nbytes

    @property
    def count(self) -> int:
        """Number of selected elements (sparsifiers) or encoded elements."""
        if self.indices is not None:
            return int(self.indices.numel())
        return self.numel


class Compressor(abc.ABC):
    """Base class of every registered compressor.

    Subclasses set ``name`` and implement :meth:`compress` and :meth:`decompress`.

    Class attributes describe how the method is used, not state:
        exchanges: the exchanges (:mod:`gradsift.exchanges`) its payloads can travel
            by, its default first: ``"allgather"`` for payloads whose size or positions
            differ between workers, ``"allreduce"`` for payloads every worker lays out
            alike (dense casts, seeded random-k: summed element-wise), ``"delegated"``
            for a method that runs its own collectives (PowerSGD).
        error_feedback: whether the method is meant to run with error feedback
            (biased compressors); the DDP hook wraps it with
            :class:`gradsift.feedback.ErrorFeedback` when True.
        identity: the payload is the gradient itself (``none``), so the DDP hook
            runs stock DDP's in-place allreduce on the bucket instead of the
            compress/exchange/decompress path.
        needs_parameters: the method needs to know which parameters a flat tensor
            holds (VGC reads their per-sample variance); the DDP hook then calls
            ``compress(tensor, key=..., parameters=[p, ...])`` with the parameters in
            flattening order.
    """

    name: ClassVar[str]
    exchanges: ClassVar[tuple[str, ...]] = ("allgather",)
    error_feedback: bool = True  # a class default an instance may override (PowerSGD)
    needs_parameters: ClassVar[bool] = False
    identity: ClassVar[bool] = False

    def attach(self, module: torch.nn.Module) -> None:
        """Instrument the model before training (VGC installs its variance hooks).

        Called once by the DDP hook with the wrapped module; the default does nothing.
        """
        del module

    def options(self) -> dict[str, Any]:
        """The options this instance was built with (for summaries and reports)."""
        return {}

    @abc.abstractmethod
    def compress(self, tensor: torch.Tensor, *, key: Hashable = 0) -> Payload:
        """Compress one gradient (any shape; flattened) into a payload.

        ``key`` names the tensor (a bucket index, a parameter name) so that
        per-tensor adaptation state is kept apart.
        """

    @abc.abstractmethod
    def decompress(self, payloads: Sequence[Payload], numel: int) -> torch.Tensor:
        """Return the mean over ``payloads`` as a dense 1-D tensor of length ``numel``."""

    def decompress_into(self, payloads: Sequence[Payload], out: torch.Tensor) -> None:
        """Write the mean over ``payloads`` into ``out`` (1-D, ``numel`` elements), in place.

        What the DDP hook calls, with ``out`` a view of the bucket's result: the default
        copies :meth:`decompress`; sparsifiers scatter straight into ``out``.
        """
        out.copy_(self.decompress(payloads, out.numel()))

    def sent_dense(self, payload: Payload) -> torch.Tensor:
        """The dense tensor this worker's payload stands for (its own contribution).

        Error feedback subtracts it from the compensated gradient. The default
        decodes the single payload; sparsifiers override it with a scatter.
        """
        return self.decompress([payload], payload.numel)

    def state_dict(self) -> dict[str, Any]:
        """Per-tensor adaptation state, as plain tensors and numbers."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        if state:
            raise InvalidOptionError(f"{self.name} keeps no state, got keys {sorted(state)}")

    def snapshot(self) -> dict[str, Any]:
        r"""The state to return to if the step now starting is dropped (default: ``state_dict()``).

        The DDP hook takes one at the start of every step and :meth:`restore`\ s it when
        the step is dropped (a non-finite gradient on some rank), so it must be cheap:
        per-tensor state of the size of a gradient belongs in the shared
        :class:`~gradsift.state.TensorStore` (:attr:`store`), which rolls back for free.
        """
        return self.state_dict()

    def restore(self, snapshot: dict[str, Any]) -> None:
        """Return to a :meth:`snapshot` (default: ``load_state_dict``)."""
        self.load_state_dict(snapshot)

    @property
    def store(self) -> TensorStore:
        """Where per-tensor state of gradient size lives: the DDP hook's shared store once
        :meth:`bind_store` was called, else a store of this instance's own."""
        store = self.__dict__.get("_store")
        if store is None:
            store = self.__dict__["_store"] = TensorStore()
        return store

    def bind_store(self, store: TensorStore) -> None:
        """Keep per-tensor state in ``store`` (the DDP hook's, which checkpoints and rolls it back)."""
        self.__dict__["_store"] = store
        self.__dict__["_store_shared"] = True

    @property
    def owns_store(self) -> bool:
        """True until :meth:`bind_store`: the store's content is then part of :meth:`state_dict`."""
        return not self.__dict__.get("_store_shared", False)

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options().items())
        return f"{type(self).__name__}({opts})"


def index_dtype(numel: int) -> torch.dtype:
    """Wire dtype of positions into a ``numel``-element tensor: int32 when they all fit, else int64."""
    return torch.int32 if numel <= INT32_LIMIT else torch.int64


def target_count(numel: int, ratio: float) -> int:
    """Target number of selected elements: ``k = max(1, floor(numel * ratio))`` (0 if empty)."""
    if numel == 0:
        return 0
    return max(1, int(numel * ratio))


class Sparsifier(Compressor):
    """A compressor that sends ``(values, indices)`` of selected elements.

    Subclasses implement :meth:`select`, returning the 1-D int64 indices to send.
    This class handles flattening, the empty tensor, gathering the values, the
    payload layout and the aggregation ``mean_w scatter_add(indices_w, values_w)``
    (``index_add_``, so indices repeated across workers add up instead of being
    dropped).
    """

    exchanges: ClassVar[tuple[str, ...]] = ("allgather", "balanced", "shared-mask")

    def __init__(self, ratio: float = 0.01) -> None:
        self.ratio = check_ratio(ratio)

    def options(self) -> dict[str, Any]:
        return {"ratio": self.ratio}

    @abc.abstractmethod
    def select(self, flat: torch.Tensor, key: Hashable) -> torch.Tensor:
        """Return the indices to send for the non-empty flat gradient ``flat``."""

    def compress(self, tensor: torch.Tensor, *, key: Hashable = 0) -> Payload:
        flat = as_flat_gradient(tensor)
        if flat.numel() == 0:
            indices = torch.empty(0, dtype=torch.int64, device=flat.device)
        else:
            indices = self.select(flat, key)
        return Payload(
            numel=flat.numel(),
            dtype=flat.dtype,
            values=flat.index_select(0, indices),
            indices=indices,
        )

    def decompress(self, payloads: Sequence[Payload], numel: int) -> torch.Tensor:
        return scatter_mean(payloads, numel)

    def decompress_into(self, payloads: Sequence[Payload], out: torch.Tensor) -> None:
        if type(self).decompress is not Sparsifier.decompress:  # a subclass decodes its own way
            super().decompress_into(payloads, out)
        else:
            scatter_mean(payloads, out.numel(), out=out)

    def sent_dense(self, payload: Payload) -> torch.Tensor:
        return scatter_mean([payload], payload.numel)


def scatter_mean(payloads: Sequence[Payload], numel: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Dense mean of sparse payloads: ``(1/W) sum_w scatter_add(indices_w, values_w)``.

    Uses ``index_add_`` so an index sent by several workers accumulates every value.
    The result has the payloads' dtype and device; with ``out`` (``numel`` elements of
    that dtype) it is written there, in place, and returned.
    """
    if not payloads:
        raise InvalidOptionError("payloads must hold at least one payload")
    first = payloads[0]
    if out is not None and (out.numel() != numel or out.dtype != first.dtype):
        raise InvalidOptionError(
            f"out holds {out.numel()} {out.dtype} elements; the payloads decode to {numel} {first.dtype}"
        )
    dense = None if out is None else out.zero_()
    for payload in payloads:
        if payload.numel != numel:
            raise InvalidOptionError(f"payload encodes {payload.numel} elements, expected numel={numel}")
        if payload.indices is None or payload.values is None:
            raise InvalidOptionError("scatter_mean needs sparse payloads: each with indices and values")
        if dense is None:
            dense = torch.zeros(numel, dtype=first.dtype, device=payload.values.device)
        dense.index_add_(0, payload.indices, payload.values.to(first.dtype))
    assert dense is not None  # payloads is not empty
    if len(payloads) > 1:
        dense /= len(payloads)
    return dense
