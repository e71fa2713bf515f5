"""ops.split_columns on the CPU: column blocks copied exactly, and bad parts refused with the reason."""
from __future__ import annotations

import numpy as np
import pytest

from lily import _core

ops = _core.ops


@pytest.mark.parametrize("T, widths", [(3, [8192, 4096, 32, 32]), (7, [5, 1, 2]), (1, [9])])
def test_split_columns_copies_blocks(T, widths):
    y = np.random.default_rng(T).standard_normal((T, sum(widths))).astype(np.float32)
    parts = ops.split_columns("cpu", y, widths)
    bounds = np.cumsum([0] + widths)
    for p, b0, b1 in zip(parts, bounds[:-1], bounds[1:]):
        assert np.array_equal(p, y[:, b0:b1])


@pytest.mark.parametrize("widths, message", [([3, 3], "sum to 6, not y's 7"), ([1, 1, 1, 1, 3], "5 parts"),
                                             ([], "0 parts")])
def test_split_columns_refuses_bad_parts(widths, message):
    y = np.zeros((2, 7), np.float32)
    with pytest.raises(Exception, match=message):
        ops.split_columns("cpu", y, widths)
