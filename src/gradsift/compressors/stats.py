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
  ``eta = beta * Q^-1(alpha, delta/p)`` with ``Q^-1`` the inverse of the upper
  regularized incomplete gamma (:func:`inverse_upper_gamma`), ``0`` when ``delta >= p``.
* :class:`NormalFit` -- mean and standard deviation of the *signed* values
  (GaussianK-SGD); :func:`normal_two_sided_threshold` gives
  ``eta = mu + sigma * Phi^-1(1 - delta/2)``.

Every formula is written once, in PyTorch, on 0-d tensors: the DDP hook's SIDCo fits
on the gradient's device and never reads a value on the host (``*_of`` functions,
:class:`Moments`), while the ``fit_*`` functions -- the API of ``gradsift analyze`` --
return the same fits with Python floats (one host transfer per fit). A fit's fields are
floats or 0-d tensors, and its thresholds come back in the same kind. Moments are
accumulated in float64 whatever the input dtype. SIDCo's later stages fit the *excess*
``x - min(x)`` of the exceedances of a bound (:func:`exponential_excess`,
:func:`generalized_pareto_excess`) from the moments of ``x`` itself, without forming the
shifted copy. Goodness of fit is the Kolmogorov-Smirnov distance
``D = sup_x |F_n(x) - F(x)|`` between the empirical and the fitted CDF, computed on a
fixed-seed subsample of large tensors.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass
from statistics import NormalDist
from typing import Any, Protocol, TypeVar

import numpy as np
import torch

from gradsift.compressors.tail_kernels import moment_sums
from gradsift.core.validation import check_ratio

#: Bound on ``m^2/v`` and ``1/r``: keeps the fits finite on (nearly) constant data,
#: where the GP threshold then tends to the constant and the gamma shape is huge.
_MAX_MOMENT_RATIO = 1e6

#: Newton steps of :func:`inverse_upper_gamma` (from its starting point, 8 reach float64
#: rounding over the shapes and tails SIDCo meets: tests/compressors/test_stats.py).
_INVERSE_GAMMA_STEPS = 10

Number = float | torch.Tensor
F = TypeVar("F")


def _tensor(value: Number) -> torch.Tensor:
    return value if isinstance(value, torch.Tensor) else torch.tensor(float(value), dtype=torch.float64)


def _like(reference: Number, value: torch.Tensor) -> Number:
    """``value`` as a float when ``reference`` is one (the host API), else the tensor."""
    return value if isinstance(reference, torch.Tensor) else float(value)


def _scipy_stats() -> Any:
    """``scipy.stats``, imported on the first :meth:`MagnitudeFit.distribution` call: the fits
    and thresholds never need it, and importing it loads hundreds of modules."""
    from scipy import stats

    return stats


def on_host(fit: F) -> F:
    """``fit`` with every tensor field replaced by a Python float (one host transfer)."""
    names = [f.name for f in dataclasses.fields(fit)]  # type: ignore[arg-type]
    tensors = [getattr(fit, name) for name in names]
    values = torch.stack([_tensor(t).double().cpu() for t in tensors]).tolist()
    return dataclasses.replace(fit, **dict(zip(names, values, strict=True)))  # type: ignore[type-var]


class MagnitudeFit(Protocol):
    """A fitted distribution of magnitudes that can place a threshold."""

    def exceedance_threshold(self, ratio: float) -> Number:
        """``eta`` with ``P(a > eta) = ratio`` under the fit."""
        ...

    def distribution(self) -> Any:
        """The fit as a frozen ``scipy.stats`` distribution (pdf, cdf, ppf for plots and KS)."""
        ...


@dataclass(frozen=True)
class ExponentialFit:
    """Exponential distribution of magnitudes with mean ``scale``."""

    scale: Number

    def exceedance_threshold(self, ratio: float) -> Number:
        """``eta = scale * ln(1/ratio)``."""
        return _like(self.scale, _tensor(self.scale) * -math.log(ratio))

    def distribution(self) -> Any:
        return _scipy_stats().expon(scale=float(self.scale))


@dataclass(frozen=True)
class GeneralizedParetoFit:
    """Generalized Pareto with survival ``(1 + shape*x/scale)^(-1/shape)``."""

    shape: Number
    scale: Number

    def exceedance_threshold(self, ratio: float) -> Number:
        """``eta = (scale/shape) (ratio^-shape - 1)``; ``scale * ln(1/ratio)`` as shape -> 0."""
        log_ratio = math.log(ratio)
        shape, scale = _tensor(self.shape), _tensor(self.scale)
        limit = scale * -log_ratio
        negligible = (shape * log_ratio).abs() < 1e-9
        safe = torch.where(negligible, 1.0, shape)
        general = scale / safe * torch.expm1(-safe * log_ratio)
        return _like(self.scale, torch.where(negligible, limit, general))

    def distribution(self) -> Any:
        return _scipy_stats().genpareto(c=float(self.shape), scale=float(self.scale))


@dataclass(frozen=True)
class GammaFit:
    """Gamma(shape, scale) for the non-zero magnitudes, which are a fraction ``nonzero_fraction``."""

    shape: Number
    scale: Number
    nonzero_fraction: Number

    def exceedance_threshold(self, ratio: float) -> Number:
        """``eta = scale * Q^-1(shape, ratio / nonzero_fraction)``; 0 when that ratio reaches 1."""
        fraction = _tensor(self.nonzero_fraction)
        conditional = ratio / fraction.clamp_min(1e-300)
        inside = (fraction > 0) & (conditional < 1.0)
        quantile = inverse_upper_gamma(_tensor(self.shape), torch.where(inside, conditional, 0.5))
        return _like(self.scale, torch.where(inside, _tensor(self.scale) * quantile, 0.0))

    def distribution(self) -> Any:
        """The non-zero part (zeros are the point mass ``1 - nonzero_fraction`` at 0)."""
        return _scipy_stats().gamma(a=float(self.shape), scale=float(self.scale))


@dataclass(frozen=True)
class NormalFit:
    """Normal distribution of the signed values."""

    mean: Number
    std: Number

    def two_sided_threshold(self, ratio: float) -> Number:
        """See :func:`normal_two_sided_threshold`."""
        return normal_two_sided_threshold(self.mean, self.std, ratio)

    def distribution(self) -> Any:
        return _scipy_stats().norm(loc=float(self.mean), scale=float(self.std))


def normal_two_sided_threshold(mean: Number, std: Number, ratio: float) -> Number:
    """GaussianK-SGD's threshold ``eta = mean + std * Phi^-1(1 - ratio/2)``; ``|mean|`` when ``std <= 0``.

    Under a centred normal, ``P(|g| > eta) = ratio``. ``ratio`` must lie in (0, 1].
    """
    quantile = NormalDist().inv_cdf(1.0 - check_ratio(ratio) / 2.0)
    mean_t, std_t = _tensor(mean), _tensor(std)
    return _like(mean, torch.where(std_t <= 0, mean_t.abs(), mean_t + std_t * quantile))


def inverse_upper_gamma(shape: torch.Tensor, tail: torch.Tensor) -> torch.Tensor:
    """``x`` with ``Q(shape, x) = tail`` (``Q`` the upper regularized incomplete gamma), in
    float64, for ``shape > 0`` and ``0 < tail < 1``: scipy's ``gammainccinv`` on 0-d tensors.

    Newton's method on ``h(t) = ln Q(shape, e^t) - ln tail`` in ``t = ln x`` (so ``x``
    stays positive), ``h'(t) = -x^shape e^-x / (Gamma(shape) Q)``, from the usual starting
    points: Wilson-Hilferty's ``shape (1 - 1/(9 shape) + z/(3 sqrt(shape)))^3`` with
    ``z = Phi^-1(1 - tail)`` for ``shape >= 1``; for ``shape < 1``, with
    ``p = 1 - tail`` and ``c = 1 - shape (0.253 + 0.12 shape)``, ``(p/c)^(1/shape)``
    when ``p < c``, else ``1 - ln(1 - (p - c)/(1 - c))``. A fixed number of steps, no
    host read.
    """
    a = shape.double()
    q = tail.double()
    p = 1.0 - q
    z = torch.special.ndtri(p)
    wilson = a * (1.0 - 1.0 / (9.0 * a) + z / (3.0 * a.sqrt())).clamp_min(1e-3) ** 3
    c = 1.0 - a * (0.253 + 0.12 * a)
    small = torch.where(
        p < c, (p / c).clamp_min(1e-300) ** (1.0 / a), 1.0 - torch.log1p(-(p - c) / (1.0 - c))
    )
    t = torch.where(a >= 1.0, wilson, small).clamp_min(1e-300).log()
    log_gamma = torch.lgamma(a)
    log_tail = q.log()
    for _ in range(_INVERSE_GAMMA_STEPS):
        x = t.exp()
        upper = torch.special.gammaincc(a, x).clamp_min(1e-300)
        slope = -torch.exp(a * t - x - log_gamma) / upper
        t = t - ((upper.log() - log_tail) / slope).clamp(-2.0, 2.0)
    return t.exp()


@dataclass(frozen=True)
class Moments:
    """Moments of the elements of a sample that lie above a bound (float64 0-d tensors).

    Attributes: ``count`` of them, their ``mean``, the mean of their squares
    ``square_mean`` and their ``minimum`` (+inf when there are none).
    """

    count: torch.Tensor
    mean: torch.Tensor
    square_mean: torch.Tensor
    minimum: torch.Tensor

    @property
    def variance(self) -> torch.Tensor:
        """Population variance ``E[x^2] - E[x]^2``, floored at 0.

        The cancellation is harmless here: magnitudes have ``var / mean^2`` of order one
        (1 for the exponential), and nearly constant data is capped by the moment ratio.
        """
        return (self.square_mean - self.mean * self.mean).clamp_min(0.0)


def moments(values: torch.Tensor, above: Number | None = None) -> Moments:
    """:class:`Moments` of the 1-D ``values`` (all of them, or those ``> above``), float64
    accumulation, no host read of a device tensor (:func:`gradsift.compressors.tail_kernels.moment_sums`).
    An empty set has count 0 and mean 0."""
    count, total, squares, minimum = moment_sums(values.reshape(-1), above)
    denominator = count.clamp_min(1.0)
    return Moments(count, total / denominator, squares / denominator, minimum)


def exponential_of(m: Moments) -> ExponentialFit:
    """The exponential MLE from the moments: ``scale = mean``."""
    return ExponentialFit(scale=m.mean)


def generalized_pareto_of(mean: torch.Tensor, variance: torch.Tensor) -> GeneralizedParetoFit:
    """Method of moments: ``xi = (1 - m^2/v)/2``, ``s = m (m^2/v + 1)/2``.

    ``m^2/v`` is capped at 1e6, so constant data yields a threshold at the constant
    instead of a division by zero.
    """
    ratio = torch.where(
        variance > 0,
        (mean * mean / variance.clamp_min(1e-300)).clamp_max(_MAX_MOMENT_RATIO),
        _MAX_MOMENT_RATIO,
    )
    return GeneralizedParetoFit(shape=0.5 * (1.0 - ratio), scale=0.5 * mean * (ratio + 1.0))


def gamma_of(magnitudes: torch.Tensor) -> GammaFit:
    """Closed-form approximate MLE of the gamma over the non-zero magnitudes (``>= 0``).

    ``r = ln(mean(a)) - mean(ln a)`` (>= 0 by Jensen, floored at 1e-6),
    ``alpha = (3 - r + sqrt((r-3)^2 + 24 r)) / (12 r)``, ``beta = mean(a) / alpha``.
    The sums run over all of ``a`` without forming the non-zero subset: a zero adds 0
    to ``sum(a)`` and its ``ln 0 = -inf`` is replaced by 0 (a NaN stays NaN). No non-zero
    value: shape 1, scale 0, fraction 0.
    """
    a = magnitudes.reshape(-1).double()
    logs = a.log().nan_to_num_(nan=math.nan, posinf=math.inf, neginf=0.0)
    nonzero = torch.count_nonzero(a).double()
    some = nonzero > 0
    mean = a.sum() / nonzero.clamp_min(1.0)
    spread = (mean.clamp_min(1e-300).log() - logs.sum() / nonzero.clamp_min(1.0)).clamp_min(
        1.0 / _MAX_MOMENT_RATIO
    )
    shape = (3.0 - spread + torch.sqrt((spread - 3.0) ** 2 + 24.0 * spread)) / (12.0 * spread)
    return GammaFit(
        shape=torch.where(some, shape, 1.0),
        scale=torch.where(some, mean / shape, 0.0),
        nonzero_fraction=nonzero / max(1, a.numel()),
    )


def exponential_excess(m: Moments) -> tuple[torch.Tensor, ExponentialFit]:
    """``(t, fit of x - t)`` with ``t = min(x)``: the exponential of the excess over the smallest value.

    ``mean(x - t) = mean(x) - t``, so the shifted copy is never formed.
    """
    return m.minimum, ExponentialFit(scale=m.mean - m.minimum)


def generalized_pareto_excess(m: Moments) -> tuple[torch.Tensor, GeneralizedParetoFit]:
    """``(t, GP fit of x - t)`` with ``t = min(x)``, from ``mean(x) - t`` and ``var(x)`` (shift-invariant)."""
    return m.minimum, generalized_pareto_of(m.mean - m.minimum, m.variance)


def fit_exponential(magnitudes: torch.Tensor) -> ExponentialFit:
    """MLE of the exponential: ``scale = mean(a)`` (0 for an empty tensor), as floats."""
    return on_host(exponential_of(moments(magnitudes.detach())))


def fit_generalized_pareto(magnitudes: torch.Tensor) -> GeneralizedParetoFit:
    """Method-of-moments GP (:func:`generalized_pareto_of`) of ``mean(a)``, ``var(a)``, as floats."""
    if magnitudes.numel() == 0:
        return GeneralizedParetoFit(shape=0.0, scale=0.0)
    m = moments(magnitudes.detach())
    return on_host(generalized_pareto_of(m.mean, m.variance))


def fit_gamma(magnitudes: torch.Tensor) -> GammaFit:
    """:func:`gamma_of` with Python floats."""
    return on_host(gamma_of(magnitudes.detach()))


def fit_normal(values: torch.Tensor) -> NormalFit:
    """Mean and (population) standard deviation of the signed values, as floats."""
    a = values.detach().reshape(-1).double()
    if a.numel() == 0:
        return NormalFit(mean=0.0, std=0.0)
    std, mean = torch.std_mean(a, correction=0)
    return on_host(NormalFit(mean=mean, std=std))


def _as_float64(values: torch.Tensor) -> torch.Tensor:
    return values.detach().reshape(-1).to(torch.float64)


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
        ("gamma", gamma, magnitudes, 1.0 - float(gamma.nonzero_fraction)),
        ("normal", normal, sample, 0.0),
    ):
        degenerate = getattr(fit, "scale", getattr(fit, "std", 0.0)) <= 0
        ks = math.nan if degenerate else ks_distance(data, fit.distribution().cdf, atom_at_zero=atom)
        report[family] = {"params": asdict(fit), "ks": ks}
    return report
