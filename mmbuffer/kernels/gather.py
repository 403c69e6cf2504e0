"""Gather kernels: copy rows of mapped columns into caller buffers, compiled and GIL-free.

Every array here is a flat ``uint8`` view of C-contiguous rows of ``row_bytes``
bytes, whatever the column's dtype and shape (``bytes_of``), so one compiled
version serves every column. Runs of consecutive rows (a slice, or the part of a
slice before its lane's ring wraps) are copied with one ``memcpy`` each; rows
are copied in the order given, straight into the output: no sort, no temporary.
``next_<col>`` comes in the same pass as ``<col>``: row ``r``'s next value is
row ``following(r)`` of its lane, or ``final[r]`` where the row ends an episode
(``terminated | truncated``).

The kernels trust their inputs' sizes only after checking them (a wrong size
would write outside an array): ``copy_rows`` and ``copy_rows_next`` return the
position of the first row id outside ``[0, rows)``, or -1 when every id is in
range (nothing is copied from the first bad row on), and raise ``ValueError`` on
buffers of the wrong size.

>>> import numpy as np
>>> src = np.arange(12, dtype=np.int32).reshape(6, 2)
>>> out = np.zeros((3, 2), np.int32)
>>> copy_rows(bytes_of(src), np.array([4, 5, 0]), 8, bytes_of(out))
-1
>>> out.tolist()
[[8, 9], [10, 11], [0, 1]]
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from numba import types
from numba.core import cgutils as _cgutils
from numba.extending import intrinsic

cgutils: Any = _cgutils  # numba's code generation helpers are untyped

__all__ = ["bytes_of", "copy_rows", "copy_rows_next", "first_out_of_range"]


def _memcpy_typing(typingctx: Any, dst: Any, dst_off: Any, src: Any, src_off: Any, nbytes: Any) -> Any:
    """``dst[dst_off : dst_off + nbytes] = src[src_off : ...]`` as one ``llvm.memcpy``
    (numba's slice assignment copies byte by byte: 2-10x slower on rows of a few KB).
    Unchecked: the callers check every range first."""
    sig = types.void(dst, types.intp, src, types.intp, types.intp)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        d, doff, s, soff, n = args
        dptr = cgutils.create_struct_proxy(signature.args[0])(context, builder, value=d).data
        sptr = cgutils.create_struct_proxy(signature.args[2])(context, builder, value=s).data
        cgutils.raw_memcpy(builder, builder.gep(dptr, [doff]), builder.gep(sptr, [soff]), n, 1)
        return context.get_dummy_value()

    return sig, codegen


_memcpy: Any = intrinsic(_memcpy_typing)


@numba.njit(nogil=True, cache=True)
def _copy_rows(src: Any, rows: Any, row_bytes: int, out: Any) -> int:
    n = rows.shape[0]
    nrows = src.shape[0] // row_bytes if row_bytes > 0 else 0
    if out.shape[0] != n * row_bytes:
        raise ValueError("copy_rows: out has the wrong size")
    i = 0
    while i < n:
        r = rows[i]
        if r < 0 or r >= nrows:
            return i
        j = i + 1
        while j < n and rows[j] == rows[j - 1] + 1 and rows[j] < nrows:
            j += 1
        _memcpy(out, i * row_bytes, src, r * row_bytes, (j - i) * row_bytes)
        i = j
    return -1


@numba.njit(nogil=True, cache=True)
def _copy_rows_next(
    src: Any, final: Any, terminated: Any, truncated: Any, rows: Any, lane_size: int, row_bytes: int,
    out: Any, out_next: Any, want_rows: bool,
) -> int:
    n = rows.shape[0]
    nrows = src.shape[0] // row_bytes if row_bytes > 0 else 0
    if (
        final.shape[0] != src.shape[0]
        or terminated.shape[0] != nrows
        or truncated.shape[0] != nrows
        or lane_size <= 0
        or nrows % lane_size != 0
        or out_next.shape[0] != n * row_bytes
        or (want_rows and out.shape[0] != n * row_bytes)
    ):
        raise ValueError("copy_rows_next: arrays of inconsistent sizes")
    i = 0
    while i < n:
        r = rows[i]
        if r < 0 or r >= nrows:
            return i
        j = i + 1
        while j < n and rows[j] == rows[j - 1] + 1 and rows[j] < nrows:
            j += 1
        if want_rows:
            _memcpy(out, i * row_bytes, src, r * row_bytes, (j - i) * row_bytes)
        # next values of rows[i:j] (consecutive): runs of following rows, cut where a
        # row ends its episode (its final observation instead) or its lane wraps
        k = i
        while k < j:
            q = rows[k]
            if terminated[q] != 0 or truncated[q] != 0:
                _memcpy(out_next, k * row_bytes, final, q * row_bytes, row_bytes)
                k += 1
                continue
            m = k + 1
            if (q + 1) % lane_size != 0:
                first = q + 1
                while m < j:
                    p = rows[m]
                    if terminated[p] != 0 or truncated[p] != 0 or (p + 1) % lane_size == 0:
                        break
                    m += 1
            else:  # the lane's last row: its following row is the lane's first
                first = q + 1 - lane_size
            _memcpy(out_next, k * row_bytes, src, first * row_bytes, (m - k) * row_bytes)
            k = m
        i = j
    return -1


@numba.njit(nogil=True, cache=True)
def _first_out_of_range(rows: Any, nrows: int) -> int:
    for i in range(rows.shape[0]):
        if rows[i] < 0 or rows[i] >= nrows:
            return i
    return -1


def bytes_of(array: np.ndarray) -> np.ndarray:
    """The bytes of a C-contiguous array as a flat ``uint8`` view (no copy)."""
    if not array.flags.c_contiguous:
        raise ValueError("bytes_of: expected a C-contiguous array")
    flat: np.ndarray = array.reshape(-1).view(np.uint8)
    return flat


def copy_rows(src: np.ndarray, rows: np.ndarray, row_bytes: int, out: np.ndarray) -> int:
    """Copy rows ``rows`` (int64, flat) of ``src`` into consecutive rows of ``out``
    (both flat bytes, see ``bytes_of``); the position of the first row id out of
    range (then nothing from it on is copied), or -1."""
    return int(_copy_rows(src, rows, row_bytes, out))


def copy_rows_next(
    src: np.ndarray,
    final: np.ndarray,
    terminated: np.ndarray,
    truncated: np.ndarray,
    rows: np.ndarray,
    lane_size: int,
    row_bytes: int,
    out_next: np.ndarray,
    out: np.ndarray | None = None,
) -> int:
    """``copy_rows`` of ``src`` into ``out`` (when given) and, in the same pass, the
    next value of each row into ``out_next``: ``src`` at the following row of its
    lane (``lane_size`` rows, a ring), or ``final`` where ``terminated`` or
    ``truncated`` (flat bytes, one per row) ends the episode there."""
    want = out is not None
    return int(
        _copy_rows_next(
            src, final, terminated, truncated, rows, lane_size, row_bytes,
            out if out is not None else out_next, out_next, want,
        )
    )


def first_out_of_range(rows: np.ndarray, nrows: int) -> int:
    """The position of the first id in ``rows`` (int64, flat) outside ``[0, nrows)``, or -1."""
    return int(_first_out_of_range(rows, nrows))
