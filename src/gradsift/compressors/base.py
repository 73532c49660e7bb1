"""The compressor protocol (the payload it produces is :mod:`gradsift.core.payload`'s).

A compressor turns one flat gradient into a :class:`Payload` and a list of payloads, one
per worker, back into the dense mean (``decompress``). It never talks to the network and
never keeps error-feedback residuals: those are :mod:`gradsift.hook.feedback`'s job.
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
  :class:`~gradsift.core.readout.Readout`, read once when the step closes.
* :meth:`Compressor.compress` is the public call: the same ``encode`` with no capacity
  (every selected element, exactly), then one host read that raises
  :class:`~gradsift.core.errors.NonFiniteGradientError` for a non-finite input and applies
  the compressor's adaptation.
"""

from __future__ import annotations

import abc
from collections.abc import Hashable, Sequence
from typing import Any, ClassVar, NamedTuple

import torch

from gradsift.core.errors import InvalidOptionError, NonFiniteGradientError
from gradsift.core.finite import nonfinite
from gradsift.core.mean import divided
from gradsift.core.payload import Count, Payload
from gradsift.core.readout import Readout
from gradsift.core.store import Canonical, TensorStore
from gradsift.core.transaction import Transaction
from gradsift.core.validation import as_flat_gradient, check_ratio


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
            :class:`gradsift.hook.feedback.ErrorFeedback` when True.
        identity: the payload is the gradient itself (``none``), so the DDP hook
            runs stock DDP's in-place allreduce on the bucket.
        needs_parameters: the method needs to know which parameters a flat tensor
            holds (VGC reads their per-sample variance); the DDP hook then calls
            ``encode(tensor, key=..., parameters=[p, ...])`` with the parameters in
            flattening order.
        adaptive_capacity: the number of entries the method sends follows the data,
            with no ratio to bound it (a fixed threshold, VGC): the DDP hook then sizes
            the payload from the counts of earlier steps (:mod:`gradsift.hook.capacity`).
        server_stage: :meth:`encode` is deterministic, keeps no state and does not depend
            on the rank, so every rank can compress the workers' mean again and get the
            same result (1-bit Adam's server stage, the hook option ``server_feedback``).
        momentum_correction: the DDP hook takes an adopted SGD optimizer's momentum over
            (DGC's momentum correction, :mod:`gradsift.hook.recipe`); False: the optimizer
            keeps it and applies it to the exchanged mean (PowerSGD, whose paper does so).
        residual_decay: error feedback's ``beta`` in ``c = g + beta r`` when the hook option
            ``residual_decay`` is unset (1: plain error feedback; random-k's is below 1).
        sparse: the payload is selected values at their positions (``values`` and
            ``indices``, no codes), so error feedback subtracts it from the residual without
            the compensated gradient (:meth:`gradsift.hook.feedback.ErrorFeedback.keeps_lazily`).
        own_residual: the method keeps what it did not send in its own state (VGC's
            residual), so the hook's error feedback would send that part twice: the hook
            option ``error_feedback=True`` is refused with it.
        decode_checks: :meth:`decompress_into` returns a malformed flag of its own (VGC's
            words), so the step's flag is known only once the means are written: the DDP hook
            then never lets a bucket hold state until the close
            (:class:`~gradsift.core.parts.Context`'s ``before_mean``).

    Example (docs/extending.md writes a new one, end to end)::

        compressor = gradsift.get_compressor("topk", ratio=0.01)
        payload = compressor.compress(gradient)  # the 1% largest |g|: payload.indices, payload.values
        mean = compressor.decompress([payload, other_payload], gradient.numel())  # the dense mean
    """

    name: ClassVar[str]
    #: The fraction of elements the method sends (a sparsifier's wire budget, which
    #: ``exchange="auto"`` and the density warm-up read); None: no such budget.
    ratio: float | None = None
    #: The ``__init__`` option that sets how much the method sends (``"ratio"``,
    #: ``"threshold"``), for tools that sweep it; None: nothing sets it.
    density_option: ClassVar[str | None] = None
    exchanges: ClassVar[tuple[str, ...]] = ("allgather",)
    error_feedback: bool = True  # a class default an instance may override (PowerSGD)
    needs_parameters: ClassVar[bool] = False
    identity: ClassVar[bool] = False
    adaptive_capacity: ClassVar[bool] = False
    server_stage: ClassVar[bool] = False
    momentum_correction: ClassVar[bool] = True
    residual_decay: ClassVar[float] = 1.0
    sparse: ClassVar[bool] = False
    own_residual: ClassVar[bool] = False
    decode_checks: ClassVar[bool] = False

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
        compressor's state then stays as it was, as it does when encoding raises). One
        :class:`~gradsift.core.transaction.Transaction`, ended by its ``settle``.
        """
        flat = as_flat_gradient(tensor)
        transaction = Transaction(self.store, self)
        try:
            payload = self.encode(flat, key=key, capacity=None, readout=transaction.readout, **extra)
        except BaseException:
            transaction.roll_back()
            raise
        flag = payload.nonfinite
        if flag is None and payload.values is not None:
            flag = nonfinite(payload.values)
        if not transaction.settle(None if flag is None else transaction.readout.slot(flag)):
            raise NonFiniteGradientError("gradient contains NaN or Inf values")
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
        :class:`~gradsift.core.store.TensorStore` (:attr:`store`), which rolls back for free.
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

    def reordering(self, key: Hashable, numel: int) -> Canonical | None:
        """``key``'s canonical layout (:meth:`TensorStore.canonical`) where the flat tensor is laid
        out otherwise; None for an empty tensor, a key without a layout, or one in number order."""
        canonical = self.store.canonical(key) if numel else None
        return None if canonical is None or canonical.identity else canonical

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
    ``mean_w scatter_add(indices_w, values_w)`` (:func:`scatter_mean`: one ``index_add_``
    per worker in rank order, so indices repeated across workers add up, in the same order
    on every rank; padding adds zero at index 0).

    The capacity of a sparsifier with a ``ratio`` is ``k = max(1, floor(n ratio))``:
    the ratio is the wire budget, and a threshold method that selects more sends the
    ``k`` largest of them (:func:`gradsift.compressors.kernels.keep_largest`), the rest waiting in
    error feedback.
    """

    exchanges: ClassVar[tuple[str, ...]] = ("allgather", "balanced", "shared-mask")
    density_option: ClassVar[str | None] = "ratio"
    sparse: ClassVar[bool] = True
    ratio: float

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
    """Dense mean of sparse payloads: ``(1/W) sum_w scatter_add(indices_w, values_w)``,
    summed in rank order.

    One ``index_add_`` per payload, in list order (the exchanges pass them in rank order):
    an index sent by several workers accumulates every value, and a payload's indices are
    unique (its padding entries add zero at index 0, which changes no sum), so each
    position sees its additions in a fixed order -- ``((0 + v_0) + v_1) + ...`` -- on
    every device. A single ``index_add_`` of all payloads would leave that order to
    CUDA's atomics and give ranks different last bits (docs/decisions.md, "The sparse
    mean adds in rank order"). The result has the payloads' dtype and device; with ``out``
    (``numel`` elements) it is written there, in place, and returned (summed in the
    payloads' dtype, then cast, when ``out`` has another one).
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
    world = len(payloads)
    # 1/W on the received values (a pass over W k entries, not n) in float32 and wider; half
    # precision sums first, so that values near its subnormal range keep their bits
    scaled_first = world > 1 and torch.finfo(first.dtype).bits >= 32
    pairs = [(p.indices, p.values) for p in payloads if p.indices is not None and p.values is not None]
    device = pairs[0][1].device
    dense = torch.zeros(numel, dtype=first.dtype, device=device) if out is None else out.zero_()
    for indices, received in pairs:
        values = received.to(first.dtype)
        dense.index_add_(0, indices, divided(values, world) if scaled_first else values)
    if world > 1 and not scaled_first:
        dense /= world
    return dense
