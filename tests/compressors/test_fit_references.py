"""gradsift.compressors.stats against independent references: SciPy's distributions and KS test, closed
forms, and the degenerate inputs (empty, one element, zero spread) each fit documents.

Written to kill the mutants of stats.py that the other tests let live
(scripts/mutation/report.md).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats as scipy_stats

from gradsift.compressors import stats


def test_fitted_distributions_carry_every_parameter():
    x = np.linspace(0.05, 5.0, 40)
    pareto = stats.GeneralizedParetoFit(shape=0.2, scale=1.7)
    np.testing.assert_allclose(pareto.distribution().sf(x), (1 + 0.2 * x / 1.7) ** (-1 / 0.2), rtol=1e-12)
    gamma = stats.GammaFit(shape=0.7, scale=2.5, nonzero_fraction=0.5)
    np.testing.assert_allclose(gamma.distribution().mean(), 0.7 * 2.5, rtol=1e-12)
    np.testing.assert_allclose(gamma.distribution().var(), 0.7 * 2.5**2, rtol=1e-12)
    normal = stats.NormalFit(mean=-1.5, std=0.4)
    assert normal.distribution().mean() == -1.5 and normal.distribution().std() == pytest.approx(0.4)
    assert stats.ExponentialFit(scale=3.0).distribution().mean() == pytest.approx(3.0)


def test_empty_and_single_element_fits():
    empty = torch.empty(0)
    assert stats.fit_exponential(empty) == stats.ExponentialFit(scale=0.0)
    assert stats.fit_normal(empty) == stats.NormalFit(mean=0.0, std=0.0)
    assert stats.fit_normal(torch.tensor([3.0])) == stats.NormalFit(mean=3.0, std=0.0)
    assert stats.fit_exponential(torch.tensor([3.0])) == stats.ExponentialFit(scale=3.0)


def test_normal_threshold_without_spread_is_the_magnitude_of_the_mean():
    assert stats.normal_two_sided_threshold(-2.0, 0.0, 0.1) == 2.0
    assert stats.normal_two_sided_threshold(2.0, -1.0, 0.1) == 2.0


def test_ks_distance_of_signed_data_matches_scipy():
    """Negative values and no point mass: the left limit is the fitted CDF itself."""
    for values, fitted in [
        ([-1.2, -0.3, 0.1, 0.4, 2.0], scipy_stats.norm(loc=0.2, scale=0.9)),
        ([-1.0, -0.9, -0.8], scipy_stats.norm(loc=-3.0)),  # D from F(x_(1)-) at a negative x_(1)
    ]:
        x = torch.tensor(values, dtype=torch.float64)
        expected = scipy_stats.kstest(x.numpy(), fitted.cdf).statistic
        assert stats.ks_distance(x, fitted.cdf) == pytest.approx(expected, abs=1e-12)
    assert stats.ks_distance(torch.empty(0), fitted.cdf) == 0.0


def reference_fits(sample: np.ndarray) -> dict[str, tuple[dict, object, np.ndarray, float]]:
    """Each family fitted by its closed form in NumPy float64 (the definitions in
    gradsift.compressors.stats' docstrings, not its code): family -> (params, SciPy distribution, the
    data it is tested on, the point mass at zero in front of it)."""
    a = np.abs(sample)
    m, v = a.mean(), a.var()
    ratio = m * m / v
    nonzero = a[a > 0]
    r = math.log(nonzero.mean()) - np.log(nonzero).mean()
    alpha = (3 - r + math.sqrt((r - 3) ** 2 + 24 * r)) / (12 * r)
    beta, fraction = nonzero.mean() / alpha, len(nonzero) / len(a)
    pareto = {"shape": 0.5 * (1 - ratio), "scale": 0.5 * m * (ratio + 1)}
    return {
        "exponential": ({"scale": m}, scipy_stats.expon(scale=m), a, 0.0),
        "gpareto": (pareto, scipy_stats.genpareto(c=pareto["shape"], scale=pareto["scale"]), a, 0.0),
        "gamma": (
            {"shape": alpha, "scale": beta, "nonzero_fraction": fraction},
            scipy_stats.gamma(a=alpha, scale=beta),
            a,
            1 - fraction,
        ),
        "normal": ({"mean": sample.mean(), "std": sample.std()}, scipy_stats.norm(sample.mean(), sample.std()), sample, 0.0),
    }  # fmt: skip


def ks_with_atom(data: np.ndarray, cdf, atom: float) -> float:
    """KS distance to ``F(x) = atom + (1 - atom) cdf(x)`` for ``x >= 0`` (``F(0-) = 0``),
    over the sorted data: ``max_i max(i/n - F(x_i), F(x_i-) - (i-1)/n)``; SciPy's kstest
    when there is no atom."""
    if atom == 0.0:
        return float(scipy_stats.kstest(data, cdf).statistic)
    x = np.sort(data)
    full = atom + (1 - atom) * cdf(x)
    left = np.where(x > 0, full, 0.0)
    steps = np.arange(len(x) + 1) / len(x)
    return float(max((steps[1:] - full).max(), (left - steps[:-1]).max()))


def test_goodness_of_fit_reports_each_family_against_closed_forms_and_scipy():
    generator = torch.Generator().manual_seed(9)
    values = torch.randn(2000, generator=generator, dtype=torch.float64) * torch.rand(
        2000, generator=generator
    )
    values[::7] = 0.0
    report = stats.goodness_of_fit(values, sample_size=5000)  # no subsampling: all 2000 values
    assert set(report) == {"zero_fraction", "exponential", "gpareto", "gamma", "normal"}
    assert report["zero_fraction"] == pytest.approx(float((values == 0).double().mean()), abs=1e-15)
    for family, (params, distribution, data, atom) in reference_fits(values.numpy()).items():
        assert report[family]["params"] == pytest.approx(params, rel=1e-9), family
        expected = ks_with_atom(data, distribution.cdf, atom)
        assert report[family]["ks"] == pytest.approx(expected, abs=1e-9), family


def test_goodness_of_fit_runs_on_the_seeded_subsample():
    """With more values than ``sample_size``, the report is that of the seeded subsample;
    another seed draws another one."""
    values = torch.randn(5000, generator=torch.Generator().manual_seed(10), dtype=torch.float64)
    sample = stats.subsample(values, 2000, seed=4)
    assert sample.numel() == 2000 and not torch.equal(sample, stats.subsample(values, 2000, seed=0))
    assert stats.goodness_of_fit(values, sample_size=2000, seed=4) == stats.goodness_of_fit(
        sample, sample_size=2000
    )


def test_goodness_of_fit_of_degenerate_data():
    report = stats.goodness_of_fit(torch.zeros(100))
    assert report["zero_fraction"] == 1.0
    assert all(math.isnan(report[family]["ks"]) for family in ("exponential", "gpareto", "gamma", "normal"))
    empty = stats.goodness_of_fit(torch.empty(0))
    assert empty["zero_fraction"] == 0.0


def test_moment_fits_on_a_hand_example():
    """[1, 2, 3, 6]: mean 3, population variance 3.5, so m^2/v = 18/7."""
    x = torch.tensor([1.0, 2.0, 3.0, 6.0])
    pareto = stats.fit_generalized_pareto(x)
    moment_ratio = 9.0 / 3.5
    assert pareto.shape == pytest.approx(0.5 * (1 - moment_ratio), rel=1e-12)
    assert pareto.scale == pytest.approx(0.5 * 3.0 * (moment_ratio + 1), rel=1e-12)
    # gamma over the non-zero values, r = ln(mean) - mean(ln x), Minka's closed form
    with_zero = torch.tensor([0.0, 1.0, 2.0, 3.0, 6.0])
    gamma = stats.fit_gamma(with_zero)
    r = math.log(3.0) - (math.log(1) + math.log(2) + math.log(3) + math.log(6)) / 4
    shape = (3 - r + math.sqrt((r - 3) ** 2 + 24 * r)) / (12 * r)
    assert gamma == pytest.approx(
        stats.GammaFit(shape=shape, scale=3.0 / shape, nonzero_fraction=0.8), rel=1e-12
    )


def test_degenerate_moment_fits():
    assert stats.fit_generalized_pareto(torch.empty(0)) == stats.GeneralizedParetoFit(shape=0.0, scale=0.0)
    # one element: zero variance, the capped moment ratio puts the threshold at the value
    assert stats.fit_generalized_pareto(torch.tensor([3.0])).exceedance_threshold(0.01) == pytest.approx(
        3.0, rel=1e-4
    )
    assert stats.fit_gamma(torch.zeros(4)).exceedance_threshold(0.5) == 0.0


def test_moments_accumulate_in_float64_whatever_the_input_dtype():
    """A float32 accumulation would be off by ~1e-7 relative; float64 agrees to rounding."""
    x = torch.rand(1000, generator=torch.Generator().manual_seed(2)) * 3
    wide = x.double()
    assert stats.fit_exponential(x).scale == pytest.approx(float(wide.mean()), rel=1e-13)
    normal = stats.fit_normal(x)
    assert normal.mean == pytest.approx(float(wide.mean()), rel=1e-13)
    assert normal.std == pytest.approx(float(wide.std(correction=0)), rel=1e-13)


def test_default_subsample_is_200k_elements_with_seed_0(monkeypatch):
    """goodness_of_fit draws its subsample with (200_000, seed 0) unless told otherwise:
    recorded on the call (a 200_001-element input, which would show it, costs ~10 s of fits)."""
    drawn = []
    real = stats.subsample

    def recording(values, size, seed=0):
        drawn.append((size, seed))
        return real(values, size, seed)

    monkeypatch.setattr(stats, "subsample", recording)
    x = torch.randn(64, generator=torch.Generator().manual_seed(3))
    stats.goodness_of_fit(x)
    stats.goodness_of_fit(x, sample_size=32, seed=5)
    assert drawn == [(200_000, 0), (32, 5)]
    assert torch.equal(real(x, 10), real(x, 10, seed=0))


def test_generalized_pareto_threshold_leaves_the_exponential_limit_only_for_a_negligible_shape():
    """``eta = (scale/shape) expm1(-shape ln ratio)``; the limit ``scale ln(1/ratio)`` only
    when ``|shape ln ratio| < 1e-9``. At shape 5e-7 and ratio 1e-300 the product is 3.5e-4:
    the limit would be off by 1.7e-4 relative."""
    shape, scale, ratio = 5e-7, 2.0, 1e-300
    exact = scale / shape * math.expm1(-shape * math.log(ratio))
    assert stats.GeneralizedParetoFit(shape=shape, scale=scale).exceedance_threshold(ratio) == pytest.approx(
        exact, rel=1e-12
    )
    assert abs(exact / (scale * -math.log(ratio)) - 1) > 1e-4
    assert stats.GeneralizedParetoFit(shape=0.0, scale=scale).exceedance_threshold(0.01) == pytest.approx(
        scale * math.log(100), rel=1e-15
    )


def test_gamma_fit_of_no_nonzero_value_and_of_equal_values():
    """Empty or all-zero magnitudes: the documented placeholder fit (shape 1, scale 0), also
    in goodness_of_fit's report. Equal values: ``r = 0`` is floored at 1e-6 before Minka's form."""
    placeholder = stats.GammaFit(shape=1.0, scale=0.0, nonzero_fraction=0.0)
    assert stats.fit_gamma(torch.zeros(5)) == placeholder
    assert stats.fit_gamma(torch.empty(0)) == placeholder
    assert stats.goodness_of_fit(torch.zeros(8))["gamma"]["params"] == {
        "shape": 1.0,
        "scale": 0.0,
        "nonzero_fraction": 0.0,
    }
    r = 1e-6
    shape = (3 - r + math.sqrt((r - 3) ** 2 + 24 * r)) / (12 * r)
    equal = stats.fit_gamma(torch.tensor([0.0, 2.0, 2.0, 2.0]))
    assert equal == pytest.approx(
        stats.GammaFit(shape=shape, scale=2.0 / shape, nonzero_fraction=0.75), rel=1e-9
    )


def test_subsample_of_at_most_size_elements_is_the_input_in_its_order():
    x = torch.arange(12.0).reshape(3, 4)
    assert torch.equal(stats.subsample(x, 12), x.reshape(-1))
    assert torch.equal(stats.subsample(x, 50), x.reshape(-1))
    drawn = stats.subsample(x, 11)
    assert drawn.numel() == 11 and len(set(drawn.tolist())) == 11
