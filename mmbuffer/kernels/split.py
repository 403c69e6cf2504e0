"""A batch's runs copied by every key in one call, shared by threads: ``gather_runs``.

``gather_runs`` copies what ``gather.gather_small`` copies (same arguments: every
key of a batch into one block, ``next_<col>`` in the same pass), but run by run
(``gather.runs``: each run of consecutive rows one ``memcpy`` per column), in
chunks of ``chunk`` runs that the threads calling it with the same ``shared``
array claim one at a time (an atomic counter). So a helper that starts late, on a
loaded machine, takes only what is left, and none when the caller has finished:

* the caller calls ``gather_runs`` and then ``close(shared)``: how many helpers
  entered (it waits for those); a helper that has not entered by then never will;
* a helper calls ``enter(shared)`` first (False: closed, nothing to do), then
  ``gather_runs``.

Each call checks every argument and run as ``gather_small`` does, before it claims
anything, so a call with bad arguments raises ``ValueError`` and copies nothing.

>>> import numpy as np
>>> shared = np.zeros(2, np.int64)
>>> enter(shared), close(shared), enter(shared)
(True, 1, False)
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from numba import types
from numba.core import cgutils as _cgutils
from numba.extending import intrinsic

from .gather import check_passes as _check_passes, copy_runs as _copy_runs, next_runs as _next_runs
from .intrinsics import pointer as _pointer, pointer64 as _pointer64

cgutils: Any = _cgutils  # numba's code generation helpers are untyped

__all__ = ["close", "enter", "gather_runs"]

_carray: Any = numba.carray  # type: ignore[attr-defined]  # numba's stubs do not export it


def _cell(context: Any, builder: Any, kind: Any, array: Any, i: Any) -> Any:
    data = cgutils.create_struct_proxy(kind)(context, builder, value=array).data
    return builder.gep(data, [i])


def _fetch_add_typing(typingctx: Any, array: Any, i: Any, value: Any) -> Any:
    """``array[i] += value`` as one atomic step; the value before (int64 arrays)."""
    sig = types.int64(array, types.intp, types.int64)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.atomic_rmw("add", _cell(context, builder, signature.args[0], args[0], args[1]), args[2], "seq_cst")

    return sig, codegen


def _swap_typing(typingctx: Any, array: Any, i: Any, expected: Any, value: Any) -> Any:
    """``array[i] = value`` if it holds ``expected``, as one atomic step; the value before."""
    sig = types.int64(array, types.intp, types.int64, types.int64)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        cell = _cell(context, builder, signature.args[0], args[0], args[1])
        pair = builder.cmpxchg(cell, args[2], args[3], "seq_cst", "seq_cst")
        return builder.extract_value(pair, 0)

    return sig, codegen


_fetch_add: Any = intrinsic(_fetch_add_typing)
_swap: Any = intrinsic(_swap_typing)


@numba.njit(nogil=True, cache=True)
def _enter(shared: Any) -> bool:
    if shared.shape[0] != 2:
        raise ValueError("enter: shared must hold 2 counters")
    while True:
        entered = shared[1]
        if entered < 0:
            return False
        if _swap(shared, 1, entered, entered + 1) == entered:
            return True


@numba.njit(nogil=True, cache=True)
def _close(shared: Any) -> int:
    if shared.shape[0] != 2:
        raise ValueError("close: shared must hold 2 counters")
    while True:
        entered: int = shared[1]
        if entered < 0:
            return -1 - entered
        if _swap(shared, 1, entered, -1 - entered) == entered:
            return entered


def enter(shared: np.ndarray) -> bool:
    """Count a helper in on ``shared`` (int64 ``[next chunk, helpers in]``, zeros at
    first): False once the caller has closed it."""
    return bool(_enter(shared))


def close(shared: np.ndarray) -> int:
    """Close ``shared`` to helpers that have not entered; how many had."""
    return int(_close(shared))


@numba.njit(nogil=True, cache=True)
def _gather_runs(
    addresses: Any, sizes: Any, row_bytes: Any, own_at: Any, next_at: Any, lane_size: int, rows: Any, starts: Any,
    nrows: int, out: Any, cursors: Any, by_episode: bool, shared: Any, chunk: int,
) -> None:
    n = rows.shape[0]
    count = starts.shape[0] - 1
    if count < 0 or starts[0] != 0 or starts[count] != n or chunk <= 0 or shared.shape[0] != 2:
        raise ValueError("gather_runs: inconsistent runs or shared counters")
    _check_passes(addresses, sizes, row_bytes, own_at, next_at, lane_size, n, nrows, out, cursors, by_episode)
    passes = row_bytes.shape[0]
    terminated = _carray(_pointer(addresses[2 * passes]), sizes[2 * passes])
    truncated = _carray(_pointer(addresses[2 * passes + 1]), sizes[2 * passes + 1])
    index = _carray(_pointer64(addresses[2 * passes + 2]), sizes[2 * passes + 2] // 8)
    while True:
        k0 = _fetch_add(shared, 0, 1) * chunk
        if k0 >= count:
            return
        k1 = min(k0 + chunk, count)
        for p in range(passes):
            rb = row_bytes[p]
            src = _carray(_pointer(addresses[2 * p]), sizes[2 * p])
            if next_at[p] == -1:
                if own_at[p] != -1:
                    _copy_runs(src, rows, starts, k0, k1, rb, out, own_at[p])
            else:
                final = _carray(_pointer(addresses[2 * p + 1]), sizes[2 * p + 1])
                _next_runs(src, final, terminated, truncated, rows, starts, k0, k1, lane_size, rb, out, own_at[p],
                           out, next_at[p], index, cursors, by_episode)


def gather_runs(
    addresses: np.ndarray, sizes: np.ndarray, row_bytes: np.ndarray, own_at: np.ndarray, next_at: np.ndarray,
    lane_size: int, rows: np.ndarray, starts: np.ndarray, nrows: int, out: np.ndarray, cursors: np.ndarray,
    by_episode: bool, shared: np.ndarray, chunk: int,
) -> None:
    """The passes of ``gather.gather_small`` (same arguments) over the runs ``starts``
    of ``rows`` (``gather.runs``), ``chunk`` runs at a time until ``shared`` (int64
    ``[next chunk, helpers in]``) has none left (see the module's docstring)."""
    _gather_runs(addresses, sizes, row_bytes, own_at, next_at, lane_size, rows, starts, nrows, out, cursors,
                 by_episode, shared, chunk)
