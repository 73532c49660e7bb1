"""The wire format's rules on hand-made messages, complementing test_wire.py: the value-dtype
names, index widening past int32, what to_wire leaves alone (no copy, random-k's local
indices), quantized payloads' multi-field headers and round trip, and each check of a
received message at its exact boundary."""

from __future__ import annotations

import pytest
import torch

import gradsift
from gradsift.compressors.base import INT32_LIMIT, Payload
from gradsift.errors import WireFormatError
from gradsift.exchanges import wire


def payload(indices: list[int], values: list[float] | None = None, numel: int = 10) -> Payload:
    values = [float(i) for i in indices] if values is None else values
    return Payload(
        numel=numel, dtype=torch.float32, values=torch.tensor(values), indices=torch.tensor(indices)
    )


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
    ],
)
def test_value_dtype_names(name, dtype):
    assert wire.parse_value_dtype(name) is dtype


def test_no_value_dtype_keeps_values():
    assert wire.parse_value_dtype(None) is None
    with pytest.raises(
        gradsift.InvalidOptionError, match=r"value_dtype must be one of None, fp32, fp16, bf16; got 'FP16'"
    ):
        wire.parse_value_dtype("FP16")
    with pytest.raises(gradsift.InvalidOptionError, match="got torch.float64"):
        wire.parse_value_dtype(torch.float64)


def test_to_wire_widens_indices_past_int32_and_leaves_a_wire_ready_payload_alone():
    huge = Payload(
        numel=INT32_LIMIT + 1,
        dtype=torch.float32,
        values=torch.ones(2),
        indices=torch.tensor([3, INT32_LIMIT], dtype=torch.int32),
    )
    assert wire.to_wire(huge).indices.tolist() == [3, INT32_LIMIT]
    assert wire.to_wire(huge).indices.dtype == torch.int64
    ready = Payload(
        numel=10,
        dtype=torch.float32,
        values=torch.ones(3),
        indices=torch.tensor([1, 4, 8], dtype=torch.int32),
    )
    assert wire.to_wire(ready) is ready
    assert wire.to_wire(ready, torch.float32) is ready  # values already in the value dtype
    pair = wire.to_wire(payload([5, 2], [0.5, 0.25]))  # two unsorted indices are sorted too
    assert pair.indices.tolist() == [2, 5] and pair.values.tolist() == [0.25, 0.5]
    one = Payload(numel=10, dtype=torch.float32, values=torch.tensor([2.5]), indices=torch.tensor([7]))
    sent = wire.to_wire(one, torch.float16)
    assert sent.indices.tolist() == [7] and sent.indices.dtype == torch.int32
    assert sent.values.dtype == torch.float16 and sent.values.tolist() == [2.5]


def test_to_wire_keeps_random_k_indices_local():
    """Random-k's positions come from a shared seed: they are not a wire field, so to_wire
    neither sorts nor narrows them (the values stay paired with them)."""
    compressor = gradsift.get_compressor("randomk", ratio=0.3, seed=1)
    local = compressor.compress(torch.arange(20.0))
    assert "indices" not in local.fields()
    sent = wire.to_wire(local, torch.float16)
    assert sent.indices is local.indices
    assert sent.values.dtype == torch.float16 and torch.equal(sent.values.float(), local.values)


def test_quantized_payloads_travel_as_codes_and_scales():
    """Two QSGD parts: header (codes, scales) per part, part-major; decode returns each
    part's codes and scales and no stale info."""
    compressor = gradsift.get_compressor("qsgd")
    parts = [compressor.compress(torch.linspace(-1, 1, n)) for n in (40, 9)]
    assert list(parts[0].fields()) == ["codes", "scales"]
    header = wire.header(parts)
    assert header == [parts[0].codes.numel(), 1, parts[1].codes.numel(), 1]
    data = wire.concat_fields(parts)
    assert torch.equal(data["codes"], torch.cat([parts[0].codes.reshape(-1), parts[1].codes.reshape(-1)]))
    decoded = wire.decode(header, data, parts)
    for got, want in zip(decoded, parts, strict=True):
        assert torch.equal(got.codes, want.codes) and torch.equal(got.scales, want.scales)
        assert got.info == {} and got.indices is None and got.numel == want.numel
        torch.testing.assert_close(
            compressor.decompress([got], got.numel), compressor.decompress([want], want.numel)
        )
    assert wire.header(parts, nonfinite=True) == [wire.NONFINITE] * 4


def test_concat_fields_flattens_a_single_part():
    part = Payload(numel=6, dtype=torch.float32, values=torch.arange(6.0).reshape(2, 3))
    assert wire.concat_fields([part])["values"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


def test_check_headers_accepts_flags_of_a_multi_part_message_and_zero_lengths():
    rows = torch.tensor([[2, 2, 0, 0], [-1, -1, -1, -1], [0, 0, 1, 1]], dtype=torch.int32)
    assert wire.check_headers(rows, parts=2, fields=2) is True
    assert wire.check_headers(rows[[0, 2]], parts=2, fields=2) is False
    with pytest.raises(
        WireFormatError, match=r"4 lengths per worker \(2 parts x 2 fields\), got shape \(4,\)"
    ):
        wire.check_headers(rows[0], parts=2, fields=2)
    with pytest.raises(WireFormatError, match="negative lengths"):
        wire.check_headers(torch.tensor([[-1, -1, -1, 0]], dtype=torch.int32), parts=2, fields=2)


@pytest.mark.parametrize(
    ("indices", "ok"),
    [
        ([0, 9], True),
        ([9], True),
        ([], True),
        ([0, 10], False),
        ([10], False),
        ([-1], False),
        ([-1, 3], False),
    ],
)
def test_index_range_is_checked_at_both_ends(indices, ok):
    part = wire.to_wire(payload(indices))
    header, data = wire.header([part]), wire.concat_fields([part])
    if ok:
        assert wire.decode(header, data, [part])[0].indices.tolist() == indices
    else:
        with pytest.raises(WireFormatError, match=r"part 0: indices must lie in \[0, 10\)"):
            wire.decode(header, data, [part])


def test_check_positions_names_the_part_and_the_range():
    wire.check_positions(torch.tensor([0, 4, 9]), 10)
    with pytest.raises(WireFormatError, match=r"part 3: indices must lie in \[0, 9\), got range \[0, 9\]"):
        wire.check_positions(torch.tensor([0, 4, 9]), 9, part=3)
    for bad in ([4, 4], [1, 5, 3], [0, 4, 4], [2, 7, 9, 8]):  # each pair of neighbours is checked
        with pytest.raises(WireFormatError, match="part 0: indices must increase strictly"):
            wire.check_positions(torch.tensor(bad), 10)


def test_decode_of_a_multi_field_length_mismatch_names_the_field():
    parts = [wire.to_wire(payload([1, 2])), wire.to_wire(payload([3]))]
    data = wire.concat_fields(parts)
    with pytest.raises(WireFormatError, match="field 'indices' holds 3 elements, header says 4"):
        wire.decode([2, 2, 1, 2], data, parts)
    with pytest.raises(WireFormatError, match="header has 2 lengths, expected 4"):
        wire.decode([2, 2], data, parts)
    with pytest.raises(WireFormatError, match=r"message carries fields \['codes', 'indices', 'values'\]"):
        wire.decode([2, 2, 1, 1], {**data, "codes": torch.zeros(1, dtype=torch.uint8)}, parts)


def test_decode_takes_every_field_from_the_message_not_from_the_local_templates():
    """The templates are the receiver's own payloads: codes and scales must come from the
    sender's message."""
    qsgd = gradsift.get_compressor("qsgd")
    mine = [qsgd.compress(torch.linspace(-1, 1, 40)), qsgd.compress(torch.linspace(0, 3, 9))]
    theirs = [qsgd.compress(torch.linspace(2, -5, 40)), qsgd.compress(torch.linspace(-1, 0, 9))]
    assert not torch.equal(mine[0].codes, theirs[0].codes) and not torch.equal(
        mine[1].scales, theirs[1].scales
    )
    decoded = wire.decode(wire.header(theirs), wire.concat_fields(theirs), mine)
    for got, sent in zip(decoded, theirs, strict=True):
        assert torch.equal(got.codes, sent.codes) and torch.equal(got.scales, sent.scales)


def test_decode_of_three_parts_keeps_each_offset():
    parts = [wire.to_wire(payload(i, numel=10)) for i in ([1, 2, 3], [0], [4, 8])]
    decoded = wire.decode(wire.header(parts), wire.concat_fields(parts), parts)
    assert [p.indices.tolist() for p in decoded] == [[1, 2, 3], [0], [4, 8]]
    assert [p.values.tolist() for p in decoded] == [[1.0, 2.0, 3.0], [0.0], [4.0, 8.0]]


def test_to_wire_sorts_any_disorder_and_carries_a_positions_only_payload():
    """[1, 5, 3] is out of order only after the first element. A payload of positions
    without values is sorted and sent as it is, with or without a value dtype."""
    mixed = wire.to_wire(payload([1, 5, 3], [0.1, 0.5, 0.3]))
    assert mixed.indices.tolist() == [1, 3, 5] and mixed.values.tolist() == pytest.approx([0.1, 0.3, 0.5])
    positions = Payload(numel=10, dtype=torch.float32, values=None, indices=torch.tensor([5, 2]))
    for value_dtype in (None, torch.float16):
        sent = wire.to_wire(positions, value_dtype)
        assert sent.indices.tolist() == [2, 5] and sent.values is None
