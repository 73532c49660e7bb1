"""SIDCo: statistical threshold sparsification (Abdelmoniem et al., MLSys 2021).

The magnitudes ``a = |g|`` are modelled by a sparsity-inducing distribution whose
fitted quantile gives a threshold ``eta`` with ``P(a > eta) = delta``; the selection is
then one comparison pass ``|g| > eta``. Per call, for a tensor of ``n`` elements and
target count ``k = max(1, floor(n delta))``:

1. **Sample.** ``S <= sample_size`` magnitudes at the stride ``ceil(n/sample_size)``
   (the offset rotates with the call count), in float64. For ``n <= sample_size``
   this is the whole tensor.
2. **Fit in stages** (peaks over threshold, specs/sidco.md): stage 1 fits the first
   family to the sample and takes ``eta_1`` for ``delta_1 = first_ratio``; stages
   ``m = 2..M`` keep the exceedances ``x > eta_{m-1}``, shift them by ``t = min(x)``
   and set ``eta_m = t + threshold(fit_tail(x - t), delta_m)`` with
   ``delta_m = (delta/delta_1)^(1/(M-1))``. ``M = 1`` (or ``delta >= delta_1``) is
   the single-stage fit.
3. **Correct.** ``eta = eta_M * exp(c)`` with ``c`` the per-tensor log correction
   learned from previous calls (step 6).
4. **Check on the sample** (``adapt=True``): the sample's exceedance count at
   ``eta`` predicts the achieved count; if it misses the expected ``k S/n`` by more
   than a factor ``1.25`` (or 3 standard errors, ``exp(3/sqrt(k S/n))``, when the
   sample is not the whole tensor), ``eta`` becomes the sample's own quantile
   (``kthvalue`` on ``S`` elements). This is what holds the density on
   error-compensated gradients, where a few percent of ``eta`` moves the count 10-30x.
5. **Select** ``|g| > eta`` over the full tensor in cache-sized chunks (one read of
   memory); the chunks' maxima give the non-finite check for free.
6. **Adapt** (``adapt=True``): with ``L = ln(achieved/k)`` and ``s`` the local
   log-log slope ``d ln(count)/d ln(eta)`` measured on the sample, the next
   correction is ``c = ln(eta/eta_M) - 0.5 L/s`` (damped Newton step in log space,
   step at most 1, ``|c| <= ln(100)``). With ``stages=None`` the stage count is the
   ``M`` in ``[1, ceil(log2(1/delta))]`` whose uncorrected threshold predicts the
   count best on the sample: all candidates on the first call, ``M-1..M+1`` every
   ``stage_period`` calls (``c`` is re-based so the applied threshold is continuous).

Per-tensor state (stage count, log correction, call count, last threshold) lives in
the instance per ``key`` and round-trips through ``state_dict()``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from typing import Any, ClassVar

import torch

from gradsift.compressors.base import Sparsifier, target_count
from gradsift.compressors.threshold import select_above_threshold
from gradsift.errors import InvalidOptionError
from gradsift.stats import MagnitudeFit, fit_exponential, fit_gamma, fit_generalized_pareto
from gradsift.validation import check_int, check_real, raise_if_nonfinite

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
    """``|flat|`` at positions ``offset + j * stride``, ``stride = ceil(n / size)``, as float64.

    The sample spans the whole tensor (at most ``size`` elements; all of them when
    ``n <= size``). The offset is ``call mod stride``, so successive calls see
    different elements and a periodic layout cannot hide from the sample for long.
    """
    n = flat.numel()
    if n <= size:
        return flat.abs().to(torch.float64)
    stride = -(-n // size)
    return flat[call % stride :: stride].abs().to(torch.float64)


def count_above(sample: torch.Tensor, eta: float) -> int:
    """Number of sample elements strictly above ``eta``."""
    return int(torch.count_nonzero(sample > eta))


def max_stage_count(ratio: float) -> int:
    """Largest stage count SIDCo uses for density ``ratio``: ``max(1, ceil(log2(1/ratio)))``."""
    return max(1, math.ceil(math.log2(1.0 / ratio) - 1e-12))


class _SIDCo(Sparsifier):
    """Multi-stage statistical threshold with per-tensor closed-loop correction.

    Options:
        ratio: target density delta in (0, 1].
        first_ratio: stage-1 density delta_1 in (0, 1) (default 0.25).
        stages: ``None`` adapts the stage count per tensor (with ``adapt=False`` it
            stays at 2, or 1 when that is the maximum); an int in
            ``[1, ceil(log2(1/ratio))]`` fixes it.
        sample_size: elements the stages are fitted on (>= 1024; default 2^18).
        adapt: run the sample check and the between-call correction (default True);
            False gives the paper's plain fitted threshold.
        stage_period: calls between stage-count re-evaluations when ``stages=None``.
    """

    first_fit: ClassVar[Callable[[torch.Tensor], MagnitudeFit]]
    tail_fit: ClassVar[Callable[[torch.Tensor], MagnitudeFit]]

    def __init__(
        self,
        ratio: float = 0.01,
        first_ratio: float = 0.25,
        stages: int | None = None,
        sample_size: int = 1 << 18,
        adapt: bool = True,
        stage_period: int = 5,
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
        self._keys: dict[Hashable, dict[str, Any]] = {}

    def options(self) -> dict[str, Any]:
        return {
            "ratio": self.ratio,
            "first_ratio": self.first_ratio,
            "stages": self.stages,
            "sample_size": self.sample_size,
            "adapt": self.adapt,
            "stage_period": self.stage_period,
        }

    # -- the statistical threshold ------------------------------------------------

    def fitted_threshold(self, sample: torch.Tensor, stages: int) -> float:
        """``eta_M`` of the multi-stage fit on ``sample`` (magnitudes) with ``stages`` stages."""
        first = type(self).first_fit(sample)
        if stages == 1 or self.ratio >= self.first_ratio:
            return first.exceedance_threshold(self.ratio)
        eta = first.exceedance_threshold(self.first_ratio)
        stage_ratio = (self.ratio / self.first_ratio) ** (1.0 / (stages - 1))
        tail = sample
        for _ in range(stages - 1):
            tail = tail[tail > eta]
            if tail.numel() < 2:
                break
            base = tail.min()
            eta = float(base) + type(self).tail_fit(tail - base).exceedance_threshold(stage_ratio)
        return eta

    def _stage_error(self, sample: torch.Tensor, stages: int, expected: float) -> tuple[float, float]:
        """(|ln(predicted/expected)| on the sample, eta) for one stage count."""
        eta = self.fitted_threshold(sample, stages)
        return abs(math.log((count_above(sample, eta) + 0.5) / (expected + 0.5))), eta

    def _choose_stages(self, sample: torch.Tensor, state: dict[str, Any], expected: float) -> float:
        """Pick the stage count (when adaptive) and return its fitted threshold."""
        current = state["stages"]
        if self.stages is not None or expected < _MIN_EXPECTED:
            return self.fitted_threshold(sample, current)
        if state["calls"] == 0:
            candidates = range(1, self.max_stages + 1)
        elif state["calls"] % self.stage_period == 0:
            candidates = range(max(1, current - 1), min(self.max_stages, current + 1) + 1)
        else:
            return self.fitted_threshold(sample, current)
        errors = {m: self._stage_error(sample, m, expected) for m in candidates}
        best = min(errors, key=lambda m: errors[m][0])
        if current in errors and errors[current][0] <= errors[best][0] + _STAGE_MARGIN:
            best = current
        if best != current and current in errors and errors[current][1] > 0 and errors[best][1] > 0:
            # keep the applied threshold continuous: eta_old * e^c_old == eta_new * e^c_new
            state["log_correction"] += math.log(errors[current][1] / errors[best][1])
        state["stages"] = best
        return errors[best][1]

    # -- closed loop --------------------------------------------------------------

    @staticmethod
    def _checked_on_sample(sample: torch.Tensor, eta: float, expected: float, exact: bool) -> float:
        """``eta``, or the sample's own quantile when the sample predicts a clear miss."""
        if expected < (1.0 if exact else _MIN_EXPECTED):
            return eta
        tolerance = (
            _SAMPLE_TOLERANCE if exact else max(_SAMPLE_TOLERANCE, _STANDARD_ERRORS / math.sqrt(expected))
        )
        miss = math.log((count_above(sample, eta) + 0.5) / (expected + 0.5))
        if abs(miss) <= tolerance:
            return eta
        keep = min(round(expected), sample.numel() - 1)
        return float(torch.kthvalue(sample, sample.numel() - keep).values)

    @staticmethod
    def _sample_slope(sample: torch.Tensor, eta: float) -> float:
        """``|d ln(count)/d ln(eta)|`` of the sample at ``eta`` (finite difference, bounded)."""
        below = count_above(sample, eta * math.exp(-_SLOPE_STEP))
        above = count_above(sample, eta * math.exp(_SLOPE_STEP))
        slope = math.log((below + 0.5) / (above + 0.5)) / (2 * _SLOPE_STEP)
        return min(max(slope, _SLOPE_RANGE[0]), _SLOPE_RANGE[1])

    def _next_correction(
        self, sample: torch.Tensor, eta: float, eta_fit: float, achieved: int, k: int
    ) -> float:
        """Damped Newton step in log space driving ``achieved/k`` to 1."""
        log_error = math.log((achieved + 0.5) / (k + 0.5))
        step = _DAMPING * log_error / self._sample_slope(sample, eta)
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
        sample = magnitude_sample(flat, self.sample_size, state["calls"])
        raise_if_nonfinite(sample.sum())  # the fits below need finite input; the full check is step 5
        expected = k * sample.numel() / n
        eta_fit = (
            self._choose_stages(sample, state, expected)
            if self.adapt
            else self.fitted_threshold(sample, state["stages"])
        )
        eta = eta_fit * math.exp(state["log_correction"]) if self.adapt else eta_fit
        if self.adapt:
            eta = self._checked_on_sample(sample, eta, expected, exact=sample.numel() == n)
        indices, peak = select_above_threshold(flat, eta)
        raise_if_nonfinite(peak)
        if self.adapt and eta > 0 and eta_fit > 0:
            state["log_correction"] = self._next_correction(sample, eta, eta_fit, indices.numel(), k)
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
    tail_fit = staticmethod(fit_exponential)


class SIDCoGeneralizedPareto(_SIDCo):
    """SIDCo-P: generalized Pareto first stage and tails (``"sidco-gpareto"``)."""

    name = "sidco-gpareto"
    first_fit = staticmethod(fit_generalized_pareto)
    tail_fit = staticmethod(fit_generalized_pareto)


class SIDCoGamma(_SIDCo):
    """SIDCo-GP: gamma first stage (zeros dropped, delta rescaled), generalized Pareto tails (``"sidco-gamma"``)."""

    name = "sidco-gamma"
    first_fit = staticmethod(fit_gamma)
    tail_fit = staticmethod(fit_generalized_pareto)
