"""``gradsift.hook.layout.saved_runs``: a bucket cut into the buckets its stored state was kept for.

A resumed run's first step gets DDP's first bucketing (one bucket of every parameter), the
checkpoint holds state for the rebuilt buckets; the bucket is cut into those only where they
cover it exactly, each in one contiguous run (tests/frontends/test_ddp_resilience.py resumes
such a run bit for bit).
"""

from __future__ import annotations

from gradsift.hook.layout import saved_runs


def test_a_bucket_covered_by_stored_buckets_in_runs_is_cut_into_them() -> None:
    layouts = {(2, 3): (3, 2), (0, 1): (1, 0)}
    assert saved_runs((0, 1, 2, 3), layouts) == [(0, 1), (2, 3)]
    assert saved_runs((3, 2, 1, 0), layouts) == [(3, 2), (1, 0)]  # each run in the bucket's own order


def test_a_bucket_stays_whole_otherwise() -> None:
    layouts = {(2, 3): (3, 2), (0, 1): (1, 0)}
    assert saved_runs((2, 3), layouts) is None  # a stored bucket itself
    assert saved_runs((0, 2, 1, 3), layouts) is None  # a stored bucket in two runs
    assert saved_runs((0, 1, 2, 3, 4), layouts) is None  # a parameter no stored bucket holds
    assert saved_runs((0, 1, 2, 3), {(0, 1, 2, 3): (3, 2, 1, 0)}) is None  # the step before a rebuild
    assert saved_runs((0, 1, 2), {0: (0,), 1: (1,), 2: (2,)}) is None  # per-parameter keys are no buckets
    assert saved_runs((0, 1, 2), {}) is None  # a fresh run
