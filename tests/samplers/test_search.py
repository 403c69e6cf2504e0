"""The slice index's batched search (``kernels.sampling._search_right_many``): every
item's answer is ``np.searchsorted(a, x, side="right")``, for empty, tiny and large
arrays, repeated values and targets outside the range."""

from __future__ import annotations

import numpy as np
import pytest

from mmbuffer.kernels.sampling import _search_right_many


@pytest.mark.parametrize("n", [0, 1, 2, 3, 5, 8, 64, 1000, 12_345])
def test_each_answer_is_numpys_searchsorted_right(n):
    rng = np.random.default_rng(n)
    a = np.cumsum(rng.integers(0, 3, n)).astype(np.int64)  # sorted, with runs of equal values
    top = int(a[-1]) if n else 0
    xs = rng.integers(-2, top + 3, 700).astype(np.int64)
    out = np.full(700, -1, np.int64)
    _search_right_many(a, xs, out)
    assert np.array_equal(out, np.searchsorted(a, xs, side="right"))
