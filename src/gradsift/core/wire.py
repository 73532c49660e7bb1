"""Wire format: a bucket's payloads as one fixed-size message, and back.

A *message* is one worker's contribution for one DDP bucket: one payload per part
(``P`` parts), each with the fields of :meth:`Payload.fields` in their fixed order. Its
size is the same on every worker and known before any data exists -- a sparse
payload has a fixed capacity (:mod:`gradsift.compressors.base`) -- so it travels in a
single collective with no size exchange first. It is one byte buffer:

* a **header** of ``1 + 2P`` int32 words: the flags (bit 0 :data:`NONFINITE`: "my input
  held NaN or Inf", so the non-finite flag rides in the message at no extra round
  trip), then per part the entries in use (``length``) and the entries the compressor
  wanted to send (``demand``; an adaptive-capacity compressor sizes its next payloads
  from the largest, and from the mean in use when it bounds its padding). Both are the
  field's capacity for a payload without a length;
* per part, per field, the tensor at its full capacity, each starting on an 8-byte
  boundary: ``values`` in the chosen value dtype, ``indices`` as int32 (int64 only when
  ``numel > 2**31 - 1``) and strictly increasing over the entries in use (so a receiver
  checks uniqueness in one pass), ``codes`` and ``scales`` as the compressor made them.

:func:`to_wire` applies the dtype rules. ``p.nbytes`` counts every field at its
capacity plus the payload's 4-byte length word; the header's flag word is the
message's own 4 bytes (:attr:`MessageLayout.nbytes` adds the alignment padding).
:meth:`MessageLayout.unpack` checks what a peer could get wrong -- flags, lengths
beyond the capacity, indices out of range or not increasing -- on the device, reports
it as a per-sender flag, and turns every entry not in use or out of range into index 0
with value 0, so that decoding a malformed message writes nothing out of range (the
hook then drops the step and raises :class:`~gradsift.core.errors.WireFormatError`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gradsift.core.errors import InvalidOptionError
from gradsift.core.payload import Count, Payload, index_dtype

#: Header flag of a sender whose input held NaN or Inf.
NONFINITE = 1

HEADER_DTYPE = torch.int32
_ALIGN = 8

_VALUE_DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "fp16": torch.float16,
    "float16": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
}


def parse_value_dtype(value: object) -> torch.dtype | None:
    """Return the dtype named by ``value`` (fp32/fp16/bf16, or a torch dtype); None stays None."""
    if value is None:
        return None
    if isinstance(value, torch.dtype) and value in _VALUE_DTYPES.values():
        return value
    if isinstance(value, str) and value in _VALUE_DTYPES:
        return _VALUE_DTYPES[value]
    raise InvalidOptionError(f"value_dtype must be one of None, fp32, fp16, bf16; got {value!r}")


def to_wire(payload: Payload, value_dtype: torch.dtype | None = None) -> Payload:
    """The payload as it is sent: indices narrowed to their wire dtype, values cast to ``value_dtype``.

    Fields that already have the wire dtype are not copied (random-k's indices, which
    stay local, are left as they are).
    """
    values, indices = payload.values, payload.fields().get("indices")
    if indices is not None and indices.dtype != index_dtype(payload.numel):
        indices = indices.to(index_dtype(payload.numel))
    if value_dtype is not None and values is not None and values.dtype != value_dtype:
        values = values.to(value_dtype)
    if indices is None:
        indices = payload.indices
    if values is payload.values and indices is payload.indices:
        return payload
    return dataclasses.replace(payload, values=values, indices=indices)


def flagged(payload: Payload, nonfinite: torch.Tensor) -> Payload:
    """``payload`` with its non-finite flag replaced."""
    return dataclasses.replace(payload, nonfinite=nonfinite)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


@dataclass(frozen=True)
class FieldSlot:
    """Where one field of one part lies in a message."""

    part: int
    name: str
    dtype: torch.dtype
    count: int
    offset: int

    @property
    def nbytes(self) -> int:
        return self.count * self.dtype.itemsize


@dataclass(frozen=True)
class Received:
    """What :meth:`MessageLayout.unpack` found in the gathered messages.

    Attributes:
        payloads: ``payloads[w][p]``, worker ``w``'s payload for part ``p`` (views of the
            received buffer; entries not in use or out of range zeroed).
        malformed: ``[W]`` bool, worker ``w``'s message broke the format.
        nonfinite: 0-d bool, some worker flagged a non-finite input.
        demand: ``[P]`` int, per part the largest demand of any worker.
        used: ``[P]`` float, per part the mean over workers of the entries in use.
    """

    payloads: list[list[Payload]]
    malformed: torch.Tensor
    nonfinite: torch.Tensor
    demand: torch.Tensor
    used: torch.Tensor


class MessageLayout:
    """The byte layout of a message of ``templates`` (wire-form payloads, one per part).

    Every worker builds the same layout from its own payloads: capacities and dtypes
    follow from the options and the bucket, never from the data.
    """

    def __init__(self, templates: Sequence[Payload]) -> None:
        self.templates = list(templates)
        self.header_words = 1 + 2 * len(self.templates)
        offset = _aligned(self.header_words * HEADER_DTYPE.itemsize)
        slots = []
        for part, payload in enumerate(self.templates):
            for name, tensor in payload.fields().items():
                slots.append(FieldSlot(part, name, tensor.dtype, tensor.numel(), offset))
                offset += _aligned(tensor.numel() * tensor.element_size())
        self.slots = tuple(slots)
        self.nbytes = offset

    def pack(
        self, payloads: Sequence[Payload], nonfinite: torch.Tensor | None, into: torch.Tensor | None = None
    ) -> torch.Tensor:
        """One worker's message (uint8, :attr:`nbytes`) for ``payloads`` (laid out like the
        templates): a new tensor, or written over ``into`` (uint8, :attr:`nbytes`)."""
        if into is None:
            message = torch.zeros(self.nbytes, dtype=torch.uint8, device=device_of(payloads))
        else:
            message = into.zero_()
        header = message[: self.header_words * HEADER_DTYPE.itemsize].view(HEADER_DTYPE)
        if nonfinite is not None:
            header[0:1].copy_(nonfinite.reshape(1))
        for part, payload in enumerate(payloads):
            length = payload.entries()
            put_count(header, 1 + 2 * part, length)
            put_count(header, 2 + 2 * part, length if payload.demand is None else payload.demand)
        for slot in self.slots:
            field = payloads[slot.part].fields()[slot.name].reshape(-1)
            message[slot.offset : slot.offset + slot.nbytes].view(slot.dtype).copy_(field)
        return message

    def packed(self, message: torch.Tensor, payloads: Sequence[Payload]) -> list[Payload]:
        """``payloads`` (the ones :meth:`pack` wrote into ``message``) with every field a view of
        its bytes in ``message``: the same values, and no memory of their own."""
        views = []
        for part, payload in enumerate(payloads):
            fields: dict[str, Any] = {
                slot.name: message[slot.offset : slot.offset + slot.nbytes]
                .view(slot.dtype)
                .view(payload.fields()[slot.name].shape)
                for slot in self.slots
                if slot.part == part
            }
            views.append(dataclasses.replace(payload, **fields))
        return views

    def unpack(self, gathered: torch.Tensor, world: int) -> Received:
        """Split ``world`` gathered messages (``world * nbytes`` uint8) and check them on the device."""
        rows = gathered.view(world, self.nbytes)
        header = rows[:, : self.header_words * HEADER_DTYPE.itemsize].view(HEADER_DTYPE)
        flags = header[:, 0]
        malformed = (flags & ~NONFINITE) != 0
        fields: dict[tuple[int, str], torch.Tensor] = {
            (slot.part, slot.name): rows[:, slot.offset : slot.offset + slot.nbytes].view(slot.dtype)
            for slot in self.slots
        }
        payloads: list[list[Payload]] = [[] for _ in range(world)]
        for part, template in enumerate(self.templates):
            length, demand = header[:, 1 + 2 * part], header[:, 2 + 2 * part]
            capacity = template.capacity
            malformed |= (length < 0) | (length > capacity) | (demand < 0)
            columns: dict[str, Any] = {name: fields[(part, name)] for name in template.fields()}
            if template.variable_size:
                columns, bad = _checked_entries(columns, length, capacity, template.numel)
                malformed |= bad
            for w in range(world):
                payloads[w].append(
                    dataclasses.replace(
                        template,
                        info={},
                        length=length[w].clamp(0, capacity) if template.variable_size else None,
                        demand=None,
                        nonfinite=None,
                        **{name: column[w] for name, column in columns.items()},
                    )
                )
        # every part at once (a length beyond its capacity is malformed: the step is dropped)
        lengths, demands = header[:, 1::2], header[:, 2::2]
        used = lengths.clamp_min(0).to(torch.float32).mean(dim=0)
        return Received(payloads, malformed, (flags & NONFINITE).any(), demands.amax(dim=0), used)


def _checked_entries(
    columns: dict[str, Any], length: torch.Tensor, capacity: int, numel: int
) -> tuple[dict[str, Any], torch.Tensor]:
    """Entries in use of a sparse field pair, checked (``[W]`` malformed) and made harmless."""
    indices = columns.get("indices")
    if indices is None:
        return columns, torch.zeros_like(length, dtype=torch.bool)
    used = torch.arange(capacity, device=indices.device).unsqueeze(0) < length.unsqueeze(1)
    inside = (indices >= 0) & (indices < numel)
    bad = (used & ~inside).any(dim=1)
    if capacity > 1:
        bad |= (used[:, 1:] & (indices[:, 1:] <= indices[:, :-1])).any(dim=1)
    keep = used & inside
    cleaned = dict(columns)
    cleaned["indices"] = torch.where(keep, indices, 0)
    if "values" in columns:
        cleaned["values"] = torch.where(keep, columns["values"], 0)
    return cleaned, bad


def put_count(header: torch.Tensor, index: int, value: Count) -> None:
    """``header[index] = value`` without a host read or a host-to-device copy: a device count
    is copied on the device, a host int passed to ``fill_`` as a kernel argument
    (``header[index] = 3`` would stage the int on the host and copy it over)."""
    if isinstance(value, torch.Tensor):
        header[index : index + 1].copy_(value.reshape(1))
    else:
        header[index : index + 1].fill_(value)


def device_of(payloads: Sequence[Payload]) -> torch.device:
    """Where the payloads' tensors are (the CPU when they have none)."""
    for payload in payloads:
        for tensor in payload.fields().values():
            return tensor.device
    return torch.device("cpu")
