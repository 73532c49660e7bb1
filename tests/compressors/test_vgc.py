"""VGC's send rule, residual and variance state, payload bytes and the attach() path."""

import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import gradsift
from gradsift.compressors.vgc import VGC
from gradsift.compressors.vgc_codec import decode


def _minibatch(mean, std, batch, gen):
    """Minibatch mean gradient and the variance of that mean (1/B convention)."""
    samples = mean + std * torch.randn(batch, mean.numel(), generator=gen)
    g = samples.mean(0)
    return g, ((samples * samples).mean(0) - g * g) / batch


def _sent_indices(payload):
    return decode(payload.codes, payload.scales, payload.numel)[0]


def test_signal_is_sent_at_once_and_pure_noise_is_delayed():
    gen = torch.Generator().manual_seed(0)
    n, batch = 2000, 32
    signal = torch.arange(n) < 200  # mean 1 with std 0.5; the rest: mean 0, std 1
    mean = signal.float()
    std = torch.where(signal, 0.5, 1.0)
    vgc = VGC(alpha=4.0, zeta=0.999)
    g, s = _minibatch(mean, std, batch, gen)
    first = set(_sent_indices(vgc.compress(g, variance=s)).tolist())
    assert set(range(200)) <= first  # SNR ~ 11 standard errors: all sent immediately
    noise_sent = len(first - set(range(200))) / 1800
    assert noise_sent < 0.1  # |r| > 2 standard errors by chance: ~4.6 % expected
    for _ in range(30):
        g, s = _minibatch(mean, std, batch, gen)
        vgc.compress(g, variance=s)
    # Delayed noise keeps its variance growing with its residual: |r|/sqrt(v) stays O(1).
    r, v = vgc.residuals[0][200:], vgc.variances[0][200:]
    assert float(((r * r) <= 4.0 * v).float().mean()) > 0.9


def test_variance_decay_eventually_sends_a_delayed_element():
    """r = 0.1 with v = 1 is held; with g = s = 0 afterwards v = zeta^t, sent once 0.01 > 2 zeta^t."""
    zeta = 0.9
    vgc = VGC(alpha=2.0, zeta=zeta)
    g, s = torch.tensor([0.1, 0.0]), torch.tensor([1.0, 0.0])
    steps_until_sent = math.ceil(math.log(0.01 / 2.0) / math.log(zeta))  # 51
    sent_at = None
    for step in range(100):
        payload = vgc.compress(g, variance=s)
        if 0 in _sent_indices(payload).tolist():
            sent_at = step
            break
        g, s = torch.zeros(2), torch.zeros(2)
    assert sent_at == steps_until_sent
    never = VGC(alpha=2.0, zeta=1.0)
    never.compress(torch.tensor([0.1]), variance=torch.tensor([1.0]))
    assert all(never.compress(torch.zeros(1), variance=torch.zeros(1)).count == 0 for _ in range(100))


def test_alpha_zero_sends_every_representable_nonzero_element():
    g = torch.randn(500).clamp(-2.5, 2.5)
    g[g.abs() < 0.3] = 0.3  # all within 2^7.5 of the largest magnitude
    g[::7] = 0
    payload = VGC(alpha=0.0).compress(g, variance=torch.rand(500) * 100)
    assert _sent_indices(payload).tolist() == torch.nonzero(g).squeeze(1).tolist()


def test_quantization_error_stays_in_the_residual_and_variance_resets():
    gen = torch.Generator().manual_seed(3)
    vgc = VGC(alpha=1.0, zeta=0.5)
    total = torch.zeros(1000)
    sent = torch.zeros(1000)
    previous_v = torch.zeros(1000)
    for _ in range(5):
        g, s = torch.randn(1000, generator=gen), torch.rand(1000, generator=gen)
        payload = vgc.compress(g, variance=s)
        total += g
        sent += vgc.sent_dense(payload)
        indices = _sent_indices(payload)
        expected_v = (previous_v + s) * 0.5
        expected_v[indices] = 0
        torch.testing.assert_close(vgc.variances[0], expected_v)
        previous_v = vgc.variances[0].clone()
    # Everything accumulated is either sent (quantized) or still in the residual.
    torch.testing.assert_close(sent + vgc.residuals[0], total, rtol=0, atol=1e-5)
    assert float(vgc.residuals[0].abs().max()) > 0  # quantization left something behind


def test_strom_hybrid_sends_large_residuals_regardless_of_variance():
    g = torch.tensor([0.5, -2.0, 1.5, 0.1])
    huge = torch.full((4,), 1e6)
    assert VGC(alpha=1.0).compress(g, variance=huge).count == 0
    payload = VGC(alpha=1.0, tau=1.0).compress(g, variance=huge)
    assert _sent_indices(payload).tolist() == [1, 2]


def test_payload_layout_and_bytes():
    g = torch.tensor([3.0, 0.0, -0.75, 0.01, 1.5, 0.02])
    vgc = gradsift.get_compressor("vgc", alpha=0.0)
    payload = vgc.compress(g, variance=torch.zeros(6))
    assert payload.indices is None and payload.values is None
    assert payload.codes.dtype == torch.int32 and payload.scales.tolist() == [3.0]
    # 0.01 < M * 2^-7.5 = 0.0166 would round up to M/128: it stays in the residual;
    # 0.02 is sent at the lowest level, M/128.
    assert payload.count == 4
    # 1 chunk count + 4 words (int32), 1 float32 scale, one 4-byte length per field.
    assert payload.nbytes == 4 * 5 + 4 + 4  # words and chunk count, the scale, one length
    # 3, -0.75 = -3/4 and 1.5 = 3/2 are exact levels.
    assert vgc.decompress([payload], 6).tolist() == [3.0, 0.0, -0.75, 0.0, 1.5, 3.0 / 128]
    assert vgc.residuals[0][3] == 0.01 and vgc.variances[0][3] == 0


def test_decompress_averages_workers_and_adds_shared_indices():
    a = VGC(alpha=0.0).compress(torch.tensor([1.0, 0.0, 2.0]), variance=torch.zeros(3))
    b = VGC(alpha=0.0).compress(torch.tensor([0.0, 4.0, 2.0]), variance=torch.zeros(3))
    assert VGC().decompress([a, b], 3).tolist() == [0.5, 2.0, 2.0]


def test_nonfinite_gradient_raises_and_leaves_state_untouched():
    vgc = VGC(alpha=1.0)
    vgc.compress(torch.randn(100), variance=torch.ones(100))
    before = vgc.state_dict()
    for bad in (float("nan"), float("inf"), -float("inf")):
        g = torch.randn(100) * 0.01
        g[42] = bad
        with pytest.raises(gradsift.NonFiniteGradientError):
            vgc.compress(g, variance=torch.ones(100))
        assert torch.equal(vgc.residuals[0], before["residuals"][0])
        assert torch.equal(vgc.variances[0], before["variances"][0])


def test_state_dict_round_trip_resumes_identically():
    gen = torch.Generator().manual_seed(5)
    stream = [(torch.randn(300, generator=gen), torch.rand(300, generator=gen)) for _ in range(6)]
    first = VGC(alpha=2.0)
    for g, s in stream[:3]:
        first.compress(g, variance=s, key="layer")
    resumed = VGC(alpha=2.0)
    resumed.load_state_dict(first.state_dict())
    for g, s in stream[3:]:
        p, q = first.compress(g, variance=s, key="layer"), resumed.compress(g, variance=s, key="layer")
        assert torch.equal(p.codes, q.codes) and torch.equal(p.scales, q.scales)
    with pytest.raises(ValueError, match="residuals and variances"):
        resumed.load_state_dict({"residuals": {}})


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"alpha": -1.0}, "alpha"),
        ({"zeta": 1.5}, "zeta"),
        ({"tau": 0.0}, "tau"),
        ({"variance_method": "magic"}, "variance_method"),
        ({"conv_rule": "fast"}, "conv_rule"),
    ],
)
def test_bad_options_are_rejected(options, match):
    with pytest.raises(ValueError, match=match):
        gradsift.get_compressor("vgc", **options)


def test_bad_calls_are_rejected():
    vgc = VGC()
    with pytest.raises(ValueError, match="variance must have as many elements"):
        vgc.compress(torch.randn(10), variance=torch.ones(9))
    with pytest.raises(ValueError, match="needs variance="):
        vgc.compress(torch.randn(10))
    with pytest.raises(ValueError, match="attach"):
        vgc.compress(torch.randn(10), parameters=[nn.Parameter(torch.zeros(10))])
    vgc.compress(torch.randn(10), variance=torch.ones(10), key="b")
    with pytest.raises(ValueError, match="reset"):
        vgc.compress(torch.randn(11), variance=torch.ones(11), key="b")
    vgc.reset("b")
    assert vgc.compress(torch.randn(11), variance=torch.ones(11), key="b").numel == 11


def test_parameters_that_do_not_cover_the_tensor_are_refused():
    model = nn.Linear(4, 3)  # 12 + 3 elements
    vgc = VGC()
    vgc.attach(model)
    with pytest.raises(gradsift.InvalidOptionError, match="parameters hold 15 elements but tensor has 10"):
        vgc.compress(torch.randn(10), parameters=list(model.parameters()))
    assert vgc.residuals == {}  # refused before any state was written


@pytest.mark.parametrize("missing", ["codes", "scales"])
def test_decompress_refuses_a_payload_without_codes_or_scales(missing):
    payload = VGC(alpha=0.0).compress(torch.tensor([1.0, 0.0, 2.0]), variance=torch.zeros(3))
    setattr(payload, missing, None)
    with pytest.raises(gradsift.InvalidOptionError, match="a vgc payload carries codes and scales"):
        VGC().decompress([payload], 3)


@pytest.mark.parametrize("missing", ["residuals", "variances"])
def test_load_state_dict_names_the_missing_table(missing):
    vgc = VGC()
    vgc.compress(torch.randn(6), variance=torch.ones(6))
    state = vgc.state_dict()
    del state[missing]
    fresh = VGC()
    with pytest.raises(
        gradsift.InvalidOptionError,
        match=rf"vgc state needs keys residuals and variances, missing \['{missing}'\]",
    ):
        fresh.load_state_dict(state)
    assert fresh.residuals == {} and fresh.variances == {}


def test_attached_compressor_reads_the_hooks_variance_for_its_parameters():
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
    vgc = VGC(alpha=1.0)
    vgc.attach(model)
    assert vgc.tracker.unsupported_parameters() == ["1.weight", "1.bias"]
    F.cross_entropy(model(torch.randn(32, 8)), torch.randint(0, 3, (32,))).backward()
    params = list(model.parameters())
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    expected_variance = torch.cat([vgc.tracker.variance(p).reshape(-1) for p in params])
    reference = VGC(alpha=1.0).compress(flat, variance=expected_variance)
    payload = vgc.compress(flat, key=0, parameters=params)
    assert torch.equal(payload.codes, reference.codes)
    # BatchNorm parameters have variance 0: every non-zero one is sent (dense).
    offset = sum(p.numel() for p in params[:2])  # after Linear weight and bias
    sent = set(_sent_indices(payload).tolist())
    bn = range(offset, offset + 32)
    assert all(i in sent for i in bn if flat[i] != 0)
    assert vgc.tracker.second_moment(params[0]) is None  # consumed
