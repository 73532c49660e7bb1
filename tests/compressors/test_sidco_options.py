"""SIDCo's options as behaviour, not as valid values: adapt=False's two stages, sample_size,
first_ratio and stage_period, each against a computation in the test.

``sidco-exp`` with ``adapt=False`` is the plain fitted threshold, and its fit is the
exponential MLE: with one stage ``eta = mean(sample) * ln(1/delta)``, with two
``eta_2 = t + mean(E - t) * ln(delta_1/delta)`` over the sample's exceedances ``E`` of
``eta_1 = mean(sample) * ln(1/delta_1)``, ``t = min(E)`` (docs/sidco.md). So the
threshold a call records tells exactly which elements the fit saw and which ratios
its stages used. Thresholds are compared to a relative 1e-6: the reference runs in
float64, the fit may sum its sample in float32 (a relative error near 1e-7 on these
sizes), while a wrong sample or ratio moves the threshold by percents.
"""

from __future__ import annotations

import math

import pytest
import torch

import gradsift

VARIANTS = ("sidco-exp", "sidco-gpareto", "sidco-gamma")


def threshold(compressor, key=0) -> float:
    return float(compressor.state_dict()["keys"][key]["threshold"])


def heavy_tailed(n: int, seed: int) -> torch.Tensor:
    """Student-t with 3 degrees of freedom: one exponential stage misses its tail badly."""
    generator = torch.Generator().manual_seed(seed)
    chi2 = torch.randn(3, n, generator=generator).square_().sum(0)
    return torch.randn(n, generator=generator) / (chi2 / 3.0).sqrt_()


def exponential_chain(sample: torch.Tensor, ratio: float, first_ratio: float, stages: int) -> float:
    """The documented exponential peaks-over-threshold chain, on float64 magnitudes."""
    a = sample.abs().double()
    if stages == 1 or ratio >= first_ratio:
        return float(a.mean()) * math.log(1 / ratio)
    eta = float(a.mean()) * math.log(1 / first_ratio)
    stage_ratio = (ratio / first_ratio) ** (1 / (stages - 1))
    for _ in range(stages - 1):
        a = a[a > eta]
        base = float(a.min())
        eta = base + float((a - base).mean()) * math.log(1 / stage_ratio)
    return eta


# --- adapt=False without stages: two stages ----------------------------------------------


@pytest.mark.parametrize("name", VARIANTS)
def test_plain_fit_defaults_to_two_stages(name):
    default = gradsift.get_compressor(name, ratio=0.001, adapt=False)
    two = gradsift.get_compressor(name, ratio=0.001, adapt=False, stages=2)
    one = gradsift.get_compressor(name, ratio=0.001, adapt=False, stages=1)
    for call in range(4):  # the stage count never moves, whatever the data
        x = heavy_tailed(100_000, seed=call)
        assert torch.equal(default.compress(x).indices, two.compress(x).indices)
        one.compress(x)
        assert threshold(default) == threshold(two) != threshold(one)
        assert default.state_dict()["keys"][0]["stages"] == 2
    assert default.state_dict()["keys"][0]["log_correction"] == 0.0


def test_plain_fit_default_is_one_stage_when_that_is_the_maximum():
    # ratio 0.6: ceil(log2(1/0.6)) = 1 stage at most
    default = gradsift.get_compressor("sidco-exp", ratio=0.6, adapt=False)
    x = heavy_tailed(10_000, seed=1)
    default.compress(x)
    assert default.state_dict()["keys"][0]["stages"] == 1
    assert threshold(default) == pytest.approx(exponential_chain(x, 0.6, 0.25, 1), rel=1e-6)


def test_two_stage_default_is_the_documented_chain():
    x = heavy_tailed(50_000, seed=2)
    compressor = gradsift.get_compressor("sidco-exp", ratio=0.001, adapt=False)
    payload = compressor.compress(x)
    eta = exponential_chain(x, 0.001, 0.25, 2)
    assert threshold(compressor) == pytest.approx(eta, rel=1e-6)
    assert torch.equal(payload.indices, torch.nonzero(x.abs() > eta).view(-1))


# --- first_ratio --------------------------------------------------------------------------


@pytest.mark.parametrize("first_ratio", [0.05, 0.25, 0.4])
@pytest.mark.parametrize("stages", [2, 3])
def test_first_ratio_is_the_first_stage_ratio(first_ratio, stages):
    x = heavy_tailed(50_000, seed=3)
    compressor = gradsift.get_compressor(
        "sidco-exp", ratio=0.001, adapt=False, stages=stages, first_ratio=first_ratio
    )
    compressor.compress(x)
    assert threshold(compressor) == pytest.approx(exponential_chain(x, 0.001, first_ratio, stages), rel=1e-6)


def test_first_ratio_changes_the_threshold_on_heavy_tails():
    # On t3 the stage-1 exponential fit is wrong, so where stage 1 stops matters.
    x = heavy_tailed(50_000, seed=4)
    etas = []
    for first_ratio in (0.05, 0.25, 0.4):
        compressor = gradsift.get_compressor("sidco-exp", ratio=0.001, adapt=False, first_ratio=first_ratio)
        compressor.compress(x)
        etas.append(threshold(compressor))
    assert len({round(eta, 6) for eta in etas}) == 3, etas


def test_ratio_at_or_above_first_ratio_is_one_stage():
    x = heavy_tailed(20_000, seed=5)
    for ratio in (0.25, 0.3):
        compressor = gradsift.get_compressor(
            "sidco-exp", ratio=ratio, adapt=False, stages=2, first_ratio=0.25
        )
        compressor.compress(x)
        assert threshold(compressor) == pytest.approx(float(x.abs().double().mean()) * math.log(1 / ratio))


# --- sample_size ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("numel", "sample_size", "stride"),
    [(8192, 2048, 4), (5000, 1024, 5), (5000, 2048, 3), (3000, 4096, 1), (4096, 4096, 1)],
)
def test_fit_sees_the_strided_sample_with_a_rotating_offset(numel, sample_size, stride):
    """stride = ceil(n / sample_size), offset = call mod stride (all of x when n <= sample_size)."""
    # Each residue class mod the stride gets its own scale, so the threshold tells which one was fitted.
    positions = torch.arange(numel)
    x = heavy_tailed(numel, seed=6).abs() * (1.0 + positions % 7) * (1 + 10 * (positions % stride))
    compressor = gradsift.get_compressor(
        "sidco-exp", ratio=0.01, adapt=False, stages=1, sample_size=sample_size
    )
    for call in range(stride + 2):
        payload = compressor.compress(x)
        sample = x[call % stride :: stride]
        assert sample.numel() <= sample_size
        eta = float(sample.double().mean()) * math.log(100)
        assert threshold(compressor) == pytest.approx(eta, rel=1e-6), call
        assert torch.equal(payload.indices, torch.nonzero(x > eta).view(-1))


def test_sample_size_caps_the_fit_and_changes_the_threshold():
    x = heavy_tailed(1 << 16, seed=7)
    etas = {}
    for size in (1024, 4096, 1 << 16):
        compressor = gradsift.get_compressor("sidco-gpareto", ratio=0.01, adapt=False, sample_size=size)
        compressor.compress(x)
        etas[size] = threshold(compressor)
        reference = gradsift.get_compressor("sidco-gpareto", ratio=0.01, adapt=False)
        reference.compress(x[:: (1 << 16) // size].contiguous())  # the same sample as the whole tensor
        assert etas[size] == pytest.approx(threshold(reference), rel=1e-6)
    assert len(set(etas.values())) == 3


# --- stage_period ----------------------------------------------------------------------------


@pytest.mark.parametrize("period", [1, 3, 4])
def test_stage_count_is_re_chosen_every_stage_period_calls_by_one_step(period):
    """From one stage on t3 data (which wants three), the count moves only on calls ``c`` with
    ``c % stage_period == 0``, by at most one stage each time, and does move on the first two."""
    compressor = gradsift.get_compressor("sidco-exp", ratio=0.001, stage_period=period, exact_below=0)
    compressor.load_state_dict(
        {"keys": {0: {"stages": 1, "calls": 1, "log_correction": 0.0, "threshold": 0.0}}}
    )
    stages = [1]
    for call in range(1, 2 * period + 2):
        compressor.compress(heavy_tailed(1 << 17, seed=100 + call))
        stages.append(compressor.state_dict()["keys"][0]["stages"])
        if call % period:
            assert stages[-1] == stages[-2], stages
        assert abs(stages[-1] - stages[-2]) <= 1, stages
    re_evaluations = [stages[c] - stages[c - 1] for c in range(1, len(stages)) if c % period == 0]
    assert re_evaluations[:2] == [1, 1], stages


def test_first_call_considers_every_stage_count_later_calls_only_neighbours():
    """Bounded magnitudes: the exponential stages overshoot the maximum below four stages
    (sample error ln(count) about 5.6 for 1-3 stages, 1.0-1.5 for 4-5), so the first call,
    which tries all of 1..ceil(log2(1/delta)), leaves the initial two stages for more than
    three; a later re-evaluation from two sees only 1-3, which miss alike, and keeps two."""
    x = torch.rand(1 << 17, generator=torch.Generator().manual_seed(8))
    first = gradsift.get_compressor("sidco-exp", ratio=0.001, exact_below=0)
    first.compress(x)
    assert first.state_dict()["keys"][0]["stages"] > 3
    later = gradsift.get_compressor("sidco-exp", ratio=0.001, stage_period=1, exact_below=0)
    later.load_state_dict({"keys": {0: {"stages": 2, "calls": 1, "log_correction": 0.0, "threshold": 0.0}}})
    later.compress(x)
    assert later.state_dict()["keys"][0]["stages"] == 2


@pytest.mark.parametrize("name", VARIANTS)
def test_options_report_every_setting_and_rebuild_the_compressor(name):
    settings = {
        "ratio": 0.002,
        "first_ratio": 0.3,
        "stages": 3,
        "sample_size": 4096,
        "adapt": False,
        "stage_period": 7,
        "exact_below": 512,
    }
    compressor = gradsift.get_compressor(name, **settings)
    assert compressor.options() == settings
    assert gradsift.get_compressor(name, **compressor.options()).options() == settings
    assert gradsift.get_compressor(name).options() == {
        "ratio": 0.01,
        "first_ratio": 0.25,
        "stages": None,
        "sample_size": 1 << 18,
        "adapt": True,
        "stage_period": 5,
        "exact_below": compressor.crossover,
    }
