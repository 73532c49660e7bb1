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
   (``kthvalue`` on ``S`` elements). This is what holds the density on
   error-compensated gradients, where a few percent of ``eta`` moves the count 10-30x.
5. **Select** ``|g| > eta`` over the full tensor
   (:func:`gradsift.compressors.threshold.select_above_threshold`: one read of
   memory; NaN is selected, so checking the selected values checks all ``n``).
6. **Adapt** (``adapt=True``): with ``L = ln(achieved/k)`` and ``s`` the local
   log-log slope ``d ln(count)/d ln(eta)`` measured on the sample, the next
   correction is ``c = ln(eta/eta_M) - 0.5 L/s`` (damped Newton step in log space,
   step at most 1, ``|c| <= ln(100)``). With ``stages=None`` the stage count is the
   ``M`` in ``[1, ceil(log2(1/delta))]`` whose uncorrected threshold predicts the
   count best on the sample: all candidates on the first call, ``M-1..M+1`` every
   ``stage_period`` calls (``c`` is re-based so the applied threshold is continuous).

Every sample count a call needs (the check, the slope, the stage candidates) comes
from one broadcast comparison of the sample with all those thresholds
(:class:`SampleCounts`). Per-tensor state (stage count, log correction, call count,
last threshold) lives in the instance per ``key`` and round-trips through
``state_dict()``.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable
from typing import Any, ClassVar

import torch

from gradsift.compressors.base import Sparsifier, target_count
from gradsift.compressors.threshold import selected_finite
from gradsift.compressors.topk import top_k_selection
from gradsift.errors import InvalidOptionError, NonFiniteGradientError
from gradsift.kernels import CallingThreadOnly, counts_above, select_above_threshold, values_above
from gradsift.stats import (
    MagnitudeFit,
    fit_exponential,
    fit_exponential_excess,
    fit_gamma,
    fit_generalized_pareto,
    fit_generalized_pareto_excess,
    statistics_dtype,
)
from gradsift.validation import check_int, check_real

_SAMPLE_TOLERANCE = math.log(1.25)  # the sample check's band for ln(count/expected)
_STANDARD_ERRORS = 3.0  # ... widened to this many Poisson standard errors on a subsample
_MIN_EXPECTED = 4.0  # below this many expected sample exceedances a subsample says nothing
_SLOPE_STEP = 0.1  # ln-eta offset at which the sample count is read for the slope
_SLOPE_RANGE = (0.5, 200.0)  # bounds on |d ln(count)/d ln(eta)|
_DAMPING = 0.5
_MAX_STEP = 1.0
_MAX_LOG_CORRECTION = math.log(100.0)
_STAGE_MARGIN = 0.05  # a stage count must predict better by this much (in |ln|) to replace the current


def magnitude_sample(flat: torch.Tensor, size: int, call: int) -> torch.Tensor:
    """``|flat|`` at positions ``offset + j * stride``, ``stride = ceil(n / size)``.

    The sample spans the whole tensor (at most ``size`` elements; all of them when
    ``n <= size``). The offset is ``call mod stride``, so successive calls see
    different elements and a periodic layout cannot hide from the sample for long.
    Returned in :func:`gradsift.stats.statistics_dtype` (float32, or float64 for float64).
    """
    n = flat.numel()
    stride = -(-n // size)
    strided = flat if stride == 1 else flat[call % stride :: stride]
    return strided.abs().to(statistics_dtype(flat.dtype))


def max_stage_count(ratio: float) -> int:
    """Largest stage count SIDCo uses for density ``ratio``: ``max(1, ceil(log2(1/ratio)))``."""
    return max(1, math.ceil(math.log2(1.0 / ratio) - 1e-12))


def slope_points(eta: float) -> tuple[float, float]:
    """The thresholds ``eta e^(-+0.1)`` at which the sample's log-log slope is read."""
    return eta * math.exp(-_SLOPE_STEP), eta * math.exp(_SLOPE_STEP)


class SampleCounts:
    """Exceedance counts ``#{s > eta}`` of one sample, many thresholds per call.

    :meth:`prefetch` counts every new threshold at once
    (:func:`gradsift.kernels.counts_above`: on a GPU one comparison, one reduction and
    one host transfer for all of them); calling the object returns a count, computing
    it only if it was not prefetched. Thresholds are compared in the sample's dtype.
    """

    def __init__(self, sample: torch.Tensor) -> None:
        self.sample = sample
        self._counts: dict[float, int] = {}

    def prefetch(self, thresholds: Iterable[float]) -> None:
        missing = sorted(set(thresholds) - self._counts.keys())
        if missing:
            self._counts.update(zip(missing, counts_above(self.sample, missing), strict=True))

    def __call__(self, eta: float) -> int:
        self.prefetch((eta,))
        return self._counts[eta]

    def record(self, eta: float, count: int) -> None:
        """Remember a count the caller already has (the size of an exceedance set it formed)."""
        self._counts[eta] = count

    def value_with_above(self, keep: int) -> float:
        """The sample value with exactly ``keep`` elements above it: the ``(S - keep)``-th smallest.

        The order statistic lies in every tail ``{s > t}`` holding more than ``keep``
        elements (it is the ``(m - keep)``-th smallest of an ``m``-element tail), so
        ``kthvalue`` runs on the smallest such tail among the counts already known,
        and on the whole sample only when none is.
        """
        known = [(count, eta) for eta, count in self._counts.items() if count > keep]
        if not known:
            return float(torch.kthvalue(self.sample, self.sample.numel() - keep).values)
        count, eta = min(known)
        return float(torch.kthvalue(values_above(self.sample, eta), count - keep).values)


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
    tail_fit: ClassVar[staticmethod[[torch.Tensor], tuple[float, MagnitudeFit]]]
    #: The size from which this variant's statistical path costs less than the exact top-k
    #: on CPU (measured one thread, ratio 0.01; docs/decisions.md): ``exact_below``'s default.
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
        if not isinstance(adapt, bool):
            raise InvalidOptionError(f"adapt must be True or False, got {adapt!r}")
        self.adapt = adapt
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

    def fitted_threshold(self, sample: torch.Tensor, stages: int) -> float:
        """``eta_M`` of the multi-stage fit on ``sample`` (magnitudes) with ``stages`` stages."""
        return self.fitted_thresholds(sample, (stages,))[stages]

    def fitted_thresholds(
        self, sample: torch.Tensor, candidates: Iterable[int], counts: SampleCounts | None = None
    ) -> dict[int, float]:
        """``{M: eta_M}`` for each stage count ``M`` in ``candidates``.

        Stage 1's fit and its exceedances are computed once and shared by every ``M``
        (their number is recorded in ``counts``, when given). Raises
        :class:`NonFiniteGradientError` when the sample holds NaN or Inf (the stage-1
        threshold is then not finite).
        """
        first = type(self).first_fit(sample)
        single = first.exceedance_threshold(self.ratio)
        if not math.isfinite(single):
            raise NonFiniteGradientError("gradient contains NaN or Inf values")
        thresholds: dict[int, float] = {}
        exceedances = None
        for stages in candidates:
            if stages == 1 or self.ratio >= self.first_ratio:
                thresholds[stages] = single
                continue
            eta = first.exceedance_threshold(self.first_ratio)
            if exceedances is None:
                exceedances = values_above(sample, eta)
                if counts is not None:
                    counts.record(eta, exceedances.numel())
            thresholds[stages] = self._tail_threshold(exceedances, eta, stages)
        return thresholds

    def _tail_threshold(self, exceedances: torch.Tensor, eta: float, stages: int) -> float:
        """Stages 2..M from the exceedances of ``eta_1 = eta``."""
        stage_ratio = (self.ratio / self.first_ratio) ** (1.0 / (stages - 1))
        tail = exceedances
        for stage in range(stages - 1):
            if stage > 0:
                tail = values_above(tail, eta)
            if tail.numel() < 2:
                break
            base, fit = type(self).tail_fit(tail)
            eta = base + fit.exceedance_threshold(stage_ratio)
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
        self, sample: torch.Tensor, state: dict[str, Any], expected: float, counts: SampleCounts
    ) -> tuple[float, float]:
        """``(eta_M, eta)``: the fitted threshold of the stage count in use and the applied one.

        When several stage counts are evaluated, each one's *uncorrected* threshold is
        scored by ``|ln(predicted/expected)|`` on the sample; the best replaces the
        current one only if it is better by :data:`_STAGE_MARGIN`, and ``c`` is re-based
        (``eta_old e^c_old == eta_new e^c_new``) so the applied ``eta`` does not jump.
        """
        current = state["stages"]
        fitted = self.fitted_thresholds(sample, self._stage_candidates(state, expected), counts)
        applied = fitted[current] * math.exp(state["log_correction"])
        if len(fitted) == 1:
            return fitted[current], applied
        counts.prefetch([*fitted.values(), applied, *slope_points(applied)])
        errors = {m: abs(math.log((counts(eta) + 0.5) / (expected + 0.5))) for m, eta in fitted.items()}
        best = min(errors, key=errors.__getitem__)
        if errors[current] <= errors[best] + _STAGE_MARGIN:
            best = current
        state["stages"] = best
        if best == current:
            return fitted[current], applied
        if fitted[current] > 0 and fitted[best] > 0:
            state["log_correction"] += math.log(fitted[current] / fitted[best])
            return fitted[best], applied
        return fitted[best], fitted[best] * math.exp(state["log_correction"])

    # -- closed loop --------------------------------------------------------------

    @staticmethod
    def _checked_on_sample(counts: SampleCounts, eta: float, expected: float, exact: bool) -> float:
        """``eta``, or the sample's own quantile when the sample predicts a clear miss."""
        if expected < (1.0 if exact else _MIN_EXPECTED):
            return eta
        tolerance = (
            _SAMPLE_TOLERANCE if exact else max(_SAMPLE_TOLERANCE, _STANDARD_ERRORS / math.sqrt(expected))
        )
        miss = math.log((counts(eta) + 0.5) / (expected + 0.5))
        if abs(miss) <= tolerance:
            return eta
        return counts.value_with_above(min(round(expected), counts.sample.numel() - 1))

    @staticmethod
    def _sample_slope(counts: SampleCounts, eta: float) -> float:
        """``|d ln(count)/d ln(eta)|`` of the sample at ``eta`` (finite difference, bounded)."""
        below, above = (counts(point) for point in slope_points(eta))
        slope = math.log((below + 0.5) / (above + 0.5)) / (2 * _SLOPE_STEP)
        return min(max(slope, _SLOPE_RANGE[0]), _SLOPE_RANGE[1])

    def _next_correction(
        self, counts: SampleCounts, eta: float, eta_fit: float, achieved: int, k: int
    ) -> float:
        """Damped Newton step in log space driving ``achieved/k`` to 1."""
        log_error = math.log((achieved + 0.5) / (k + 0.5))
        step = _DAMPING * log_error / self._sample_slope(counts, eta)
        corrected = math.log(eta / eta_fit) + min(max(step, -_MAX_STEP), _MAX_STEP)
        return min(max(corrected, -_MAX_LOG_CORRECTION), _MAX_LOG_CORRECTION)

    # -- Sparsifier ---------------------------------------------------------------

    def _state(self, key: Hashable) -> dict[str, Any]:
        if key not in self._keys:
            initial = self.stages if self.stages is not None else min(2, self.max_stages)
            self._keys[key] = {"stages": initial, "log_correction": 0.0, "calls": 0, "threshold": 0.0}
        return self._keys[key]

    def select(self, flat: torch.Tensor, key: Hashable) -> torch.Tensor:
        state = self._state(key)
        n = flat.numel()
        k = target_count(n, self.ratio)
        with CallingThreadOnly(flat.device, largest=n):
            if self.adapt and n < self.exact_below:
                indices, magnitudes, state["threshold"] = top_k_selection(flat, k)
                state["calls"] += 1
                # like |g| > eta >= 0 on the statistical path, exact zeros are never sent
                return indices if state["threshold"] > 0 else indices[magnitudes > 0]
            return self._statistical_selection(flat, k, state)

    def _statistical_selection(self, flat: torch.Tensor, k: int, state: dict[str, Any]) -> torch.Tensor:
        """Steps 1-6 of the module docstring."""
        n = flat.numel()
        sample = magnitude_sample(flat, self.sample_size, state["calls"])
        if self.adapt:
            expected = k * sample.numel() / n
            counts = SampleCounts(sample)
            eta_fit, eta = self._fit_and_apply(sample, state, expected, counts)
            counts.prefetch([eta, *slope_points(eta)])
            eta = self._checked_on_sample(counts, eta, expected, exact=sample.numel() == n)
        else:
            eta_fit = eta = self.fitted_threshold(sample, state["stages"])
        # mean(x) - min(x) of a constant tail can round below 0: the threshold is a magnitude
        eta = max(eta, 0.0)
        indices = selected_finite(flat, select_above_threshold(flat, eta))
        if self.adapt and eta > 0 and eta_fit > 0:
            state["log_correction"] = self._next_correction(counts, eta, eta_fit, indices.numel(), k)
        state["calls"] += 1
        state["threshold"] = eta
        return indices

    def state_dict(self) -> dict[str, Any]:
        """``{"keys": {key: {"stages", "log_correction", "calls", "threshold"}}}`` (plain numbers)."""
        return {"keys": {key: dict(state) for key, state in self._keys.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        expected = {"stages", "log_correction", "calls", "threshold"}
        keys = state.get("keys") if isinstance(state, dict) else None
        if not isinstance(keys, dict) or any(set(entry) != expected for entry in keys.values()):
            raise InvalidOptionError(
                f"{self.name} state must be {{'keys': {{key: {{{', '.join(sorted(expected))}}}}}}}, got {state!r:.200}"
            )
        for entry in keys.values():
            check_int(entry["stages"], "stages", low=1, high=self.max_stages)
        self._keys = {key: dict(entry) for key, entry in keys.items()}


class SIDCoExponential(_SIDCo):
    """SIDCo-E: exponential first stage, exponential tails (``"sidco-exp"``)."""

    name = "sidco-exp"
    first_fit = staticmethod(fit_exponential)
    tail_fit = staticmethod(fit_exponential_excess)
    crossover = 1 << 16


class SIDCoGeneralizedPareto(_SIDCo):
    """SIDCo-P: generalized Pareto first stage and tails (``"sidco-gpareto"``)."""

    name = "sidco-gpareto"
    first_fit = staticmethod(fit_generalized_pareto)
    tail_fit = staticmethod(fit_generalized_pareto_excess)
    crossover = 1 << 16


class SIDCoGamma(_SIDCo):
    """SIDCo-GP: gamma first stage (zeros dropped, delta rescaled), generalized Pareto tails (``"sidco-gamma"``)."""

    name = "sidco-gamma"
    first_fit = staticmethod(fit_gamma)
    tail_fit = staticmethod(fit_generalized_pareto_excess)
    crossover = 1 << 17  # the gamma's first stage takes a logarithm of every sampled element
