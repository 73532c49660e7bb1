"""SIDCo's closed loop on hand-made samples, each rule against the number the module
docstring's formula gives: the sample counts and order statistic, the stage-count choice
(candidates, margin, continuity), the sample slope, the damped correction step and its bounds, and
the state checks.

The stage-choice tests use a compressor whose fitted threshold per stage count is
given (:class:`Scripted`): the fit is tested elsewhere (test_sidco_fit.py), here the
rules that pick among its results are. On ``RAMP = 1, 2, ..., 1000`` a threshold
``1000 - c`` has exactly ``c`` sample elements above it, so each stage count's
predicted count is chosen by hand.
"""

from __future__ import annotations

import math

import pytest
import torch

import gradsift
from gradsift.compressors.sidco import SIDCoExponential
from gradsift.compressors.sidco_sample import magnitude_sample, sample_counts, sample_slope
from gradsift.core.errors import InvalidOptionError, NonFiniteGradientError
from gradsift.core.readout import Readout

RAMP = torch.arange(1, 1001, dtype=torch.float64)


class Scripted(SIDCoExponential):
    """SIDCo-E whose fitted threshold for ``m`` stages is ``1000 - counts[m]``; it records
    which stage counts each call evaluated."""

    def __init__(self, counts: dict[int, int], scale: float = 1.0, **options) -> None:
        super().__init__(**options)
        self.counts, self.scale = counts, scale
        self.evaluated: list[tuple[int, ...]] = []

    def fitted_thresholds(self, sample, candidates) -> dict[int, torch.Tensor]:
        self.evaluated.append(tuple(candidates))
        return {
            m: torch.tensor(self.scale * (1000 - self.counts[m]), dtype=torch.float64) for m in candidates
        }


def state(stages: int, calls: int, log_correction: float = 0.3) -> dict:
    return {"stages": stages, "calls": calls, "log_correction": log_correction, "threshold": 0.0}


def sample_error(count: int, expected: float) -> float:
    return abs(math.log((count + 0.5) / (expected + 0.5)))


def fit_and_apply(compressor: Scripted, record: dict, expected: float) -> tuple[float, float]:
    """``_fit_and_apply`` as a committed step runs it: its deferred stage choice applied."""
    sample = RAMP * compressor.scale
    readout = Readout()
    fitted, applied = compressor._fit_and_apply(sample, record, expected, readout)
    readout.read()
    readout.commit()
    return float(fitted), float(applied)


def plain(record: dict) -> dict:
    """A state record with its 0-d tensors as floats (for comparisons)."""
    return {k: float(v) if isinstance(v, torch.Tensor) else v for k, v in record.items()}


def test_sample_counts_are_strict():
    sample = torch.tensor([1.0, 2.0, 2.0, 3.0], dtype=torch.float64)
    thresholds = [torch.tensor(t, dtype=torch.float64) for t in (0.5, 1.0, 2.0, 3.0)]
    assert sample_counts(sample, thresholds).tolist() == [4, 3, 1, 0]
    ramp = [torch.tensor(1000.0 - c, dtype=torch.float64) for c in (0, 1, 100, 999)]
    assert sample_counts(RAMP, ramp).tolist() == [0, 1, 100, 999]


def test_a_dropped_step_never_applies_the_stage_choice():
    """The choice is deferred to the step's commit: a discarded readout leaves the count."""
    compressor = Scripted({1: 300, 2: 150, 3: 100, 4: 104}, ratio=0.0625)
    record = state(stages=2, calls=0)
    readout = Readout()
    compressor._fit_and_apply(RAMP, record, 100.0, readout)
    readout.discard()
    assert record == state(stages=2, calls=0)


def test_stage_candidates_every_count_first_then_neighbours_every_period():
    compressor = SIDCoExponential(ratio=0.0625, stage_period=5)
    assert compressor.max_stages == 4
    assert list(compressor._stage_candidates(state(2, calls=0), 100.0)) == [1, 2, 3, 4]
    assert list(compressor._stage_candidates(state(1, calls=10), 100.0)) == [1, 2]
    assert list(compressor._stage_candidates(state(3, calls=5), 100.0)) == [2, 3, 4]
    assert list(compressor._stage_candidates(state(4, calls=5), 100.0)) == [3, 4]
    # between periods, below 4 expected sample exceedances, or with stages fixed: the current
    assert list(compressor._stage_candidates(state(3, calls=7), 100.0)) == [3]
    assert list(compressor._stage_candidates(state(3, calls=0), 3.9)) == [3]
    assert list(compressor._stage_candidates(state(3, calls=0), 4.0)) == [1, 2, 3, 4]
    fixed = SIDCoExponential(ratio=0.0625, stages=2)
    assert list(fixed._stage_candidates(state(2, calls=0), 100.0)) == [2]


def test_one_candidate_applies_the_correction_to_its_threshold():
    compressor = Scripted({2: 400}, ratio=0.0625, stage_period=5)
    record = state(stages=2, calls=7)
    assert fit_and_apply(compressor, record, 100.0) == (
        600.0,
        pytest.approx(600.0 * math.exp(0.3), rel=1e-12),
    )
    assert compressor.evaluated == [(2,)] and plain(record) == state(stages=2, calls=7)


def test_first_call_picks_the_best_stage_count_and_keeps_the_applied_threshold():
    """Predicted counts 300, 150, 100, 104 for 100 expected: three stages win. The choice is
    known once the step's readout is read, so this call applied the current count's
    eta_2 e^0.3; the log correction is re-based by ln(eta_2/eta_3), so the next call's
    eta_3 e^c applies that same threshold."""
    compressor = Scripted({1: 300, 2: 150, 3: 100, 4: 104}, ratio=0.0625)
    record = state(stages=2, calls=0)
    fitted, applied = fit_and_apply(compressor, record, 100.0)
    assert compressor.evaluated == [(1, 2, 3, 4)]
    assert (fitted, applied) == (850.0, pytest.approx(850.0 * math.exp(0.3), rel=1e-12))
    assert record["stages"] == 3
    assert float(record["log_correction"]) == pytest.approx(0.3 + math.log(850.0 / 900.0), rel=1e-12)
    assert 900.0 * math.exp(float(record["log_correction"])) == pytest.approx(applied, rel=1e-12)


def test_re_basing_with_thresholds_below_one():
    """Gradient magnitudes are mostly below 1: the same choice on RAMP / 1000."""
    compressor = Scripted({1: 300, 2: 150, 3: 100, 4: 104}, scale=1e-3, ratio=0.0625)
    record = state(stages=2, calls=0)
    fitted, applied = fit_and_apply(compressor, record, 100.0)
    assert (fitted, record["stages"]) == (pytest.approx(0.85), 3)
    assert float(record["log_correction"]) == pytest.approx(0.3 + math.log(0.85 / 0.9), rel=1e-12)
    assert applied == pytest.approx(0.85 * math.exp(0.3), rel=1e-12)


@pytest.mark.parametrize(("current", "counts", "best"), [(2, {1: 4, 2: 3}, 1), (1, {1: 5, 2: 4}, 2)])
def test_stage_errors_use_half_corrected_counts(current, counts, best):
    """At 4 expected the +0.5 on both counts decides: 4 (error 0) beats 3 (ln(3.5/4.5) = 0.25),
    and 4 beats 5 (ln(5.5/4.5) = 0.2); +1.5 on either side would reverse one of them."""
    compressor = Scripted(counts, ratio=0.25, first_ratio=0.1)
    record = state(stages=current, calls=0)
    fit_and_apply(compressor, record, 4.0)
    assert record["stages"] == best


def test_the_current_stage_count_stays_within_the_margin():
    """Current two stages predict 104 (error 0.035), three stages 100 (error 0): within the
    0.05 margin, so two stay and the correction is not re-based. At 110 (error 0.090) they go."""
    assert sample_error(104, 100.0) < 0.05 < sample_error(110, 100.0)
    record = state(stages=2, calls=0)
    near = Scripted({1: 300, 2: 104, 3: 100, 4: 150}, ratio=0.0625)
    assert fit_and_apply(near, record, 100.0) == (896.0, pytest.approx(896.0 * math.exp(0.3), rel=1e-12))
    assert plain(record) == state(stages=2, calls=0)
    far = Scripted({1: 300, 2: 110, 3: 100, 4: 150}, ratio=0.0625)
    fit_and_apply(far, record, 100.0)
    assert record["stages"] == 3


def test_a_re_evaluation_changes_the_count_by_at_most_one():
    """From three stages on call 10 (period 5) only 2..4 are fitted; of them four predict best."""
    compressor = Scripted({2: 400, 3: 300, 4: 100}, ratio=0.0625, stage_period=5)
    record = state(stages=3, calls=10)
    assert fit_and_apply(compressor, record, 100.0)[0] == 700.0  # this call: the current count's
    assert compressor.evaluated == [(2, 3, 4)] and record["stages"] == 4


@pytest.mark.parametrize(("counts", "best"), [({1: 1000, 2: 500}, 1), ({1: 100, 2: 1000}, 1)])
def test_no_re_basing_when_either_threshold_is_zero(counts, best):
    """A zero threshold (1000 predicted on RAMP) has no logarithm: the stage count changes,
    the correction stays and applies to the new count's threshold."""
    compressor = Scripted(counts, ratio=0.25, first_ratio=0.1)
    assert compressor.max_stages == 2
    record = state(stages=2, calls=0)
    eta = 1000.0 - counts[2]  # this call applies the current (two-stage) threshold
    assert fit_and_apply(compressor, record, float(counts[best])) == (eta, pytest.approx(eta * math.exp(0.3)))
    assert plain(record) == state(stages=best, calls=0)


# --- the sample check ------------------------------------------------------------------------


def checked(eta: float, expected: float, exact: bool) -> float:
    return float(
        SIDCoExponential._checked_on_sample(RAMP, torch.tensor(eta, dtype=torch.float64), expected, exact)
    )


def test_sample_check_needs_one_expected_exceedance_on_the_whole_tensor_and_four_on_a_subsample():
    """eta = 0 keeps all 1000: a clear miss whenever the check runs, which then takes the
    value with round(expected) elements above it."""
    assert checked(0.0, 0.9, exact=True) == 0.0
    assert checked(0.0, 1.0, exact=True) == 999.0
    assert checked(0.0, 3.9, exact=True) == 996.0
    assert checked(0.0, 3.9, exact=False) == 0.0
    assert checked(0.0, 4.0, exact=False) == 996.0


def test_sample_check_band_is_ln_1_25_on_the_whole_tensor_and_3_standard_errors_on_a_subsample():
    """130 predicted for 100 expected: ln(130.5/100.5) = 0.26 lies outside ln(1.25) = 0.22
    but inside 3/sqrt(100) = 0.3."""
    assert checked(870.0, 100.0, exact=True) == 900.0
    assert checked(870.0, 100.0, exact=False) == 870.0
    # 40 for 100: -0.91, outside both
    assert checked(960.0, 100.0, exact=False) == 900.0


@pytest.mark.parametrize(
    ("eta", "expected", "kept"), [(999.5, 1.0, True), (998.5, 1.5, True), (997.5, 1.5, False)]
)
def test_sample_check_compares_half_corrected_counts_edge_included(eta, expected, kept):
    """One predicted for one expected is a hit (ln(1.5/1.5) = 0); two for 1.5 lies exactly on
    the band's edge ((2 + 0.5)/(1.5 + 0.5) = 1.25), which keeps eta; three for 1.5 does not."""
    assert checked(eta, expected, exact=True) == (eta if kept else 998.0)


def test_sample_check_keeps_at_least_the_smallest_sample_value():
    """1000 expected from a sample of 1000 at a threshold one element exceeds: the
    replacement keeps 999 above it, the sample's minimum."""
    assert checked(999.5, 1000.0, exact=True) == 1.0


# --- the slope and the correction step --------------------------------------------------------

#: 400 magnitudes at 1 and 100 at 2: around eta = 1 (+-10% in ln) the count falls from 500 to 100.
STEP_SAMPLE = torch.cat([torch.ones(400, dtype=torch.float64), torch.full((100,), 2.0, dtype=torch.float64)])
STEP_SLOPE = math.log(500.5 / 100.5) / 0.2


def test_sample_slope_is_the_finite_difference_of_ln_count():
    def slope(eta: float) -> float:
        return float(sample_slope(STEP_SAMPLE, torch.tensor(eta, dtype=torch.float64)))

    assert slope(1.0) == pytest.approx(STEP_SLOPE, rel=1e-12)
    # a flat count (nothing near eta) is floored at 0.5
    assert slope(10.0) == 0.5
    assert slope(1.5) == 0.5


@pytest.mark.parametrize(("achieved", "k"), [(150, 100), (60, 100), (100, 100)])
def test_correction_is_a_damped_newton_step_in_log_space(achieved, k):
    compressor = SIDCoExponential(ratio=0.01)
    step = 0.5 * math.log((achieved + 0.5) / (k + 0.5)) / STEP_SLOPE
    assert abs(step) < 1
    one, fit = torch.tensor(1.0, dtype=torch.float64), torch.tensor(0.8, dtype=torch.float64)
    assert float(
        compressor._next_correction(sample_slope(STEP_SAMPLE, one), one, fit, achieved, k)
    ) == pytest.approx(math.log(1.0 / 0.8) + step, rel=1e-12, abs=1e-15)


@pytest.mark.parametrize(
    ("eta_fit", "achieved", "k", "expected"),
    [
        (0.8, 100, 10, math.log(10 / 0.8) + 1.0),  # step 0.5 ln(100.5/10.5) / 0.5 = 2.26: at most 1
        (0.8, 0, 10, math.log(10 / 0.8) - 1.0),  # step -3.04: at least -1
        (0.05, 100, 10, math.log(100.0)),  # ln(200) + 1: capped at ln(100)
        (2000.0, 0, 10, -math.log(100.0)),  # ln(1/200) - 1: at least -ln(100)
    ],
)
def test_correction_step_and_total_are_bounded(eta_fit, achieved, k, expected):
    """At eta = 10 nothing of STEP_SAMPLE is near: the slope is its floor 0.5."""
    compressor = SIDCoExponential(ratio=0.01)
    ten, fit = torch.tensor(10.0, dtype=torch.float64), torch.tensor(eta_fit, dtype=torch.float64)
    # the achieved count as the CPU selection gives it (a host int) and as a GPU's (a tensor)
    for count in (achieved, torch.tensor(achieved)):
        assert float(
            compressor._next_correction(sample_slope(STEP_SAMPLE, ten), ten, fit, count, k)
        ) == pytest.approx(expected, rel=1e-12)


# --- the state ------------------------------------------------------------------------------


def test_load_state_dict_names_the_expected_layout_and_checks_stages():
    compressor = gradsift.get_compressor("sidco-exp", ratio=0.01)
    layout = "sidco-exp state must be {'keys': {key: {calls, log_correction, stages, threshold}}}, got"
    for bad in ([("keys", {})], "keys", {"keys": [0]}, {"stages": 1}):
        with pytest.raises(InvalidOptionError) as raised:
            compressor.load_state_dict(bad)
        assert str(raised.value).startswith(layout), raised.value
    for stages in (0, -1, compressor.max_stages + 1):
        with pytest.raises(InvalidOptionError, match="stages must lie in"):
            compressor.load_state_dict({"keys": {0: state(stages=stages, calls=0)}})
    compressor.load_state_dict({"keys": {0: state(stages=compressor.max_stages, calls=3)}})
    assert compressor.state_dict() == {"keys": {0: state(stages=compressor.max_stages, calls=3)}}


# --- the sample and the stages ----------------------------------------------------------------


def test_magnitude_sample_strides_from_a_rotating_offset_in_the_statistics_dtype():
    x = -torch.arange(10.0)
    assert magnitude_sample(x, 10, call=3).tolist() == list(range(10))  # n <= size: all of it
    assert magnitude_sample(x, 5, call=0).tolist() == [0, 2, 4, 6, 8]  # stride 2
    assert magnitude_sample(x, 5, call=1).tolist() == [1, 3, 5, 7, 9]
    assert magnitude_sample(x, 4, call=4).tolist() == [1, 4, 7]  # stride 3, offset 4 mod 3
    for dtype, kept in [
        (torch.float16, torch.float32),
        (torch.bfloat16, torch.float32),
        (torch.float64, torch.float64),
    ]:
        assert magnitude_sample(x.to(dtype), 5, call=0).dtype == kept


def test_a_bucket_laid_out_otherwise_is_sampled_at_its_canonical_positions():
    """DDP hands a bucket in its own layout (here parameter 1 before parameter 0); the sample
    is the one of the parameters in number order, element for element and in that order."""
    from gradsift.core.store import Canonical

    numels = {0: 4, 1: 6}
    canonical = -torch.arange(10.0)  # parameter 0 is elements 0-3, parameter 1 elements 4-9
    laid_out = torch.cat([canonical[4:], canonical[:4]])  # DDP's layout (1, 0)
    mapping = Canonical((1, 0), numels)
    for size, call in [(10, 0), (5, 0), (5, 1), (4, 4)]:
        assert torch.equal(
            magnitude_sample(laid_out, size, call, mapping), magnitude_sample(canonical, size, call)
        )


def test_a_tail_of_two_exceedances_is_fitted_and_one_stops_the_stages():
    """998 ones and [50, 60]: eta_1 = mean ln 4 = 1.536 keeps the two; the exponential excess
    over t = 50 has mean 5, so two stages give 50 + 5 ln(0.25/0.01); with three stages
    (delta_m = 0.2) stage 2 gives 50 + 5 ln 5 = 58.05, above which one element is left: stop."""
    sample = torch.cat(
        [torch.ones(998, dtype=torch.float64), torch.tensor([50.0, 60.0], dtype=torch.float64)]
    )
    compressor = SIDCoExponential(ratio=0.01, adapt=False)
    assert float(compressor.fitted_threshold(sample, 2)) == pytest.approx(50 + 5 * math.log(25), rel=1e-12)
    assert float(compressor.fitted_threshold(sample, 3)) == pytest.approx(50 + 5 * math.log(5), rel=1e-12)
    assert float(compressor.fitted_threshold(sample, 1)) == pytest.approx(1.108 * math.log(100), rel=1e-12)


def test_a_non_finite_sample_makes_every_threshold_non_finite():
    """Nothing is read on the host during the fit: a NaN or Inf reaches every threshold,
    and the selection's flag (NaN and Inf are always selected) reports the input."""
    compressor = SIDCoExponential(ratio=0.01)
    for bad in (math.nan, math.inf):
        sample = torch.tensor([1.0, bad, 2.0], dtype=torch.float64)
        assert all(
            not math.isfinite(float(eta)) for eta in compressor.fitted_thresholds(sample, (1, 2)).values()
        )


def test_a_new_key_starts_from_the_documented_state_and_round_trips():
    """A call that raises (a NaN in the input) leaves the state as it was: no key yet."""
    compressor = SIDCoExponential(ratio=0.001, exact_below=0)
    bad = torch.ones(4096)
    bad[0] = math.nan
    with pytest.raises(NonFiniteGradientError):
        compressor.compress(bad, key="k")
    assert compressor.state_dict() == {"keys": {}}
    compressor.compress(torch.randn(4096, generator=torch.Generator().manual_seed(1)), key="k")
    again = SIDCoExponential(ratio=0.001, exact_below=0)
    again.load_state_dict(compressor.state_dict())
    assert again.state_dict() == compressor.state_dict()
    assert set(again.state_dict()["keys"]["k"]) == {"stages", "log_correction", "calls", "threshold"}
