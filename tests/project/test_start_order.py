"""tests/support/start_order.py, the order an xdist worker starts its groups in: the documented
runs, then the groups with a slow test, then the quick groups, the larger first.

Oracle: stub items whose groups and markers are written out, the expected order by hand."""

from __future__ import annotations

import pytest

from support.doc_commands import EXAMPLES_GROUP
from support.start_order import start_order


class _Item:
    """What ``_start_order`` reads of a test: its xdist group and whether it is slow."""

    def __init__(self, group: str, slow: bool = False) -> None:
        self.markers = {"xdist_group": pytest.mark.xdist_group(group).mark}
        if slow:
            self.markers["slow"] = pytest.mark.slow.mark

    def get_closest_marker(self, name: str):
        return self.markers.get(name)


def test_documented_then_slow_then_the_larger_quick_groups_first() -> None:
    items = [
        _Item("small.py"),  # quick, 1 test
        _Item("large.py"), _Item("large.py"), _Item("large.py"),  # quick, 3 tests
        _Item("slow.py"), _Item("slow.py", slow=True),  # one slow test makes the group slow
        _Item("middle.py"), _Item("middle.py"),  # quick, 2 tests
        _Item(EXAMPLES_GROUP, slow=True),
    ]  # fmt: skip
    order = start_order(items, (EXAMPLES_GROUP,))
    ranked = sorted(order, key=order.get)
    assert ranked == [EXAMPLES_GROUP, "slow.py", "large.py", "middle.py", "small.py"]
