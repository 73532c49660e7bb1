"""Shared machinery of the dense quantizers (QSGD, TernGrad, signSGD).

A quantizer encodes *every* element as a fixed-width unsigned code and adds a few
float scales (a norm, a maximum). The payload is ``codes`` (bit-packed with
:mod:`gradsift.compressors.bitpack`, ``ceil(n*b/8)`` bytes) plus ``scales``; its size depends only
on ``numel`` (``variable_size=False``: no length travels with it). Whether the input
held NaN/Inf is a device flag computed from the scales (a norm or maximum propagates
NaN and is Inf when any element is).

Aggregation is ``(1/W) sum_w decode(payload_w)``: codes of different workers are
relative to different scales and do not survive element-wise summation, so these
payloads are allgathered, not allreduced (the ``allgather`` exchange).

Arithmetic runs in ``float32`` for half-precision gradients and in the gradient's own
dtype otherwise; ``decompress`` returns the gradient's dtype.
"""

from __future__ import annotations

import abc
from collections.abc import Hashable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from gradsift.compressors import draws
from gradsift.compressors.base import Compressor
from gradsift.compressors.bitpack import pack, packed_nbytes, unpack
from gradsift.core.errors import InvalidOptionError, WireFormatError
from gradsift.core.finite import nonfinite
from gradsift.core.payload import Payload
from gradsift.core.precision import working_dtype
from gradsift.core.readout import Readout
from gradsift.core.store import Canonical
from gradsift.core.validation import check_int


def rows(flat: torch.Tensor, size: int, fill: float, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``flat`` as rows of ``size`` elements (the blocks that share one scale), the last
    padded with ``fill``, in ``dtype`` (default ``flat``'s): one new tensor at most, the
    values cast as they are copied into it (no widened copy beside the padded one). A block
    longer than ``flat`` is ``flat``: one row, nothing padded (its scale is the same)."""
    dtype = flat.dtype if dtype is None else dtype
    size = max(1, min(size, flat.numel()))
    missing = -flat.numel() % size
    if not missing:
        return flat.to(dtype).view(-1, size)
    padded = torch.empty(flat.numel() + missing, dtype=dtype, device=flat.device)
    padded[: flat.numel()].copy_(flat)
    padded[flat.numel() :].fill_(fill)
    return padded.view(-1, size)


class Quantizer(Compressor):
    """Base of the dense quantizers: packing, empty tensors, the per-worker decode.

    Subclasses set :attr:`code_bits` and implement :meth:`quantize` and :meth:`dequantize`.
    """

    error_feedback = False
    code_bits: int

    @abc.abstractmethod
    def quantize(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Encode a non-empty flat gradient: ``(integer codes in [0, 2**code_bits), scales)``;
        the scales are non-finite exactly when ``flat`` holds NaN or Inf."""

    @abc.abstractmethod
    def dequantize(self, codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Decode integer ``codes`` (as :func:`~gradsift.compressors.bitpack.unpack` gives
        them) with their ``scales`` into a dense tensor of ``dtype`` (the signed arithmetic in
        ``dtype``: small integers, exact there). Elementwise: a code's value depends on the
        code and its scale only (:meth:`_decoded` relies on it)."""

    def encode(
        self, flat: torch.Tensor, *, key: Hashable, capacity: int | None, readout: Readout, **extra: Any
    ) -> Payload:
        """Quantize ``flat``; a DDP bucket in canonical order (its parameters in number
        order, :meth:`gradsift.core.store.TensorStore.canonical`), so the scales' sums, the
        rounding draws and which elements share a scale (QSGD's per-512 norms) do not
        depend on the layout DDP hands in (it changes when DDP rebuilds its buckets and
        when a run resumes). The codes then stay in canonical order and the payload says
        so (``Payload.canonical``); decoding lays the mean back. A bucket already laid out
        in number order is quantized as it is."""
        numel = flat.numel()
        canonical = self.reordering(key, numel)
        if numel == 0:
            codes = torch.empty(0, dtype=torch.uint8, device=flat.device)
            scales = torch.empty(0, dtype=working_dtype(flat.dtype), device=flat.device)
        else:
            codes, scales = self.quantize(flat if canonical is None else canonical.to_canonical(flat))
        payload = Payload(
            numel=numel,
            dtype=flat.dtype,
            codes=pack(codes, self.code_bits),
            scales=scales,
            variable_size=False,
            nonfinite=nonfinite(scales),
            canonical=canonical,
        )
        payload.info["bits_per_element"] = 8 * payload.nbytes / numel if numel else 0.0
        return payload

    def decompress(self, payloads: Sequence[Payload], numel: int) -> torch.Tensor:
        total, canonical = self._mean(payloads, numel)
        total = total.to(payloads[0].dtype)
        return total if canonical is None else canonical.to_flat(total)

    def decompress_into(self, payloads: Sequence[Payload], out: torch.Tensor) -> torch.Tensor | None:
        if type(self).decompress is not Quantizer.decompress:  # a subclass decodes its own way
            return super().decompress_into(payloads, out)
        total, canonical = self._mean(payloads, out.numel())
        total = total.to(payloads[0].dtype)
        if canonical is None or out.dtype != total.dtype:
            out.copy_(total if canonical is None else canonical.to_flat(total))
        else:
            canonical.to_flat(total, out=out)  # laid back straight into the bucket
        return None

    def _mean(self, payloads: Sequence[Payload], numel: int) -> tuple[torch.Tensor, Canonical | None]:
        """The mean of the decoded ``payloads`` in their order (compute dtype), and the
        canonical mapping that lays it out as the tensor (None: it already is)."""
        if not payloads:
            raise InvalidOptionError("payloads must hold at least one payload")
        dtype = payloads[0].dtype
        canonical = payloads[0].canonical
        total: torch.Tensor | None = None
        for payload in payloads:
            if payload.numel != numel:
                raise InvalidOptionError(f"payload encodes {payload.numel} elements, expected numel={numel}")
            if payload.codes is None or payload.scales is None:
                raise InvalidOptionError(f"a {self.name} payload carries codes and scales")
            if payload.canonical is not canonical and not _same_order(payload.canonical, canonical):
                raise InvalidOptionError(
                    f"{self.name} payloads of one tensor must all be in canonical order or all in its own"
                )
            if payload.codes.numel() != packed_nbytes(numel, self.code_bits):
                raise WireFormatError(
                    f"{self.name} payload holds {payload.codes.numel()} code bytes, "
                    f"{numel} elements of {self.code_bits} bits need {packed_nbytes(numel, self.code_bits)}"
                )
            decoded = self._decoded(payload, numel, working_dtype(dtype))
            total = decoded if total is None else total.add_(decoded)
        assert total is not None  # payloads is not empty
        if len(payloads) > 1:
            total /= len(payloads)
        return total, canonical

    def _decoded(self, payload: Payload, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """One payload's values in ``dtype``.

        With one scale for the whole tensor and codes that never straddle a byte (``code_bits``
        divides 8), each byte stands for the same ``8 / code_bits`` values wherever it lies:
        :meth:`dequantize` (elementwise) decodes the 256 byte patterns once, and the payload
        is one lookup per byte into that table -- no unpacked codes, no arithmetic per element.
        Otherwise :meth:`dequantize` of the unpacked codes.
        """
        assert payload.codes is not None and payload.scales is not None  # checked by the caller
        if payload.scales.numel() != 1 or 8 % self.code_bits:
            return self.dequantize(unpack(payload.codes, self.code_bits, numel), payload.scales, dtype)
        per_byte = 8 // self.code_bits
        patterns = torch.arange(256, dtype=torch.uint8, device=payload.codes.device)
        table = self.dequantize(unpack(patterns, self.code_bits, 256 * per_byte), payload.scales, dtype)
        return table.view(256, per_byte).index_select(0, payload.codes.int()).view(-1)[:numel]


def _same_order(a: Canonical | None, b: Canonical | None) -> bool:
    """Whether two mappings lay the same chunks out alike (payloads of different workers' stores)."""
    if a is None or b is None:
        return a is b
    return a.sizes == b.sizes and a.chunks == b.chunks


class StochasticQuantizer(Quantizer):
    """A quantizer with unbiased stochastic rounding, drawn from its own generators.

    Each tensor key (a DDP bucket's, a layer's) draws from its own generator per device,
    seeded from ``(seed, rank, key)`` (:func:`~gradsift.compressors.draws.stream_seed`;
    ``rank`` = the torch.distributed rank when a process group exists, else 0), so the
    workers' rounding errors are independent, each run is reproducible, and a part's draws
    do not depend on which parts were encoded before it (DDP's bucket order and grouping
    change with its rebuild and when a run resumes). The generators' states are exported by
    :meth:`state_dict`, so a resumed run draws the same numbers.

    Unbiased compressors need no error feedback (``error_feedback = False``): the
    expected update already equals the gradient, and a residual would only add the
    rounding noise of the previous step back in.
    """

    def __init__(self, seed: int = 0) -> None:
        self.seed = check_int(seed, "seed", low=0, high=2**62)
        self.generators: dict[tuple[str, Hashable], torch.Generator] = {}
        self.drawing: Hashable = 0  # the key being encoded: whose stream :meth:`uniform` draws from

    def options(self) -> dict[str, Any]:
        return {"seed": self.seed}

    def encode(
        self, flat: torch.Tensor, *, key: Hashable, capacity: int | None, readout: Readout, **extra: Any
    ) -> Payload:
        """:meth:`Quantizer.encode`, its rounding drawn from ``key``'s stream."""
        self.drawing = key
        return super().encode(flat, key=key, capacity=capacity, readout=readout, **extra)

    def uniform(self, like: torch.Tensor) -> torch.Tensor:
        """Independent U[0, 1) draws, one per element of ``like`` (same shape, dtype, device)."""
        return torch.rand(
            like.shape, generator=self._generator(like.device), dtype=like.dtype, device=like.device
        )

    def _generator(self, device: torch.device) -> torch.Generator:
        name = (str(device), self.drawing)
        generator = self.generators.get(name)
        if generator is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
            seed = draws.stream_seed(self.seed, (rank, self.drawing), 0)
            generator = torch.Generator(device=device).manual_seed(seed)
            self.generators[name] = generator
        return generator

    def state_dict(self) -> dict[str, Any]:
        """The generator states as ``[device name, key, state (uint8 tensor)]`` entries."""
        return {
            "seed": self.seed,
            "generators": [[d, k, g.get_state()] for (d, k), g in self.generators.items()],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if set(state) != {"seed", "generators"}:
            raise InvalidOptionError(
                f"{self.name} state must hold keys seed, generators; got {sorted(state)}"
            )
        if state["seed"] != self.seed:
            raise InvalidOptionError(
                f"checkpoint was made with seed={state['seed']}, this {self.name} has {self.seed}"
            )
        if isinstance(state["generators"], dict):
            raise InvalidOptionError(
                f"this {self.name} checkpoint holds one rounding generator per device, from a gradsift "
                "before each tensor drew from its own: its draws cannot be continued; resume it with "
                "that version, or start the compressor's state afresh"
            )
        generators = {}  # all read before any replaces this compressor's
        for entry in state["generators"]:
            if not (isinstance(entry, list | tuple) and len(entry) == 3):
                raise InvalidOptionError(
                    f"{self.name} state's generators are [device name, key, state] entries; got {entry!r:.80}"
                )
            device, key, generator_state = entry
            generator = torch.Generator(device=device)
            generator.set_state(generator_state)
            generators[(device, _as_key(key))] = generator
        self.generators = generators


def _as_key(key: Any) -> Hashable:
    """A tensor key as saved (a list where a checkpoint format turned a tuple into one)."""
    return tuple(_as_key(k) for k in key) if isinstance(key, list) else key
