"""Bit packing: the bytes are the little-endian bit stream of the definition (a Python
integer as the oracle), exact round trips for every width and length (codes back as uint8),
the byte layout, bad input."""

import contextlib

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from gradsift.compressors import kernels
from gradsift.compressors.bitpack import bits_for, pack, packed_nbytes, unpack


@given(
    numel=st.integers(min_value=0, max_value=300),
    bits=st.integers(min_value=1, max_value=8),
    seed=st.integers(min_value=0, max_value=2**31 - 1),
)
def test_round_trip_is_exact(numel, bits, seed):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (numel,), generator=gen, dtype=torch.int64)
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.numel() == packed_nbytes(numel, bits) == -(-numel * bits // 8)
    unpacked = unpack(packed, bits, numel)
    assert unpacked.dtype == torch.uint8
    assert torch.equal(unpacked.long(), codes)


@given(
    numel=st.integers(min_value=0, max_value=200),
    bits=st.integers(min_value=1, max_value=8),
    seed=st.integers(min_value=0, max_value=2**31 - 1),
)
def test_bytes_are_the_bit_stream_of_the_definition(numel, bits, seed):
    """Bit ``j`` of code ``i`` is stream bit ``i*b + j``; stream bit ``p`` is bit ``p mod 8`` of
    byte ``p div 8``: the stream as one Python integer, its bytes little-endian. On the CPU's
    branch (NumPy's for one bit) and the device branch, both ways."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (numel,), generator=gen, dtype=torch.uint8)
    stream = sum(code << (i * bits) for i, code in enumerate(codes.tolist()))
    expected = stream.to_bytes(packed_nbytes(numel, bits), "little")
    for branch in (contextlib.nullcontext, kernels.device_branch):
        with branch():
            packed = pack(codes, bits)
            assert bytes(packed.tolist()) == expected
            assert torch.equal(unpack(packed, bits, numel), codes)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 7, 8])
def test_round_trip_of_extreme_codes_from_uint8(bits):
    codes = torch.tensor([0, 2**bits - 1] * 5 + [2**bits - 1], dtype=torch.uint8)
    assert torch.equal(unpack(pack(codes, bits), bits, codes.numel()).long(), codes.long())


def test_layout_is_little_endian_within_bytes():
    # 1 bit: element i is bit i of byte 0.
    assert pack(torch.tensor([1, 0, 1, 1, 0, 0, 0, 0, 1]), 1).tolist() == [0b00001101, 0b1]
    # 2 bits: codes 3, 0, 2, 1 -> 0b01_10_00_11.
    assert pack(torch.tensor([3, 0, 2, 1]), 2).tolist() == [0b01100011]
    # 3 bits (straddles bytes): codes 5, 6, 7 -> stream 101 011 111 (LSB first).
    # stream bits 0..8 = 1,0,1, 0,1,1, 1,1,1 -> byte0 = 0b11110101, byte1 = 0b1.
    assert pack(torch.tensor([5, 6, 7]), 3).tolist() == [0b11110101, 0b1]


def test_unused_high_bits_of_last_byte_are_zero():
    packed = pack(torch.tensor([7, 7, 7]), 3)  # 9 bits -> 2 bytes, 7 spare bits
    assert packed.tolist() == [255, 1]


def test_bits_for():
    assert [bits_for(m) for m in (0, 1, 2, 3, 4, 30, 254, 255, 256)] == [1, 1, 2, 2, 3, 5, 8, 8, 9]


def test_widest_codes_keep_every_bit():
    codes = torch.tensor([255, 0, 255, 128, 1, 255, 254, 255, 7])
    assert pack(codes, 8).tolist() == codes.tolist()
    for bits in (7, 8):
        top = torch.full((17,), 2**bits - 1)
        assert torch.equal(unpack(pack(top, bits), bits, 17).long(), top)


@pytest.mark.parametrize("bits", [0, 9, -1, 2.0, True])
def test_bad_width_names_argument_and_range(bits):
    with pytest.raises(ValueError, match=r"bits must"):
        pack(torch.tensor([1]), bits)


def test_bad_codes_and_packed_tensors():
    with pytest.raises(TypeError, match="codes must be a 1-D integer tensor"):
        pack(torch.tensor([1.0]), 2)
    with pytest.raises(TypeError, match="codes must be a 1-D integer tensor"):
        pack(torch.tensor([[1]]), 2)
    with pytest.raises(TypeError, match="packed must be a 1-D uint8 tensor"):
        unpack(torch.tensor([1], dtype=torch.int32), 2, 1)
    with pytest.raises(ValueError, match=r"packed holds 1 bytes, but 5 codes of 2 bits need 2"):
        unpack(torch.zeros(1, dtype=torch.uint8), 2, 5)
    with pytest.raises(ValueError, match="numel must"):
        unpack(torch.zeros(1, dtype=torch.uint8), 2, -1)
