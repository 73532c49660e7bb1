"""DeMo (Peng, Quesnelle, Kingma 2024): decoupled momentum, its fast DCT components exchanged, sign steps.

``optimizer = gradsift.DeMo(model.parameters(), lr=1e-3)`` for a model that is *not*
wrapped in DDP (or that runs its backward inside ``ddp.no_sync()``): each worker's
gradients stay its own, and DeMo's step is the exchange. Every :meth:`DeMo.step`, for
every parameter ``theta`` (with the gradient ``g_k`` of worker ``k``, out of ``W``):

1. the local momentum, which is also the error-feedback buffer: ``delta = beta delta + g_k``;
2. its fast components: ``delta`` is cut into chunks -- a matrix into ``chunk x chunk``
   tiles, any other tensor flattened into runs of ``chunk`` elements; a dimension shorter
   than ``chunk`` is one tile wide, the remainder of a longer one is zero-padded -- each
   chunk goes through the orthonormal DCT-II (``D X D^T`` for a tile, ``D x`` for a run,
   ``D`` the precomputed basis matrix), and the ``topk`` coefficients of largest magnitude
   of every chunk are kept: ``q_k`` (values in ``value_dtype``, indices inside the chunk);
3. what is sent leaves the momentum: ``delta -= IDCT(q_k)`` (cropped to the parameter,
   with the values as sent);
4. one all-gather moves every worker's values and indices -- a fixed count per chunk, so
   nothing about sizes is exchanged first -- and every worker forms ``g~ = IDCT(mean_k q_k)``;
5. the step, with AdamW's decoupled weight decay:
   ``theta = theta (1 - lr weight_decay) - lr sign(g~)``.

The sum over the workers is taken worker by worker in rank order (``sign`` makes the
``1/W`` of the mean moot), so every rank adds the same numbers in the same order and the
ranks hold the same parameters bit for bit: one ``scatter_add`` with indices repeated across
workers would run on CUDA atomics in no fixed order. Every rank starts from rank 0's
parameters (one broadcast each at construction, as DDP does when it wraps a model).

A message is ``topk`` values and ``topk`` indices per chunk: indices as int16 (int32 for
chunks of more than ``2**15`` elements), values in the parameters' dtype unless
``value_dtype`` says otherwise. With the paper's setting (64 x 64 tiles, 32 kept, fp32)
a matrix travels in ``32 * (4 + 2) = 192`` bytes per 4,096 elements, where an fp32
allreduce's message has ``4,096 * 4 = 16,384``. :meth:`DeMo.stats` reports like the DDP hook's ``stats()``
(``bytes_sent``, ``bytes_received`` -- ``(W-1)`` messages --, ``dense_bytes``, ``density``,
phase times). ``state_dict()`` holds every parameter's ``delta``, the groups' ``lr`` and
``weight_decay``, the step count and the byte totals: a run resumes bit for bit.

A step is all or nothing: the momentum it computes (into a second buffer per parameter,
swapped in: DeMo holds two momentum buffers) is kept only once the exchange is checked. ``nonfinite="raise"`` (default): a NaN or Inf in what any worker sent raises
:class:`NonFiniteGradientError`, an index outside its chunk :class:`WireFormatError`, on
every rank before any parameter or momentum moves (flags from the gathered message, the
step's one host read), so the step can be taken again; ``"propagate"``: no host read, NaN
reaches the parameters and an out-of-range entry is dropped alike on every rank. Every step
releases the previous step's collective handles and buffers. A
worker that dies makes the others raise :class:`PeerFailureError` within the process
group's timeout. Every parameter with ``requires_grad`` takes part in every step (a missing
``.grad`` counts as zero), so the messages of all workers have one layout.

DeMo is an optimizer, not a gradient hook, so it does not take the hook's bucket route; it
shares the route's one implementation of each idea they have in common: the non-finite check
(:func:`gradsift.core.finite.nonfinite`), the telemetry record (:mod:`gradsift.core.telemetry`),
the settings agreement, the collectives and the value dtype's parsing (docs/architecture.md
says what differs and why).

Against the reference code (bloc97/DeMo) this follows the paper's and the spec's formulas:
the momentum accumulates ``g_k``, not ``lr g_k``; the mean is over all workers, not over
those that sent a coefficient; the remainder of a dimension is padded instead of the chunk
shrunk to a divisor of it; indices travel in 16 bits, not 64.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from gradsift.core.agreement import setting_text
from gradsift.core.errors import (
    InvalidOptionError,
    InvalidTensorError,
    NonFiniteGradientError,
    WireFormatError,
)
from gradsift.core.exchanging import ExchangingOptimizer, parse_options
from gradsift.core.finite import nonfinite
from gradsift.core.precision import working_dtype
from gradsift.core.telemetry import BucketRecord
from gradsift.core.validation import check_choice, check_int, check_real
from gradsift.core.wire import parse_value_dtype

#: What a non-finite value in the exchange does: raise on every rank, or reach the parameters.
NONFINITE_POLICIES = ("raise", "propagate")
#: The largest ``chunk`` (a tile of ``chunk**2`` elements and its two ``chunk x chunk`` bases).
MAX_CHUNK = 1024


@dataclass(frozen=True)
class DeMoOptions:
    """DeMo's settings shared by every parameter group (the message's layout depends on them).

    Attributes:
        beta: the momentum's decay (the paper's 0.999), in [0, 1).
        chunk: a tile's side (a run's length for tensors that are not matrices), the paper's 64.
        topk: coefficients kept per chunk (the paper's 32; at most the chunk's size).
        value_dtype: the values' wire dtype, ``"fp32"``/``"fp16"``/``"bf16"``; None (default)
            the parameters' dtype when they share one, else float32.
        nonfinite: ``"raise"`` (default) or ``"propagate"`` (see the module docstring).
    """

    beta: float = 0.999
    chunk: int = 64
    topk: int = 32
    value_dtype: Any = None
    nonfinite: str = "raise"

    def __post_init__(self) -> None:
        check_real(self.beta, "beta", low=0.0, high=1.0, high_open=True)
        check_int(self.chunk, "chunk", low=1, high=MAX_CHUNK)
        check_int(self.topk, "topk", low=1)
        if self.topk > self.chunk * self.chunk:  # the default 32 too, with a chunk of 5 or less
            raise InvalidOptionError(
                f"topk must lie in [1, {self.chunk * self.chunk}], the coefficients of a {self.chunk} x "
                f"{self.chunk} chunk, got {self.topk} (the default is {DeMoOptions.topk}: with chunk="
                f"{self.chunk} pass topk= too)"
            )
        object.__setattr__(self, "value_dtype", parse_value_dtype(self.value_dtype))
        check_choice(self.nonfinite, "nonfinite", NONFINITE_POLICIES)

    @classmethod
    def parse(cls, options: dict[str, Any]) -> DeMoOptions:
        """The settings from keyword ``options``; an unknown name raises, listing the known ones."""
        return parse_options(cls, options, "DeMo")

    def describe(self) -> dict[str, Any]:
        """The settings as plain JSON types."""
        settings = asdict(self)
        settings["value_dtype"] = (
            None if self.value_dtype is None else str(self.value_dtype).removeprefix("torch.")
        )
        return settings


@dataclass(frozen=True)
class Tiling:
    """How one parameter is cut: its 2-D view ``rows x cols`` (a matrix as it is, anything
    else as one row), tiles of ``tile_rows x tile_cols`` on a ``grid``, ``keep`` kept per tile."""

    shape: torch.Size
    rows: int
    cols: int
    tile_rows: int
    tile_cols: int
    keep: int

    @classmethod
    def of(cls, shape: torch.Size, chunk: int, topk: int) -> Tiling:
        rows, cols = (shape[0], shape[1]) if len(shape) == 2 else (1, math.prod(shape))
        tile_rows, tile_cols = min(chunk, rows), min(chunk, cols)
        return cls(shape, rows, cols, tile_rows, tile_cols, min(topk, tile_rows * tile_cols))

    @property
    def grid(self) -> tuple[int, int]:
        return -(-self.rows // self.tile_rows), -(-self.cols // self.tile_cols)

    @property
    def chunks(self) -> int:
        return self.grid[0] * self.grid[1]

    @property
    def entries(self) -> int:
        """Coefficients sent per step."""
        return self.chunks * self.keep


def dct_basis(size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The orthonormal DCT-II matrix ``D`` (``y = D x``): ``D[k, i] = c_k cos(pi (2i + 1) k / (2 size))``,
    ``c_0 = sqrt(1 / size)``, ``c_k = sqrt(2 / size)``; ``D^T`` is its inverse."""
    k = torch.arange(size, dtype=torch.float64)[:, None]
    i = torch.arange(size, dtype=torch.float64)[None, :]
    basis = torch.cos(math.pi * (2 * i + 1) * k / (2 * size)) * math.sqrt(2.0 / size)
    basis[0] /= math.sqrt(2.0)
    return basis.to(dtype=dtype, device=device)


class DeMo(ExchangingOptimizer, method="DeMo", key="demo"):
    """DeMo's optimizer (see the module docstring); ``lr`` and ``weight_decay`` per parameter
    group, the settings of :class:`DeMoOptions` for all (``beta=0.999``, ``chunk=64``,
    ``topk=32``, ``value_dtype=None``, ``nonfinite='raise'``). ``process_group``: the workers
    (default: the world when ``torch.distributed`` is initialised, else this process alone,
    which needs no collective).
    What every optimizer whose step is its exchange shares (the parameters, the agreement,
    the all-gather, the telemetry, the checkpoint) is :class:`gradsift.core.exchanging.ExchangingOptimizer`'s.

    Example::

        optimizer = gradsift.DeMo(model.parameters(), lr=1e-3)   # model not DDP-wrapped
        loss.backward(); optimizer.step(); optimizer.stats()["step"]["bytes_sent"]
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        *,
        weight_decay: float = 0.0,
        process_group: Any = None,
        **options: Any,
    ) -> None:
        self.options = DeMoOptions.parse(options)
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay}, process_group)
        dtypes = {p.dtype for p in self.params}
        self.value_dtype = self.options.value_dtype or (dtypes.pop() if len(dtypes) == 1 else torch.float32)
        self.index_dtype = torch.int16 if self.options.chunk**2 <= 2**15 else torch.int32
        self.tilings = {p: Tiling.of(p.shape, self.options.chunk, self.options.topk) for p in self.params}
        self.entries = sum(t.entries for t in self.tilings.values())
        self.message_bytes = self.entries * (self.value_dtype.itemsize + self.index_dtype.itemsize)
        self.elements_sent = [tiling.entries for tiling in self.tilings.values()]
        self.values_bytes = self.entries * self.value_dtype.itemsize
        #: Per entry of a message, the size of its chunk: every index must lie below it.
        self._index_bounds = torch.cat(
            [
                torch.full((t.entries,), t.tile_rows * t.tile_cols, dtype=torch.int32)
                for t in self.tilings.values()
            ]
        ).to(self.params[0].device)
        self._bases: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        #: Per parameter, the buffer the next step's momentum is written into (double buffering).
        self._spare: dict[torch.Tensor, torch.Tensor | None] = {}
        self.start()  # collective: the ranks agree and take rank 0's parameters

    def settings(self) -> dict[str, str]:
        """What every rank's DeMo must share: its options (the values' dtype as resolved),
        the groups and the parameters' layout."""
        settings = {name: setting_text(value) for name, value in self.options.describe().items()}
        settings["value_dtype"] = setting_text(self.value_dtype)
        return {**settings, **super().settings()}

    # -- the step -----------------------------------------------------------------------------
    def exchange(self, record: BucketRecord, device: torch.device) -> bool:
        """One DeMo step on every parameter (steps 1-5 of the module docstring); never skipped
        (a refused step raises)."""
        with record.timed("compress_ms", device):
            message, deltas = self._compress()
        with record.timed("communicate_ms", device):
            rows = self.gather(message)
        with record.timed("decompress_ms", device):
            values, indices = self._received(rows)
            self._update(values, indices)
            for param, delta in zip(self.params, deltas, strict=True):  # the momentum moves with them
                self._spare[param] = self.state[param].get("delta")
                self.state[param]["delta"] = delta
        return False

    def _compress(self) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Momentum, DCT, top-k per chunk, error feedback: this worker's message as bytes, and
        every parameter's new momentum, written into its spare buffer (the one the momentum
        before the last step held): :meth:`step` commits them once the exchange is validated,
        so a refused step leaves the momentum as it was, and no step allocates a new one."""
        values, indices, deltas = [], [], []
        for param in self.params:
            grad = param.grad
            if grad is not None and grad.is_sparse:
                raise InvalidTensorError("DeMo does not take sparse gradients")
            previous = self.state[param].get("delta")
            if previous is None:
                previous = torch.zeros_like(param, memory_format=torch.preserve_format)
            spare = self._spare.get(param)
            if spare is None or spare.shape != previous.shape or spare.dtype != previous.dtype:
                spare = torch.empty_like(previous)
            delta = torch.mul(previous, self.options.beta, out=spare)
            if grad is not None:
                delta.add_(grad)
            tiling = self.tilings[param]
            coefficients = self._encode(delta, tiling)
            index = coefficients.abs().topk(tiling.keep, dim=1, sorted=False).indices
            sent = coefficients.gather(1, index).to(self.value_dtype)
            kept = torch.zeros_like(coefficients).scatter_(1, index, sent.to(coefficients.dtype))
            delta.sub_(self._decode(kept, tiling).to(delta.dtype))
            values.append(sent.reshape(-1))
            indices.append(index.to(self.index_dtype).reshape(-1))
            deltas.append(delta)
        message = torch.cat([torch.cat(values).view(torch.uint8), torch.cat(indices).view(torch.uint8)])
        return message, deltas

    def _received(self, rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The workers' values and indices, ``(W, entries)`` each, checked before anything moves.

        ``nonfinite="raise"``: an index outside its chunk raises :class:`WireFormatError`, a NaN
        or Inf value :class:`NonFiniteGradientError` -- on every rank alike (they all hold the
        same rows), from the step's one host read, with no parameter and no momentum moved.
        ``"propagate"`` reads nothing: an out-of-range entry is dropped on the device (it adds
        nothing, on every rank alike), so no write lands outside a chunk."""
        # clone: a row's slice may start off its dtype's alignment inside the gathered bytes
        values = torch.stack([row[: self.values_bytes].clone().view(self.value_dtype) for row in rows])
        indices = torch.stack([row[self.values_bytes :].clone().view(self.index_dtype) for row in rows]).int()
        in_range = (indices >= 0) & (indices < self._index_bounds)
        if self.options.nonfinite == "raise":
            flags = torch.stack([in_range.all(dim=1), ~torch.stack([nonfinite(row) for row in values])])
            valid, finite = flags.tolist()  # the step's one host read
            kept = "no parameter and no momentum moved, on any rank"
            if not all(valid):
                raise WireFormatError(
                    f"DeMo step {self.steps}: rank(s) {[r for r, ok in enumerate(valid) if not ok]} sent "
                    f"coefficient indices outside their chunk (a corrupt message or a peer built "
                    f"with other settings); {kept}. The step can be taken again or the job stopped"
                )
            if not all(finite):
                raise NonFiniteGradientError(
                    f"DeMo step {self.steps}: rank(s) {[r for r, ok in enumerate(finite) if not ok]} sent "
                    f"NaN or Inf (a gradient or momentum that is not finite); {kept}. The step can "
                    "be taken again on finite gradients (e.g. after lowering the loss scale) or the job stopped"
                )
            return values, indices
        return torch.where(in_range, values, 0), torch.where(in_range, indices, 0)

    def _update(self, values: torch.Tensor, indices: torch.Tensor) -> None:
        """Sum the workers' coefficients (rank order), IDCT, sign step with decoupled weight decay."""
        start = 0
        groups = {p: g for g in self.param_groups for p in g["params"]}
        for param in self.params:
            tiling = self.tilings[param]
            end = start + tiling.entries
            total = torch.zeros(tiling.chunks, tiling.tile_rows * tiling.tile_cols,
                                dtype=working_dtype(param.dtype), device=param.device)  # fmt: skip
            for worker_values, worker_indices in zip(values, indices, strict=True):
                total.scatter_add_(
                    1,
                    worker_indices[start:end].reshape(tiling.chunks, tiling.keep).long(),
                    worker_values[start:end].reshape(tiling.chunks, tiling.keep).to(total.dtype),
                )
            direction = self._decode(total, tiling).sign_().to(param.dtype)
            group = groups[param]
            if group["weight_decay"]:
                param.mul_(1.0 - group["lr"] * group["weight_decay"])
            param.add_(direction, alpha=-group["lr"])
            start = end

    # -- the transform ------------------------------------------------------------------------
    def _basis(self, size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (size, dtype)
        if key not in self._bases:
            self._bases[key] = dct_basis(size, dtype, device)
        return self._bases[key]

    def _encode(self, tensor: torch.Tensor, tiling: Tiling) -> torch.Tensor:
        """The chunks' DCT coefficients, one chunk per row: ``(chunks, tile_rows * tile_cols)``."""
        dtype = working_dtype(tensor.dtype)
        (grid_rows, grid_cols), tr, tc = tiling.grid, tiling.tile_rows, tiling.tile_cols
        view = tensor.reshape(tiling.rows, tiling.cols).to(dtype)
        padded = torch.nn.functional.pad(
            view, (0, grid_cols * tc - tiling.cols, 0, grid_rows * tr - tiling.rows)
        )
        tiles = padded.reshape(grid_rows, tr, grid_cols, tc)
        rows, cols = self._basis(tr, dtype, tensor.device), self._basis(tc, dtype, tensor.device)
        return torch.einsum("aibj,ki,lj->abkl", tiles, rows, cols).reshape(tiling.chunks, tr * tc)

    def _decode(self, coefficients: torch.Tensor, tiling: Tiling) -> torch.Tensor:
        """The inverse of :meth:`_encode`, cropped to the parameter's shape."""
        (grid_rows, grid_cols), tr, tc = tiling.grid, tiling.tile_rows, tiling.tile_cols
        rows = self._basis(tr, coefficients.dtype, coefficients.device)
        cols = self._basis(tc, coefficients.dtype, coefficients.device)
        tiles = coefficients.reshape(grid_rows, grid_cols, tr, tc)
        padded = torch.einsum("abkl,ki,lj->aibj", tiles, rows, cols).reshape(grid_rows * tr, grid_cols * tc)
        return padded[: tiling.rows, : tiling.cols].reshape(tiling.shape)

    # -- checkpoints --------------------------------------------------------------------------
    def checkpoint_settings(self) -> dict[str, Any]:
        """A checkpoint's momentum is laid out by ``chunk`` and ``topk``: it loads only with the same."""
        return {"chunk": self.options.chunk, "topk": self.options.topk}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (every ``delta``, the groups, the step count and the byte
        totals; made with the same ``chunk`` and ``topk``)."""
        super().load_state_dict(state_dict)
        self._spare = {}  # never write into a tensor the loaded state may share
