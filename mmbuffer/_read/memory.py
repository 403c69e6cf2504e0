"""Memory for the tensors of new batches, recycled once a batch is gone (``Recycler``).

>>> r = Recycler()
>>> a = r.small(64); address = a.ctypes.data
>>> del a
>>> r.small(64).ctypes.data == address
True
"""

from __future__ import annotations

import collections
import ctypes
import math
import sys
import weakref
from typing import Any, cast

import numpy as np
import torch

__all__ = ["RECYCLER", "Recycler", "recycled"]


def _references(raw: np.ndarray) -> int:
    """``sys.getrefcount(raw)`` from a caller that holds ``raw`` in a local and in a pool."""
    return sys.getrefcount(raw)


def _calibrate() -> int:
    """What ``_references`` counts for a block nothing else references (measured, not
    assumed: how the interpreter counts its own references varies by version)."""
    pool: collections.deque[np.ndarray] = collections.deque()
    raw = np.empty(0, np.uint8)
    pool.append(raw)
    return _references(raw)


_FREE = _calibrate()


class Recycler:
    """Memory for new batches, taken back once every tensor of a batch is gone.

    A batch of a few MB in fresh memory costs a page fault per 4 KiB on its
    first write (``malloc`` maps large blocks anew, and ``free`` returns them to
    the system): 0.5-0.8 ms for a 2.7 MB batch on the dev VM, more than the
    copy itself. Each block is lent behind a ``ctypes`` array that every array
    and tensor carved from it references (numpy keeps non-array bases in a
    view's base chain), so its finalizer runs only when the last of them is
    gone; the block then waits for the next batch of the same size. Finalizers
    may run in any thread, so the free lists are deques (atomic append/pop) and
    nothing here takes a lock. A caller that keeps its batches just gets new
    blocks.
    """

    def __init__(self, *, per_size: int = 4, sizes: int = 8) -> None:
        self._free: dict[int, collections.deque[np.ndarray]] = {}
        self._per_size = per_size
        self._sizes = sizes
        self._types: dict[int, Any] = {}
        self._small: dict[int, collections.deque[np.ndarray]] = {}

    def small(self, nbytes: int) -> np.ndarray:
        """``nbytes`` writable bytes (uninitialized) for a small batch, without ``block``'s
        lease and finalizer (3.5 us, a tenth of a small batch): one of the last
        ``per_size`` blocks of this size that nothing references any more, read from
        its reference count (each array and tensor carved from a block references it),
        else a new one. A block is popped before it is looked at, so two threads never
        both take it: the one that looks second sees the first one's reference."""
        pool = self._small.get(nbytes)
        if pool is None:
            if len(self._small) >= self._sizes:
                self._small = {}
            pool = self._small.setdefault(nbytes, collections.deque(maxlen=self._per_size))
        for _ in range(len(pool)):
            try:
                raw = pool.popleft()
            except IndexError:
                break
            pool.append(raw)
            if _references(raw) <= _FREE:  # the pool's and ``raw``: nobody else's
                return raw
        raw = np.empty(nbytes, np.uint8)
        pool.append(raw)
        return raw

    def block(self, nbytes: int) -> np.ndarray:
        """``nbytes`` writable bytes (uninitialized)."""
        try:
            raw = self._free[nbytes].pop()
        except (KeyError, IndexError):
            raw = np.empty(nbytes, np.uint8)
        kind = self._types.get(nbytes)
        if kind is None:
            kind = self._types[nbytes] = ctypes.c_uint8 * nbytes
            if len(self._types) > 4 * self._sizes:
                self._types = {nbytes: kind}
        lease: Any = kind.from_buffer(cast(Any, raw))
        weakref.finalize(lease, self._give_back, raw).atexit = False
        memory: np.ndarray = np.frombuffer(lease, np.uint8)
        return memory

    def _give_back(self, raw: np.ndarray) -> None:
        free = self._free.get(raw.nbytes)
        if free is None:
            if len(self._free) >= self._sizes:
                self._free = {}
            free = self._free.setdefault(raw.nbytes, collections.deque(maxlen=self._per_size))
        free.append(raw)


RECYCLER = Recycler()


def recycled(shape: tuple[int, ...], dtype: np.dtype) -> torch.Tensor:
    """An uninitialized CPU tensor in memory recycled across batches (as a batch's
    own tensors: a fresh block of a few MB page-faults per 4 KiB on its first write)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.from_numpy(np.empty(shape, dtype))
    return torch.from_numpy(RECYCLER.block(nbytes).view(dtype).reshape(shape))
