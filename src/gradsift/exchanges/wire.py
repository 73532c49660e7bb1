"""Wire format: a payload as the flat tensors that cross the network, and back.

A *message* is one worker's contribution for one DDP bucket: one or more payloads
(one per compressed tensor, ``P`` parts), each with the same fields ``F`` in the fixed
order of :meth:`Payload.fields`. It travels as

* a **header**: one int32 per (part, field), the field's length in elements --
  ``4 * F`` bytes per payload, exactly :attr:`Payload.header_nbytes`. A length of
  :data:`NONFINITE` (-1) in every slot says "my gradient was not finite, no data
  follows", so the non-finite flag rides in the size exchange at no extra byte;
* per field, the parts' tensors concatenated: ``values`` in the chosen value dtype,
  ``indices`` as int32 (int64 only when ``numel > 2**31 - 1``) and strictly increasing
  within a part (so a receiver checks uniqueness in one pass), ``codes`` and
  ``scales`` as the compressor made them.

:func:`to_wire` applies the dtype rules; ``p.nbytes`` already counts indices at their
wire width, so ``p.nbytes == to_wire(p).nbytes`` is exactly the number
of bytes the message puts on the wire (padding added by an allgather is the
collective's cost, reported separately by the hook). :func:`decode` checks every
length, dtype and index range of a received message and raises
:class:`~gradsift.errors.WireFormatError` instead of scattering garbage into a gradient.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import torch

from gradsift.compressors.base import Payload, index_dtype
from gradsift.errors import InvalidOptionError, WireFormatError

#: Header length that flags a sender whose gradient held NaN or Inf.
NONFINITE = -1

HEADER_DTYPE = torch.int32

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
    """The payload as it is sent: indices sorted and narrowed, values cast to ``value_dtype``.

    Unsorted indices (``torch.topk``'s) are sorted with their values (one check, and a
    sort of the ``k`` sent elements only when needed); fields that already have the
    wire dtype and order are not copied.
    """
    values, indices = payload.values, payload.fields().get("indices")  # random-k keeps its indices local
    if indices is not None and indices.numel() > 1 and not bool((indices[1:] > indices[:-1]).all()):
        indices, order = torch.sort(indices)
        values = None if values is None else values[order]
    if indices is not None and indices.dtype != index_dtype(payload.numel):
        indices = indices.to(index_dtype(payload.numel))
    if value_dtype is not None and values is not None and values.dtype != value_dtype:
        values = values.to(value_dtype)
    if indices is None:
        indices = payload.indices
    if values is payload.values and indices is payload.indices:
        return payload
    return dataclasses.replace(payload, values=values, indices=indices)


def header(payloads: Sequence[Payload], nonfinite: bool = False) -> list[int]:
    """Field lengths of each payload, flattened part-major (``P * F`` ints).

    With ``nonfinite`` every slot is :data:`NONFINITE`.
    """
    lengths = [t.numel() for p in payloads for t in p.fields().values()]
    return [NONFINITE] * len(lengths) if nonfinite else lengths


def concat_fields(payloads: Sequence[Payload]) -> dict[str, torch.Tensor]:
    """Per field name, the parts' tensors concatenated (the data half of a message)."""
    names = list(payloads[0].fields())
    return {
        name: torch.cat([p.fields()[name].reshape(-1) for p in payloads])
        if len(payloads) > 1
        else payloads[0].fields()[name].reshape(-1)
        for name in names
    }


def check_headers(headers: torch.Tensor, parts: int, fields: int) -> bool:
    """Validate gathered headers (``[W, parts * fields]``); return True if any sender was non-finite.

    Raises :class:`WireFormatError` on a wrong shape, a negative length other than a
    whole-message :data:`NONFINITE` flag, or a flag mixed with lengths.
    """
    if headers.dim() != 2 or headers.shape[1] != parts * fields:
        raise WireFormatError(
            f"header must have {parts * fields} lengths per worker ({parts} parts x {fields} fields), "
            f"got shape {tuple(headers.shape)}"
        )
    flagged = headers == NONFINITE
    whole = flagged.all(dim=1)
    if bool((flagged.any(dim=1) & ~whole).any()) or bool((headers < NONFINITE).any()):
        raise WireFormatError(f"header holds negative lengths: {headers.tolist()}")
    return bool(whole.any())


def decode(
    lengths: Sequence[int],
    data: Mapping[str, torch.Tensor],
    templates: Sequence[Payload],
) -> list[Payload]:
    """Split one worker's received message into validated payloads.

    Args:
        lengths: that worker's header row (``P * F`` ints, part-major).
        data: per field name, that worker's concatenated field data (already trimmed).
        templates: the local payloads for the same parts: they give the field names,
            dtypes, ``numel`` and dense dtype each received part must have.

    Raises :class:`WireFormatError` when a length does not add up, a dtype differs,
    values and indices disagree in count, or an index lies outside ``[0, numel)``.
    """
    names = list(templates[0].fields())
    if len(lengths) != len(templates) * len(names):
        raise WireFormatError(f"header has {len(lengths)} lengths, expected {len(templates) * len(names)}")
    if sorted(data) != sorted(names):
        raise WireFormatError(f"message carries fields {sorted(data)}, expected {sorted(names)}")
    for name in names:
        expected = templates[0].fields()[name].dtype
        if data[name].dtype != expected or data[name].dim() != 1:
            raise WireFormatError(
                f"field {name!r} must be a 1-D {expected} tensor, got {data[name].dim()}-D {data[name].dtype}"
            )
        total = sum(lengths[i] for i in range(names.index(name), len(lengths), len(names)))
        if total != data[name].numel():
            raise WireFormatError(f"field {name!r} holds {data[name].numel()} elements, header says {total}")
    offsets = dict.fromkeys(names, 0)
    decoded = []
    for part, template in enumerate(templates):
        fields = {}
        for j, name in enumerate(names):
            n = lengths[part * len(names) + j]
            fields[name] = data[name][offsets[name] : offsets[name] + n]
            offsets[name] += n
        payload = dataclasses.replace(
            template,
            info={},
            values=fields.get("values", template.values),
            indices=fields.get("indices", template.indices),
            codes=fields.get("codes", template.codes),
            scales=fields.get("scales", template.scales),
        )
        _check_indices(payload, part)
        decoded.append(payload)
    return decoded


def _check_indices(payload: Payload, part: int) -> None:
    """Indices must pair one-to-one with values, increase strictly and lie in ``[0, numel)``."""
    indices = payload.indices
    if indices is None:
        return
    if payload.values is not None and payload.values.numel() != indices.numel():
        raise WireFormatError(f"part {part}: {payload.values.numel()} values for {indices.numel()} indices")
    check_positions(indices, payload.numel, part)


def check_positions(indices: torch.Tensor, numel: int, part: int = 0) -> None:
    """Raise :class:`WireFormatError` unless ``indices`` increase strictly within ``[0, numel)``.

    Strictly increasing means no index repeats (a repeated index would add one
    worker's value twice); with sorted indices the range check reads the two ends.
    """
    if indices.numel() == 0:
        return
    if indices.numel() > 1 and not bool((indices[1:] > indices[:-1]).all()):
        raise WireFormatError(f"part {part}: indices must increase strictly (a repeated or unsorted index)")
    low, high = int(indices[0]), int(indices[-1])
    if low < 0 or high >= numel:
        raise WireFormatError(f"part {part}: indices must lie in [0, {numel}), got range [{low}, {high}]")
