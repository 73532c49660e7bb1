"""VGC's 32-bit element encoding: round trips, the 2^28 chunk boundary, strict decoding."""

import pytest
import torch

from gradsift.compressors.vgc_codec import CHUNK_SIZE, chunk_count, decode, encode
from gradsift.core.errors import WireFormatError


def _random_message(numel, k, seed=0):
    gen = torch.Generator().manual_seed(seed)
    indices = torch.randperm(numel, generator=gen)[:k].sort().values
    values = torch.randn(k, generator=gen) * torch.exp(torch.randn(k, generator=gen))
    return indices, values


@pytest.mark.parametrize(("numel", "k"), [(1, 1), (10, 3), (1000, 1000), (100_000, 517)])
def test_round_trip_returns_indices_and_the_encoders_quantized_values(numel, k):
    indices, values = _random_message(numel, k)
    codes, scales, quantized = encode(indices, values, numel)
    assert codes.dtype == torch.int32 and codes.numel() == 1 + k  # one chunk count + k words
    assert scales.dtype == torch.float32 and float(scales[0]) == float(values.abs().max())
    got_indices, got_values = decode(codes, scales, numel)
    assert torch.equal(got_indices, indices)
    assert torch.equal(got_values, quantized)


def test_quantization_levels_signs_and_relative_error():
    scale = 3.0
    levels = torch.arange(8, dtype=torch.float32)
    values = torch.cat([scale * 2.0**-levels, -scale * 2.0**-levels, torch.tensor([scale * 2**-10])])
    indices = torch.arange(values.numel())
    _, scales, quantized = encode(indices, values, 100)
    assert float(scales[0]) == scale
    # Powers of two of M are represented exactly, with their sign.
    assert torch.equal(quantized[:16], values[:16])
    # Below M * 2^-7.5 the level saturates at 7: the value is rounded up to M / 128.
    assert float(quantized[16]) == scale / 128
    # Everywhere above the saturation point the relative error is within a factor sqrt(2).
    r = torch.empty(10_000).uniform_(scale * 2**-7.5, scale) * torch.sign(torch.randn(10_000))
    _, _, q = encode(torch.arange(r.numel() + 1), torch.cat([r, torch.tensor([scale])]), r.numel() + 1)
    ratio = (q[:-1] / r).double()
    assert bool((ratio > 0).all())
    assert float(ratio.min()) >= 2**-0.5 - 1e-6 and float(ratio.max()) <= 2**0.5 + 1e-6


def test_chunk_boundary_without_allocating_the_tensor():
    numel = 2 * CHUNK_SIZE + 7
    assert chunk_count(numel) == 3 and chunk_count(CHUNK_SIZE) == 1 and chunk_count(CHUNK_SIZE + 1) == 2
    indices = torch.tensor([0, CHUNK_SIZE - 1, CHUNK_SIZE, CHUNK_SIZE + 5, 2 * CHUNK_SIZE + 6])
    values = torch.tensor([1.0, -0.5, 0.25, -2.0, 0.125])
    codes, scales, quantized = encode(indices, values, numel)
    assert codes[:3].tolist() == [2, 2, 1]  # per-chunk counts, then the words
    assert codes.numel() == 3 + 5
    got_indices, got_values = decode(codes, scales, numel)
    assert got_indices.tolist() == indices.tolist()
    assert torch.equal(got_values, quantized) and torch.equal(quantized, values)  # powers of two of M


def test_empty_message():
    codes, scales, quantized = encode(torch.empty(0, dtype=torch.int64), torch.empty(0), 50)
    assert codes.tolist() == [0] and float(scales[0]) == 0.0 and quantized.numel() == 0
    indices, values = decode(codes, scales, 50)
    assert indices.numel() == 0 and values.numel() == 0


def _valid():
    indices, values = _random_message(1000, 20)
    codes, scales, _ = encode(indices, values, 1000)
    return codes, scales


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda c, s: (c.to(torch.int64), s), "int32"),
        (lambda c, s: (c.reshape(3, 7), s), "1-D int32"),
        (lambda c, s: (c, s.double()), "float32"),
        (lambda c, s: (c, torch.cat([s, s])), "shape"),
        (lambda c, s: (c[:-1], s), "do not add up"),
        (lambda c, s: (torch.cat([c, c[-1:]]), s), "do not add up"),
        (lambda c, s: (torch.cat([torch.tensor([-1], dtype=torch.int32), c[1:]]), s), "do not add up"),
        (lambda c, s: (c[:0], s), "fewer than"),
        (lambda c, s: (c, torch.tensor([float("nan")])), "scale"),
        (lambda c, s: (c, torch.tensor([float("inf")])), "scale"),
        (lambda c, s: (c, torch.tensor([-1.0])), "scale"),
        (lambda c, s: (c, torch.tensor([0.0])), "scale"),
        # index 4000 >= numel: word = 4000 << 4
        (lambda c, s: (torch.cat([c[:-1], torch.tensor([4000 << 4], dtype=torch.int32)]), s), "< numel"),
        # a repeated word: indices not strictly increasing
        (lambda c, s: (torch.cat([c[:1] + 1, c[1:], c[-1:]]), s), "strictly increasing"),
    ],
)
def test_malformed_messages_are_rejected(mutate, match):
    codes, scales = mutate(*_valid())
    with pytest.raises(WireFormatError, match=match):
        decode(codes, scales, 1000)


def test_index_beyond_numel_in_last_chunk():
    codes, scales, _ = encode(torch.tensor([CHUNK_SIZE + 3]), torch.tensor([1.0]), CHUNK_SIZE + 10)
    with pytest.raises(WireFormatError, match="< numel"):
        decode(codes, scales, CHUNK_SIZE + 3)
