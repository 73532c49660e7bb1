"""``gradsift.hook.layout.saved_runs``: a bucket cut into the buckets its stored state was kept for,
and ``ParameterLayout.parts``: the bucket laid out as those buckets were saved.

A resumed run's first step gets DDP's first bucketing (one bucket of every parameter), the
checkpoint holds state for the rebuilt buckets; the bucket is cut into those only where they
cover it exactly, each run a saved bucket's parameters. Where the saved buckets lie otherwise
in the bucket (apart, or in another order), the route hands the parts a copy laid out as they
were saved and lays the mean back (tests/frontends/test_ddp_resilience.py resumes such runs
bit for bit).
"""

from __future__ import annotations

import torch

from gradsift.core.store import TensorStore
from gradsift.hook.layout import FlatBucket, Grouped, ParameterLayout, saved_runs

SIZES = dict.fromkeys(range(5), 10)  # every parameter 10 elements


def test_a_bucket_covered_by_stored_buckets_is_cut_into_them() -> None:
    layouts = {(2, 3): (3, 2), (0, 1): (1, 0)}
    assert saved_runs((0, 1, 2, 3), layouts, SIZES) == [(0, 1), (2, 3)]
    assert saved_runs((3, 2, 1, 0), layouts, SIZES) == [(3, 2), (1, 0)]  # each run in the bucket's own order
    # a stored bucket's parameters apart: its run where its first parameter is
    assert saved_runs((0, 2, 1, 3), layouts, SIZES) == [(0, 1), (2, 3)]
    assert saved_runs((2, 0, 3, 1), layouts, SIZES) == [(2, 3), (0, 1)]


def test_a_bucket_stays_whole_otherwise() -> None:
    layouts = {(2, 3): (3, 2), (0, 1): (1, 0)}
    assert saved_runs((2, 3), layouts, SIZES) is None  # a stored bucket itself
    assert saved_runs((0, 1, 2, 3, 4), layouts, SIZES) is None  # a parameter no stored bucket holds
    assert saved_runs((0, 1, 2, 3), {(0, 1, 2, 3): (3, 2, 1, 0)}, SIZES) is None  # the step before a rebuild
    per_parameter = {0: (0,), 1: (1,), 2: (2,)}  # per-parameter keys are no buckets
    assert saved_runs((0, 1, 2), per_parameter, SIZES) is None
    assert saved_runs((0, 1, 2), {}, SIZES) is None  # a fresh run


def test_a_parameter_of_no_elements_joins_its_key_wherever_it_lies() -> None:
    sizes = {**SIZES, 0: 0}  # parameter 0 takes no room in the flat bucket
    layouts = {(0, 3, 4): (0, 4, 3), (1, 2): (2, 1)}  # DDP's rebuild put it with 3 and 4
    assert saved_runs((0, 1, 2, 3, 4), layouts, sizes) == [(1, 2), (3, 4, 0)]
    alone = {(0,): (0,), (1, 2, 3, 4): (4, 3, 2, 1)}  # a bucket of the empty parameter only
    assert saved_runs((0, 1, 2, 3, 4), alone, sizes) == [(1, 2, 3, 4), (0,)]


def bucket_of(sizes: list[int]) -> FlatBucket:
    """A bucket of parameters 0, 1, ... of ``sizes`` elements, each filled with its number."""
    params = [torch.nn.Parameter(torch.zeros(n)) for n in sizes]
    return FlatBucket(torch.cat([torch.full((n,), float(i)) for i, n in enumerate(sizes)]), params, last=True)


def layout_of(
    bucket: FlatBucket, saved: dict[tuple[int, ...], tuple[int, ...]]
) -> tuple[ParameterLayout, TensorStore]:
    layout, store = ParameterLayout(), TensorStore()
    layout.bind(torch.nn.ParameterList(bucket.params))
    store.layouts.update(saved)
    return layout, store


def test_a_bucket_is_regrouped_as_its_saved_buckets_were_and_laid_back() -> None:
    bucket = bucket_of([3, 2, 4, 1])
    for saved, grouped_order in [
        ({(0, 3): (3, 0), (1, 2): (2, 1)}, (3, 0, 2, 1)),  # saved buckets whose parameters lie apart
        ({(0, 1): (1, 0), (2, 3): (3, 2)}, (1, 0, 3, 2)),  # together, each in another order
    ]:
        layout, store = layout_of(bucket, saved)
        parts, order, grouped = layout.parts(bucket, "bucket", store)
        assert isinstance(grouped, Grouped) and grouped.is_last()
        expected = [float(i) for i in grouped_order for _ in range(bucket.params[i].numel())]
        assert grouped.buffer().tolist() == expected
        assert list(map(id, grouped.parameters())) == [id(bucket.params[i]) for i in grouped_order]
        firsts = [order.index(saved[key][0]) for key in saved]
        assert order == grouped_order and [part.key for part in parts] == [
            k for _, k in sorted(zip(firsts, saved, strict=True))
        ]
        assert all(part.flat.data_ptr() == grouped.buffer()[part.offset :].data_ptr() for part in parts)
        assert {part.key: store.layouts[part.key] for part in parts} == saved  # laid out as saved
        mean = grouped.buffer() * 10  # a result in the grouped order, back in the bucket's
        assert grouped.laid_back(mean).tolist() == (bucket.buffer() * 10).tolist()


def test_a_bucket_is_left_as_it_is_where_no_regrouping_is_needed() -> None:
    bucket = bucket_of([3, 2, 4, 1])
    as_saved = {(0, 1): (0, 1), (2, 3): (2, 3)}
    apart = {(0, 3): (3, 0), (1, 2): (2, 1)}
    for saved, granularity, regroup in [
        (as_saved, "bucket", True),  # laid out as saved already
        (apart, "layer", True),  # one part per parameter
        (apart, "bucket", False),  # an exchange of whole buckets
        ({(0, 1, 2, 3): (3, 2, 1, 0)}, "bucket", True),  # a saved bucket itself (DDP's rebuild)
        ({}, "bucket", True),  # nothing saved
    ]:
        layout, store = layout_of(bucket, saved)
        assert layout.parts(bucket, granularity, store, regroup)[2] is bucket, (saved, granularity, regroup)
    empty = bucket_of([3, 4, 0, 1])  # parameter 2 has no elements: where it lies takes no room
    layout, store = layout_of(empty, {(0, 2): (2, 0), (1, 3): (1, 3)})
    assert layout.parts(empty, "bucket", store)[2] is empty
