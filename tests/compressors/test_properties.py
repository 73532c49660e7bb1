"""Properties every sparsifier keeps, checked by hypothesis over sizes, dtypes and ratios.

The sparsifiers are found in the registry: every class that subclasses
``base.Sparsifier`` and needs no parameters (so methods added later are covered
without editing this file). Every registry module is imported: a broken one is an
error at collection, never a silent skip.
"""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from gradsift.compressors import Sparsifier, available_compressors, compressor_class, get_compressor
from gradsift.core.payload import FIELD_HEADER_NBYTES, index_dtype
from gradsift.tools.benchmarking import density_option


def _sparsifier_names():
    """Registry names of the parameter-free sparsifiers whose density one option sets (the
    ratio or the threshold: ``cocktail``'s subset, top-k and bits have their own tests, in
    test_cocktail.py); a module that fails to import fails here."""
    return [
        name
        for name in available_compressors()
        if issubclass(cls := compressor_class(name), Sparsifier)
        and not cls.needs_parameters
        and cls.density_option is not None
    ]


SPARSIFIERS = _sparsifier_names()
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def build(name, ratio, threshold):
    """The sparsifier with its density option: ``ratio``, or ``threshold`` for the fixed one."""
    option = density_option(name)
    return get_compressor(name, **{option: ratio if option == "ratio" else threshold})


@st.composite
def gradients(draw, sizes=None):
    """A heavy-tailed gradient (Laplace times a log-normal scale), sometimes with ties and zeros."""
    n = draw(st.integers(0, 5000) if sizes is None else sizes)
    dtype = draw(st.sampled_from(DTYPES))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    x = torch.empty(n, dtype=torch.float64).exponential_(generator=generator)
    x *= torch.randint(0, 2, (n,), generator=generator) * 2 - 1
    x *= torch.randn(n, generator=generator, dtype=torch.float64).mul_(0.5).exp_()
    if draw(st.booleans()):  # coarse values: many ties, as in low-precision or built-up gradients
        x = x.mul_(4).round_().div_(4)
    if draw(st.booleans()):  # ReLU-like exact zeros
        x[torch.rand(n, generator=generator) < 0.4] = 0
    return x.to(dtype)


ratios = st.floats(1e-4, 1.0)
thresholds = st.sampled_from([0.01, 0.5, 1.0, 3.0])


def test_the_property_tests_cover_every_sparsifier():
    expected = {
        "topk",
        "randomk",
        "dgc",
        "redsync",
        "gaussiank",
        "threshold",
        "sidco-exp",
        "sidco-gpareto",
        "sidco-gamma",
    }
    assert expected <= set(SPARSIFIERS)


@pytest.mark.parametrize("name", SPARSIFIERS)
@given(x=gradients(), ratio=ratios, threshold=thresholds, rows=st.sampled_from([1, 2, 5]))
def test_payload_is_a_faithful_sparse_copy(name, x, ratio, threshold, rows):
    n = x.numel()
    shaped = x.reshape(rows, -1) if n % rows == 0 else x
    p = build(name, ratio, threshold).compress(shaped)
    assert p.numel == n and p.dtype == x.dtype
    # Unique, in-range, 1-D integer indices; values equal to the input there, bit for bit.
    assert p.indices.dim() == 1 and not p.indices.dtype.is_floating_point
    assert p.indices.unique().numel() == p.indices.numel() == p.values.numel() == p.count
    if p.count:
        assert int(p.indices.min()) >= 0 and int(p.indices.max()) < n
    assert torch.equal(p.values, x[p.indices])
    # Bytes: the values, the indices unless every worker regenerates them, one length.
    value_bytes = p.count * x.element_size()
    index_bytes = p.count * index_dtype(n).itemsize  # counted at wire width
    if p.variable_size:
        assert p.nbytes == value_bytes + index_bytes + FIELD_HEADER_NBYTES
    else:  # seeded indices: an allreduce of the values alone
        assert p.nbytes == value_bytes


@pytest.mark.parametrize("name", SPARSIFIERS)
@given(x=gradients(), ratio=ratios, threshold=thresholds, data=st.data())
def test_decompress_is_the_mean_of_the_dense_scatters(name, x, ratio, threshold, data):
    n = x.numel()
    other = data.draw(gradients(sizes=st.just(n)))
    # Three workers with their own instances; two hold the same gradient, so their
    # indices coincide and must be added, not dropped.
    payloads = [build(name, ratio, threshold).compress(g) for g in (x, x, other.to(x.dtype))]
    expected, magnitude = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    for p in payloads:
        expected[p.indices] += p.values.double()
        magnitude[p.indices] += p.values.double().abs()
    expected /= 3
    compressor = build(name, ratio, threshold)
    result = compressor.decompress(payloads, n)
    assert result.dtype == x.dtype and result.shape == (n,)
    eps = torch.finfo(x.dtype).eps
    # a sum in x's dtype errs by a few eps of its terms' magnitudes, not of the (cancelled) sum
    scale = float(magnitude.max()) / 3 if n else 0.0
    torch.testing.assert_close(result.double(), expected, rtol=4 * eps, atol=4 * eps * scale)
    own = torch.zeros(n, dtype=x.dtype)
    own[payloads[0].indices] = payloads[0].values
    assert torch.equal(compressor.sent_dense(payloads[0]), own)
