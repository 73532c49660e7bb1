"""Distribution fits, exceedance thresholds and goodness of fit for gradient magnitudes.

SIDCo models the magnitudes ``a = |g|`` of a gradient as draws from a
sparsity-inducing distribution, fits it with a few reductions and reads the
threshold ``eta`` with ``P(a > eta) = delta`` off the fit. The families here:

* :class:`ExponentialFit` -- MLE ``mu = mean(a)``; ``eta = mu * ln(1/delta)``.
* :class:`GeneralizedParetoFit` -- method of moments with ``m = mean(a)``,
  ``v = var(a)``: shape ``xi = (1 - m^2/v) / 2``, scale ``s = m (m^2/v + 1) / 2``;
  ``eta = (s/xi) (delta^-xi - 1)``, and ``s ln(1/delta)`` in the limit ``xi -> 0``.
* :class:`GammaFit` -- closed-form approximation of the MLE over the *non-zero*
  magnitudes (fraction ``p``): ``r = ln(mean(a)) - mean(ln a)``,
  ``alpha = (3 - r + sqrt((r-3)^2 + 24 r)) / (12 r)``, ``beta = mean(a)/alpha``;
  ``eta = beta * Q^-1(alpha, delta/p)`` with ``Q^-1`` the exact inverse of the upper
  regularized incomplete gamma (SciPy, one scalar), ``0`` when ``delta >= p``.
* :class:`NormalFit` -- mean and standard deviation of the *signed* values
  (GaussianK-SGD); :func:`normal_two_sided_threshold` gives
  ``eta = mu + sigma * Phi^-1(1 - delta/2)``.

Moments are accumulated in float64 whatever the input dtype, and every fit brings its
few scalars to the host in one transfer.
SIDCo's later stages fit the *excess* ``x - min(x)`` of the exceedances
(:func:`fit_exponential_excess`, :func:`fit_generalized_pareto_excess`) from the
moments of ``x`` itself, without forming the shifted copy. Goodness of fit is the
Kolmogorov-Smirnov distance ``D = sup_x |F_n(x) - F(x)|`` between the empirical and
the fitted CDF, computed on a fixed-seed subsample of large tensors.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from statistics import NormalDist
from typing import Any, Protocol

import numpy as np
import torch
from scipy import special, stats

from gradsift.validation import check_ratio

#: Bound on ``m^2/v`` and ``1/r``: keeps the fits finite on (nearly) constant data,
#: where the GP threshold then tends to the constant and the gamma shape is huge.
_MAX_MOMENT_RATIO = 1e6


class MagnitudeFit(Protocol):
    """A fitted distribution of magnitudes that can place a threshold."""

    def exceedance_threshold(self, ratio: float) -> float:
        """``eta`` with ``P(a > eta) = ratio`` under the fit."""
        ...

    def distribution(self) -> Any:
        """The fit as a frozen ``scipy.stats`` distribution (pdf, cdf, ppf for plots and KS)."""
        ...


@dataclass(frozen=True)
class ExponentialFit:
    """Exponential distribution of magnitudes with mean ``scale``."""

    scale: float

    def exceedance_threshold(self, ratio: float) -> float:
        """``eta = scale * ln(1/ratio)``."""
        return self.scale * -math.log(ratio)

    def distribution(self) -> Any:
        return stats.expon(scale=self.scale)


@dataclass(frozen=True)
class GeneralizedParetoFit:
    """Generalized Pareto with survival ``(1 + shape*x/scale)^(-1/shape)``."""

    shape: float
    scale: float

    def exceedance_threshold(self, ratio: float) -> float:
        """``eta = (scale/shape) (ratio^-shape - 1)``; ``scale * ln(1/ratio)`` as shape -> 0."""
        log_ratio = math.log(ratio)
        if abs(self.shape * log_ratio) < 1e-9:
            return self.scale * -log_ratio
        return self.scale / self.shape * math.expm1(-self.shape * log_ratio)

    def distribution(self) -> Any:
        return stats.genpareto(c=self.shape, scale=self.scale)


@dataclass(frozen=True)
class GammaFit:
    """Gamma(shape, scale) for the non-zero magnitudes, which are a fraction ``nonzero_fraction``."""

    shape: float
    scale: float
    nonzero_fraction: float

    def exceedance_threshold(self, ratio: float) -> float:
        """``eta = scale * Q^-1(shape, ratio / nonzero_fraction)``; 0 when that ratio reaches 1."""
        conditional = ratio / self.nonzero_fraction if self.nonzero_fraction > 0 else math.inf
        if conditional >= 1.0:
            return 0.0
        return self.scale * float(special.gammainccinv(self.shape, conditional))

    def distribution(self) -> Any:
        """The non-zero part (zeros are the point mass ``1 - nonzero_fraction`` at 0)."""
        return stats.gamma(a=self.shape, scale=self.scale)


@dataclass(frozen=True)
class NormalFit:
    """Normal distribution of the signed values."""

    mean: float
    std: float

    def two_sided_threshold(self, ratio: float) -> float:
        """See :func:`normal_two_sided_threshold`."""
        return normal_two_sided_threshold(self.mean, self.std, ratio)

    def distribution(self) -> Any:
        return stats.norm(loc=self.mean, scale=self.std)


def normal_two_sided_threshold(mean: float, std: float, ratio: float) -> float:
    """GaussianK-SGD's threshold ``eta = mean + std * Phi^-1(1 - ratio/2)``.

    Under a centred normal, ``P(|g| > eta) = ratio``. ``ratio`` must lie in (0, 1].
    """
    ratio = check_ratio(ratio)
    if std <= 0:
        return abs(mean)
    return mean + std * NormalDist().inv_cdf(1.0 - ratio / 2.0)


def _as_float64(values: torch.Tensor) -> torch.Tensor:
    return values.detach().reshape(-1).to(torch.float64)


def statistics_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype samples are kept in: float32 for 16-bit floats, else ``dtype`` (float32 or float64)."""
    return torch.promote_types(dtype, torch.float32)


def host_values(*scalars: torch.Tensor) -> list[float]:
    """Several 0-d tensors as Python floats, in one device-to-host transfer."""
    return torch.stack(scalars).tolist()


def _moments(x: torch.Tensor, *extra: torch.Tensor) -> list[float]:
    """``[mean, var, *extra]`` of a non-empty 1-D ``x`` (population variance), in one host transfer.

    ``var = mean(x^2) - mean(x)^2`` from a dot product: two plain reductions, where
    ``torch.var_mean``'s Welford update costs 40x a mean on CPU. The cancellation is
    harmless here: magnitudes have ``var / mean^2`` of order one (1 for the exponential),
    and nearly constant data is capped by ``_MAX_MOMENT_RATIO`` anyway.
    """
    mean, square, *rest = host_values(x.mean(), torch.dot(x, x) / x.numel(), *extra)
    return [mean, max(square - mean * mean, 0.0), *rest]


def exponential_from_mean(mean: float) -> ExponentialFit:
    """The exponential MLE from the sample mean."""
    return ExponentialFit(scale=mean)


def generalized_pareto_from_moments(mean: float, var: float) -> GeneralizedParetoFit:
    """Method of moments: ``xi = (1 - m^2/v)/2``, ``s = m (m^2/v + 1)/2``.

    ``m^2/v`` is capped at 1e6, so constant data yields a threshold at the constant
    instead of a division by zero.
    """
    moment_ratio = min(mean * mean / var, _MAX_MOMENT_RATIO) if var > 0 else _MAX_MOMENT_RATIO
    return GeneralizedParetoFit(shape=0.5 * (1.0 - moment_ratio), scale=0.5 * mean * (moment_ratio + 1.0))


def fit_exponential(magnitudes: torch.Tensor) -> ExponentialFit:
    """MLE of the exponential: ``scale = mean(a)`` (0 for an empty tensor)."""
    a = _as_float64(magnitudes)
    return exponential_from_mean(float(a.mean()) if a.numel() else 0.0)


def fit_generalized_pareto(magnitudes: torch.Tensor) -> GeneralizedParetoFit:
    """Method-of-moments GP (:func:`generalized_pareto_from_moments`) of ``mean(a)``, ``var(a)``."""
    a = _as_float64(magnitudes)
    if a.numel() == 0:
        return GeneralizedParetoFit(shape=0.0, scale=0.0)
    mean, var = _moments(a)
    return generalized_pareto_from_moments(mean, var)


def fit_gamma(magnitudes: torch.Tensor) -> GammaFit:
    """Closed-form approximate MLE of the gamma over the non-zero magnitudes (``>= 0``).

    ``r = ln(mean(a)) - mean(ln a)`` (>= 0 by Jensen, floored at 1e-6),
    ``alpha = (3 - r + sqrt((r-3)^2 + 24 r)) / (12 r)``, ``beta = mean(a) / alpha``.
    The sums run over all of ``a`` without forming the non-zero subset: a zero adds 0
    to ``sum(a)`` and its ``ln 0 = -inf`` is replaced by 0 (a NaN stays NaN).
    """
    a = _as_float64(magnitudes)
    logs = a.log().nan_to_num_(nan=math.nan, posinf=math.inf, neginf=0.0)
    nonzero, total, total_log = host_values(torch.count_nonzero(a).double(), a.sum(), logs.sum())
    if nonzero == 0:
        return GammaFit(shape=1.0, scale=0.0, nonzero_fraction=0.0)
    mean = total / nonzero
    spread = max(math.log(mean) - total_log / nonzero, 1.0 / _MAX_MOMENT_RATIO)
    shape = (3.0 - spread + math.sqrt((spread - 3.0) ** 2 + 24.0 * spread)) / (12.0 * spread)
    return GammaFit(shape=shape, scale=mean / shape, nonzero_fraction=nonzero / a.numel())


def fit_exponential_excess(exceedances: torch.Tensor) -> tuple[float, ExponentialFit]:
    """``(t, fit of x - t)`` with ``t = min(x)``: the exponential of the excess over the smallest value.

    ``mean(x - t) = mean(x) - t``, so the shifted copy is never formed.
    """
    x = _as_float64(exceedances)
    base, mean = host_values(x.min(), x.mean())
    return base, exponential_from_mean(mean - base)


def fit_generalized_pareto_excess(exceedances: torch.Tensor) -> tuple[float, GeneralizedParetoFit]:
    """``(t, GP fit of x - t)`` with ``t = min(x)``, from ``mean(x) - t`` and ``var(x)`` (shift-invariant)."""
    x = _as_float64(exceedances)
    mean, var, base = _moments(x, x.min())
    return base, generalized_pareto_from_moments(mean - base, var)


def fit_normal(values: torch.Tensor) -> NormalFit:
    """Mean and (population) standard deviation of the signed values."""
    a = _as_float64(values)
    if a.numel() == 0:
        return NormalFit(mean=0.0, std=0.0)
    std, mean = host_values(*torch.std_mean(a, correction=0))
    return NormalFit(mean=mean, std=std)


def ks_distance(sample: torch.Tensor, cdf: Any, *, atom_at_zero: float = 0.0) -> float:
    """Kolmogorov-Smirnov distance ``sup_x |F_n(x) - F(x)|`` of ``sample`` to a fitted CDF.

    ``cdf`` maps a NumPy array to probabilities. ``atom_at_zero`` is a point mass
    ``p0`` at 0 mixed in front of it: ``F(x) = p0 + (1 - p0) cdf(x)`` for ``x >= 0``.
    With ``x_(1) <= ... <= x_(n)`` sorted,
    ``D = max_i max(i/n - F(x_(i)), F(x_(i)-) - (i-1)/n)``, where the left limit
    ``F(0-) = 0`` accounts for the jump of the point mass.
    """
    x = torch.sort(_as_float64(sample)).values.numpy()
    n = x.size
    if n == 0:
        return 0.0
    fitted = atom_at_zero + (1.0 - atom_at_zero) * cdf(x)
    left_limit = np.where(x > 0, fitted, 0.0) if atom_at_zero > 0 else fitted
    steps = np.arange(n + 1, dtype=np.float64) / n
    return max(float((steps[1:] - fitted).max()), float((left_limit - steps[:-1]).max()))


def subsample(values: torch.Tensor, size: int, seed: int = 0) -> torch.Tensor:
    """At most ``size`` elements of the flattened ``values``, drawn without replacement with a fixed seed."""
    flat = values.detach().reshape(-1)
    if flat.numel() <= size:
        return flat
    generator = torch.Generator().manual_seed(seed)
    return flat[torch.randperm(flat.numel(), generator=generator)[:size].to(flat.device)]


def goodness_of_fit(values: torch.Tensor, *, sample_size: int = 200_000, seed: int = 0) -> dict[str, Any]:
    """Fit every family and measure its KS distance to the data.

    Magnitude families (exponential, generalized Pareto, gamma with its point mass of
    zeros) are fitted to ``|values|``; the normal to the signed values. All on one
    fixed-seed subsample of at most ``sample_size`` elements. Returns
    ``{family: {"params": {...}, "ks": D}}`` plus ``"zero_fraction"``.
    """
    sample = _as_float64(subsample(values, sample_size, seed))
    magnitudes = sample.abs()
    exponential = fit_exponential(magnitudes)
    pareto = fit_generalized_pareto(magnitudes)
    gamma = fit_gamma(magnitudes)
    normal = fit_normal(sample)
    report: dict[str, Any] = {
        "zero_fraction": float((magnitudes == 0).double().mean()) if sample.numel() else 0.0
    }
    for family, fit, data, atom in (
        ("exponential", exponential, magnitudes, 0.0),
        ("gpareto", pareto, magnitudes, 0.0),
        ("gamma", gamma, magnitudes, 1.0 - gamma.nonzero_fraction),
        ("normal", normal, sample, 0.0),
    ):
        degenerate = getattr(fit, "scale", getattr(fit, "std", 0.0)) <= 0
        ks = math.nan if degenerate else ks_distance(data, fit.distribution().cdf, atom_at_zero=atom)
        report[family] = {"params": asdict(fit), "ks": ks}
    return report
