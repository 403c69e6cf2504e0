"""Gather kernels: copy rows of mapped columns into caller buffers, compiled and GIL-free.

Every array here is a flat ``uint8`` view of C-contiguous rows of ``row_bytes``
bytes, whatever the column's dtype and shape (``bytes_of``), so one compiled
version serves every column. ``runs`` splits the row ids once per batch into runs
of consecutive rows (a slice, or the part of a slice before its lane's ring
wraps); the copy kernels then copy each run with one ``memcpy``, in the order
given, straight into the output (no sort, no temporary), while prefetching the
source of the runs a few steps ahead: a batch's rows are scattered over the
store, and without it each run waits for its first cache line and page-table
walk in turn (2-3x slower, measured: ``benchmarks/HISTORY.md``). ``next_<col>``
comes in the same pass as ``<col>``: row ``r``'s next value is row
``following(r)`` of its lane, or the final observation of the episode that ends
there (``terminated | truncated``): in a version 4 store the ``final`` row of that
episode's slot, found by a binary search over the lane's episode ends
(``_final_slot``; only at episode ends), in a version 3 store ``final[r]``.

Safety does not depend on the caller: each run is checked against the source's
size before it is copied, and buffers of the wrong size raise ``ValueError``.

>>> import numpy as np
>>> src = np.arange(12, dtype=np.int32).reshape(6, 2)
>>> out = np.zeros((3, 2), np.int32)
>>> rows = np.array([4, 5, 0])
>>> starts, bad = runs(rows, 6)
>>> starts.tolist(), bad
([0, 2, 3], -1)
>>> copy_rows(bytes_of(src), rows, starts, 8, bytes_of(out))
>>> out.tolist()
[[8, 9], [10, 11], [0, 1]]
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np

from .intrinsics import memcpy as _memcpy, pointer as _pointer, pointer64 as _pointer64, prefetch as _prefetch
from .finals import check_finals as _check_finals, final_seq as _final_seq, final_slot as _final_slot, zero as _zero

__all__ = [
    "address", "bytes_of", "check_passes", "copy_rows", "copy_rows_next", "copy_runs", "gather_small", "next_runs",
    "overwritten", "prefetch_rows", "runs",
]

_LINE = 64  # bytes of a cache line
_AHEAD_LINES = 64  # lines in flight ahead of the copy (about what a core keeps outstanding)
# Lines prefetched of one run: its first misses; the hardware prefetcher streams the
# rest. Prefetching whole runs (up to 128 lines) made a 256 x 64 slice gather 10-14%
# slower (benchmarks/HISTORY.md, 2026-11-23 evening): the surplus requests queue behind
# the misses that matter.
_MAX_RUN_LINES = 4


@numba.njit(nogil=True, cache=True)
def _runs(rows: Any, nrows: int) -> tuple[Any, int]:
    n = rows.shape[0]
    starts = np.empty(n + 1, np.int64)
    count = 0
    for i in range(n):
        r = rows[i]
        if r < 0 or r >= nrows:
            return starts[:0], i
        if i == 0 or r != rows[i - 1] + 1:
            starts[count] = i
            count += 1
    starts[count] = n
    return starts[: count + 1], -1


@numba.njit(nogil=True, cache=True)
def _ahead(starts: Any, rows: Any, row_bytes: int) -> int:
    """How many runs ahead to prefetch: about ``_AHEAD_LINES`` lines in flight."""
    count = starts.shape[0] - 1
    if count <= 0:
        return 1
    lines = min(max((rows.shape[0] * row_bytes) // (count * _LINE), 1), _MAX_RUN_LINES)
    ahead: int = min(max(_AHEAD_LINES // lines, 2), 64)
    return ahead


@numba.njit(nogil=True, cache=True)
def _prefetch_run(src: Any, first_row: int, length: int, row_bytes: int) -> None:
    a = first_row * row_bytes
    b = min(a + length * row_bytes, a + _MAX_RUN_LINES * _LINE)
    x = a - a % _LINE
    while x < b:
        _prefetch(src, x)
        x += _LINE


@numba.njit(nogil=True, cache=True)
def _check_run(starts: Any, k: int, n: int, rows: Any, nrows: int) -> tuple[int, int, int]:
    """Positions ``[i, j)`` and first row of run ``k``, checked to lie inside the rows
    and the source (whatever ``starts`` holds)."""
    i, j = starts[k], starts[k + 1]
    if i < 0 or j <= i or j > n:
        raise ValueError("copy: run starts out of order")
    r = rows[i]
    if r < 0 or r + (j - i) > nrows:
        raise ValueError("copy: a run of rows outside the source")
    return i, j, r


@numba.njit(nogil=True, cache=True)
def copy_runs(src: Any, rows: Any, starts: Any, k0: int, k1: int, row_bytes: int, out: Any, at: int) -> None:
    """Runs ``[k0, k1)``: the rows of position ``i`` to byte ``at + i * row_bytes`` of
    ``out`` (the caller checked that every position's row fits there)."""
    n = rows.shape[0]
    nrows = src.shape[0] // row_bytes
    ahead = _ahead(starts, rows, row_bytes)
    for k in range(k0, min(k0 + ahead, k1)):
        i, j, r = _check_run(starts, k, n, rows, nrows)
        _prefetch_run(src, r, j - i, row_bytes)
    for k in range(k0, k1):
        if k + ahead < k1:
            i, j, r = _check_run(starts, k + ahead, n, rows, nrows)
            _prefetch_run(src, r, j - i, row_bytes)
        i, j, r = _check_run(starts, k, n, rows, nrows)
        _memcpy(out, at + i * row_bytes, src, r * row_bytes, (j - i) * row_bytes)


@numba.njit(nogil=True, cache=True)
def _copy_rows(src: Any, rows: Any, starts: Any, row_bytes: int, out: Any) -> None:
    n = rows.shape[0]
    if row_bytes <= 0 or out.shape[0] != n * row_bytes or src.shape[0] % row_bytes != 0:
        raise ValueError("copy_rows: out has the wrong size")
    copy_runs(src, rows, starts, 0, starts.shape[0] - 1, row_bytes, out, 0)


@numba.njit(nogil=True, cache=True)
def _copy_rows_next(
    src: Any, final: Any, terminated: Any, truncated: Any, rows: Any, starts: Any, lane_size: int,
    row_bytes: int, out: Any, out_next: Any, want_rows: bool, index: Any, cursors: Any, by_episode: bool,
) -> None:
    n = rows.shape[0]
    if row_bytes <= 0 or src.shape[0] % row_bytes != 0:
        raise ValueError("copy_rows_next: arrays of inconsistent sizes")
    nrows = src.shape[0] // row_bytes
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
    _check_finals(nrows, lane_size, index, cursors, by_episode)
    next_runs(src, final, terminated, truncated, rows, starts, 0, starts.shape[0] - 1, lane_size, row_bytes,
               out, 0 if want_rows else -1, out_next, 0, index, cursors, by_episode)


@numba.njit(nogil=True, cache=True)
def next_runs(
    src: Any, final: Any, terminated: Any, truncated: Any, rows: Any, starts: Any, k0: int, k1: int, lane_size: int,
    row_bytes: int, out: Any, own_at: int, out_next: Any, next_at: int, index: Any, cursors: Any, by_episode: bool,
) -> None:
    """Runs ``[k0, k1)`` of ``copy_rows_next``: position ``i``'s row to byte ``own_at +
    i * row_bytes`` of ``out`` (-1: not wanted), its next value to ``next_at + ...`` of
    ``out_next`` (the caller checked the sizes)."""
    n = rows.shape[0]
    nrows = src.shape[0] // row_bytes
    ahead = _ahead(starts, rows, row_bytes)
    hint, hint_lane = -1, -1  # the last episode found: a slice's next end is usually the next one
    last_q, last_slot = -1, -1  # and its row (a padded window repeats it)
    for k in range(k0 - ahead, k1):
        if k + ahead < k1:
            i, j, r = _check_run(starts, k + ahead, n, rows, nrows)
            _prefetch_run(src, r, j - i + 1, row_bytes)  # and the row after: the last one's next
            _prefetch(terminated, r)
            _prefetch(truncated, r)
            _prefetch(terminated, r + j - i - 1)
            _prefetch(truncated, r + j - i - 1)
        if k < k0:
            continue
        i, j, r = _check_run(starts, k, n, rows, nrows)
        if own_at >= 0:
            _memcpy(out, own_at + i * row_bytes, src, r * row_bytes, (j - i) * row_bytes)
        # next values of the run's rows r, r + 1, ...: runs of following rows, cut
        # where a row ends its episode (its final observation instead) or its lane
        p = i
        lane_last = (r // lane_size + 1) * lane_size - 1  # a run may go on into the next lane
        while p < j:
            q = r + (p - i)
            if q > lane_last:
                lane_last += lane_size
            if terminated[q] != 0 or truncated[q] != 0:
                slot = q
                if by_episode and q == last_q:
                    slot = last_slot
                elif by_episode:
                    lane = q // lane_size
                    seq = _final_seq(q, lane_size, index, cursors, hint if lane == hint_lane else -1)
                    slot = -1 if seq < 0 else lane * lane_size + seq % lane_size
                    hint, hint_lane, last_q, last_slot = seq, lane, q, slot
                if slot >= 0:
                    _memcpy(out_next, next_at + p * row_bytes, final, slot * row_bytes, row_bytes)
                else:  # no episode ends there in these cursors (a row the caller re-checks)
                    _zero(out_next, next_at + p * row_bytes, row_bytes)
                p += 1
                continue
            m = p + 1
            if q != lane_last:
                first = q + 1
                s = q + 1
                while m < j and s != lane_last and terminated[s] == 0 and truncated[s] == 0:
                    m += 1
                    s += 1
            else:  # the lane's last row: its following row is the lane's first
                first = q + 1 - lane_size
            _memcpy(out_next, next_at + p * row_bytes, src, first * row_bytes, (m - p) * row_bytes)
            p = m


_carray: Any = numba.carray  # type: ignore[attr-defined]  # numba's stubs do not export it
_SMALL_AHEAD = 8  # runs prefetched ahead (rows, in a uniform draw)


@numba.njit(nogil=True, cache=True)
def check_passes(
    addresses: Any, sizes: Any, row_bytes: Any, own_at: Any, next_at: Any, lane_size: int, n: int, nrows: int, out: Any,
    cursors: Any, by_episode: bool,
) -> bool:
    """Raise ``ValueError`` unless the passes of ``gather_small`` (and ``runs.gather_runs``) fit
    their sources and ``out``; whether any pass copies next values."""
    passes = row_bytes.shape[0]
    if (addresses.shape[0] != 2 * passes + 3 or sizes.shape[0] != addresses.shape[0] or own_at.shape[0] != passes
            or next_at.shape[0] != passes or lane_size <= 0 or nrows % lane_size != 0):
        raise ValueError("gather: inconsistent arguments")
    flags = False
    for p in range(passes):
        rb = row_bytes[p]
        if rb <= 0 or sizes[2 * p] != nrows * rb:
            raise ValueError("gather: a source of the wrong size")
        for at in (own_at[p], next_at[p]):
            if at != -1 and (at < 0 or at + n * rb > out.shape[0]):
                raise ValueError("gather: out has the wrong size")
        if next_at[p] != -1:
            flags = True
            if sizes[2 * p + 1] != nrows * rb:
                raise ValueError("gather: a final array of the wrong size")
    if flags and (sizes[2 * passes] != nrows or sizes[2 * passes + 1] != nrows):
        raise ValueError("gather: flags of the wrong size")
    if flags:
        index = _carray(_pointer64(addresses[2 * passes + 2]), sizes[2 * passes + 2] // 8)
        _check_finals(nrows, lane_size, index, cursors, by_episode)
    return flags


@numba.njit(nogil=True, cache=True)
def _gather_small(
    addresses: Any, sizes: Any, row_bytes: Any, own_at: Any, next_at: Any, lane_size: int, rows: Any, nrows: int, out: Any,
    cursors: Any, by_episode: bool, sparse: Any, ends_at: Any, width: int,
) -> int:
    n = rows.shape[0]
    windows = ends_at.shape[0] > 0  # the done flags of windows: read at their episodes' last rows only
    if windows and (ends_at.shape[0] * width != n or sparse.shape[0] != row_bytes.shape[0]):
        raise ValueError("gather: windows of inconsistent sizes")
    # runs of consecutive rows (a window's): each pass copies a run's own values at once
    # (row by row, a gather of 256 slices of 4 rows at 1e9 rows was 20-40% slower and one
    # of 64 x 64 rows twice as slow: benchmarks/HISTORY.md)
    starts, bad = _runs(rows, nrows)
    if bad >= 0:
        return bad
    count = starts.shape[0] - 1
    flags = check_passes(addresses, sizes, row_bytes, own_at, next_at, lane_size, n, nrows, out, cursors, by_episode)
    passes = row_bytes.shape[0]
    terminated = _carray(_pointer(addresses[2 * passes]), sizes[2 * passes])
    truncated = _carray(_pointer(addresses[2 * passes + 1]), sizes[2 * passes + 1])
    index = _carray(_pointer64(addresses[2 * passes + 2]), sizes[2 * passes + 2] // 8)
    for k in range(-_SMALL_AHEAD, count):
        a = k + _SMALL_AHEAD
        if a < count:  # the first lines of run ``a`` (a row and its next row at least) in every source
            r, length = rows[starts[a]], starts[a + 1] - starts[a]
            for p in range(passes):
                if windows and sparse[p]:
                    continue
                rb, nx = row_bytes[p], 1 if next_at[p] != -1 else 0
                src = _carray(_pointer(addresses[2 * p]), sizes[2 * p])
                x = r * rb
                end = min((r + length + nx) * rb, x + max(_MAX_RUN_LINES * _LINE, (1 + nx) * rb)) - 1
                while x <= end:
                    _prefetch(src, x)
                    x += _LINE
                _prefetch(src, end)
            if flags:
                _prefetch(terminated, r)
                _prefetch(truncated, r)
                if length > 1:
                    _prefetch(terminated, r + length - 1)
                    _prefetch(truncated, r + length - 1)
        if k < 0:
            continue
        i0, i1 = starts[k], starts[k + 1]
        for i in range(i0, i1 if flags else i0 + 1):  # with next values, row by row
            r = rows[i]
            last = flags and (terminated[r] != 0 or truncated[r] != 0)
            slot = _final_slot(r, lane_size, index, cursors, by_episode) if last else -1
            following = r + 1 if (r + 1) % lane_size != 0 else r + 1 - lane_size
            for p in range(passes):
                rb = row_bytes[p]
                src = _carray(_pointer(addresses[2 * p]), sizes[2 * p])
                if own_at[p] != -1 and i == i0 and windows and sparse[p]:  # a one-byte flag, set
                    for q in range(i0, i1):  # only where an episode ends: at each window's ``ends_at``
                        w = q // width
                        out[own_at[p] + q] = src[rows[q]] if q - w * width == ends_at[w] else 0
                elif own_at[p] != -1 and i == i0:  # the run's own values at once
                    _memcpy(out, own_at[p] + i0 * rb, src, r * rb, (i1 - i0) * rb)
                if next_at[p] != -1:
                    if slot >= 0:
                        final = _carray(_pointer(addresses[2 * p + 1]), sizes[2 * p + 1])
                        _memcpy(out, next_at[p] + i * rb, final, slot * rb, rb)
                    elif last:  # no episode ends there in these cursors (a row the caller re-checks)
                        _zero(out, next_at[p] + i * rb, rb)
                    else:
                        _memcpy(out, next_at[p] + i * rb, src, following * rb, rb)
    return -1


@numba.njit(nogil=True, cache=True)
def _prefetch_rows(addresses: Any, sizes: Any, row_bytes: Any, rows: Any, width: int, skip: Any) -> None:
    if width <= 0:
        return
    for p in range(row_bytes.shape[0]):
        if skip.shape[0] and skip[p]:
            continue
        rb = row_bytes[p]
        src = _carray(_pointer(addresses[2 * p]), sizes[2 * p])
        n = rows.shape[0]
        for w in range(0, n, width):
            first, last = rows[w], rows[min(w + width, n) - 1]
            if not 0 <= last - first < width:  # not one run (a wrapped or padded window): its first row
                last = first
            _prefetch_run(src, first, last - first + 1, rb)


def gather_small(
    addresses: np.ndarray, sizes: np.ndarray, row_bytes: np.ndarray, own_at: np.ndarray, next_at: np.ndarray,
    lane_size: int, rows: np.ndarray, nrows: int, out: np.ndarray, cursors: np.ndarray, by_episode: bool,
    sparse: np.ndarray | None = None, ends_at: np.ndarray | None = None, width: int = 1,
) -> int:
    """Every key of a small batch in one call, row by row. Pass ``p`` copies rows
    ``rows`` (int64, flat) of ``row_bytes[p]`` bytes of its source to byte
    ``own_at[p]`` of ``out`` and their next values (as ``copy_rows_next``: the
    following row of the lane, or the final row where a flag ends the episode) to
    byte ``next_at[p]`` (-1: not wanted). The arrays are given by address and size
    in bytes (``addresses``, ``sizes``: per pass its source and its finals, then the
    terminated and truncated flags, then the int64 episode ends ``index/ends``; see
    ``address``): the caller keeps them alive through the call. ``cursors``,
    ``by_episode``: where final observations are (``_final_slot``). Returns the position of the first row id outside ``[0,
    nrows)`` (then nothing is copied), or -1; sizes that do not fit raise
    ``ValueError``.

    Where ``copy_rows`` pays a call per key and a ``runs`` split, this pays one call
    (arrays by address: numba types a read-only array, a reader's map, ~15x slower
    than a writable one at each call): a small batch's cost is mostly fixed
    (``benchmarks/bench_small_batch.py``). A run of consecutive rows (a window) is
    copied at once for each key, its next values row by row.

    With ``ends_at`` (int64, one per window of ``width`` rows: ``rows`` is ``[B, width]``
    flat), each pass marked in ``sparse`` (one-byte done flags, no next values) reads
    only the row at position ``ends_at[w]`` of window ``w`` (-1: none) and writes 0 at the
    others: the caller knows those are where its windows' episodes end, and a flag is
    set nowhere else, so the flags' cache lines are not read (two of a short window's
    three at 1e9 rows).
    """
    if ends_at is None or sparse is None:
        sparse, ends_at = _NO_WINDOWS, _NO_ENDS
    return int(_gather_small(addresses, sizes, row_bytes, own_at, next_at, lane_size, rows, nrows, out, cursors,
                             by_episode, sparse, ends_at, width))


_NO_WINDOWS = np.zeros(0, np.bool_)
_NO_ENDS = np.zeros(0, np.int64)


def prefetch_rows(
    addresses: np.ndarray, sizes: np.ndarray, row_bytes: np.ndarray, rows: np.ndarray, width: int = 1,
    skip: np.ndarray | None = None,
) -> None:
    """Ask for the first cache lines of every window of ``width`` rows of ``rows``
    (int64, flat; a window that is not one run: its first row) in the source of each
    ``gather_small`` pass (its ``addresses``, ``sizes``) that ``skip`` does not mark, and
    return without waiting for them. Called as soon as a batch's rows are drawn, the
    lines arrive while the Python before the gather runs: every miss of the batch in
    flight at once, where the gather's loop, which copies as it goes, keeps a few (a
    256-window batch at 1e9 rows: 0.065 against 0.085 ms, ``benchmarks/HISTORY.md``). A hint:
    a prefetch never faults, so rows need no check here.

    >>> src = np.arange(256, dtype=np.uint8)
    >>> at, size = address(src)
    >>> prefetch_rows(np.array([at, 0]), np.array([size, 0]), np.array([1]), np.array([3, 4, 200, 201]), 2)
    """
    _prefetch_rows(addresses, sizes, row_bytes, rows, width, _NO_WINDOWS if skip is None else skip)


@numba.njit(nogil=True, cache=True)
def _overwritten(first: Any, cursors: Any, reserved: Any, lane_size: int, bad: Any, by_lane: bool) -> int:
    n = first.shape[0]
    if (cursors.shape[0] != (reserved.shape[0] if by_lane else n)) or bad.shape[0] < n or lane_size <= 0:
        raise ValueError("overwritten: arrays of inconsistent sizes")
    count = 0
    for i in range(n):
        f = first[i]
        lane = f // lane_size
        if f < 0 or lane >= reserved.shape[0]:
            raise ValueError("overwritten: a row outside the lanes")
        w = cursors[lane] if by_lane else cursors[i]
        if w - 1 - (w - 1 - f % lane_size) % lane_size < reserved[lane] - lane_size:
            bad[count] = i
            count += 1
    return count


def overwritten(first: np.ndarray, cursors: np.ndarray, reserved: np.ndarray, lane_size: int, *,
                by_lane: bool = False) -> np.ndarray:
    """The positions of the items whose first row ``first`` (int64, drawn when its lane's
    cursor was ``cursors``) the writer may have begun rewriting: its absolute row
    (``Layout.absolute_at``) is below its lane's reservation ``reserved`` less a lane,
    as ``mmbuffer._read.recheck.overwritten`` says, in one pass (a reader checks every
    batch: the numpy expression costs ~7 us on a small one). ``cursors`` has one value
    per item, or with ``by_lane`` one per lane (items drawn from one view: its cursors)."""
    bad = np.empty(first.shape[0], np.int64)
    return bad[: _overwritten(first, cursors, reserved, lane_size, bad, by_lane)]


def address(array: np.ndarray) -> tuple[int, int]:
    """The address and size in bytes of a C-contiguous array (``gather_small``'s arguments)."""
    flat = bytes_of(array)
    return int(flat.ctypes.data), int(flat.shape[0])


def bytes_of(array: np.ndarray) -> np.ndarray:
    """The bytes of a C-contiguous array as a flat ``uint8`` view (no copy)."""
    if not array.flags.c_contiguous:
        raise ValueError("bytes_of: expected a C-contiguous array")
    flat: np.ndarray = array.reshape(-1).view(np.uint8)
    return flat


def runs(rows: np.ndarray, nrows: int) -> tuple[np.ndarray, int]:
    """Split row ids (int64, flat) into runs of consecutive rows: the positions where
    runs start, then ``len(rows)``; and the position of the first id outside
    ``[0, nrows)`` (then no runs), or -1."""
    starts, bad = _runs(rows, nrows)
    return starts, int(bad)


def copy_rows(src: np.ndarray, rows: np.ndarray, starts: np.ndarray, row_bytes: int, out: np.ndarray) -> None:
    """Copy rows ``rows`` (int64, flat; split by ``runs``) of ``src`` into consecutive
    rows of ``out`` (both flat bytes, see ``bytes_of``)."""
    _copy_rows(src, rows, starts, row_bytes, out)


def copy_rows_next(
    src: np.ndarray,
    final: np.ndarray,
    terminated: np.ndarray,
    truncated: np.ndarray,
    rows: np.ndarray,
    starts: np.ndarray,
    lane_size: int,
    row_bytes: int,
    out_next: np.ndarray,
    out: np.ndarray | None = None,
    index: np.ndarray | None = None,
    cursors: np.ndarray | None = None,
) -> None:
    """``copy_rows`` of ``src`` into ``out`` (when given) and, in the same pass, the
    next value of each row into ``out_next``: ``src`` at the following row of its
    lane (``lane_size`` rows, a ring), or the final observation where ``terminated``
    or ``truncated`` (flat bytes, one per row) ends the episode there: ``final`` at
    that row, or with ``index`` (``index/ends``, int64) and ``cursors`` (per lane
    ``written``, ``ep_tail``) at its episode's slot (``_final_slot``)."""
    want = out is not None
    by_episode = index is not None and cursors is not None
    _copy_rows_next(src, final, terminated, truncated, rows, starts, lane_size, row_bytes,
                    out if out is not None else out_next, out_next, want,
                    index if index is not None else _NO_INDEX, cursors if cursors is not None else _NO_INDEX, by_episode)


_NO_INDEX = np.zeros(0, np.int64)
