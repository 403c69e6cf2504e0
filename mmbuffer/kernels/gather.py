"""Gather kernel: copy rows of mapped columns into caller tensors, compiled and GIL-free.

One call gathers a whole batch, every column and every ``next_<col>``
(``Sources.gather``). The row ids are split into runs of consecutive rows (a
slice, or the part of a slice before its lane's ring wraps: ``runs``); the
kernel then walks the runs once, in the order given, and for each run copies
every column's rows with one ``memcpy`` each, straight into the outputs (no
sort, no temporary), while prefetching the sources of the runs a few steps
ahead: a batch's rows are scattered over the store, and without it each run
waits for its first cache line and page-table walk in turn (2-3x slower,
measured: ``benchmarks/RESULTS.md``). ``next_<col>`` comes in the same pass as
``<col>``: row ``r``'s next value is row ``following(r)`` of its lane, or
``final[r]`` where the row ends an episode (``terminated | truncated``); a run
with no episode end and no lane end in it (the common case) takes it as one
``memcpy`` of the source shifted by a row, which the copy before it just
brought into cache.

Why one call for everything: the sources are fixed for a store, so their
addresses are taken and checked once (``Sources``), and a batch costs one
dispatch instead of one per column with its Python around it (about 60 us of
a 2.7 MB batch's 220 us on the dev VM, measured: ``benchmarks/RESULTS.md``).

Safety does not depend on the caller: ``Sources`` checks every source's size
once and keeps the arrays alive while it exists; ``gather`` checks each output's
size and each row id; the kernel copies only whole runs of checked rows.

>>> import numpy as np, torch
>>> src = np.arange(12, dtype=np.int32).reshape(6, 2)
>>> sources = Sources([(src, None)])
>>> out = torch.zeros((3, 2), dtype=torch.int32)
>>> sources.gather(np.array([4, 5, 0]), [out], [None])
-1
>>> out.tolist()
[[8, 9], [10, 11], [0, 1]]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numba
import numpy as np
import torch
from numba import types
from numba.core import cgutils as _cgutils
from numba.extending import intrinsic

cgutils: Any = _cgutils  # numba's code generation helpers are untyped
ir: Any = cgutils.ir  # llvmlite's IR builder, as numba imports it

__all__ = ["Sources", "runs"]

_LINE = 64  # bytes of a cache line
_AHEAD_LINES = 64  # lines in flight ahead of the copy (about what a core keeps outstanding)
_MAX_RUN_LINES = 128  # lines prefetched of one run; the hardware streams the rest


def _memcpy_typing(typingctx: Any, dst: Any, src: Any, nbytes: Any) -> Any:
    """``nbytes`` bytes from address ``src`` to address ``dst`` as one ``llvm.memcpy``
    (numba's slice assignment copies byte by byte: 2-10x slower on rows of a few KB).
    Unchecked: the callers check every range first."""
    sig = types.void(types.intp, types.intp, types.intp)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        d, s, n = args
        i8p = ir.IntType(8).as_pointer()
        cgutils.raw_memcpy(builder, builder.inttoptr(d, i8p), builder.inttoptr(s, i8p), n, 1)
        return context.get_dummy_value()

    return sig, codegen


def _prefetch_typing(typingctx: Any, addr: Any) -> Any:
    """A read prefetch of the cache line holding address ``addr`` (a hint: it never
    faults, so an address past the end of an array is harmless)."""
    sig = types.void(types.intp)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        ptr = builder.inttoptr(args[0], ir.IntType(8).as_pointer())
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [ptr.type, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
        builder.call(fn, [ptr, i32(0), i32(3), i32(1)])  # read, keep in all cache levels, data
        return context.get_dummy_value()

    return sig, codegen


_memcpy: Any = intrinsic(_memcpy_typing)
_prefetch: Any = intrinsic(_prefetch_typing)


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
def _plain_run(terminated: Any, truncated: Any, first: int, length: int, lane_size: int) -> bool:
    """Whether every row of the run ``[first, first + length)`` is followed by the next
    row: none ends an episode, and the run stops before its lane's last row. The
    loop has no early exit so that it compiles to vector ORs."""
    if first + length - 1 >= (first // lane_size + 1) * lane_size - 1:
        return False
    ends = np.uint8(0)
    for s in range(first, first + length):
        ends |= terminated[s] | truncated[s]
    plain: bool = ends == 0
    return plain


@numba.njit(nogil=True, cache=True)
def _next_walk(
    src: int, final: int, out: int, terminated: Any, truncated: Any, i: int, j: int, r: int, lane_size: int, rb: int
) -> None:
    """Next values of run ``[i, j)`` (rows ``r, r + 1, ...``) row by row: runs of
    following rows, cut where a row ends its episode (its final observation
    instead) or its lane (the lane's first row follows its last)."""
    p = i
    lane_last = (r // lane_size + 1) * lane_size - 1  # a run may go on into the next lane
    while p < j:
        q = r + (p - i)
        if q > lane_last:
            lane_last += lane_size
        if terminated[q] != 0 or truncated[q] != 0:
            _memcpy(out + p * rb, final + q * rb, rb)
            p += 1
            continue
        m = p + 1
        if q != lane_last:
            first = q + 1
            s = q + 1
            while m < j and s != lane_last and terminated[s] == 0 and truncated[s] == 0:
                m += 1
                s += 1
        else:
            first = q + 1 - lane_size
        _memcpy(out + p * rb, src + first * rb, (m - p) * rb)
        p = m


@numba.njit(nogil=True, cache=True)
def _gather(
    rows: Any, nrows: int, lane_size: int, terminated: Any, truncated: Any,
    src: Any, final: Any, row_bytes: Any, own: Any, nxt: Any,
) -> int:
    """Rows ``rows`` of every column ``c`` (at address ``src[c]``, ``row_bytes[c]`` a
    row) into address ``own[c]`` and their next values into ``nxt[c]`` (0: not
    wanted). Returns the position of the first row id outside ``[0, nrows)``
    (then nothing is copied), or -1."""
    starts, bad = _runs(rows, nrows)
    if bad >= 0:
        return bad
    count = starts.shape[0] - 1
    cols = src.shape[0]
    per_row = 0
    any_next = False
    for c in range(cols):
        if own[c] != 0 or nxt[c] != 0:
            per_row += row_bytes[c]
        any_next = any_next or nxt[c] != 0
    lines = max((rows.shape[0] * per_row) // (max(count, 1) * _LINE), 1)
    ahead = min(max(_AHEAD_LINES // lines, 2), 64)  # runs in flight: about _AHEAD_LINES lines
    flags = (terminated.ctypes.data, truncated.ctypes.data)
    for k in range(-ahead, count):
        if k + ahead < count:
            i, j = starts[k + ahead], starts[k + ahead + 1]
            r = rows[i]
            for c in range(cols):
                if own[c] != 0 or nxt[c] != 0:
                    rb = row_bytes[c]
                    a = src[c] + r * rb
                    b = min(a + (j - i + (nxt[c] != 0)) * rb, a + _MAX_RUN_LINES * _LINE)
                    while a < b:
                        _prefetch(a)
                        a += _LINE
            if any_next:
                for f in flags:
                    _prefetch(f + r)
                    _prefetch(f + r + j - i - 1)
        if k < 0:
            continue
        i, j = starts[k], starts[k + 1]
        r = rows[i]
        plain = any_next and _plain_run(terminated, truncated, r, j - i, lane_size)
        for c in range(cols):
            rb = row_bytes[c]
            if own[c] != 0:
                _memcpy(own[c] + i * rb, src[c] + r * rb, (j - i) * rb)
            if nxt[c] != 0:
                if plain:
                    _memcpy(nxt[c] + i * rb, src[c] + (r + 1) * rb, (j - i) * rb)
                else:
                    _next_walk(src[c], final[c], nxt[c], terminated, truncated, i, j, r, lane_size, rb)
    return -1


def runs(rows: np.ndarray, nrows: int) -> tuple[np.ndarray, int]:
    """Split row ids (int64, flat) into runs of consecutive rows: the positions where
    runs start, then ``len(rows)``; and the position of the first id outside
    ``[0, nrows)`` (then no runs), or -1.

    >>> runs(np.array([4, 5, 0]), 6)[0].tolist()
    [0, 2, 3]
    """
    starts, bad = _runs(rows, nrows)
    return starts, int(bad)


def _address(array: np.ndarray) -> int:
    if not array.flags.c_contiguous:
        raise ValueError("Sources: expected C-contiguous arrays")
    address: int = array.ctypes.data
    return address


class Sources:
    """The columns a batch is gathered from, checked once and held (their addresses
    stay valid while this object lives).

    ``columns``: per column, its C-contiguous rows ``[nrows, ...]`` and, where
    ``next_<col>`` will be asked for, its final observations (same shape and
    dtype) or None. ``terminated``/``truncated`` (bool ``[nrows]``) and
    ``lane_size`` (the rows of a lane's ring; it divides ``nrows``) are needed
    when some column has final observations; ``nrows``, the rows of every
    column, when there may be none.
    """

    def __init__(
        self,
        columns: Sequence[tuple[np.ndarray, np.ndarray | None]],
        terminated: np.ndarray | None = None,
        truncated: np.ndarray | None = None,
        lane_size: int | None = None,
        nrows: int | None = None,
    ) -> None:
        lengths = {len(a) for a, _ in columns} | ({nrows} if nrows is not None else set())
        if len(lengths) > 1:
            raise ValueError(f"Sources: expected columns of one length, got lengths {sorted(lengths)}")
        self.nrows = lengths.pop() if lengths else 0
        self.lane_size = self.nrows if lane_size is None else int(lane_size)
        self.row_bytes = np.array([a[:1].nbytes if len(a) else 0 for a, _ in columns], np.int64)
        for a, f in columns:
            if a.ndim == 0 or (f is not None and (f.shape != a.shape or f.dtype != a.dtype)):
                raise ValueError("Sources: expected final observations of their column's shape and dtype")
        flags = [np.zeros(0, np.uint8) if x is None else x for x in (terminated, truncated)]
        if any(f is not None for _, f in columns) and (
            any(x.shape != (self.nrows,) or x.itemsize != 1 for x in flags)
            or self.lane_size <= 0
            or self.nrows % self.lane_size
        ):
            raise ValueError("Sources: expected terminated/truncated of one byte per row and a lane size dividing the rows")
        self._keep = (columns, flags)
        self._flags = [x.view(np.uint8) for x in flags]
        self.src = np.array([_address(a) for a, _ in columns], np.int64)
        self.final = np.array([0 if f is None else _address(f) for _, f in columns], np.int64)

    def gather(
        self, rows: np.ndarray, own: Sequence[torch.Tensor | None], nxt: Sequence[torch.Tensor | None]
    ) -> int:
        """Copy rows ``rows`` (int64, flat) of column ``c`` into ``own[c]`` and their next
        values into ``nxt[c]`` (CPU tensors of ``len(rows)`` rows, contiguous; None:
        not wanted). Returns the position of the first id outside the rows (then
        nothing is copied), or -1."""
        n = len(rows)
        cols = len(self.src)
        if len(own) != cols or len(nxt) != cols:
            raise ValueError(f"gather: expected {cols} outputs and {cols} next outputs")
        own_at = np.zeros(cols, np.int64)
        nxt_at = np.zeros(cols, np.int64)
        for c in range(cols):
            for at, t in ((own_at, own[c]), (nxt_at, nxt[c])):
                if t is None:
                    continue
                if t.device.type != "cpu" or not t.is_contiguous() or t.nbytes != n * self.row_bytes[c]:
                    raise ValueError(f"gather: output {c} has the wrong size, device or layout")
                at[c] = t.data_ptr()
            if nxt[c] is not None and self.final[c] == 0:
                raise ValueError(f"gather: next values of column {c} asked for, but it has no final observations")
        rows = np.ascontiguousarray(rows, np.int64)
        term, trunc = self._flags
        return int(_gather(rows, self.nrows, self.lane_size, term, trunc, self.src, self.final, self.row_bytes, own_at, nxt_at))
