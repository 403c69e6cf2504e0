"""Runs of rows copied into a mapped column in one compiled call: the rows a
multi-stream ``extend`` appends to several lanes (``_ledger/appending.py``), one run
per lane (two where its ring wraps), without a numpy call per run.

>>> import numpy as np
>>> dst, src = np.zeros((6, 2), np.int16), np.arange(8, dtype=np.int16).reshape(4, 2)
>>> scatter_runs(dst.reshape(-1).view(np.uint8), src.reshape(-1).view(np.uint8),
...              np.array([4, 0]), np.array([0, 2]), np.array([2, 1]), 4)
>>> dst.tolist()
[[4, 5], [0, 0], [0, 0], [0, 0], [0, 1], [2, 3]]
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np

from .intrinsics import memcpy

__all__ = ["scatter_runs"]


@numba.njit(nogil=True, cache=True)
def _scatter(dst: Any, src: Any, dst_rows: Any, src_rows: Any, counts: Any, row_bytes: int) -> None:
    for r in range(counts.size):
        n = counts[r]
        if n > 0:
            memcpy(dst, dst_rows[r] * row_bytes, src, src_rows[r] * row_bytes, n * row_bytes)


def scatter_runs(
    dst: np.ndarray, src: np.ndarray, dst_rows: np.ndarray, src_rows: np.ndarray, counts: np.ndarray, row_bytes: int
) -> None:
    """Copy ``counts[r]`` rows from row ``src_rows[r]`` of ``src`` to row ``dst_rows[r]``
    of ``dst`` for each run ``r`` (both flat bytes, rows of ``row_bytes``; int64 run
    arrays). Unchecked: the caller keeps every run inside both arrays."""
    _scatter(dst, src, dst_rows.astype(np.int64, copy=False), src_rows.astype(np.int64, copy=False),
             counts.astype(np.int64, copy=False), row_bytes)
