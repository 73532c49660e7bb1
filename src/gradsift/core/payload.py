"""The payload: what one worker contributes for one flat gradient, and its wire sizes.

A compressor (:mod:`gradsift.compressors`) produces a :class:`Payload`; an exchange
(:mod:`gradsift.exchanges`) frames it (:mod:`gradsift.core.wire`), moves it and hands
the payloads that arrive back to the compressor to decode. Its byte counts
(:attr:`Payload.nbytes`, :meth:`Payload.used_nbytes`) are the telemetry's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from gradsift.core.store import Canonical

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
            parameters in number order, :class:`gradsift.core.store.Canonical`) instead of the
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


def index_dtype(numel: int) -> torch.dtype:
    """Wire dtype of positions into a ``numel``-element tensor: int32 when they all fit, else int64."""
    return torch.int32 if numel <= INT32_LIMIT else torch.int64
