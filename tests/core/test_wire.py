"""Wire format: one fixed-size message per bucket -- its layout, exact byte counts, the dtype
rules, the round trip, and what a receiver does with a malformed message (flags the
sender on the device and writes nothing out of range)."""

from __future__ import annotations

import pytest
import torch

import gradsift
from gradsift.core import wire
from gradsift.core.payload import FIELD_HEADER_NBYTES, INT32_LIMIT, Payload


def payload(indices, values=None, numel=10, length=None, demand=None) -> Payload:
    values = [float(i) + 0.5 for i in indices] if values is None else values
    return Payload(
        numel=numel,
        dtype=torch.float32,
        values=torch.tensor(values),
        indices=torch.tensor(indices),
        length=length,
        demand=demand,
    )


def gathered(layout: wire.MessageLayout, messages: list[list[Payload]], flags=None) -> torch.Tensor:
    """What an all_gather of each worker's packed message would hand every worker."""
    flags = flags or [None] * len(messages)
    return torch.cat([layout.pack(m, f) for m, f in zip(messages, flags, strict=True)])


# -- dtypes and bytes ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "dtype"),
    [
        ("fp32", torch.float32),
        ("float32", torch.float32),
        ("fp16", torch.float16),
        ("float16", torch.float16),
        ("bf16", torch.bfloat16),
        ("bfloat16", torch.bfloat16),
        (torch.float16, torch.float16),
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.float32),
        (None, None),
    ],
)
def test_value_dtype_names(name, dtype):
    assert wire.parse_value_dtype(name) is dtype


@pytest.mark.parametrize("bad", ["fp8", "int8", torch.int32, 3])
def test_value_dtype_rejects_unknown(bad):
    with pytest.raises(ValueError, match="value_dtype must be one of"):
        wire.parse_value_dtype(bad)


def test_to_wire_narrows_indices_casts_values_and_leaves_a_wire_ready_payload_alone():
    local = gradsift.get_compressor("topk", ratio=0.05).compress(torch.randn(100))
    sent = wire.to_wire(local)
    assert sent.indices.dtype == torch.int32 and sent.values is local.values
    assert sent.nbytes == local.nbytes == 5 * 4 + 5 * 4 + FIELD_HEADER_NBYTES
    narrow = wire.to_wire(local, torch.bfloat16)
    assert narrow.values.dtype == torch.bfloat16 and narrow.nbytes == 5 * 2 + 5 * 4 + FIELD_HEADER_NBYTES
    assert narrow.dtype == torch.float32  # the dense gradient keeps its dtype
    assert wire.to_wire(sent) is sent and wire.to_wire(sent, torch.float32) is sent
    long = Payload(
        numel=INT32_LIMIT + 1, dtype=torch.float32, values=torch.ones(1), indices=torch.tensor([0])
    )
    assert wire.to_wire(long).indices.dtype == torch.int64


def test_to_wire_keeps_random_k_indices_local():
    randomk = gradsift.get_compressor("randomk", ratio=0.1).compress(torch.randn(100))
    sent = wire.to_wire(randomk, torch.float16)
    assert sent.indices is randomk.indices and "indices" not in sent.fields()


def test_layout_aligns_every_field_to_eight_bytes_after_the_header():
    parts = [wire.to_wire(payload([1, 4, 7])), wire.to_wire(payload([2], numel=5))]
    layout = wire.MessageLayout(parts)
    assert layout.header_words == 1 + 2 * 2  # flags, then (length, demand) per part
    offsets = [(s.part, s.name, s.offset, s.nbytes) for s in layout.slots]
    assert offsets == [
        (0, "values", 24, 12),
        (0, "indices", 40, 12),
        (1, "values", 56, 4),
        (1, "indices", 64, 4),
    ]
    assert layout.nbytes == 72 and all(s.offset % 8 == 0 for s in layout.slots)


# -- round trip ---------------------------------------------------------------------------------


def test_two_workers_two_parts_round_trip_with_padding_lengths_and_demands():
    mine = [
        wire.to_wire(payload([1, 4, 7, 0], length=torch.tensor(3), demand=torch.tensor(9))),
        wire.to_wire(payload([2, 3])),
    ]
    theirs = [
        wire.to_wire(payload([0, 5, 9, 0], length=torch.tensor(2), demand=torch.tensor(4))),
        wire.to_wire(payload([1, 4])),
    ]
    layout = wire.MessageLayout(mine)
    received = layout.unpack(gathered(layout, [mine, theirs]), world=2)
    assert received.malformed.tolist() == [False, False] and not bool(received.nonfinite)
    assert received.demand.tolist() == [9, 2]  # the most any worker wanted, per part
    assert received.used.tolist() == [2.5, 2.0]  # the mean entries in use: (3 + 2) / 2, (2 + 2) / 2
    for worker, sent in enumerate([mine, theirs]):
        for got, want in zip(received.payloads[worker], sent, strict=True):
            used = int(want.entries())
            assert torch.equal(got.indices[:used], want.indices[:used])
            assert torch.equal(got.values[:used], want.values[:used])
            assert int(got.length) == used
            assert bool((got.indices[used:] == 0).all()) and bool((got.values[used:] == 0).all())


def test_a_flagged_sender_makes_the_whole_group_non_finite():
    part = [wire.to_wire(payload([1, 2]))]
    layout = wire.MessageLayout(part)
    received = layout.unpack(
        gathered(layout, [part, part], [torch.tensor(False), torch.tensor(True)]), world=2
    )
    assert bool(received.nonfinite) and received.malformed.tolist() == [False, False]


def test_quantized_payloads_travel_as_codes_and_scales_without_a_length():
    qsgd = gradsift.get_compressor("qsgd").compress(torch.randn(1000))
    layout = wire.MessageLayout([qsgd])
    assert [s.name for s in layout.slots] == ["codes", "scales"]
    received = layout.unpack(gathered(layout, [[qsgd], [qsgd]]), world=2)
    got = received.payloads[1][0]
    assert torch.equal(got.codes, qsgd.codes) and torch.equal(got.scales, qsgd.scales) and got.length is None
    assert received.malformed.tolist() == [False, False]


def test_a_message_packed_into_its_slot_is_the_fresh_message_and_the_payloads_become_views_of_it():
    """Oracle: :meth:`pack` into a new tensor. Packed into worker 1's slot of a buffer of two
    (an in-place allgather's), the slot holds the same bytes, the other slot is untouched, and
    :meth:`packed` gives payloads equal to the originals whose fields live in the slot."""
    qsgd = gradsift.get_compressor("qsgd").compress(torch.randn(100))
    mine = [wire.to_wire(payload([1, 4, 7, 0], length=torch.tensor(3), demand=torch.tensor(9))), qsgd]
    layout = wire.MessageLayout(mine)
    flag = torch.tensor(True)
    buffer = torch.full((2 * layout.nbytes,), 0xAB, dtype=torch.uint8)
    slot = buffer.narrow(0, layout.nbytes, layout.nbytes)
    assert layout.pack(mine, flag, into=slot).data_ptr() == slot.data_ptr()
    assert torch.equal(slot, layout.pack(mine, flag))
    assert bool((buffer[: layout.nbytes] == 0xAB).all())
    start, end = slot.data_ptr(), slot.data_ptr() + layout.nbytes
    for view, original in zip(layout.packed(slot, mine), mine, strict=True):
        assert view.fields().keys() == original.fields().keys()
        for name, tensor in view.fields().items():
            want = original.fields()[name]
            assert tensor.dtype == want.dtype and torch.equal(tensor, want)
            assert start <= tensor.data_ptr() and tensor.data_ptr() + tensor.nbytes <= end
        assert (view.length, view.demand, view.numel) == (original.length, original.demand, original.numel)


# -- what a peer could get wrong ----------------------------------------------------------------


def tampered(mutate) -> wire.Received:
    """Worker 1's message for two parts, with ``mutate`` applied to its raw bytes' header or
    fields (``mutate(header int32 view, indices of part 0 int32 view)``)."""
    good = [wire.to_wire(payload([1, 4, 7])), wire.to_wire(payload([2, 3], numel=5))]
    layout = wire.MessageLayout(good)
    buffer = gathered(layout, [good, good])
    second = buffer[layout.nbytes :]
    header = second[: layout.header_words * 4].view(torch.int32)
    slot = layout.slots[1]
    mutate(header, second[slot.offset : slot.offset + slot.nbytes].view(torch.int32))
    return layout.unpack(buffer, world=2)


@pytest.mark.parametrize(
    "mutate",
    [
        lambda header, idx: header.__setitem__(1, 4),  # length beyond the capacity of 3
        lambda header, idx: header.__setitem__(1, -1),  # a negative length
        lambda header, idx: header.__setitem__(2, -5),  # a negative demand
        lambda header, idx: header.__setitem__(0, 6),  # an unknown flag bit
        lambda header, idx: idx.__setitem__(2, 10),  # index == numel
        lambda header, idx: idx.__setitem__(0, -1),  # index below 0
        lambda header, idx: idx.__setitem__(1, 1),  # a repeated index
        lambda header, idx: idx.__setitem__(2, 3),  # not increasing
    ],
)
def test_a_malformed_message_flags_its_sender_and_decodes_into_nothing_out_of_range(mutate):
    received = tampered(mutate)
    assert received.malformed.tolist() == [False, True]
    for part in received.payloads[1]:
        if part.indices is not None:
            assert bool(((part.indices >= 0) & (part.indices < part.numel)).all())


def test_an_index_at_the_last_position_or_zero_is_accepted():
    received = tampered(lambda header, idx: (idx.__setitem__(0, 0), idx.__setitem__(2, 9)))
    assert received.malformed.tolist() == [False, False]


def test_padding_beyond_the_length_is_never_checked():
    """Entries past the length may hold anything: they are not in use."""
    received = tampered(lambda header, idx: (header.__setitem__(1, 1), idx.__setitem__(2, 99)))
    assert received.malformed.tolist() == [False, False]
    assert received.payloads[1][0].indices.tolist() == [1, 0, 0]
