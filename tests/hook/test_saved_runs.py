"""``gradsift.hook.layout.saved_runs``: a bucket cut into the buckets its stored state was kept for.

A resumed run's first step gets DDP's first bucketing (one bucket of every parameter), the
checkpoint holds state for the rebuilt buckets; the bucket is cut into those only where they
cover it exactly, each in one contiguous run (tests/frontends/test_ddp_resilience.py resumes
such a run bit for bit).
"""

from __future__ import annotations

from gradsift.hook.layout import saved_runs

SIZES = dict.fromkeys(range(5), 10)  # every parameter 10 elements


def test_a_bucket_covered_by_stored_buckets_in_runs_is_cut_into_them() -> None:
    layouts = {(2, 3): (3, 2), (0, 1): (1, 0)}
    assert saved_runs((0, 1, 2, 3), layouts, SIZES) == [(0, 1), (2, 3)]
    assert saved_runs((3, 2, 1, 0), layouts, SIZES) == [(3, 2), (1, 0)]  # each run in the bucket's own order


def test_a_bucket_stays_whole_otherwise() -> None:
    layouts = {(2, 3): (3, 2), (0, 1): (1, 0)}
    assert saved_runs((2, 3), layouts, SIZES) is None  # a stored bucket itself
    assert saved_runs((0, 2, 1, 3), layouts, SIZES) is None  # a stored bucket in two runs
    assert saved_runs((0, 1, 2, 3, 4), layouts, SIZES) is None  # a parameter no stored bucket holds
    assert saved_runs((0, 1, 2, 3), {(0, 1, 2, 3): (3, 2, 1, 0)}, SIZES) is None  # the step before a rebuild
    per_parameter = {0: (0,), 1: (1,), 2: (2,)}  # per-parameter keys are no buckets
    assert saved_runs((0, 1, 2), per_parameter, SIZES) is None
    assert saved_runs((0, 1, 2), {}, SIZES) is None  # a fresh run


def test_a_parameter_of_no_elements_joins_its_key_wherever_it_lies() -> None:
    sizes = {**SIZES, 0: 0}  # parameter 0 takes no room in the flat bucket
    layouts = {(0, 3, 4): (0, 4, 3), (1, 2): (2, 1)}  # DDP's rebuild put it with 3 and 4
    assert saved_runs((0, 1, 2, 3, 4), layouts, sizes) == [(1, 2), (3, 4, 0)]
    assert saved_runs((0, 1, 2, 3, 4), layouts, SIZES) is None  # with elements it splits its bucket
    alone = {(0,): (0,), (1, 2, 3, 4): (4, 3, 2, 1)}  # a bucket of the empty parameter only
    assert saved_runs((0, 1, 2, 3, 4), alone, sizes) == [(1, 2, 3, 4), (0,)]
