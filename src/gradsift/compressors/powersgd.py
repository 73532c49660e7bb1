"""PowerSGD (Vogels et al. 2019), by wrapping PyTorch's own DDP communication hook.

PyTorch ships the algorithm as ``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook``
(per-layer, ``powerSGD_hook``) and ``batched_powerSGD_hook`` (the whole bucket as one
square matrix). This module does not reimplement it: :class:`PowerSGD` owns one
``PowerSGDState`` and hands it, with each bucket, to PyTorch's hook.

Per bucket and step (after ``start_iter`` plain allreduces):

1. gradsift's error feedback adds the local error ``e`` to the bucket: ``c = g + e``;
2. PyTorch's hook views each gradient as a matrix ``M`` (``shape[0] x rest``) and
   compresses it when ``(n + m) r * min_compression_rate < n m``; the others are
   allreduced as they are;
3. ``P = M Q`` (``Q`` random and orthogonalised at first, then warm-started),
   allreduce ``P``, orthogonalise it; ``Q = M^T P``, allreduce ``Q`` and divide by W;
4. writes the mean ``P Q^T`` back; error feedback keeps ``e = c - P Q^T``.

With SGD momentum the optimizer keeps its momentum and applies it to the exchanged mean, as
in the paper's Algorithm 2 (``momentum_correction = False``): DGC's momentum correction
would feed the power iteration the velocity, about ``1 / (1 - m)`` gradients of slowly
turning direction, and leave in the error what rank ``r`` misses of it; at rank 1 that
stale velocity comes back in bursts and training collapses (docs/decisions.md).

Steps 1 and 4 are PyTorch's own error feedback, moved into gradsift's state store
(PyTorch's ``PowerSGDState`` runs with ``use_error_feedback=False``), so that the
error follows DDP's bucket rebuilds, checkpoints with the hook, and is rolled back with
every other state when a step is dropped. Because communication happens *between*
the two matrix products, PowerSGD has no ``compress``/``decompress`` of one flat
tensor: it only runs through ``gradsift.register_comm_hook(ddp_model, "powersgd", ...)``,
whose ``delegated`` exchange calls :meth:`PowerSGD.ddp_hook`.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import (
    PowerSGDState,
    batched_powerSGD_hook,
    powerSGD_hook,
)

from gradsift.compressors.base import Compressor
from gradsift.compressors.pytorch_hooks import batched_hook_runs, collectives_done_on_return
from gradsift.core.errors import InvalidOptionError
from gradsift.core.payload import Payload
from gradsift.core.readout import Readout
from gradsift.core.validation import check_bool, check_int, check_real

#: The ``PowerSGDState`` fields a checkpoint needs (the hyperparameters come from the options).
_STATE_TENSOR_DICTS = ("error_dict", "p_memory_dict", "q_memory_dict")
_STATE_COUNTERS = ("iter", "total_numel_before_compression", "total_numel_after_compression")


#: Steps after a load that may run dense while DDP has not yet laid its buckets out as the
#: memories were (it rebuilds them after its first step, after its second with ``static_graph``).
DENSE_AFTER_LOAD = 2


class PowerSGD(Compressor):
    """``powersgd``: rank-``r`` power iteration per matrix-shaped layer (PyTorch's hook).

    Options (PyTorch's name in parentheses):
        rank: ``r`` (``matrix_approximation_rank``), >= 1; default 8, the lowest rank measured
            that kept fp32's accuracy on every workload measured (PyTorch's default, 1, ended
            below a worker training alone on them): docs/decisions.md, "PowerSGD's default
            rank is 8".
        start_iter: plain allreduce for the first steps (``start_powerSGD_iter``); >= 2
            when error feedback or warm start is on (DDP rebuilds buckets after step 1).
            Default 10 (PyTorch: 1000; suggested: ~10% of the steps).
        min_compression_rate: compress a layer only if it shrinks by more than this, > 0;
            default 2.
        use_error_feedback: keep the local error (PowerSGD is biased); default True.
            It lives in gradsift's error feedback (the hook's state store).
        warm_start: reuse last step's ``Q``; default True.
        orthogonalization_epsilon: added to column norms in Gram-Schmidt (PyTorch's choice at
            rank <= 2 and in half precision; QR above, which takes none), >= 0; default
            None: :func:`negligible_epsilon` of each bucket's dtype, which changes no
            norm PyTorch's default 0 handles and makes an all-zero column zeros, not
            0/0 = NaN. ``batched`` ignores it (PyTorch's batched hook takes none).
        seed: seed of the NumPy generator that draws the initial ``Q`` (same on every rank).
        batched: use ``batched_powerSGD_hook`` (the bucket as one square matrix: faster,
            usually less accurate unless rank 1); default False. Refused where the installed
            PyTorch's batched hook cannot run (:func:`batched_hook_runs`).
    """

    name = "powersgd"
    exchanges = ("delegated",)
    momentum_correction = False  # the paper's momentum, after the exchange (module docstring)

    def __init__(
        self,
        rank: int = 8,
        start_iter: int = 10,
        min_compression_rate: float = 2.0,
        use_error_feedback: bool = True,
        warm_start: bool = True,
        orthogonalization_epsilon: float | None = None,
        seed: int = 0,
        batched: bool = False,
    ) -> None:
        self.rank = check_int(rank, "rank", low=1)
        self.use_error_feedback = check_bool(use_error_feedback, "use_error_feedback")
        self.error_feedback = self.use_error_feedback  # gradsift's, in place of PyTorch's
        self.warm_start = check_bool(warm_start, "warm_start")
        lowest_start = 2 if (self.use_error_feedback or self.warm_start) else 0
        self.start_iter = check_int(start_iter, "start_iter", low=lowest_start)
        self.min_compression_rate = check_real(
            min_compression_rate, "min_compression_rate", low=0.0, low_open=True
        )
        self.orthogonalization_epsilon = (
            None
            if orthogonalization_epsilon is None
            else check_real(orthogonalization_epsilon, "orthogonalization_epsilon", low=0.0)
        )
        self.seed = check_int(seed, "seed", low=0, high=2**32 - 1)
        self.batched = check_bool(batched, "batched")
        if self.batched and not batched_hook_runs():
            raise InvalidOptionError(
                f"batched=True: PyTorch's batched_powerSGD_hook (torch {torch.__version__}) hands its "
                "_orthogonalize a single matrix where that function asserts a batch of them, so it fails "
                "at its first compressed step; use the per-layer hook (batched=False, the default)"
            )
        self.state = PowerSGDState(
            process_group=None,
            matrix_approximation_rank=self.rank,
            start_powerSGD_iter=self.start_iter,
            min_compression_rate=self.min_compression_rate,
            use_error_feedback=False,
            warm_start=self.warm_start,
            orthogonalization_epsilon=self.orthogonalization_epsilon or 0.0,
            random_seed=self.seed,
        )
        #: Parameter shapes of each bucket the memory (error, P, Q) was made for.
        self.layouts: dict[int, list[list[int]]] = {}
        #: Bytes the last :meth:`ddp_hook` call of each bucket index put on the wire.
        self.sent_nbytes: dict[int, int] = {}
        #: Steps since :meth:`load_state_dict` while it may still run dense ones (None: none to run).
        self.steps_after_load: int | None = None

    def options(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "start_iter": self.start_iter,
            "min_compression_rate": self.min_compression_rate,
            "use_error_feedback": self.use_error_feedback,
            "warm_start": self.warm_start,
            "orthogonalization_epsilon": self.orthogonalization_epsilon,
            "seed": self.seed,
            "batched": self.batched,
        }

    def will_compress(self, bucket: dist.GradBucket) -> bool:
        """Whether the next :meth:`ddp_hook` call on ``bucket`` compresses (not a dense step)."""
        return not self._dense_after_load(bucket) and self.state.iter >= self.state.start_powerSGD_iter

    def _dense_after_load(self, bucket: dist.GradBucket) -> bool:
        """After :meth:`load_state_dict`: the first step runs dense, and so does every step of the
        first :data:`DENSE_AFTER_LOAD` whose bucket is not yet in the layout its memory was made
        for (DDP rebuilds its buckets after its first step, after its second with
        ``static_graph=True``)."""
        if self.steps_after_load is None:
            return False
        if self.steps_after_load == 0:
            return True
        remembered = self.layouts.get(bucket.index())
        waiting = remembered is not None and remembered != shapes(bucket)
        return waiting and self.steps_after_load < DENSE_AFTER_LOAD

    def attach(self, module: torch.nn.Module) -> None:
        """Refuse a model with a trainable parameter of no elements: PyTorch's hook views every
        gradient of a bucket as a matrix, ``tensor.view(rows, -1)``, which no shape of zero
        elements allows, so its first step would fail inside PyTorch."""
        empty = next(
            (name for name, p in module.named_parameters() if p.requires_grad and p.numel() == 0), None
        )
        if empty is not None:
            raise InvalidOptionError(
                f"powersgd runs PyTorch's powerSGD_hook, which cannot lay out the gradient of {empty!r} "
                "(a parameter of no elements) as a matrix and fails at its first step: remove the "
                "parameter, freeze it (requires_grad=False), or pick another compressor"
            )

    def ddp_hook(
        self, process_group: dist.ProcessGroup | None, bucket: dist.GradBucket
    ) -> torch.futures.Future:
        """Run PyTorch's PowerSGD hook on ``bucket`` (the ``delegated`` exchange's contract).

        The first step after :meth:`load_state_dict` is a plain allreduce that leaves
        the memory untouched: a fresh DDP model uses its initial bucket layout for one
        step and then rebuilds its buckets (why PyTorch requires ``start_iter >= 2``),
        and the loaded memory belongs to the rebuilt layout; so is a later one of the first
        :data:`DENSE_AFTER_LOAD` steps whose bucket is not yet laid out as its memory was
        (``static_graph=True`` rebuilds a step later). A compressed step whose bucket layout
        differs from the one its memory was made for raises :class:`InvalidOptionError`
        instead of adding the error to the wrong elements.
        """
        self.state.process_group = process_group
        buffer = bucket.buffer()
        dense_nbytes = buffer.numel() * buffer.element_size()
        dense = self._dense_after_load(bucket)
        if self.steps_after_load is not None and bucket.is_last():
            self.steps_after_load += 1
            if self.steps_after_load >= DENSE_AFTER_LOAD:
                self.steps_after_load = None
        if dense:
            self.state.maybe_increase_iter(bucket)
            self.sent_nbytes[bucket.index()] = dense_nbytes
            with collectives_done_on_return():
                return default_hooks.allreduce_hook(process_group, bucket)  # type: ignore[arg-type]  # None: the default group
        compressing = self.state.iter >= self.state.start_powerSGD_iter
        if compressing:
            self._check_layout(bucket)
        if self.orthogonalization_epsilon is None:
            self.state.orthogonalization_epsilon = negligible_epsilon(buffer.dtype)
        sent_before = self.state.total_numel_after_compression
        hook = batched_powerSGD_hook if self.batched else powerSGD_hook
        with collectives_done_on_return():
            future = hook(self.state, bucket)
        sent = self.state.total_numel_after_compression - sent_before
        self.sent_nbytes[bucket.index()] = sent * buffer.element_size() if compressing else dense_nbytes
        return future

    def hook_nbytes(self, bucket: dist.GradBucket) -> int:
        """Bytes this worker contributed to the allreduces of ``bucket``'s last :meth:`ddp_hook` call.

        The whole bucket during the first ``start_iter`` steps; afterwards the elements
        of ``P``, ``Q`` and the uncompressed layers, read from the counter PyTorch's
        hook advances (``total_numel_after_compression``), times the element size.
        """
        return self.sent_nbytes.get(bucket.index(), 0)

    def _check_layout(self, bucket: dist.GradBucket) -> None:
        index = bucket.index()
        layout = shapes(bucket)
        remembered = self.layouts.get(index)
        has_memory = index in self.state.p_memory_dict
        if has_memory and remembered is not None and remembered != layout:
            raise InvalidOptionError(
                f"DDP bucket {index} holds parameters of shapes {layout}, but its PowerSGD memory "
                f"(warm start) was made for {remembered}: load a checkpoint of this model"
            )
        self.layouts[index] = layout

    def encode(
        self, flat: torch.Tensor, *, key: Hashable, capacity: int | None, readout: Readout, **extra: Any
    ) -> Payload:
        raise _hook_only()

    def decompress(self, payloads: Sequence[Payload], numel: int) -> torch.Tensor:
        raise _hook_only()

    def snapshot(self) -> dict[str, Any]:
        """:meth:`state_dict` plus the steps since a load (a rollback must not add dense ones)."""
        return {"state": self.state_dict(), "steps_after_load": self.steps_after_load}

    def restore(self, snapshot: dict[str, Any]) -> None:
        self.load_state_dict(snapshot["state"])
        self.steps_after_load = snapshot["steps_after_load"]

    def state_dict(self) -> dict[str, Any]:
        """Step count, byte counters, P/Q memories (warm start), their layouts, the RNG.

        ``error_dict`` stays empty (the error lives in gradsift's error feedback); it is
        kept in the dict so that checkpoints keep one shape."""
        _, keys, position, has_gauss, cached_gaussian = self.state.rng.get_state(legacy=True)
        keys = np.asarray(keys)
        state: dict[str, Any] = {name: int(getattr(self.state, name)) for name in _STATE_COUNTERS}
        for name in _STATE_TENSOR_DICTS:
            state[name] = {k: v.clone() for k, v in getattr(self.state, name).items()}
        state["layouts"] = {k: [list(shape) for shape in v] for k, v in self.layouts.items()}
        state["rng"] = {
            "keys": torch.from_numpy(keys.astype("int64")),
            "position": int(position),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        }
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; refused, naming the options, where the ``P``/``Q`` memories
        do not have the sizes this compressor's would (:func:`memory_numels`): a checkpoint made
        with another ``rank`` (the default was PyTorch's 1 until it became 8),
        ``min_compression_rate`` or ``batched``."""
        expected = {*_STATE_COUNTERS, *_STATE_TENSOR_DICTS, "layouts", "rng"}
        if set(state) != expected:
            raise InvalidOptionError(f"powersgd state must hold keys {sorted(expected)}; got {sorted(state)}")
        for index, layout in state["layouts"].items():
            if index not in state["p_memory_dict"]:
                continue
            held = (state["p_memory_dict"][index].numel(), state["q_memory_dict"][index].numel())
            made = memory_numels(layout, self.rank, self.min_compression_rate, self.batched)
            if held != made:
                raise InvalidOptionError(
                    f"the checkpoint's PowerSGD memory of bucket {index} holds {held[0]} + {held[1]} elements "
                    f"(P + Q), which rank={self.rank}, min_compression_rate={self.min_compression_rate:g}, "
                    f"batched={self.batched} would make {made[0]} + {made[1]}: register the hook with the "
                    "options the checkpoint was made with (the default rank was 1 before it became 8)"
                )
        for name in _STATE_COUNTERS:
            setattr(self.state, name, int(state[name]))
        for name in _STATE_TENSOR_DICTS:
            setattr(self.state, name, {k: v.clone() for k, v in state[name].items()})
        self.layouts = {k: [list(shape) for shape in v] for k, v in state["layouts"].items()}
        self.steps_after_load = 0
        rng = state["rng"]
        self.state.rng.set_state(
            (
                "MT19937",
                rng["keys"].numpy().astype("uint32"),
                rng["position"],
                rng["has_gauss"],
                rng["cached_gaussian"],
            )
        )


def shapes(bucket: dist.GradBucket) -> list[list[int]]:
    """The shapes of ``bucket``'s parameters, in its order: the layout a PowerSGD memory is made for."""
    return [list(g.shape) for g in bucket.gradients()]


def memory_numels(
    layout: Sequence[Sequence[int]], rank: int, min_compression_rate: float, batched: bool
) -> tuple[int, int]:
    """The elements of ``P`` and ``Q`` PyTorch's hook keeps (warm start) for a bucket holding
    parameters of the shapes ``layout``. Per layer (``powerSGD_hook``): each parameter viewed as
    an ``n x m`` matrix (``shape[0]`` rows) is compressed at rank ``r = min(n, m, rank)`` when
    ``(n + m) r * min_compression_rate < n m``, adding ``n r`` to ``P`` and ``m r`` to ``Q``.
    Batched (``batched_powerSGD_hook``): the bucket as one ``s x s`` square,
    ``s = ceil(sqrt(numel))``, so ``s * rank`` each."""
    if batched:
        side = math.isqrt(sum(math.prod(shape) for shape in layout) - 1) + 1
        return side * rank, side * rank
    p = q = 0
    for shape in layout:
        n = shape[0]
        m = math.prod(shape[1:])
        r = min(n, m, rank)
        if (n + m) * r * min_compression_rate < n * m:
            p, q = p + n * r, q + m * r
    return p, q


def negligible_epsilon(dtype: torch.dtype) -> float:
    """PowerSGD's default ``orthogonalization_epsilon`` for gradients of ``dtype``: the dtype's
    smallest positive number, but at least float32's smallest normal number, 2^-126 (fp32,
    bf16: 2^-126; fp16: its smallest subnormal, 2^-24).

    Gram-Schmidt divides each column of ``P = M Q`` by ``norm + epsilon``. A layer whose
    gradient and error are all zeros (a parameter no rank used this step, under
    ``find_unused_parameters=True``) gives a zero column, which PyTorch's default 0 turns into
    0/0 = NaN: a step whose mean is not finite, dropped or poisoned like an overflow, at every
    compressed step. Any positive epsilon gives zeros. This one is at most half a unit in the
    last place of every norm of at least ``4 epsilon / finfo(dtype).eps`` (fp32: 2^-101;
    fp16: 2^-12; fp64: 2^-72), so such a norm, and the step, are bit for bit PyTorch's. It is
    normal in float32, so no flush of subnormals to zero undoes it where the sum is taken in
    float32 or wider.
    """
    info = torch.finfo(dtype)
    return max(info.tiny * info.eps, torch.finfo(torch.float32).tiny)


def _hook_only() -> InvalidOptionError:
    return InvalidOptionError(
        "powersgd exchanges P and Q between its two matrix products, so it has no compress()/"
        "decompress() of a single tensor; use gradsift.register_comm_hook(ddp_model, 'powersgd', ...)"
    )
