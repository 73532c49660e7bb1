"""The compressor protocol and the payload it produces.

A compressor turns one flat gradient into a :class:`Payload` and a list of payloads, one
per worker, back into the dense mean (``decompress``). It never talks to the network and
never keeps error-feedback residuals: those are :mod:`gradsift.feedback`'s job.
Per-tensor state (stage counts, thresholds, RNG streams) is kept per ``key`` inside the
compressor *instance* and exported with ``state_dict()`` -- never in class attributes or
module globals.

Two ways in, one implementation:

* :meth:`Compressor.encode` is the hot path the DDP hook takes. It never reads a tensor
  on the host (on a GPU that would stall the device during backward): its payload has a
  **fixed capacity** known from the options (``capacity`` entries, the unused ones
  padding at index 0 with value 0, so every additive use of a padded payload ignores
  them), the number of entries in use is a device scalar (:attr:`Payload.length`), and
  whether the input held NaN/Inf is a device flag (:attr:`Payload.nonfinite`). Facts the
  compressor needs on the host later (SIDCo's stage choice) go through the step's
  :class:`~gradsift.readout.Readout`, read once when the step closes.
* :meth:`Compressor.compress` is the public call: the same ``encode`` with no capacity
  (every selected element, exactly), then one host read that raises
  :class:`~gradsift.errors.NonFiniteGradientError` for a non-finite input and applies
  the compressor's adaptation.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

import torch

from gradsift.errors import InvalidOptionError, NonFiniteGradientError
from gradsift.readout import Readout
from gradsift.state import Canonical, TensorStore
from gradsift.validation import as_flat_gradient, check_ratio

#: Bytes of the length word the wire format sends for every variable-size payload.
FIELD_HEADER_NBYTES = 4

#: Largest position an int32 index can hold; longer tensors send int64 indices.
INT32_LIMIT = 2**31 - 1

_WIRE_FIELDS = ("values", "indices", "codes", "scales")

#: A count: a host int when the compressor knows it without looking at the data, else a
#: 0-d integer tensor on the data's device.
Count = int | torch.Tensor


@dataclass
class Payload:
    """What one worker contributes for one flat gradient.

    Attributes:
        numel: length of the dense gradient this payload encodes.
        dtype: dtype of that dense gradient (``decompress`` returns it).
        values: sent values (sparsifiers: ``values[j]`` belongs at ``indices[j]``).
        indices: 1-D integer positions in ``[0, numel)``, strictly increasing over the
            entries in use.
        codes: packed integer codes (quantizers, VGC's 32-bit words).
        scales: a small 1-D float tensor of per-message scalars (norms, scales).
        variable_size: True when the payload's entries in use vary (sparsifiers, VGC):
            the wire then sends one 4-byte length with it; False for payloads whose size
            depends on ``numel`` only (dense casts, seeded random-k, the quantizers).
        length: entries in use of a fixed-capacity payload (the first ``length`` of
            ``values``/``indices``/``codes``; the rest is padding: index 0, value 0);
            None when every entry is in use.
        demand: entries the compressor would have sent without the capacity (>= length;
            the rest stayed in the residual); None when it equals ``length``.
        nonfinite: 0-d bool tensor, True when the input held NaN or Inf; None for
            payloads whose values carry every element (dense casts), so that a NaN
            reaches the receivers by itself.
        info: local facts about the compression (not sent), e.g. the threshold used.
        canonical: set when the encoded elements lie in canonical order (a DDP bucket's
            parameters in number order, :class:`gradsift.state.Canonical`) instead of the
            tensor's: decoding lays them back with it. Not sent: the canonical order
            does not depend on a worker's bucket layout, and a received payload keeps
            the one of this worker's own (its template), so the mean lands in this
            worker's layout. None: the elements lie as in the tensor.
    """

    numel: int
    dtype: torch.dtype
    values: torch.Tensor | None = None
    indices: torch.Tensor | None = None
    codes: torch.Tensor | None = None
    scales: torch.Tensor | None = None
    variable_size: bool = True
    length: Count | None = None
    demand: Count | None = None
    nonfinite: torch.Tensor | None = None
    info: dict[str, Any] = field(default_factory=dict)
    canonical: Canonical | None = field(default=None, repr=False, compare=False)

    def fields(self) -> dict[str, torch.Tensor]:
        """The tensors that cross the wire, by field name, in a fixed order."""
        return {name: t for name in _WIRE_FIELDS if (t := getattr(self, name)) is not None}

    @property
    def header_nbytes(self) -> int:
        """Bytes of framing the wire format adds: one length word for a variable-size payload."""
        return FIELD_HEADER_NBYTES if self.variable_size else 0

    @property
    def capacity(self) -> int:
        """Entries the payload has room for (all of them are sent, padding included)."""
        if self.indices is not None:
            return self.indices.numel()
        return self.numel if self.values is None else self.values.numel()

    @property
    def nbytes(self) -> int:
        """Bytes this payload puts on the wire: every field at its size (a fixed-capacity
        payload's padding included) plus its header.

        Indices are counted at their wire width, :func:`index_dtype` of ``numel``
        (int32 below 2^31 elements), whatever dtype the compressor produced them in.
        """
        fields = self.fields()
        data = sum(t.numel() * t.element_size() for name, t in fields.items() if name != "indices")
        if "indices" in fields:
            data += fields["indices"].numel() * index_dtype(self.numel).itemsize
        return data + self.header_nbytes

    def entry_nbytes(self) -> int:
        """Bytes of one entry in use (a value and its index): what ``length`` counts."""
        size = 0 if self.values is None else self.values.element_size()
        return size + (index_dtype(self.numel).itemsize if self.indices is not None else 0)

    def entries(self) -> Count:
        """Entries in use: ``length``, or every entry (a dense payload's: every element)."""
        return self.capacity if self.length is None else self.length

    def used_nbytes(self) -> Count:
        """Bytes of the entries in use plus the header: :attr:`nbytes` without the padding
        (a device scalar for a payload whose ``length`` is one)."""
        if self.length is None:
            return self.nbytes
        padding_entries = self.capacity - self.length
        return self.nbytes - padding_entries * self.entry_nbytes()

    @property
    def count(self) -> int:
        """Number of selected (or encoded) elements; reads ``length`` on the host if it is a tensor."""
        if self.length is not None:
            return int(self.length)
        if self.indices is not None:
            return int(self.indices.numel())
        return self.numel

    def trimmed(self) -> Payload:
        """The payload without padding (one host read of ``length``); itself when unpadded."""
        if self.length is None:
            return self
        used = int(self.length)
        cut = {name: t[:used] for name in ("values", "indices") if (t := getattr(self, name)) is not None}
        return dataclasses.replace(self, **cut, length=None)


class Compressor(abc.ABC):
    """Base class of every registered compressor.

    Subclasses set ``name`` and implement :meth:`encode` and :meth:`decompress`.

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
            runs stock DDP's in-place allreduce on the bucket.
        needs_parameters: the method needs to know which parameters a flat tensor
            holds (VGC reads their per-sample variance); the DDP hook then calls
            ``encode(tensor, key=..., parameters=[p, ...])`` with the parameters in
            flattening order.
        adaptive_capacity: the number of entries the method sends follows the data,
            with no ratio to bound it (a fixed threshold, VGC): the DDP hook then sizes
            the payload from the counts of earlier steps (:mod:`gradsift.capacity`).

    Example (docs/extending.md writes a new one, end to end)::

        compressor = gradsift.get_compressor("topk", ratio=0.01)
        payload = compressor.compress(gradient)  # the 1% largest |g|: payload.indices, payload.values
        mean = compressor.decompress([payload, other_payload], gradient.numel())  # the dense mean
    """

    name: ClassVar[str]
    exchanges: ClassVar[tuple[str, ...]] = ("allgather",)
    error_feedback: bool = True  # a class default an instance may override (PowerSGD)
    needs_parameters: ClassVar[bool] = False
    identity: ClassVar[bool] = False
    adaptive_capacity: ClassVar[bool] = False

    def attach(self, module: torch.nn.Module) -> None:
        """Instrument the model before training (VGC installs its variance hooks).

        Called once by the DDP hook with the wrapped module; the default does nothing.
        """
        del module

    def options(self) -> dict[str, Any]:
        """The options this instance was built with (for summaries and reports)."""
        return {}

    def capacity(self, numel: int) -> int | None:
        """Entries a fixed-capacity payload of a ``numel``-element tensor has room for
        (the first step's, for an adaptive-capacity method); None: the payload's size
        depends on ``numel`` only."""
        del numel
        return None

    @abc.abstractmethod
    def encode(
        self, flat: torch.Tensor, *, key: Hashable, capacity: int | None, readout: Readout, **extra: Any
    ) -> Payload:
        """Compress the 1-D floating-point ``flat`` without reading any tensor on the host.

        ``capacity`` (from :meth:`capacity`, or None for an exact payload) bounds the
        entries; ``key`` names the tensor so that per-tensor state is kept apart;
        ``readout`` receives what the compressor needs on the host once the step closes.
        """

    def compress(self, tensor: torch.Tensor, *, key: Hashable = 0, **extra: Any) -> Payload:
        """Compress one gradient (any shape; flattened) into an exact payload: the method as
        its paper defines it, with no capacity (under the DDP hook a threshold method's
        selection beyond the payload's capacity is cut to its largest entries).

        Raises :class:`NonFiniteGradientError` when ``tensor`` holds NaN or Inf (the
        compressor's state then stays as it was).
        """
        flat = as_flat_gradient(tensor)
        readout = Readout()
        store = self.store
        owned = not store.in_transaction
        if owned:
            store.begin()
        before = self.snapshot()
        payload = self.encode(flat, key=key, capacity=None, readout=readout, **extra)
        flag = payload.nonfinite
        if flag is None and payload.values is not None:
            flag = ~torch.isfinite(payload.values.sum(dtype=torch.float64))
        checked = None if flag is None else readout.slot(flag)
        readout.read()
        if checked is not None and checked[0]:
            if owned:
                store.rollback()
            self.restore(before)
            raise NonFiniteGradientError("gradient contains NaN or Inf values")
        if owned:
            store.commit()
        readout.commit()
        return payload.trimmed()

    @abc.abstractmethod
    def decompress(self, payloads: Sequence[Payload], numel: int) -> torch.Tensor:
        """Return the mean over ``payloads`` as a dense 1-D tensor of length ``numel``."""

    def decompress_into(self, payloads: Sequence[Payload], out: torch.Tensor) -> torch.Tensor | None:
        """Write the mean over ``payloads`` (as received) into ``out`` (1-D, ``numel`` elements).

        What the DDP hook calls, with ``out`` a view of the bucket's result, and without
        a host read: the default copies :meth:`decompress`; sparsifiers scatter straight
        into ``out``. Returns a 0-d bool device flag when a payload breaks the
        compressor's own encoding rules beyond what the wire checks (None: nothing to
        check); decoding stays safe whatever the flag says, and the hook drops the step.
        """
        out.copy_(self.decompress(payloads, out.numel()))
        return None

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


class Selection(NamedTuple):
    """What a sparsifier's :meth:`Sparsifier.select` found.

    Attributes:
        indices: int64 positions, strictly increasing over the first ``length``; with a
            capacity, exactly that many entries, the unused ones 0.
        length: entries in use (None: all of ``indices``).
        nonfinite: 0-d bool, True when the input held NaN or Inf.
        demand: entries selected before the capacity cut (None: ``length``).
    """

    indices: torch.Tensor
    length: Count | None
    nonfinite: torch.Tensor
    demand: Count | None = None


def in_use(capacity: int, length: Count | None, device: torch.device) -> torch.Tensor | None:
    """Mask of the entries in use of a ``capacity``-entry payload (None: all of them)."""
    if length is None or (isinstance(length, int) and length >= capacity):
        return None
    return torch.arange(capacity, device=device) < length


class Sparsifier(Compressor):
    """A compressor that sends ``(values, indices)`` of selected elements.

    Subclasses implement :meth:`select`. This class handles the empty tensor, gathering
    the values (zero at padding), the payload layout and the aggregation
    ``mean_w scatter_add(indices_w, values_w)`` (``index_add_``, so indices repeated
    across workers add up instead of being dropped; padding adds zero at index 0).

    The capacity of a sparsifier with a ``ratio`` is ``k = max(1, floor(n ratio))``:
    the ratio is the wire budget, and a threshold method that selects more sends the
    ``k`` largest of them (:func:`gradsift.kernels.keep_largest`), the rest waiting in
    error feedback.
    """

    exchanges: ClassVar[tuple[str, ...]] = ("allgather", "balanced", "shared-mask")

    def __init__(self, ratio: float = 0.01) -> None:
        self.ratio = check_ratio(ratio)

    def options(self) -> dict[str, Any]:
        return {"ratio": self.ratio}

    def capacity(self, numel: int) -> int | None:
        return target_count(numel, self.ratio)

    @abc.abstractmethod
    def select(self, flat: torch.Tensor, key: Hashable, capacity: int | None, readout: Readout) -> Selection:
        """The elements to send of the non-empty flat gradient ``flat`` (at most ``capacity``)."""

    def encode(
        self, flat: torch.Tensor, *, key: Hashable, capacity: int | None, readout: Readout, **extra: Any
    ) -> Payload:
        if extra:
            raise InvalidOptionError(f"{self.name} takes no {', '.join(sorted(extra))}")
        if flat.numel() == 0:
            empty = torch.zeros(0, dtype=torch.int64, device=flat.device)
            selection = Selection(empty, None, torch.zeros((), dtype=torch.bool, device=flat.device))
        else:
            selection = self.select(flat, key, capacity, readout)
        values = flat.index_select(0, selection.indices)
        used = in_use(values.numel(), selection.length, flat.device)
        if used is not None:
            values = torch.where(used, values, 0)
        return Payload(
            numel=flat.numel(),
            dtype=flat.dtype,
            values=values,
            indices=selection.indices,
            length=selection.length,
            demand=selection.demand,
            nonfinite=selection.nonfinite,
        )

    def decompress(self, payloads: Sequence[Payload], numel: int) -> torch.Tensor:
        return scatter_mean(payloads, numel)

    def decompress_into(self, payloads: Sequence[Payload], out: torch.Tensor) -> torch.Tensor | None:
        if type(self).decompress is not Sparsifier.decompress:  # a subclass decodes its own way
            return super().decompress_into(payloads, out)
        scatter_mean(payloads, out.numel(), out=out)
        return None

    def sent_dense(self, payload: Payload) -> torch.Tensor:
        return scatter_mean([payload], payload.numel)


def scatter_mean(payloads: Sequence[Payload], numel: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Dense mean of sparse payloads: ``(1/W) sum_w scatter_add(indices_w, values_w)``.

    Uses ``index_add_`` so an index sent by several workers accumulates every value
    (padding entries add zero at index 0). The result has the payloads' dtype and
    device; with ``out`` (``numel`` elements) it is written there, in place, and
    returned (summed in the payloads' dtype, then cast, when ``out`` has another one).
    """
    if not payloads:
        raise InvalidOptionError("payloads must hold at least one payload")
    first = payloads[0]
    if out is not None and out.numel() != numel:
        raise InvalidOptionError(f"out holds {out.numel()} elements; the payloads decode to {numel}")
    if out is not None and out.dtype != first.dtype:  # a bf16 bucket of fp32 payloads: sum in fp32
        return out.copy_(scatter_mean(payloads, numel))
    for payload in payloads:
        if payload.numel != numel:
            raise InvalidOptionError(f"payload encodes {payload.numel} elements, expected numel={numel}")
        if payload.indices is None or payload.values is None:
            raise InvalidOptionError("scatter_mean needs sparse payloads: each with indices and values")
    values = [p.values for p in payloads if p.values is not None]
    indices = [p.indices for p in payloads if p.indices is not None]
    joined_values = values[0] if len(values) == 1 else torch.cat([v.to(first.dtype) for v in values])
    joined_indices = indices[0] if len(indices) == 1 else torch.cat(indices)
    dense = torch.zeros(numel, dtype=first.dtype, device=joined_values.device) if out is None else out.zero_()
    dense.index_add_(0, joined_indices, joined_values.to(first.dtype))
    if len(payloads) > 1:
        dense /= len(payloads)
    return dense
