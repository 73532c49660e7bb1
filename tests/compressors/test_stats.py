"""Distribution fits, exceedance thresholds and goodness of fit (gradsift.compressors.stats)."""

import math

import pytest
import torch
from scipy import stats as scipy_stats

from gradsift.compressors import stats

N = 10**6


def _exceedance(values: torch.Tensor, eta: float) -> float:
    return float((values > eta).double().mean())


def test_exponential_mle_and_threshold():
    a = torch.empty(N, dtype=torch.float64).exponential_(0.5, generator=torch.Generator().manual_seed(1))
    fit = stats.fit_exponential(a)
    assert fit.scale == pytest.approx(2.0, rel=0.01)
    assert fit.exceedance_threshold(0.01) == pytest.approx(fit.scale * math.log(100.0))
    for ratio in (0.1, 0.01, 0.001):
        assert _exceedance(a, fit.exceedance_threshold(ratio)) / ratio == pytest.approx(1.0, abs=0.08)


def test_generalized_pareto_moments_recover_shape_and_quantiles():
    a = torch.from_numpy(scipy_stats.genpareto(c=0.2, scale=1.5).rvs(N, random_state=2))
    fit = stats.fit_generalized_pareto(a)
    assert fit.shape == pytest.approx(0.2, abs=0.02)
    assert fit.scale == pytest.approx(1.5, rel=0.03)
    for ratio in (0.1, 0.01, 0.001):
        assert _exceedance(a, fit.exceedance_threshold(ratio)) / ratio == pytest.approx(1.0, abs=0.1)


def test_generalized_pareto_small_shape_is_the_exponential_limit():
    fit = stats.GeneralizedParetoFit(shape=1e-13, scale=2.0)
    assert fit.exceedance_threshold(0.01) == pytest.approx(2.0 * math.log(100.0), rel=1e-9)


def test_generalized_pareto_constant_data_gives_the_constant():
    fit = stats.fit_generalized_pareto(torch.full((100,), 3.0))
    assert fit.exceedance_threshold(0.01) == pytest.approx(3.0, rel=1e-3)


def test_gamma_drops_zeros_and_rescales_ratio():
    a = torch.from_numpy(scipy_stats.gamma(a=0.5, scale=2.0).rvs(N, random_state=3))
    a[: N // 3] = 0.0
    fit = stats.fit_gamma(a)
    assert fit.nonzero_fraction == pytest.approx(2 / 3, abs=1e-6)
    assert fit.shape == pytest.approx(0.5, rel=0.03)
    assert fit.scale == pytest.approx(2.0, rel=0.05)
    for ratio in (0.1, 0.01, 0.001):
        assert _exceedance(a, fit.exceedance_threshold(ratio)) / ratio == pytest.approx(1.0, abs=0.1)
    # asking for more than the non-zero fraction: every non-zero element is selected
    assert fit.exceedance_threshold(0.9) == 0.0


def test_gamma_of_all_zeros_is_a_zero_threshold():
    fit = stats.fit_gamma(torch.zeros(10))
    assert fit.nonzero_fraction == 0.0
    assert fit.exceedance_threshold(0.01) == 0.0


def test_normal_two_sided_threshold():
    assert stats.normal_two_sided_threshold(0.0, 1.0, 0.05) == pytest.approx(1.959964, abs=1e-6)
    assert stats.normal_two_sided_threshold(1.0, 2.0, 0.05) == pytest.approx(1.0 + 2 * 1.959964, abs=1e-5)
    g = torch.randn(N, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    fit = stats.fit_normal(g)
    assert _exceedance(g.abs(), fit.two_sided_threshold(0.01)) / 0.01 == pytest.approx(1.0, abs=0.06)
    with pytest.raises(ValueError, match="ratio"):
        stats.normal_two_sided_threshold(0.0, 1.0, 0.0)


def test_ks_distance_matches_scipy():
    x = torch.from_numpy(scipy_stats.expon.rvs(size=5000, random_state=5) * 1.3)
    fitted = scipy_stats.expon(scale=1.2)
    expected = scipy_stats.kstest(x.numpy(), fitted.cdf).statistic
    assert stats.ks_distance(x, fitted.cdf) == pytest.approx(expected, abs=1e-12)


def test_ks_distance_with_point_mass_at_zero():
    x = torch.tensor([0.0, 0.0, 1.0, 2.0])
    # F(x) = 0.5 + 0.5 * (1 - exp(-x)); the empirical CDF jumps to 0.5 at 0 too
    distance = stats.ks_distance(x, scipy_stats.expon().cdf, atom_at_zero=0.5)
    f1, f2 = 0.5 + 0.5 * (1 - math.exp(-1)), 0.5 + 0.5 * (1 - math.exp(-2))
    assert distance == pytest.approx(max(0.75 - f1, f1 - 0.5, 1.0 - f2, f2 - 0.75, 0.0))


def test_goodness_of_fit_prefers_the_true_family():
    g = torch.distributions.Laplace(0.0, 1.0).sample((300_000,))
    report = stats.goodness_of_fit(g, sample_size=100_000)
    assert report["exponential"]["ks"] < 0.01
    assert report["normal"]["ks"] > 0.05
    assert report["exponential"]["params"]["scale"] == pytest.approx(1.0, rel=0.02)
    assert report["zero_fraction"] == 0.0
    relu_like = torch.distributions.Gamma(0.4, 1.0).sample((100_000,))
    relu_like[::2] = 0.0
    report = stats.goodness_of_fit(relu_like)
    assert report["zero_fraction"] == pytest.approx(0.5, abs=1e-9)
    assert report["gamma"]["ks"] < 0.01 < report["exponential"]["ks"]


def test_subsample_is_seeded_and_bounded():
    x = torch.arange(1000.0)
    a, b = stats.subsample(x, 100, seed=3), stats.subsample(x, 100, seed=3)
    assert torch.equal(a, b) and a.numel() == 100 and a.unique().numel() == 100
    assert torch.equal(stats.subsample(x, 5000), x)
