"""VGC: variance-based gradient compression (Tsuzuku, Imachi, Akiba 2018).

Per tensor ``key`` a worker keeps the unsent gradient ``r`` and its accumulated
variance ``v`` (zeros at first). Each call, with gradient ``g`` and its variance ``s``:

1. ``r <- r + g``, ``v <- v + s``.
2. Send element ``i`` iff ``r_i^2 > alpha * v_i`` (``|r_i| / sqrt(v_i) > sqrt(alpha)``),
   or -- hybrid with Strom's method, when ``tau`` is set -- iff ``|r_i| > tau`` too.
3. Of the elements that pass, those with ``|r_i| >= M * 2^-7.5`` (``M`` their largest
   magnitude) are sent as 4-bit codes ``Q(r_i) = sign * M * 2^-l``
   (:mod:`gradsift.compressors.vgc_codec`): ``r_i <- r_i - Q(r_i)`` (the quantization
   error stays), ``v_i <- 0``. Smaller ones would round up to ``M/128``; they stay
   unsent (decision: sending them injects that overshoot as noise every step).
4. Unsent elements keep ``r_i`` and decay ``v_i <- zeta * v_i``, so a pure-noise element
   is sent eventually.

Scale convention of ``alpha``: ``s`` is the variance of the gradient tensor as autograd
produced it (:mod:`gradsift.compressors.variance`; for a mean loss, the variance of the minibatch
mean, ``(1/B) * ((1/B) sum_z g_z^2 - g^2)``), so ``alpha`` is a squared signal-to-noise
ratio in standard errors: ``alpha = 1`` sends an element once its accumulated value
exceeds one standard deviation of its accumulated noise.

Under the DDP hook the message has room for a fixed number of words, sized from the
counts of earlier steps (``adaptive_capacity``; the first step's from ``first_ratio``):
when more elements pass, the largest are sent and the others stay unsent (their residual
and variance as in step 4).

VGC's residual *is* its error feedback, so ``error_feedback = False`` and the hook option
``error_feedback=True`` is refused (``own_residual``: the unsent part would travel twice). ``r`` and ``v``
live in the compressor's :attr:`~gradsift.compressors.base.Compressor.store` (tables
``vgc.residual`` and ``vgc.variance``): under the DDP hook that is the hook's shared
store, so both follow DDP's bucket rebuilds, checkpoint with the hook and are rolled
back with a dropped step. Decompressing sums every worker's decoded words
(``index_add_``) and divides by the worker count.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from typing import Any

import torch
from torch import nn

from gradsift.compressors import vgc_codec
from gradsift.compressors.base import Compressor, in_use, scatter_mean, target_count
from gradsift.compressors.kernels import candidate_positions, select_mask, zero_at
from gradsift.compressors.variance import CONV_RULES, METHODS, VarianceTracker
from gradsift.core.errors import InvalidOptionError
from gradsift.core.payload import Payload
from gradsift.core.readout import Readout
from gradsift.core.validation import check_choice, check_ratio, check_real

RESIDUAL, VARIANCE = "vgc.residual", "vgc.variance"


class VGCPayload(Payload):
    """A VGC message: ``codes`` (chunk counts + one word per element), ``scales = [M]``.

    Its capacity is the number of words (``codes`` less the chunk counts), each entry
    one 4-byte word; ``count`` is the number of elements sent.
    """

    @property
    def capacity(self) -> int:
        return 0 if self.codes is None else self.codes.numel() - vgc_codec.chunk_count(self.numel)

    def entry_nbytes(self) -> int:
        return 4

    @property
    def count(self) -> int:
        return self.capacity if self.length is None else int(self.length)

    def trimmed(self) -> Payload:
        if self.length is None or self.codes is None:
            return self
        used = vgc_codec.chunk_count(self.numel) + int(self.length)
        return dataclasses.replace(self, codes=self.codes[:used], length=None)


class VGC(Compressor):
    """Variance-based selection with 32-bit (28-bit index, 4-bit code) elements.

    Options:
        alpha: squared signal-to-noise threshold, >= 0 (larger = sparser; 0 sends every
            non-zero element).
        zeta: decay of the accumulated variance of unsent elements, in [0, 1].
        tau: Strom threshold for the hybrid rule (also send ``|r| > tau``); None = off.
        variance_method: ``"hooks"`` (cheap per-layer rules) or ``"exact"``
            (``torch.func``; call ``compressor.tracker.record_exact(...)`` each step).
        conv_rule: ``"approx"`` (cross-position terms dropped) or ``"exact"`` (per-sample
            convolution weight gradients, one layer at a time); see :mod:`gradsift.compressors.variance`.
        first_ratio: under the DDP hook, the first step's room for words as a fraction of
            the elements, in (0, 1] (default 0.01; later steps follow the counts).

    Use standalone with ``compress(grad, variance=s)``, or after :meth:`attach` with
    ``compress(flat, key=..., parameters=[...])`` (what the DDP hook does, through
    :meth:`encode`).
    """

    name = "vgc"
    decode_checks = True  # decompress_into flags malformed words
    error_feedback = False
    own_residual = True
    needs_parameters = True
    adaptive_capacity = True

    def __init__(
        self,
        alpha: float = 1.0,
        zeta: float = 0.999,
        tau: float | None = None,
        variance_method: str = "hooks",
        conv_rule: str = "approx",
        first_ratio: float = 0.01,
    ) -> None:
        self.alpha = check_real(alpha, "alpha", low=0.0)
        self.zeta = check_real(zeta, "zeta", low=0.0, high=1.0)
        self.tau = None if tau is None else check_real(tau, "tau", low=0.0, low_open=True)
        self.variance_method = check_choice(variance_method, "variance_method", METHODS)
        self.conv_rule = check_choice(conv_rule, "conv_rule", CONV_RULES)
        self.first_ratio = check_ratio(first_ratio, "first_ratio")
        self.tracker: VarianceTracker | None = None

    def options(self) -> dict[str, Any]:
        return {
            "alpha": self.alpha,
            "zeta": self.zeta,
            "tau": self.tau,
            "variance_method": self.variance_method,
            "conv_rule": self.conv_rule,
            "first_ratio": self.first_ratio,
        }

    def capacity(self, numel: int) -> int | None:
        return target_count(numel, self.first_ratio)

    def attach(self, module: nn.Module) -> None:
        """Install the variance hooks on ``module`` (once; a second call replaces them)."""
        if self.tracker is not None:
            self.tracker.remove()
        self.tracker = VarianceTracker(module, method=self.variance_method, conv_rule=self.conv_rule)

    def encode(
        self,
        flat: torch.Tensor,
        *,
        key: Hashable,
        capacity: int | None,
        readout: Readout,
        parameters: Sequence[nn.Parameter] | None = None,
        variance: torch.Tensor | None = None,
        **extra: Any,
    ) -> Payload:
        """Accumulate ``flat`` and its variance under ``key``; send what passes the test.

        The variance comes from ``variance`` (same number of elements), or from the
        attached tracker for ``parameters`` (their gradients concatenated in order
        make up ``flat``; parameters without a recorded variance count as 0). No host read.
        """
        if extra:
            raise InvalidOptionError(f"vgc takes no {', '.join(sorted(extra))}")
        step_variance = self._step_variance(flat, parameters, variance)
        residual = self.store.get(RESIDUAL, key)
        accumulated = self.store.get(VARIANCE, key)
        if residual is not None and residual.shape != flat.shape:
            raise InvalidOptionError(
                f"tensor {key!r} changed from {residual.numel()} to {flat.numel()} elements; "
                f"call reset({key!r}) when a bucket is rebuilt"
            )
        # New tensors, put into the store: the hook's step rolls them back if a rank was non-finite.
        residual = flat.clone() if residual is None else residual + flat
        accumulated = step_variance if accumulated is None else step_variance.add_(accumulated)

        squared = residual * residual
        # "not (r^2 <= alpha v)" rather than "r^2 > alpha v": a NaN is selected, so it
        # reaches the scale M below, whose finiteness covers every element.
        keep = squared <= accumulated * self.alpha
        if self.tau is not None:
            keep &= squared <= self.tau * self.tau
        # Step 3 over every element that passed (M and the demand from the whole set): on CPU
        # their positions, host-sized; on a device every element, masked.
        passed, live = candidate_positions(~keep)
        candidates = residual if passed is None else residual.index_select(0, passed)
        magnitudes = candidates.abs()
        in_play = magnitudes if live is None else torch.where(live, magnitudes, 0.0)
        scale = in_play.max() if in_play.numel() else in_play.new_zeros(())
        # Below M * 2^-7.5 a value would be sent as M/128, injecting that overshoot as
        # noise: it stays in the residual instead (unsent, its variance keeps decaying).
        sendable = vgc_codec.representable(magnitudes, scale)
        if live is not None:
            sendable &= live
        chosen = select_mask(sendable, capacity, candidates)
        indices, length = chosen.indices, chosen.length
        if passed is not None:  # nothing passed: the padding's position 0 (none in use)
            indices = passed.index_select(0, indices) if passed.numel() else torch.zeros_like(indices)
            used = None if capacity is None else in_use(capacity, length, flat.device)
            if used is not None:
                indices = torch.where(used, indices, 0)
        codes, scales, quantized = vgc_codec.encode(
            indices, residual.index_select(0, indices), flat.numel(), length
        )

        residual.index_add_(0, indices, quantized, alpha=-1)
        zero_at(accumulated.mul_(self.zeta), indices, in_use(indices.numel(), length, flat.device))
        self.store.put(RESIDUAL, key, residual)
        self.store.put(VARIANCE, key, accumulated)
        return VGCPayload(
            numel=flat.numel(),
            dtype=flat.dtype,
            codes=codes,
            scales=scales,
            length=length,
            demand=None if capacity is None else chosen.selected,
            nonfinite=~torch.isfinite(scale),
        )

    def _step_variance(
        self, flat: torch.Tensor, parameters: Sequence[nn.Parameter] | None, variance: torch.Tensor | None
    ) -> torch.Tensor:
        """This step's variance ``s`` as a new flat tensor of ``flat``'s dtype."""
        if variance is not None:
            if variance.numel() != flat.numel():
                raise InvalidOptionError(
                    f"variance must have as many elements as tensor ({flat.numel()}), got {variance.numel()}"
                )
            return variance.reshape(-1).to(flat.dtype, copy=True)
        if parameters is None:
            raise InvalidOptionError(
                "vgc needs variance= (a tensor like the gradient) or parameters= after attach()"
            )
        if self.tracker is None:
            raise InvalidOptionError("vgc got parameters= but attach(module) was never called")
        total = sum(p.numel() for p in parameters)
        if total != flat.numel():
            raise InvalidOptionError(f"parameters hold {total} elements but tensor has {flat.numel()}")
        return self.tracker.take_variance(parameters, flat)

    def decompress(self, payloads: Sequence[Payload], numel: int) -> torch.Tensor:
        """The mean of exact messages (:func:`vgc_codec.decode`: strict, raises on a malformed one)."""
        decoded = []
        for payload in payloads:
            codes, scales = _codes_and_scales(payload)
            indices, values = vgc_codec.decode(codes, scales, numel)
            decoded.append(Payload(numel=payload.numel, dtype=torch.float32, values=values, indices=indices))
        return scatter_mean(decoded, numel).to(payloads[0].dtype)

    def decompress_into(self, payloads: Sequence[Payload], out: torch.Tensor) -> torch.Tensor | None:
        """The mean of (fixed-capacity) messages into ``out`` without a host read; returns the
        malformed flag (:func:`vgc_codec.decode_words`' problems, OR-ed over the messages)."""
        decoded, problems = [], []
        for payload in payloads:
            codes, scales = _codes_and_scales(payload)
            indices, values, found = vgc_codec.decode_words(codes, scales, out.numel(), payload.length)
            decoded.append(
                Payload(numel=payload.numel, dtype=out.dtype, values=values.to(out.dtype), indices=indices)
            )
            problems.append(found)
        scatter_mean(decoded, out.numel(), out=out)
        return torch.stack(problems).amax() > 0

    @property
    def residuals(self) -> dict[Hashable, torch.Tensor]:
        """The unsent gradient ``r`` per key (a snapshot dict)."""
        return self.store.table(RESIDUAL)

    @property
    def variances(self) -> dict[Hashable, torch.Tensor]:
        """The accumulated variance ``v`` per key (a snapshot dict)."""
        return self.store.table(VARIANCE)

    def reset(self, key: Hashable | None = None) -> None:
        """Forget the residual and variance of one key, or of every key."""
        tables = (RESIDUAL, VARIANCE)
        keys = {k for table in tables for k in self.store.table(table)} if key is None else {key}
        for stale in keys:
            self.store.discard(stale, tables)

    def state_dict(self) -> dict[str, Any]:
        """Residuals ``r`` and accumulated variances ``v`` by key (cloned) -- empty under the
        DDP hook, whose shared store holds and checkpoints them."""
        if not self.owns_store:
            return {}
        return {
            "residuals": {k: r.clone() for k, r in self.residuals.items()},
            "variances": {k: v.clone() for k, v in self.variances.items()},
        }

    def __getstate__(self) -> dict[str, Any]:
        """Pickle without the tracker (it holds the model and its hooks); ``attach`` again after loading."""
        return {**self.__dict__, "tracker": None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        if not state:
            return
        missing = {"residuals", "variances"} - set(state)
        if missing:
            raise InvalidOptionError(
                f"vgc state needs keys residuals and variances, missing {sorted(missing)}"
            )
        self.reset()
        for table, name in ((RESIDUAL, "residuals"), (VARIANCE, "variances")):
            for key, tensor in state[name].items():
                self.store.put(table, key, tensor.clone())


def _codes_and_scales(payload: Payload) -> tuple[torch.Tensor, torch.Tensor]:
    if payload.codes is None or payload.scales is None:
        raise InvalidOptionError("a vgc payload carries codes and scales")
    return payload.codes, payload.scales
