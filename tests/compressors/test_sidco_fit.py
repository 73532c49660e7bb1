"""SIDCo's multi-stage fit with its safety net off, against the known quantiles of synthetic data.

With ``adapt=False`` and a fixed ``stages`` there is no sample check and no correction:
the threshold is the plain peaks-over-threshold chain of docs/sidco.md. For a tensor of
``n`` i.i.d. magnitudes with survival function ``S`` and a sample of ``S_n`` of them:

* stage 1 fits the first family to the sample and reads ``eta_1`` at ``delta_1 = first_ratio``;
* stage ``m`` keeps the sample's exceedances over ``eta_{m-1}``, shifts them by their
  minimum ``t_m`` and reads ``eta_m = t_m + q`` off the tail family at the stage ratio
  ``r = (delta / delta_1)^(1/(M-1))``. Its target is the *conditional* quantile:
  ``P(X > eta_m | X > t_m) = r``.

The reference for one stage is the stage's estimator evaluated on the population
moments of the exceedances ``Y = X - t | X > t`` of the true distribution (closed
forms in :func:`exceedance_moment`): for families that are closed under peaks over threshold
(exponential, generalized Pareto) that is exactly the known conditional quantile
``S^-1(r S(t))``, which the tests assert; for the gamma variant's GP tails it is the
best GP approximation of the gamma tail (its gap to the true quantile is carried into
the count check, not hidden in a tolerance). Those gaps reach 0.1 in ``ln(count/k)``
(shapes 0.5 and 2, two stages at delta = 0.001; the closed-form gamma shape alone gives
-0.02 to -0.06 with one stage), the biases measured over 40 seeds of n = 2^17.

Tolerances come from the sampling spread of each estimator, by the delta method: the
estimator is a smooth function ``q(mean of phi(Y))`` of sample means of a few
statistics ``phi`` (``y``; ``y, y^2``; ``x, ln x``), so over ``N`` exceedances
``sd(q) = sqrt(grad q^T Cov(phi) grad q / N)`` with ``Cov(phi)`` again from the true
distribution. A stage is accepted within ``Z = 4.5`` standard deviations; the achieved
count ``c`` over the whole tensor within ``Z`` standard deviations of ``ln(c/k)``, which
adds the stages' errors (in log survival) and the count's binomial spread ``1/k``.
Checked over 25 seeds per case (51 of the 64 cases, at n = 2^20 and a 2^16 sample; the
tests run at half both, where the same formulas apply): the z-scores of the stages and
counts had standard deviations 0.6-1.4 and a largest |z| of 3.6.

Breaking the chain fails these tests: fitting the tail without the shift, reading the
tails at ``first_ratio`` instead of ``r``, ``r = (delta/delta_1)^(1/M)``, or one stage
too few (each tried by hand on sidco.py).
"""

from __future__ import annotations

import functools
import math
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from scipy import special
from scipy import stats as scipy_stats

import gradsift

Z = 4.5  # standard deviations a check allows (two-sided normal tail 7e-6 per check)
N = 1 << 19  # elements per tensor
SAMPLE_SIZE = 1 << 15  # the fit sees x[0::16] on a compressor's first call
FIRST_RATIO = 0.25  # the default delta_1


# --- the estimators, written from the formulas of docs (stats.py's docstring) -------------


def exponential_offset(means: Sequence[float], ratio: float) -> float:
    """Exponential MLE ``mean * ln(1/ratio)`` from ``means = (E[y],)``."""
    return means[0] * -math.log(ratio)


def pareto_offset(means: Sequence[float], ratio: float) -> float:
    """Method-of-moments GP from ``means = (E[y], E[y^2])``: ``(s/xi)(ratio^-xi - 1)``."""
    m, m2 = means
    moment_ratio = m * m / (m2 - m * m)
    shape, scale = 0.5 * (1.0 - moment_ratio), 0.5 * m * (moment_ratio + 1.0)
    if abs(shape) < 1e-12:
        return scale * -math.log(ratio)
    return scale / shape * (ratio**-shape - 1.0)


def gamma_offset(means: Sequence[float], ratio: float) -> float:
    """Closed-form approximate gamma MLE from ``means = (E[x], E[ln x])``, then ``beta Q^-1(alpha, ratio)``."""
    m, mean_log = means
    spread = math.log(m) - mean_log
    shape = (3.0 - spread + math.sqrt((spread - 3.0) ** 2 + 24.0 * spread)) / (12.0 * spread)
    return m / shape * float(special.gammainccinv(shape, ratio))


#: A statistic ``y^p (ln y)^q`` of the (shifted) exceedances, as its exponents ``(p, q)``.
Statistic = tuple[int, int]


@dataclass(frozen=True)
class Estimator:
    """A stage estimator: the offset ``q(sample means of statistics)`` over the shifted exceedances."""

    statistics: tuple[Statistic, ...]
    offset: Callable[[Sequence[float], float], float]


EXPONENTIAL = Estimator(((1, 0),), exponential_offset)
PARETO = Estimator(((1, 0), (2, 0)), pareto_offset)
GAMMA = Estimator(((1, 0), (0, 1)), gamma_offset)

#: variant -> (first-stage estimator, tail estimator), as docs/sidco.md pairs them
FAMILIES = {
    "sidco-exp": (EXPONENTIAL, EXPONENTIAL),
    "sidco-gpareto": (PARETO, PARETO),
    "sidco-gamma": (GAMMA, PARETO),
}


def exceedance_moment(dist, base: float, p: int, q: int) -> float:
    """``E[Y^p (ln Y)^q]`` of ``Y = X - base`` given ``X > base``, in closed form.

    * exponential / GP(xi, s): the exceedances are GP(xi, s + xi base), whose raw
      moments are ``s'^p p! / prod_{i<=p} (1 - i xi)`` (finite for ``xi < 1/p``);
    * gamma(a, theta) over 0: ``E[X^p (ln X)^q] = theta^p Gamma(a+p)/Gamma(a) E[(ln X')^q]``
      with ``X' ~ gamma(a+p, theta)``: ``E ln X' = psi(a+p) + ln theta``,
      ``Var ln X' = psi'(a+p)``;
    * gamma over ``base > 0``: ``E[X^j | X > t] = theta^j Gamma(a+j)/Gamma(a) Q(a+j, t/theta)/Q(a, t/theta)``
      (``Q`` the regularized upper incomplete gamma), then the binomial expansion of ``(X - t)^p``.
    """
    if dist.dist.name in ("expon", "genpareto"):
        assert q == 0
        shape = dist.kwds.get("c", 0.0)
        scale = dist.kwds["scale"] + shape * base
        return scale**p * math.factorial(p) / math.prod(1.0 - i * shape for i in range(1, p + 1))
    a, theta = dist.kwds["a"], dist.kwds["scale"]

    def gamma_ratio(j: int) -> float:
        return theta**j * math.exp(math.lgamma(a + j) - math.lgamma(a))

    if base == 0.0:
        mean_log = float(special.digamma(a + p)) + math.log(theta)
        return gamma_ratio(p) * (1.0, mean_log, float(special.polygamma(1, a + p)) + mean_log**2)[q]
    assert q == 0
    z = base / theta
    raw = [gamma_ratio(j) * special.gammaincc(a + j, z) / special.gammaincc(a, z) for j in range(p + 1)]
    return float(sum(math.comb(p, j) * raw[j] * (-base) ** (p - j) for j in range(p + 1)))


@dataclass(frozen=True)
class StageReference:
    threshold: float  # the estimator on the population: t + q(E[phi(Y)])
    sd: float  # its sampling standard deviation over the stage's N exceedances
    log_sf_sd: float  # the same in ln S(eta) (times the hazard at eta)
    log_gap: float  # ln(P(X > threshold | X > t) / r): 0 when the family is exact


def stage_reference(
    dist, estimator: Estimator, base: float, ratio: float, exceedances: int
) -> StageReference:
    """Population value and delta-method spread of one stage fitted on ``exceedances`` points over ``base``."""
    statistics = estimator.statistics
    means = np.array([exceedance_moment(dist, base, *phi) for phi in statistics])
    cov = np.array(
        [[exceedance_moment(dist, base, a[0] + b[0], a[1] + b[1]) - means[i] * means[j]
          for j, b in enumerate(statistics)] for i, a in enumerate(statistics)]
    )  # fmt: skip
    grad = np.empty(len(means))
    for i in range(len(means)):
        step = 1e-6 * abs(means[i])
        up, down = means.copy(), means.copy()
        up[i] += step
        down[i] -= step
        grad[i] = (estimator.offset(up, ratio) - estimator.offset(down, ratio)) / (2 * step)
    sd = math.sqrt(float(grad @ cov @ grad) / exceedances)
    threshold = base + estimator.offset(means, ratio)
    return StageReference(
        threshold=threshold,
        sd=sd,
        log_sf_sd=float(dist.pdf(threshold) / dist.sf(threshold)) * sd,
        log_gap=math.log(dist.sf(threshold) / dist.sf(base) / ratio),
    )


# --- the data and the code under test ---------------------------------------------------


def applied_threshold(name: str, x: torch.Tensor, ratio: float, stages: int) -> tuple[float, int]:
    """(threshold, count) of one plain call: ``adapt=False``, ``stages`` fixed, first call."""
    compressor = gradsift.get_compressor(
        name, ratio=ratio, stages=stages, adapt=False, sample_size=SAMPLE_SIZE, first_ratio=FIRST_RATIO
    )
    count = compressor.compress(x).count
    return compressor.state_dict()["keys"][0]["threshold"], count


def stage_thresholds(name: str, x: torch.Tensor, ratio: float, stages: int) -> tuple[list[float], int]:
    """``eta_1..eta_M`` of the ``M``-stage fit at ``ratio``, and the count it selects.

    Stage ``m`` of that chain is the last stage of the ``m``-stage chain at ratio
    ``delta_1 r^(m-1)`` (the same stage ratio ``r``, the same sample), so every
    intermediate threshold is read off a plain call with public options.
    """
    r = (ratio / FIRST_RATIO) ** (1.0 / (stages - 1)) if stages > 1 else 1.0
    thresholds = [applied_threshold(name, x, FIRST_RATIO * r ** (m - 1), m)[0] for m in range(1, stages)]
    last, count = applied_threshold(name, x, ratio, stages)
    return [*thresholds, last], count


@functools.cache
def draw(dist_id: str) -> torch.Tensor:
    """``N`` magnitudes of one distribution (fixed seed per distribution)."""
    dist = DISTRIBUTION_BY_ID[dist_id]
    return torch.from_numpy(dist.rvs(N, random_state=zlib.crc32(dist_id.encode()))).float()


DISTRIBUTIONS = {
    "sidco-exp": {"expon": scipy_stats.expon(scale=0.02)},
    "sidco-gpareto": {
        "gpareto-0.1": scipy_stats.genpareto(c=-0.1, scale=0.01),
        "gpareto0": scipy_stats.expon(scale=0.01),  # shape 0
        "gpareto0.1": scipy_stats.genpareto(c=0.1, scale=0.01),
        "gpareto0.2": scipy_stats.genpareto(c=0.2, scale=0.01),
    },
    "sidco-gamma": {
        "gamma0.5": scipy_stats.gamma(a=0.5, scale=0.01),
        "gamma1": scipy_stats.gamma(a=1.0, scale=0.01),
        "gamma2": scipy_stats.gamma(a=2.0, scale=0.01),
    },
}
DISTRIBUTION_BY_ID = {dist_id: dist for dists in DISTRIBUTIONS.values() for dist_id, dist in dists.items()}
CASES = [(name, dist_id) for name, dists in DISTRIBUTIONS.items() for dist_id in dists]


@pytest.mark.parametrize(("name", "dist_id"), CASES)
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("ratio", [0.01, 0.001])
def test_every_stage_hits_its_conditional_quantile(name, dist_id, stages, ratio):
    dist, x = DISTRIBUTION_BY_ID[dist_id], draw(dist_id)
    sample = x[::16].double()  # what the fit sees: stride ceil(n / sample_size), offset 0
    thresholds, count = stage_thresholds(name, x, ratio, stages)
    first, tail = FAMILIES[name]
    r = (ratio / FIRST_RATIO) ** (1.0 / (stages - 1)) if stages > 1 else None

    references = [stage_reference(dist, first, 0.0, ratio if stages == 1 else FIRST_RATIO, sample.numel())]
    for eta in thresholds[:-1]:
        exceedances = sample[sample > eta]
        references.append(stage_reference(dist, tail, float(exceedances.min()), r, exceedances.numel()))

    for m, (eta, ref) in enumerate(zip(thresholds, references, strict=True), start=1):
        assert abs(eta - ref.threshold) <= Z * ref.sd, (m, eta, ref)
    if name != "sidco-gamma":  # families closed under peaks over threshold: the known quantile
        assert all(abs(ref.log_gap) < 1e-6 for ref in references), references

    # The achieved count over all n elements: E ln(c/k) is the stages' summed gap (0 for
    # exact families), its spread the stages' errors in ln S plus the binomial 1/k.
    k = int(N * ratio)
    gap = sum(ref.log_gap for ref in references)
    spread = math.sqrt(sum(ref.log_sf_sd**2 for ref in references) + 1.0 / k)
    assert abs(math.log(count / k) - gap) <= Z * spread, (count, k, gap, spread)
    # Given the threshold, the count is binomial(n, S(eta)).
    p = dist.sf(thresholds[-1])
    assert abs(count - N * p) <= Z * math.sqrt(N * p * (1 - p)), (count, N * p)
