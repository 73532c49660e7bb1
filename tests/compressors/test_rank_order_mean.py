"""The sparse means add the workers' entries in rank order, so every rank gets the same bits.

On CUDA one ``index_add_`` of every worker's entries is a set of atomic adds whose order
varies from run to run (and rank to rank): where three or more workers sent the same
position, the float sum then differs in its last bits. The oracles here are written
independently of the code under test: a Python loop that adds each worker's entries in
rank order, and a record of every ``index_add_`` issued, none of which may add two
non-zero values at one position (the condition under which atomics cannot reorder a sum).
"""

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gradsift.compressors import scatter_mean
from gradsift.core.payload import Payload
from gradsift.exchanges import balanced

N = 512


def overlapping(world: int, dtype: torch.dtype = torch.float32, padded: int = 0) -> list[Payload]:
    """``world`` payloads of 120 distinct positions drawn from the first 160 (so most positions
    are sent by three or more workers), values spread over six decades; ``padded`` extra
    entries at index 0 with value 0 (a fixed-capacity payload's unused room)."""
    payloads = []
    for rank in range(world):
        generator = torch.Generator().manual_seed(1000 * world + rank)
        positions = torch.randperm(160, generator=generator)[:120].sort().values
        values = torch.randn(120, generator=generator) * 10.0 ** torch.randint(
            -3, 3, (120,), generator=generator
        )
        indices = torch.cat([positions, torch.zeros(padded, dtype=torch.int64)])
        values = torch.cat([values, torch.zeros(padded)]).to(dtype)
        payloads.append(Payload(numel=N, dtype=dtype, values=values, indices=indices, length=120))
    return payloads


def rank_order_reference(payloads: list[Payload], order: list[int]) -> np.ndarray:
    """The float32 mean, adding ``(1/W) v`` element by element, workers in ``order``."""
    world = len(payloads)
    scale = np.float32(1.0 / world)
    total = np.zeros(N, dtype=np.float32)
    for rank in order:
        payload = payloads[rank]
        for index, value in zip(payload.indices.tolist(), payload.values.tolist(), strict=True):
            total[index] = np.float32(total[index] + np.float32(np.float32(value) * scale))
    return total


@pytest.mark.parametrize("world", [3, 4, 8])
def test_the_mean_is_the_rank_ordered_sum_bit_for_bit(world):
    payloads = overlapping(world, padded=7)
    reference = rank_order_reference(payloads, list(range(world)))
    # the order matters for these payloads: another order gives other bits somewhere
    assert not np.array_equal(reference, rank_order_reference(payloads, list(reversed(range(world)))))
    first = scatter_mean(payloads, N)
    again = scatter_mean(payloads, N, out=torch.full((N,), 3.0))
    assert np.array_equal(first.numpy(), reference)
    assert torch.equal(first, again)


class IndexAdds(TorchDispatchMode):
    """Records the (index, source) of every ``index_add_``."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket is torch.ops.aten.index_add_:
            self.calls.append((args[2].clone(), args[3].clone()))
        return func(*args, **(kwargs or {}))


def assert_no_position_added_twice(calls) -> None:
    assert calls
    for index, source in calls:
        live = index[source != 0]
        assert live.unique().numel() == live.numel(), "one index_add_ adds two values at a position"


@pytest.mark.parametrize("world", [3, 8])
def test_no_index_add_leaves_the_order_of_a_sum_to_the_device(world):
    with IndexAdds() as seen:
        scatter_mean(overlapping(world, padded=5), N)
    assert len(seen.calls) == world
    assert_no_position_added_twice(seen.calls)


def test_half_precision_sums_in_rank_order_then_divides():
    world = 4
    payloads = overlapping(world, torch.bfloat16)
    total = torch.zeros(N, dtype=torch.bfloat16)
    for payload in payloads:  # element by element, rank order, rounding to bf16 after each add
        for index, value in zip(payload.indices.tolist(), payload.values.tolist(), strict=True):
            total[index] = (total[index].float() + value).to(torch.bfloat16)
    assert torch.equal(scatter_mean(payloads, N), total / world)


def blocks(world: int, room: int) -> balanced._Blocks:
    """Blocks as a slice owner receives them: per sender ``room`` ascending positions in
    [0, 40) (heavy overlap), the unused tail at ``_LAST`` with value 0."""
    positions, values, counts = [], [], []
    for rank in range(world):
        generator = torch.Generator().manual_seed(77 + rank)
        count = room - rank % 3
        chosen = torch.randperm(40, generator=generator)[:count].sort().values
        positions.append(torch.cat([chosen, torch.full((room - count,), balanced._LAST)]))
        scaled = torch.randn(count, generator=generator) * 10.0 ** torch.randint(
            -3, 3, (count,), generator=generator
        )
        values.append(torch.cat([scaled, torch.zeros(room - count)]))
        counts.append(count)
    return balanced._Blocks(
        torch.zeros(world, dtype=torch.bool),
        torch.tensor(counts),
        torch.stack(positions),
        torch.stack(values),
    )


@pytest.mark.parametrize("world", [3, 4, 8])
def test_the_balanced_slice_sums_its_senders_in_rank_order(world):
    room = 30
    got = blocks(world, room)
    reference = {}
    for rank in range(world):  # float32, element by element, rank order
        for position, value in zip(got.positions[rank].tolist(), got.values[rank].tolist(), strict=True):
            if position != balanced._LAST:
                reference[position] = np.float32(reference.get(position, np.float32(0)) + np.float32(value))
    with IndexAdds() as seen:
        reduced = balanced._reduce_slice(got, room, 1000, torch.float32)
    assert_no_position_added_twice(seen.calls)
    used = int(reduced.length)
    assert used > 0
    for position, value in zip(reduced.indices[:used].tolist(), reduced.values[:used].tolist(), strict=True):
        assert np.float32(value) == reference[position]


@pytest.mark.parametrize("name", ["bf16", "fp16", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_a_cast_decodes_into_the_bucket_bit_for_bit_as_its_decompress(name, dtype):
    """Oracle: ``decompress`` (a widened copy per payload, summed, divided). Writing into the
    bucket gives the same bits for every wire and bucket dtype, 1 to 3 payloads."""
    from gradsift.compressors import get_compressor
    from gradsift.core.readout import Readout

    compressor = get_compressor(name)
    generator = torch.Generator().manual_seed(5)
    flats = [(torch.randn(1000, generator=generator) * 1e3).to(dtype) for _ in range(3)]
    payloads = [compressor.encode(f, key=0, capacity=None, readout=Readout()) for f in flats]
    for world in (1, 2, 3):
        out = torch.full((1000,), float("nan"), dtype=dtype)
        assert compressor.decompress_into(payloads[:world], out) is None
        assert torch.equal(out, compressor.decompress(payloads[:world], 1000))
