"""zserve.core.groups: one grouping of request ids by frontend."""

from __future__ import annotations

import pytest

from zserve.core.groups import group_by_frontend


def test_group_by_frontend_keeps_order_and_takes_the_single_frontend_shortcut() -> None:
    assert group_by_frontend([5, 6, 7, 8], [1, 0, 1, 1]) == {1: [5, 7, 8], 0: [6]}
    assert group_by_frontend(range(3), ["a", "a", "a"]) == {"a": [0, 1, 2]}
    assert group_by_frontend([], []) == {}
    with pytest.raises(ValueError, match="2 values but 1 frontends"):
        group_by_frontend([1, 2], [0])
