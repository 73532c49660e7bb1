"""The order an xdist worker starts its groups in (``tests/conftest.py``): the documented runs
first, then the groups with a slow test, then the quick groups, the larger first -- the longest
units start first and the quick ones fill the end, so neither worker waits alone for a long
group (a quick group of many tests can be long: the fake-CUDA matrix's 127)."""

from __future__ import annotations

from typing import Any


def group_of(item: Any) -> str:
    """The xdist group of a test item."""
    return item.get_closest_marker("xdist_group").args[0]


def start_order(items: list[Any], documented: tuple[str, ...]) -> dict[str, tuple[int, int]]:
    """Per group: (0, 0) for one of ``documented``, (1, 0) for a group with a slow test, else
    (2, minus its number of tests)."""
    rank: dict[str, int] = {}
    size: dict[str, int] = {}
    for item in items:
        group = group_of(item)
        own = 0 if group in documented else 1 if item.get_closest_marker("slow") else 2
        rank[group] = min(own, rank.get(group, 2))
        size[group] = size.get(group, 0) + 1
    return {group: (rank[group], -size[group] if rank[group] == 2 else 0) for group in rank}
