"""Wire format: exact byte counts, dtype rules, and rejection of malformed messages."""

import pytest
import torch

import gradsift
from gradsift.compressors import Payload
from gradsift.exchanges import wire


def sparse(numel=100, k=5, seed=0) -> Payload:
    payload = gradsift.get_compressor("topk", ratio=k / numel).compress(
        torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    )
    assert payload.count == k
    return payload


def test_to_wire_narrows_indices_and_counts_exact_bytes():
    sent = wire.to_wire(sparse())
    assert sent.indices.dtype == torch.int32 and sent.values.dtype == torch.float32
    data = wire.concat_fields([sent])
    header = wire.header([sent])
    assert header == [5, 5]
    on_wire = 4 * len(header) + sum(t.numel() * t.element_size() for t in data.values())
    assert sent.nbytes == on_wire == 5 * 4 + 5 * 4 + 8


def test_value_dtype_casts_values_only():
    sent = wire.to_wire(sparse(), torch.bfloat16)
    assert sent.values.dtype == torch.bfloat16 and sent.nbytes == 5 * 2 + 5 * 4 + 8
    assert sent.dtype == torch.float32  # the dense gradient keeps its dtype


def test_index_dtype_switches_to_int64_past_int32():
    assert wire.index_dtype(2**31 - 1) == torch.int32
    assert wire.index_dtype(2**31) == torch.int64


@pytest.mark.parametrize("bad", ["fp8", "int8", torch.int32, 3])
def test_value_dtype_rejects_unknown(bad):
    with pytest.raises(ValueError, match="value_dtype must be one of"):
        wire.parse_value_dtype(bad)


def test_roundtrip_of_two_parts():
    parts = [wire.to_wire(sparse(100, 5, 1)), wire.to_wire(sparse(40, 2, 2))]
    decoded = wire.decode(wire.header(parts), wire.concat_fields(parts), parts)
    for got, want in zip(decoded, parts, strict=True):
        assert torch.equal(got.indices, want.indices) and torch.equal(got.values, want.values)
        assert got.numel == want.numel


def message():
    parts = [wire.to_wire(sparse())]
    return wire.header(parts), wire.concat_fields(parts), parts


def test_decode_rejects_length_that_does_not_add_up():
    _, data, parts = message()
    with pytest.raises(gradsift.WireFormatError, match="'values' holds 5 elements, header says 6"):
        wire.decode([6, 5], data, parts)


def test_decode_rejects_index_out_of_range():
    header, data, parts = message()
    data["indices"] = data["indices"].clone()
    data["indices"][-1] = 100
    with pytest.raises(
        gradsift.WireFormatError, match=r"indices must lie in \[0, 100\), got range \[\d+, 100\]"
    ):
        wire.decode(header, data, parts)
    data["indices"][-1] = 99
    data["indices"][0] = -1
    with pytest.raises(
        gradsift.WireFormatError, match=r"indices must lie in \[0, 100\), got range \[-1, 99\]"
    ):
        wire.decode(header, data, parts)


def test_decode_rejects_repeated_and_unsorted_indices():
    header, data, parts = message()
    repeated = data["indices"].clone()
    repeated[1] = repeated[0]  # one worker's value would be added twice
    with pytest.raises(gradsift.WireFormatError, match="indices must increase strictly"):
        wire.decode(header, {**data, "indices": repeated}, parts)
    with pytest.raises(gradsift.WireFormatError, match="indices must increase strictly"):
        wire.decode(header, {**data, "indices": data["indices"].flip(0)}, parts)


def test_to_wire_sorts_indices_with_their_values_and_narrows_them():
    payload = gradsift.Payload(
        numel=10, dtype=torch.float32, values=torch.tensor([3.0, 1.0, 2.0]), indices=torch.tensor([7, 1, 4])
    )
    sent = wire.to_wire(payload, torch.bfloat16)
    assert sent.indices.tolist() == [1, 4, 7] and sent.indices.dtype == torch.int32
    assert sent.values.tolist() == [1.0, 2.0, 3.0] and sent.values.dtype == torch.bfloat16
    assert payload.indices.tolist() == [7, 1, 4]  # the local payload is not modified
    ordered = gradsift.Payload(
        numel=10, dtype=torch.float32, values=torch.ones(2), indices=torch.tensor([2, 5])
    )
    assert wire.to_wire(ordered).values is ordered.values  # nothing to change: no copy


def test_decode_splits_a_multi_part_message_and_rejects_a_part_boundary_shift():
    first = gradsift.Payload(
        numel=8, dtype=torch.float32, values=torch.tensor([1.0, 2.0]), indices=torch.tensor([0, 5])
    )
    second = gradsift.Payload(
        numel=4, dtype=torch.float32, values=torch.tensor([3.0]), indices=torch.tensor([3])
    )
    parts = [wire.to_wire(first), wire.to_wire(second)]
    header, data = wire.header(parts), wire.concat_fields(parts)
    assert header == [2, 2, 1, 1]
    decoded = wire.decode(header, data, parts)
    assert decoded[0].indices.tolist() == [0, 5] and decoded[1].indices.tolist() == [3]
    assert decoded[1].values.tolist() == [3.0]
    # The same data with the boundary moved: the second part would get indices [5, 3].
    with pytest.raises(gradsift.WireFormatError, match=r"part 1: indices must increase strictly"):
        wire.decode([1, 1, 2, 2], data, parts)


def test_decode_rejects_wrong_dtype_and_shape():
    header, data, parts = message()
    with pytest.raises(gradsift.WireFormatError, match="'indices' must be a 1-D torch.int32"):
        wire.decode(header, {**data, "indices": data["indices"].long()}, parts)
    with pytest.raises(gradsift.WireFormatError, match="'values' must be a 1-D torch.float32"):
        wire.decode(header, {**data, "values": data["values"].reshape(5, 1)}, parts)


def test_decode_rejects_missing_field_and_wrong_header_size():
    header, data, parts = message()
    with pytest.raises(gradsift.WireFormatError, match="carries fields"):
        wire.decode(header, {"values": data["values"]}, parts)
    with pytest.raises(gradsift.WireFormatError, match="header has 3 lengths, expected 2"):
        wire.decode([*header, 0], data, parts)


def test_decode_rejects_values_indices_count_mismatch():
    _, data, parts = message()
    data = {"values": data["values"][:4], "indices": data["indices"]}
    with pytest.raises(gradsift.WireFormatError, match="4 values for 5 indices"):
        wire.decode([4, 5], data, parts)


def test_headers_flag_nonfinite_and_reject_negative_lengths():
    assert wire.header([wire.to_wire(sparse())], nonfinite=True) == [wire.NONFINITE] * 2
    ok = torch.tensor([[5, 5], [3, 3]], dtype=torch.int32)
    assert wire.check_headers(ok, parts=1, fields=2) is False
    flagged = torch.tensor([[5, 5], [-1, -1]], dtype=torch.int32)
    assert wire.check_headers(flagged, parts=1, fields=2) is True
    with pytest.raises(gradsift.WireFormatError, match="negative lengths"):
        wire.check_headers(torch.tensor([[5, -1], [3, 3]], dtype=torch.int32), parts=1, fields=2)
    with pytest.raises(gradsift.WireFormatError, match="negative lengths"):
        wire.check_headers(torch.tensor([[5, 5], [-7, -7]], dtype=torch.int32), parts=1, fields=2)
    with pytest.raises(gradsift.WireFormatError, match="2 lengths per worker"):
        wire.check_headers(torch.zeros(2, 3, dtype=torch.int32), parts=1, fields=2)


def test_register_comm_hook_rejects_non_ddp_and_bad_options():
    from gradsift.ddp import GradsiftHookState, HookOptions

    with pytest.raises(ValueError, match="DistributedDataParallel"):
        gradsift.register_comm_hook(torch.nn.Linear(2, 2), "topk")
    for option, value, match in [
        ("granularity", "tensor", "granularity must be one of bucket, layer"),
        ("min_numel", -1, "min_numel must lie in"),
        ("warmup_steps", 1.5, "warmup_steps must be an integer"),
        ("nonfinite", "ignore", "nonfinite must be one of propagate, skip, raise"),
        ("momentum", 1.0, "momentum must lie in"),
        ("momentum_masking", 1, "momentum_masking must be True or False"),
        ("clip_norm", 0.0, "clip_norm must lie in"),
        ("density_warmup_start", 1.5, "density_warmup_start must lie in"),
        ("exchange", "carrier-pigeon", "exchange must be one of auto, allreduce, allgather"),
        ("value_dtype", "int8", "value_dtype must be one of"),
    ]:
        with pytest.raises(ValueError, match=match):
            HookOptions(**{option: value})
        with pytest.raises(ValueError, match=match):
            GradsiftHookState.build("topk", **{option: value})
    with pytest.raises(ValueError, match="cannot travel by exchange 'allreduce'; it supports: allgather"):
        GradsiftHookState.build("topk", exchange="allreduce")
    with pytest.raises(ValueError, match="granularity='bucket'"):
        GradsiftHookState.build("powersgd", granularity="layer")
    with pytest.raises(ValueError, match="density_warmup_steps needs a sparsifier"):
        GradsiftHookState.build("qsgd", density_warmup_steps=10)
    with pytest.raises(ValueError, match="no option.*bogus"):
        GradsiftHookState.build("topk", bogus=1)
