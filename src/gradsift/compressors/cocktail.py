"""CocktailSGD's compressor (Wang et al. 2023): a rolling subset, top-k inside it, low-bit values.

Three compressors in a row, for a tensor ``x`` of ``n`` elements at its ``t``-th call:

1. **subset** -- every position has a slot in ``[0, P)``, ``P = round(1 / p)``, drawn once
   from the shared ``seed`` (the same on every worker, whatever its device); call ``t`` may select only the
   positions of slot ``t mod P``, so each position is eligible once every ``P`` calls;
2. **top-k** -- of those, the ``k = max(1, floor(n p r))`` of largest ``|x_i|`` (``r`` the
   fraction kept of the subset), sent as ascending positions; selected as the ``topk`` compressor
   selects (:func:`~gradsift.compressors.topk.top_k_selection`: a radix select on the CPU)
   among the values with every other position zeroed;
3. **quantize** -- their values, in position order, in ``b``-bit codes with one absmax
   scale per block of ``d`` (:class:`~gradsift.compressors.blockquant.BlockQuantizer`'s
   codes: ``round(x L / s_B)``, ``L = 2^(b-1) - 1``).

A position is a place in the *canonical* layout of a DDP bucket -- its parameters in number
order (:class:`~gradsift.core.store.Canonical`) -- whatever layout DDP hands in (it changes
when DDP rebuilds its buckets and when a run resumes): the slots, the ascending order and so
the blocks that share a scale are the same in every layout. The payload then carries
canonical positions and says so (``Payload.canonical``); decoding lays the mean back.

What was not sent -- the unselected elements and the selected ones' rounding error --
stays in error feedback (``error_feedback = True``). With ``gradsift.diloco(...,
sync_every=1)`` this is per-step delta sync in CocktailSGD's manner: each worker keeps
AdamW local and every step sends its model delta through the three compressors; the
paper keeps the unsent delta in the worker's own parameters, gradsift in the residual
(the worker restarts from the shared parameters every step).

Bytes per call: ``k`` int32 positions, ``ceil(k b / 8)`` of codes, ``4 ceil(k / d)`` of
scales, plus the 4-byte length. The paper sends the positions as a bitmap over the
subset (about ``n p / 8`` bytes), smaller at its ``r = 0.2``; positions keep the wire
format of every other sparse payload here. A NaN or Inf anywhere in ``x`` reaches the
selection (``x`` is masked by multiplying with 0/1, and ``NaN * 0`` is NaN), so the
payload is flagged non-finite like a top-k's.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, ClassVar

import torch

from gradsift.compressors import draws
from gradsift.compressors.base import Selection, Sparsifier, target_count
from gradsift.compressors.bitpack import pack, unpack
from gradsift.compressors.blockquant import BlockQuantizer
from gradsift.compressors.topk import top_k_selection
from gradsift.core.errors import InvalidOptionError
from gradsift.core.payload import Payload
from gradsift.core.precision import working_dtype
from gradsift.core.readout import Readout
from gradsift.core.validation import check_int, check_ratio

#: Slots are uint8: the subset is at least 1/255 of the positions.
MAX_PERIOD = 255


class Cocktail(Sparsifier):
    """``cocktail``: rolling subset ``p``, top ``r`` of it, ``bits``-bit values (module docstring).

    Options:
        subset: ``p``, the fraction of positions eligible at each call, in [1/255, 1]
            (default 0.1, the paper's).
        topk: ``r``, the fraction of the subset sent, in (0, 1] (default 0.2, the paper's).
        bits: value code width, 2, 4 or 8 (default 4); block_size: elements per scale
            (default 128, the paper's buckets).
        seed: the slots' seed, shared by all workers (default 0).

    State (``state_dict``): the per-key call counters, so a resumed run walks the same subsets.
    """

    name = "cocktail"
    exchanges: ClassVar[tuple[str, ...]] = ("allgather",)
    density_option: ClassVar[str | None] = None
    sparse: ClassVar[bool] = False  # its values travel as codes

    def __init__(
        self, subset: float = 0.1, topk: float = 0.2, bits: int = 4, block_size: int = 128, seed: int = 0
    ) -> None:
        self.subset = check_ratio(subset, "subset")
        self.period = round(1.0 / self.subset)
        if self.period > MAX_PERIOD:
            raise InvalidOptionError(f"subset must be at least 1/{MAX_PERIOD}; got {subset!r}")
        self.topk = check_ratio(topk, "topk")
        super().__init__(ratio=self.subset * self.topk)
        self.values = BlockQuantizer(bits, block_size)
        self.seed = check_int(seed, "seed", low=0, high=2**62)
        self.calls: dict[Hashable, int] = {}
        self._slots: dict[tuple[int, str], torch.Tensor] = {}

    def options(self) -> dict[str, Any]:
        return {"subset": self.subset, "topk": self.topk, "bits": self.values.code_bits,
                "block_size": self.values.block_size, "seed": self.seed}  # fmt: skip

    def slots(self, numel: int, device: torch.device) -> torch.Tensor:
        """Every position's slot in ``[0, P)`` (uint8), a function of ``(seed, numel)`` only --
        the same on every device (:mod:`gradsift.compressors.draws`)."""
        cached = self._slots.get((numel, str(device)))
        if cached is None:
            cached = draws.below(self.period, self.seed + numel, numel, device).to(torch.uint8)
            self._slots[(numel, str(device))] = cached
        return cached

    def select(self, flat: torch.Tensor, key: Hashable, capacity: int | None, readout: Readout) -> Selection:
        call = self.calls.get(key, 0)
        self.calls[key] = call + 1
        eligible = self.slots(flat.numel(), flat.device) == call % self.period
        scores = flat * eligible  # ranked by magnitude below; NaN * 0 is NaN: a non-finite input is selected
        indices, _, _, nonfinite = top_k_selection(scores, target_count(flat.numel(), self.ratio))
        return Selection(indices, None, nonfinite)

    def encode(
        self, flat: torch.Tensor, *, key: Hashable, capacity: int | None, readout: Readout, **extra: Any
    ) -> Payload:
        """The three steps on ``flat`` in its bucket's canonical order (module docstring): the
        positions sent are canonical ones and the payload says so (``Payload.canonical``)."""
        canonical = self.reordering(key, flat.numel())
        if canonical is not None:
            flat = canonical.to_canonical(flat)
        selected = super().encode(flat, key=key, capacity=capacity, readout=readout, **extra)
        assert selected.values is not None and selected.indices is not None  # a sparsifier's payload
        if selected.values.numel():
            codes, scales = self.values.quantize(selected.values)
        else:
            codes = torch.empty(0, dtype=torch.uint8, device=flat.device)
            scales = torch.empty(0, dtype=working_dtype(flat.dtype), device=flat.device)
        return Payload(
            numel=selected.numel,
            dtype=selected.dtype,
            indices=selected.indices,
            codes=pack(codes, self.values.code_bits),
            scales=scales,
            nonfinite=selected.nonfinite,
            canonical=canonical,
        )

    def decompress(self, payloads: Sequence[Payload], numel: int) -> torch.Tensor:
        """``(1/W) sum_w scatter(indices_w, decode(codes_w, scales_w))``."""
        if not payloads:
            raise InvalidOptionError("payloads must hold at least one payload")
        total = torch.zeros(numel, dtype=working_dtype(payloads[0].dtype), device=_device(payloads[0]))
        for payload in payloads:
            if (
                payload.numel != numel
                or payload.indices is None
                or payload.codes is None
                or payload.scales is None
            ):
                raise InvalidOptionError(
                    f"a {self.name} payload of {numel} elements carries indices, codes, scales"
                )
            count = payload.indices.numel()
            values = self.values.dequantize(
                unpack(payload.codes, self.values.code_bits, count), payload.scales, total.dtype
            )
            total.index_add_(0, payload.indices.long(), values)
        total = total.div_(len(payloads)).to(payloads[0].dtype)
        canonical = payloads[0].canonical
        return total if canonical is None else canonical.to_flat(total)

    def sent_dense(self, payload: Payload) -> torch.Tensor:
        return self.decompress([payload], payload.numel)

    def state_dict(self) -> dict[str, Any]:
        return {"calls": dict(self.calls)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if set(state) != {"calls"}:
            raise InvalidOptionError(f"{self.name} state must hold the key calls; got {sorted(state)}")
        self.calls = {key: int(count) for key, count in state["calls"].items()}


def _device(payload: Payload) -> torch.device:
    assert payload.indices is not None
    return payload.indices.device
