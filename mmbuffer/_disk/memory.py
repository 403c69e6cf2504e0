"""Anonymous memory that costs nothing until touched (no imports beyond numpy and mmap).

>>> z = sparse_zeros(10**10, np.int64); z[-1] = 7; int(z[-1]), int(z[0])
(7, 0)
"""

from __future__ import annotations

import mmap
import sys
from typing import Final

import numpy as np

__all__ = ["sparse_zeros"]

# Linux's MAP_NORESERVE (Python 3.11's mmap module lacks it); elsewhere no flag
MAP_NORESERVE: Final = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)


def sparse_zeros(count: int, dtype: np.dtype | type) -> np.ndarray:
    """``count`` zeros in anonymous memory whose untouched pages cost nothing, and are
    not counted against the kernel's overcommit heuristic: ``np.zeros`` of a
    3e9-row store's 48 GB index raises ``MemoryError`` on a 24 GB machine, though
    only the pages of its live episodes are ever written.

    >>> z = sparse_zeros(10**10, np.int64); z[-1] = 7; int(z[-1]), int(z[0])
    (7, 0)
    """
    dtype = np.dtype(dtype)
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE
    handle = mmap.mmap(-1, max(count * dtype.itemsize, 1), flags=flags)
    return np.frombuffer(handle, dtype, count=count)
