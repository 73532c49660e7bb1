"""SIDCo: statistical threshold sparsification (Abdelmoniem et al., MLSys 2021).

The magnitudes ``a = |g|`` are modelled by a sparsity-inducing distribution whose
fitted quantile gives a threshold ``eta`` with ``P(a > eta) = delta``; the selection is
then one comparison pass ``|g| > eta``. Per call, for a tensor of ``n`` elements and
target count ``k = max(1, floor(n delta))``:

0. **Small tensors** (``adapt=True`` and ``n < exact_below``): the exact top-k
   (:func:`gradsift.compressors.topk.top_k_selection`), which there costs less than
   any fit -- and is the best estimate of the top-``k`` set there is (exact zeros
   left out, as ``|g| > eta`` leaves them out). Steps 1-6 are skipped; the state
   records the call and the k-th magnitude as ``threshold``.
1. **Sample.** ``S <= sample_size`` magnitudes at the stride ``ceil(n/sample_size)``
   (the offset rotates with the call count), in float32 (float64 for float64
   gradients; the fits accumulate in float64). For ``n <= sample_size`` this is the
   whole tensor.
2. **Fit in stages** (peaks over threshold, docs/sidco.md): stage 1 fits the first
   family to the sample and takes ``eta_1`` for ``delta_1 = first_ratio``; stages
   ``m = 2..M`` keep the exceedances ``x > eta_{m-1}``, shift them by ``t = min(x)``
   and set ``eta_m = t + threshold(fit_tail(x - t), delta_m)`` with
   ``delta_m = (delta/delta_1)^(1/(M-1))``. ``M = 1`` (or ``delta >= delta_1``) is
   the single-stage fit. A NaN or Inf in the sample makes the fit non-finite, which
   raises :class:`NonFiniteGradientError` here.
3. **Correct.** ``eta = eta_M * exp(c)`` with ``c`` the per-tensor log correction
   learned from previous calls (step 6).
4. **Check on the sample** (``adapt=True``): the sample's exceedance count at
   ``eta`` predicts the achieved count; if it misses the expected ``k S/n`` by more
   than a factor ``1.25`` (or 3 standard errors, ``exp(3/sqrt(k S/n))``, when the
   sample is not the whole tensor), ``eta`` becomes the sample's own quantile
   (the value with ``round(k S/n)`` sample elements above it). This is what holds
   the density on error-compensated gradients, where a few percent of ``eta`` moves
   the count many-fold (docs/decisions.md).
5. **Select** ``|g| > eta`` over the full tensor
   (:func:`gradsift.compressors.threshold.threshold_selection`: one read of memory;
   NaN and Inf are selected, a non-finite ``eta`` included, so checking the selected
   values checks all ``n``); with a capacity (the DDP hook's ``k``), the ``k`` largest
   of them when there are more.
6. **Adapt** (``adapt=True``): with ``L = ln(achieved/k)`` and ``s`` the local
   log-log slope ``d ln(count)/d ln(eta)`` measured on the sample, the next
   correction is ``c = ln(eta/eta_M) - 0.5 L/s`` (damped Newton step in log space,
   step at most 1, ``|c| <= ln(100)``). With ``stages=None`` the stage count is the
   ``M`` in ``[1, ceil(log2(1/delta))]`` whose uncorrected threshold predicts the
   count best on the sample: all candidates on the first call, ``M-1..M+1`` every
   ``stage_period`` calls (``c`` is re-based so the applied threshold is continuous).

Everything runs on the gradient's device without a host read: the fits, thresholds,
the correction and the sample counts are 0-d tensors, and each choice between two
thresholds is a ``torch.where``. The sample counts a call needs come from broadcast
comparisons of the sample with several thresholds at once (:func:`sample_counts`). The
one decision the host must make -- which stage count the next calls use, since it sets
how many stages are computed -- is taken from the sample errors read once when the
DDP hook's step closes (``readout``; at once in :meth:`compress`), and applied only
if that step is kept. Per-tensor state (stage count, log correction, call count, last
threshold) lives in the instance per ``key`` and round-trips through ``state_dict()``.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable
from typing import Any, ClassVar

import torch

from gradsift.compressors.base import Selection, Sparsifier, target_count
from gradsift.compressors.kernels import CallingThreadOnly, nonzero_first
from gradsift.compressors.sidco_sample import (
    correction_of,
    device_threshold,
    log_miss,
    magnitude_sample,
    max_stage_count,
    sample_counts,
    sample_slope,
)
from gradsift.compressors.stats import (
    MagnitudeFit,
    Moments,
    exponential_excess,
    exponential_of,
    gamma_of,
    generalized_pareto_excess,
    generalized_pareto_of,
    moments,
)
from gradsift.compressors.tail_kernels import kept_or_value_with_above, narrowed
from gradsift.compressors.threshold import threshold_selection
from gradsift.compressors.topk import top_k_selection
from gradsift.core.errors import InvalidOptionError
from gradsift.core.payload import Count
from gradsift.core.readout import Readout
from gradsift.core.store import Canonical
from gradsift.core.validation import check_bool, check_int, check_real

_SAMPLE_TOLERANCE = math.log(1.25)  # the sample check's band for ln(count/expected)
_STANDARD_ERRORS = 3.0  # ... widened to this many Poisson standard errors on a subsample
_MIN_EXPECTED = 4.0  # below this many expected sample exceedances a subsample says nothing
_DAMPING = 0.5
_MAX_STEP = 1.0
_MAX_LOG_CORRECTION = math.log(100.0)
_STAGE_MARGIN = 0.05  # a stage count must predict better by this much (in |ln|) to replace the current
_STATE_KEYS = {"stages", "log_correction", "calls", "threshold"}


class _SIDCo(Sparsifier):
    """Multi-stage statistical threshold with per-tensor closed-loop correction.

    Options:
        ratio: target density delta in (0, 1].
        first_ratio: stage-1 density delta_1 in (0, 1) (default 0.25).
        stages: ``None`` adapts the stage count per tensor (with ``adapt=False`` it
            stays at 2, or 1 when that is the maximum); an int in
            ``[1, ceil(log2(1/ratio))]`` fixes it.
        sample_size: elements the stages are fitted on (>= 1024; default 2^18).
        adapt: run the sample check and the between-call correction, and take the
            exact top-k below ``exact_below`` elements (default True); False gives
            the paper's plain fitted threshold at every size.
        stage_period: calls between stage-count re-evaluations when ``stages=None``.
        exact_below: with ``adapt=True``, tensors of fewer elements get the exact
            top-k (integer >= 0; None, the default, takes the variant's
            :attr:`crossover`; 0 fits every tensor).
    """

    first_fit: ClassVar[staticmethod[[torch.Tensor], MagnitudeFit]]
    tail_fit: ClassVar[staticmethod[[Moments], tuple[torch.Tensor, MagnitudeFit]]]
    #: The size from which this variant's statistical path costs less than the exact top-k
    #: on CPU (measured one thread, ratio 0.01: results/compress/crossover-cpu.json), rounded
    #: up to a power of two: ``exact_below``'s default.
    crossover: ClassVar[int]

    def __init__(
        self,
        ratio: float = 0.01,
        first_ratio: float = 0.25,
        stages: int | None = None,
        sample_size: int = 1 << 18,
        adapt: bool = True,
        stage_period: int = 5,
        exact_below: int | None = None,
    ) -> None:
        super().__init__(ratio)
        self.first_ratio = check_real(
            first_ratio, "first_ratio", low=0.0, high=1.0, low_open=True, high_open=True
        )
        self.max_stages = max_stage_count(self.ratio)
        self.stages = None if stages is None else check_int(stages, "stages", low=1, high=self.max_stages)
        self.sample_size = check_int(sample_size, "sample_size", low=1024)
        self.adapt = check_bool(adapt, "adapt")
        self.stage_period = check_int(stage_period, "stage_period", low=1)
        self.exact_below = (
            self.crossover if exact_below is None else check_int(exact_below, "exact_below", low=0)
        )
        self._keys: dict[Hashable, dict[str, Any]] = {}

    def options(self) -> dict[str, Any]:
        return {
            "ratio": self.ratio,
            "first_ratio": self.first_ratio,
            "stages": self.stages,
            "sample_size": self.sample_size,
            "adapt": self.adapt,
            "stage_period": self.stage_period,
            "exact_below": self.exact_below,
        }

    # -- the statistical threshold ------------------------------------------------

    def fitted_threshold(self, sample: torch.Tensor, stages: int) -> torch.Tensor:
        """``eta_M`` of the multi-stage fit on ``sample`` (magnitudes) with ``stages`` stages."""
        return self.fitted_thresholds(sample, (stages,))[stages]

    def fitted_thresholds(self, sample: torch.Tensor, candidates: Iterable[int]) -> dict[int, torch.Tensor]:
        """``{M: eta_M}`` (0-d tensors) for each stage count ``M`` in ``candidates``.

        Stage 1's fit is computed once and shared by every ``M``. A NaN or Inf in the
        sample makes every threshold non-finite (the selection then flags the input).
        """
        first = type(self).first_fit(sample)
        single = device_threshold(first, self.ratio)
        eta_1 = None
        thresholds: dict[int, torch.Tensor] = {}
        for stages in candidates:
            if stages == 1 or self.ratio >= self.first_ratio:
                thresholds[stages] = single
                continue
            if eta_1 is None:
                eta_1 = device_threshold(first, self.first_ratio)
            thresholds[stages] = self._tail_threshold(sample, eta_1, stages)
        return thresholds

    def _tail_threshold(self, sample: torch.Tensor, eta: torch.Tensor, stages: int) -> torch.Tensor:
        """Stages 2..M from ``eta_1 = eta``: each fits the excess of the exceedances of the
        previous threshold; a stage with fewer than 2 exceedances keeps the previous one.
        Each stage looks only at the previous stage's tail (:func:`gradsift.compressors.tail_kernels.narrowed`)."""
        stage_ratio = (self.ratio / self.first_ratio) ** (1.0 / (stages - 1))
        tail = sample
        for _ in range(stages - 1):
            tail = narrowed(tail, eta)
            above = moments(tail, above=eta)
            base, fit = type(self).tail_fit(above)
            eta = torch.where(above.count >= 2, base + device_threshold(fit, stage_ratio), eta)
        return eta

    def _stage_candidates(self, state: dict[str, Any], expected: float) -> range:
        """The stage counts to evaluate this call (only the current one unless re-evaluating)."""
        current = state["stages"]
        if self.stages is None and expected >= _MIN_EXPECTED:
            if state["calls"] == 0:
                return range(1, self.max_stages + 1)
            if state["calls"] % self.stage_period == 0:
                return range(max(1, current - 1), min(self.max_stages, current + 1) + 1)
        return range(current, current + 1)

    def _fit_and_apply(
        self, sample: torch.Tensor, state: dict[str, Any], expected: float, readout: Readout
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(eta_M, eta)``: the fitted threshold of the stage count in use and the applied
        one, ``eta_M e^c``.

        When several stage counts are evaluated, each one's *uncorrected* threshold is
        scored by ``|ln(predicted/expected)|`` on the sample; once those scores are read
        (the step's readout), the best replaces the current count only if it is better
        by :data:`_STAGE_MARGIN`, and ``c`` is re-based
        (``eta_old e^c_old == eta_new e^c_new``) so the applied ``eta`` does not jump.
        """
        current = state["stages"]
        fitted = self.fitted_thresholds(sample, self._stage_candidates(state, expected))
        applied = fitted[current] * torch.exp(correction_of(state, sample.device))
        if len(fitted) > 1:
            counts = sample_counts(sample, list(fitted.values()))
            scores = readout.slot(torch.log((counts + 0.5) / (expected + 0.5)).abs())
            readout.after_commit(
                lambda: self._choose_stages(state, fitted, dict(zip(fitted, scores.values, strict=True)))
            )
        return fitted[current], applied

    @staticmethod
    def _choose_stages(
        state: dict[str, Any], fitted: dict[int, torch.Tensor], errors: dict[int, float]
    ) -> None:
        """Apply the stage choice of :meth:`_fit_and_apply` (host values of its scores)."""
        current = state["stages"]
        best = min(errors, key=errors.__getitem__)
        if errors[current] <= errors[best] + _STAGE_MARGIN or best == current:
            return
        state["stages"] = best
        old, new = fitted[current], fitted[best]
        correction = correction_of(state, old.device)
        rebased = correction + torch.log(old.clamp_min(1e-300) / new.clamp_min(1e-300))
        state["log_correction"] = torch.where((old > 0) & (new > 0), rebased, correction)

    # -- closed loop --------------------------------------------------------------

    @staticmethod
    def _checked_on_sample(
        sample: torch.Tensor, eta: torch.Tensor, expected: float, exact: bool
    ) -> torch.Tensor:
        """``eta``, or the sample's own quantile when the sample predicts a clear miss."""
        if expected < (1.0 if exact else _MIN_EXPECTED):
            return eta
        tolerance = (
            _SAMPLE_TOLERANCE if exact else max(_SAMPLE_TOLERANCE, _STANDARD_ERRORS / math.sqrt(expected))
        )
        (count,) = sample_counts(sample, [eta])
        miss = log_miss(count, expected)
        assert isinstance(miss, torch.Tensor)  # a count of the sample is a tensor
        keep = min(round(expected), sample.numel() - 1)
        return kept_or_value_with_above(miss.abs() <= tolerance, eta.double(), sample, keep)

    def _next_correction(
        self, slope: torch.Tensor, eta: torch.Tensor, eta_fit: torch.Tensor, achieved: Count, k: int
    ) -> torch.Tensor:
        """Damped Newton step in log space driving ``achieved/k`` to 1: ``c = ln(eta/eta_fit)
        - 0.5 L/s`` with ``L = ln((achieved + 1/2)/(k + 1/2))`` and ``s`` = ``slope``, the sample's
        :func:`~gradsift.compressors.sidco_sample.sample_slope` at ``eta`` (step in ``[-1, 1]``,
        ``|c| <= ln(100)``)."""
        step = (_DAMPING * log_miss(achieved, k) / slope).clamp(-_MAX_STEP, _MAX_STEP)
        corrected = torch.log(eta.clamp_min(1e-300) / eta_fit.clamp_min(1e-300)) + step
        return corrected.clamp(-_MAX_LOG_CORRECTION, _MAX_LOG_CORRECTION)

    # -- Sparsifier ---------------------------------------------------------------

    def _state(self, key: Hashable) -> dict[str, Any]:
        if key not in self._keys:
            initial = self.stages if self.stages is not None else min(2, self.max_stages)
            self._keys[key] = {"stages": initial, "log_correction": 0.0, "calls": 0, "threshold": 0.0}
        return self._keys[key]

    def select(self, flat: torch.Tensor, key: Hashable, capacity: int | None, readout: Readout) -> Selection:
        state = self._state(key)
        n = flat.numel()
        k = target_count(n, self.ratio)
        if self.adapt and n < self.exact_below:
            return self._exact_selection(flat, k, state)  # one torch.topk: nothing to keep off the pool
        with CallingThreadOnly(flat.device, largest=n):
            return self._statistical_selection(flat, k, state, capacity, readout, self.store.canonical(key))

    @staticmethod
    def _exact_selection(flat: torch.Tensor, k: int, state: dict[str, Any]) -> Selection:
        """Step 0: the exact top-k, exact zeros left out (like ``|g| > eta >= 0``)."""
        indices, magnitudes, state["threshold"], nonfinite = top_k_selection(flat, k)
        state["calls"] += 1
        positions, length = nonzero_first(indices, magnitudes, state["threshold"])
        return Selection(positions, None if isinstance(length, int) else length, nonfinite)

    def _statistical_selection(
        self,
        flat: torch.Tensor,
        k: int,
        state: dict[str, Any],
        capacity: int | None,
        readout: Readout,
        canonical: Canonical | None,
    ) -> Selection:
        """Steps 1-6 of the module docstring; the sample in ``canonical`` order (:func:`magnitude_sample`)."""
        sample = magnitude_sample(flat, self.sample_size, state["calls"], canonical)
        eta_fit, eta, slope = self._sampled_threshold(sample, flat.numel(), k, state, readout)
        del sample  # gone before the selection pass reads the gradient
        selection = threshold_selection(flat, eta, capacity)
        if slope is not None:
            assert selection.demand is not None  # threshold_selection reports the count
            corrected = self._next_correction(slope, eta, eta_fit, selection.demand, k)
            state["log_correction"] = torch.where(
                (eta > 0) & (eta_fit > 0), corrected, correction_of(state, flat.device)
            )
        state["calls"] += 1
        state["threshold"] = eta
        return selection

    def _sampled_threshold(
        self, sample: torch.Tensor, n: int, k: int, state: dict[str, Any], readout: Readout
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Steps 1-4 on ``sample`` (of a tensor of ``n`` elements) and its slope at the threshold
        (step 6 needs it; None without ``adapt``): ``(eta_M, eta, slope)``."""
        if self.adapt:
            expected = k * sample.numel() / n
            eta_fit, eta = self._fit_and_apply(sample, state, expected, readout)
            eta = self._checked_on_sample(sample, eta, expected, exact=sample.numel() == n)
        else:
            eta_fit = eta = self.fitted_threshold(sample, state["stages"])
        # mean(x) - min(x) of a constant tail can round below 0: the threshold is a magnitude
        eta = eta.clamp_min(0.0)
        return eta_fit, eta, sample_slope(sample, eta) if self.adapt else None

    def state_dict(self) -> dict[str, Any]:
        """``{"keys": {key: {"stages", "log_correction", "calls", "threshold"}}}``: host ints for
        the counts, 0-d tensors (or floats before the first fit) for the correction and threshold."""
        return {"keys": {key: dict(state) for key, state in self._keys.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        keys = state.get("keys") if isinstance(state, dict) else None
        if not isinstance(keys, dict) or any(
            not isinstance(entry, dict) or set(entry) != _STATE_KEYS for entry in keys.values()
        ):
            raise InvalidOptionError(
                f"{self.name} state must be {{'keys': {{key: {{{', '.join(sorted(_STATE_KEYS))}}}}}}}, got {state!r:.200}"
            )
        for entry in keys.values():
            check_int(entry["stages"], "stages", low=1, high=self.max_stages)
        self._keys = {key: dict(entry) for key, entry in keys.items()}


def _exponential_first(sample: torch.Tensor) -> MagnitudeFit:
    return exponential_of(moments(sample))


def _pareto_first(sample: torch.Tensor) -> MagnitudeFit:
    whole = moments(sample)
    return generalized_pareto_of(whole.mean, whole.variance)


class SIDCoExponential(_SIDCo):
    """SIDCo-E: exponential first stage, exponential tails (``"sidco-exp"``)."""

    name = "sidco-exp"
    first_fit = staticmethod(_exponential_first)
    tail_fit = staticmethod(exponential_excess)
    crossover = 1 << 20


class SIDCoGeneralizedPareto(_SIDCo):
    """SIDCo-P: generalized Pareto first stage and tails (``"sidco-gpareto"``)."""

    name = "sidco-gpareto"
    first_fit = staticmethod(_pareto_first)
    tail_fit = staticmethod(generalized_pareto_excess)
    crossover = 1 << 20


class SIDCoGamma(_SIDCo):
    """SIDCo-GP: gamma first stage (zeros dropped, delta rescaled), generalized Pareto tails (``"sidco-gamma"``)."""

    name = "sidco-gamma"
    first_fit = staticmethod(gamma_of)
    tail_fit = staticmethod(generalized_pareto_excess)
    crossover = 1 << 21
