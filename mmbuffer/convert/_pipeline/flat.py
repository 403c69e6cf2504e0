"""A reader over row-aligned arrays (D4RL HDF5, ``.npz``/``.npy``, TorchRL memmaps).

Every source here is a set of arrays with one row per transition plus two flag
arrays; episodes end at rows where either flag is set. ``next_arrays`` (when the
source has them, e.g. D4RL ``next_observations`` or TorchRL ``("next", ...)``)
give each episode's final observation. Without them the final observation of an
episode is unknown, so the source is refused (``ConversionError`` naming the
column) unless ``drop_last_transition=True`` (``--drop-last-transition``) accepts
dropping each episode's last transition, as ``d4rl.qlearning_dataset`` does: the
row before it then ends the episode (truncated: the data stops there, the MDP did
not) and the dropped row's observation is its final observation
(``attrs["final_obs_source"] == "next_row"``; an episode of one row is dropped
whole; both counted in the summary).

A source that stops inside an episode (its last row has no flag, as in most
D4RL files) keeps every row. With next observations the last row is a whole
transition: the episode is closed as truncated there (D4RL's ``timeouts``: the
data stops), its final observation is the last row's next observation, and
``attrs["tail_truncated_row"]`` records the row, so
:func:`~mmbuffer.convert.export_d4rl` writes the flag back as it was. Without
next observations the episode stays open: its last row has no next observation
and is not sampled (warning).

**Next observations are never changed.** The store derives ``next_<col>`` from
the following row of the episode, so a source's next observations are kept as
they are only when they agree with it. Before anything is written, the reader
compares ``next[t]`` with ``col[t + 1]`` inside every episode, byte for byte
(``-0.0`` differs from ``0.0``; a NaN equals a NaN of the same bits). By default
(``next_mode="auto"``) a source where they all agree is derived (nothing stored
twice); a source where any row differs (dropped frames, resets inside an episode,
sticky timeouts) keeps the source's next observations as an explicit column
``next/<col>`` for every row (the store then has no derived ``next_<col>``: the
explicit column is used as is), with ``attrs["next_obs"]`` and the summary's
``next_obs_mismatch_rows`` saying why. ``next_mode="derive"``
(``derive_next=True``) derives anyway: the rows that differ then answer the
following row's observation, not the source's (the loss is opted into and
counted); ``next_mode="explicit"`` (``keep_next_obs=True``) always keeps the
explicit column. The comparison reads the observations and next observations
once more before the write (``benchmarks/RESULTS.md``: conversion);
``derive_next=True`` skips it (the rows that differ are still counted during the
write).
Arrays are read in row slices only, so any object with ``shape``, ``dtype`` and
``__getitem__(slice)`` works (``h5py.Dataset``, :class:`FileArray`, numpy arrays).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ..._disk.rawio import pread_into
from . import droplast
from .reader import DEFAULT_CHUNK_BYTES, Chunk, Reader, Schema, as_flag

__all__ = ["ArrayLike", "FileArray", "RolledArray", "FlatReader", "NEXT_MODES", "TAIL_ATTR", "next_mode"]

#: How a flat source's next observations are stored (see the module docstring).
NEXT_MODES = ("auto", "derive", "explicit")
#: Bytes of flags, next-derived columns and their next observations compared at a time.
SCAN_BYTES = DEFAULT_CHUNK_BYTES
#: Rows named in a message or in ``attrs["next_obs"]["first_rows"]``.
_FIRST_ROWS = 8


def next_mode(derive_next: bool, keep_next_obs: bool, where: str) -> str:
    """The ``next_mode`` of the converters' ``derive_next`` / ``keep_next_obs`` options."""
    if derive_next and keep_next_obs:
        from ...errors import ConversionError

        raise ConversionError(f"{where}: derive_next=True and keep_next_obs=True contradict each other "
                              "(derive the next observations, or keep them as a column: pick one)")
    return "derive" if derive_next else "explicit" if keep_next_obs else "auto"

#: Store attribute: the row where a converter set ``truncated`` because the source
#: stopped inside an episode (its last row had no end flag).
TAIL_ATTR = "tail_truncated_row"


class ArrayLike(Protocol):
    shape: tuple[int, ...]
    dtype: np.dtype

    def __getitem__(self, idx: slice) -> np.ndarray: ...


class FileArray:
    """A C-order array inside a file, read with ``pread`` (no memory map).

    Reading through ``pread`` into fresh buffers keeps the process's resident set
    flat: pages of a memory map would stay counted against the process.
    """

    def __init__(self, path: str | os.PathLike[str], offset: int, shape: tuple[int, ...], dtype: Any):
        self.path = Path(path)
        self.offset = int(offset)
        self.shape = tuple(int(s) for s in shape)
        self.dtype = np.dtype(dtype)
        self._row_bytes = int(np.prod(self.shape[1:], dtype=np.int64)) * self.dtype.itemsize
        self._fd: int | None = None
        need = self.offset + self._row_bytes * (self.shape[0] if self.shape else 1)
        size = self.path.stat().st_size
        if size < need:
            from ...errors import ConversionError

            raise ConversionError(
                f"{self.path}: expected at least {need} bytes for an array of shape {self.shape} "
                f"and dtype {self.dtype}, got {size} (file seems not fully written?)"
            )

    def __len__(self) -> int:
        return self.shape[0]

    def _open(self) -> int:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
        return self._fd

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __getitem__(self, idx: Any) -> np.ndarray:
        if not self.shape:
            out = np.empty((), self.dtype)
            self._read_into(out.reshape(1).data.cast("B"), self.offset)
            return out
        if isinstance(idx, (int, np.integer)):
            row: np.ndarray = self[int(idx) : int(idx) + 1][0]
            return row
        if not isinstance(idx, slice) or idx.step not in (None, 1):
            raise TypeError(f"FileArray supports contiguous slices only, got {idx!r}")
        a, b, _ = idx.indices(self.shape[0])
        b = max(a, b)
        out = np.empty((b - a, *self.shape[1:]), self.dtype)
        if b > a:
            self._read_into(out.data.cast("B"), self.offset + a * self._row_bytes)
        return out

    def _read_into(self, view: memoryview, offset: int) -> None:
        got = pread_into(self._open(), view, offset)
        if got < len(view):  # the size was checked at construction: the file shrank since
            from ...errors import ConversionError

            raise ConversionError(
                f"{self.path}: expected {len(view)} bytes at byte {offset}, got {got} (the file ends at byte "
                f"{offset + got}: it shrank while it was read)"
            )


class RolledArray:
    """Rows ``[shift:] + [:shift]`` of the first ``length`` rows of ``base`` (a ring read in age order)."""

    def __init__(self, base: ArrayLike, shift: int, length: int) -> None:
        self.base, self.shift, self.length = base, int(shift), int(length)
        self.shape = (self.length, *base.shape[1:])
        self.dtype = base.dtype

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, idx: slice) -> np.ndarray:
        a, b, _ = idx.indices(self.length)
        b = max(a, b)
        cap = self.length
        start, stop = a + self.shift, b + self.shift
        if stop <= cap:
            return np.asarray(self.base[start:stop])
        if start >= cap:
            return np.asarray(self.base[start - cap : stop - cap])
        return np.concatenate([np.asarray(self.base[start:cap]), np.asarray(self.base[0 : stop - cap])])


class FlatReader(Reader):
    """Stream row-aligned arrays as store chunks.

    Parameters
    ----------
    path
        The source, for messages and attributes.
    columns
        Store column name -> array ``[N, *shape]`` (``reward`` squeezed to ``[N]``
        when given as ``[N, 1]``).
    terminated, truncated
        Flag arrays ``[N]`` or ``[N, 1]`` of any numeric dtype (non-zero is set).
    next_arrays
        Next-derived column -> array ``[N, *shape]`` of next observations, used for
        the final observation of every episode; rows inside an episode are
        compared with the following row's observation and the disagreements are
        counted (``next_obs_mismatch_rows``). Columns listed in ``next_keys`` but
        missing here get zeros as final observation.
    next_keys
        Columns whose next value the store derives.
    keys
        Source key of each column, for error messages.
    next_mode
        ``"auto"`` (default): derive next values when the source's next
        observations all equal the following row inside episodes, else keep them
        as explicit ``next/<col>`` columns; ``"derive"``: derive them anyway (the
        rows that differ are counted); ``"explicit"``: always keep the columns.
    drop_last_transition
        Where a next-derived column has no next observations: drop each complete
        episode's last transition and keep its observation as the final one (see
        the module docstring); refused by name without it.
    zero_unknown_finals
        Yield zeros for unknown final observations instead (an exporter's read-back
        check, which compares rows and never stores them).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        fmt: str,
        columns: Mapping[str, ArrayLike],
        terminated: ArrayLike,
        truncated: ArrayLike,
        next_arrays: Mapping[str, ArrayLike] | None = None,
        next_keys: tuple[str, ...] = (),
        keys: Mapping[str, str] | None = None,
        attrs: dict[str, Any] | None = None,
        squeeze: tuple[str, ...] = ("reward",),
        next_mode: str = "auto",
        drop_last_transition: bool = False,
        zero_unknown_finals: bool = False,
    ) -> None:
        super().__init__(path)
        if next_mode not in NEXT_MODES:
            raise ValueError(f"next_mode: expected one of {NEXT_MODES}, got {next_mode!r}")
        self.format = fmt
        self._columns = dict(columns)
        self._term = terminated
        self._trunc = truncated
        self._next = dict(next_arrays or {})
        self._next_keys = tuple(next_keys)
        self._keys = dict(keys or {})
        self._squeeze = {k for k in squeeze if k in self._columns and self._columns[k].shape[1:] == (1,)}
        everything = [*self._columns.items(), ("terminated", terminated), ("truncated", truncated),
                      *((f"next_{k}", v) for k, v in self._next.items())]
        for name, arr in everything:
            if not arr.shape:
                raise self._error("expected an array with one row per step, got a scalar", self._key(name))
        lengths = [int(arr.shape[0]) for _, arr in everything]
        n = max(set(lengths), key=lengths.count) if lengths else 0  # the most common length
        for name, arr in everything:
            if int(arr.shape[0]) != n:
                ref = next(k for k, a in everything if int(a.shape[0]) == n)
                raise self._error(
                    f"mismatched lengths: {arr.shape[0]} rows, expected {n} (as {self._key(ref)!r})",
                    self._key(name),
                )
        for flag, arr in (("terminated", terminated), ("truncated", truncated)):
            if arr.shape[1:] not in ((), (1,)):
                raise self._error(f"expected a flag per row, got shape {arr.shape}", self._key(flag))
        for k, arr in self._next.items():
            if k not in self._columns or tuple(arr.shape[1:]) != tuple(self._columns[k].shape[1:]):
                raise self._error(
                    f"next observations of shape {tuple(arr.shape[1:])} do not match "
                    f"{k!r} of shape {tuple(self._columns[k].shape[1:]) if k in self._columns else None}",
                    self._key(f"next_{k}"),
                )
        self._n = int(n or 0)
        self._next_mode = next_mode
        self._explicit: dict[str, Any] = {}
        if self._next and next_mode != "derive":
            if next_mode == "auto":
                mismatches, first = self._scan_next()
            else:
                mismatches, first = 0, []
            retyped = {k: str(arr.dtype) for k, arr in self._next.items()  # a derived column has the observations'
                       if np.dtype(arr.dtype).newbyteorder("=") != np.dtype(self._columns[k].dtype).newbyteorder("=")}
            if next_mode == "explicit" or mismatches or retyped:
                # keep the source's next observations as they are: explicit columns, not derived
                for k, arr in self._next.items():
                    self._columns[f"next/{k}"] = arr
                    self._keys[f"next/{k}"] = self._keys.get(f"next_{k}", f"next_{k}")
                self._next_keys = tuple(k for k in self._next_keys if k not in self._next)
                reason = ("asked (keep_next_obs)" if next_mode == "explicit" else
                          "the source's next observations differ from the following row" if mismatches else
                          f"the source's next observations are of another dtype than the observations: {retyped}")
                self._explicit = {"columns": [f"next/{k}" for k in self._next], "mismatch_rows": mismatches,
                                  "first_rows": first, "reason": reason}
                if retyped and next_mode == "auto":
                    self._warn(f"next observations of dtype {retyped}, unlike the observations: kept as the explicit "
                               f"column(s) {self._explicit['columns']} (derived ones would have the observations' dtype)")
                self._next = {}
                self.stats["next_obs_mismatch_rows"] = mismatches
        cols: dict[str, tuple[tuple[int, ...], str]] = {}
        for name, arr in self._columns.items():
            shape = tuple(int(s) for s in arr.shape[1:])
            if name in self._squeeze:
                shape = ()
            cols[name] = (shape, np.dtype(arr.dtype).newbyteorder("=").str)
        self._attrs = dict(attrs or {})
        missing = [k for k in self._next_keys if k not in self._next]
        self._drop: np.ndarray | None = None  # the source rows kept, when the last transitions are dropped
        rows_out = self._n
        if missing and self._n and not zero_unknown_finals:
            if not drop_last_transition:
                raise self._error(
                    f"no next observations for {missing}: the final observation of every episode is unknown "
                    "(a store keeps what it reads, never zeros in its place); drop_last_transition=True "
                    "(--drop-last-transition) drops each episode's last transition and keeps its observation "
                    "as the episode's final observation, as d4rl.qlearning_dataset does", self._key(missing[0]))
            rows_out = self._plan_drop()
        if self._next_keys:
            self._attrs["final_obs_source"] = "next_row" if self._drop is not None else "next"
        n = self._n
        self._open_tail = bool(n) and not bool(as_flag(terminated[n - 1 : n])[0] or as_flag(truncated[n - 1 : n])[0])
        # the dataset stops inside an episode: with next observations its last row is
        # a whole transition, so the episode is closed as truncated (D4RL's timeouts)
        self._close_tail = self._open_tail and bool(self._next_keys) and not missing
        if self._close_tail:
            self._attrs[TAIL_ATTR] = n - 1
        if self._explicit:
            self._attrs["next_obs"] = {"source": "explicit", **self._explicit}
        elif self._next:
            self._attrs["next_obs"] = {"source": "derived", "mode": next_mode}
        self._schema = Schema(cols, self._next_keys, rows_out, self._attrs)

    def _plan_drop(self) -> int:
        """Mark the rows kept when each complete episode's last transition is dropped
        (``droplast.py``); return how many rows are kept."""
        self._drop = droplast.kept_rows(self._term, self._trunc, self._n, SCAN_BYTES // 2)
        dropped = self._n - int(self._drop.sum())
        self.stats["dropped_last_transitions"] = dropped
        self.stats["dropped_one_row_episodes"] = droplast.one_row_episodes(self._drop)
        self._attrs["dropped_last_transitions"] = dropped
        return self._n - dropped

    def _extra_ends(self, a: int, b: int) -> np.ndarray | None:
        """Rows ``a..b`` that end an episode beyond the source's flags (``None``: none); see TorchRL."""
        return None

    def _scan_next(self) -> tuple[int, list[int]]:
        """Count the rows whose next observation differs from the following row of their episode.

        Reads the flags, the next-derived columns and their next observations
        once, in slices of about :data:`SCAN_BYTES`; returns the count
        and the first :data:`_FIRST_ROWS` such rows.
        """
        n = self._n
        row_bytes = 2 + sum(
            2 * int(np.prod(self._columns[k].shape[1:], dtype=np.int64)) * np.dtype(self._columns[k].dtype).itemsize
            for k in self._next
        )
        step = max(1, SCAN_BYTES // max(1, row_bytes))
        count, first = 0, list[int]()
        prev_next: dict[str, np.ndarray] = {}
        prev_end = True
        for a in range(0, n, step):
            b = min(n, a + step)
            done = as_flag(self._term[a:b]) | as_flag(self._trunc[a:b])
            extra = self._extra_ends(a, b)
            if extra is not None:
                done = done | extra
            differs = np.zeros(b - a, bool)  # row t: next[t] != obs[t + 1] inside an episode
            carry = False
            for k, arr in self._next.items():
                nxt, obs = np.asarray(arr[a:b]), np.asarray(self._columns[k][a:b])
                differs[:-1] |= _rows_differ(nxt[:-1], obs[1:]) & ~done[:-1]  # inside an episode
                carry |= k in prev_next and not prev_end and bool(_rows_differ(prev_next[k], obs[:1])[0])
                prev_next[k] = nxt[-1:]
            rows = np.flatnonzero(differs) + a
            if carry:
                rows = np.concatenate([[a - 1], rows])
                count += 1
            count += int(differs.sum())
            first.extend(int(r) for r in rows[: _FIRST_ROWS - len(first)])
            prev_end = bool(done[-1])
        return count, first

    def _key(self, name: str) -> str:
        return self._keys.get(name, name)

    @property
    def schema(self) -> Schema:
        return self._schema

    def chunks(self, chunk_rows: int) -> Iterator[Chunk]:
        if self._drop is not None:
            yield from self._chunks_dropping(chunk_rows)
            return
        n = self._n
        mismatches = 0
        prev_next: dict[str, np.ndarray] = {}
        prev_end = True
        for a in range(0, n, chunk_rows):
            b = min(n, a + chunk_rows)
            steps: dict[str, np.ndarray] = {}
            for name, arr in self._columns.items():
                rows = np.asarray(arr[a:b])
                if name in self._squeeze:
                    rows = rows.reshape(b - a)
                steps[name] = rows
            term = as_flag(self._term[a:b])
            trunc = as_flag(self._trunc[a:b])
            if b == n and self._close_tail:
                trunc = trunc.copy()
                trunc[-1] = True
            steps["terminated"] = term
            steps["truncated"] = trunc
            done = term | trunc
            ends = np.flatnonzero(done)
            extra = self._extra_ends(a, b) if self._next else None
            cut = done if extra is None else done | extra  # episode ends for the next-observation check
            final: dict[str, np.ndarray] = {}
            differs = np.zeros(b - a, bool)  # a row counts once, however many columns differ
            carry = False
            for k in self._next_keys:
                if k not in self._next:  # unknown (zero_unknown_finals: a read-back check)
                    shape, dtype = self._schema.columns[k]
                    final[k] = np.zeros((len(ends), *shape), dtype)
                else:
                    nxt = np.asarray(self._next[k][a:b])
                    final[k] = nxt[ends]
                    obs = steps[k]
                    differs[:-1] |= _rows_differ(nxt[:-1], obs[1:]) & ~cut[:-1]  # inside an episode: obs[t + 1]
                    carry |= k in prev_next and not prev_end and bool(_rows_differ(prev_next[k], obs[:1])[0])
                    if nxt.dtype != obs.dtype:  # derived (derive_next): finals the column's dtype cannot hold are lost too
                        differs[ends] |= _rows_differ(final[k], final[k].astype(obs.dtype))
                    prev_next[k] = nxt[-1:]
            mismatches += int(differs.sum()) + int(carry)
            prev_end = bool(cut[-1]) if len(cut) else prev_end
            yield Chunk(steps, final)
        if self._next:
            self.stats["next_obs_mismatch_rows"] = mismatches
            if mismatches:  # only with next_mode="derive": "auto" keeps them (see __init__)
                self._warn(
                    f"derive_next=True: {mismatches} rows have a next observation that differs from the following "
                    "row's observation inside an episode (or, at an episode's end, that the observations' dtype "
                    "cannot hold); as asked, the store derives next values from the following row, not the source's"
                )
        if self._explicit.get("mismatch_rows"):
            e = self._explicit
            self._warn(
                f"{e['mismatch_rows']} rows have a next observation that differs from the following row's "
                f"observation inside an episode (first rows {e['first_rows']}): the source's next "
                f"observations are kept as the explicit column(s) {e['columns']} (the store derives no "
                "next values for them); derive_next=True (--derive-next) derives them from the following "
                "row instead and loses these rows' next observations"
            )
        if self._close_tail:
            self.stats["tail_truncated_row"] = n - 1
            self._warn(
                "the last episode has no terminated/truncated flag (the dataset stops there): kept as "
                f"a truncated episode (truncated set at row {n - 1}, attrs[{TAIL_ATTR!r}]), whose final "
                "observation is the last row's next observation; export_d4rl writes it back unflagged"
            )
        elif self._open_tail and self._next_keys:
            self._warn(
                "the last episode has no terminated/truncated flag and the source has no next "
                f"observations: kept as an open episode; its last row (row {n - 1}) has no next "
                "observation, so it is stored but not sampled"
            )
        elif self._open_tail:
            self._warn("the last episode has no terminated/truncated flag: kept as an open episode")

    def _chunks_dropping(self, chunk_rows: int) -> Iterator[Chunk]:
        """``chunks`` with each complete episode's last transition dropped (``droplast.py``)."""
        assert self._drop is not None
        yield from droplast.chunks(self._columns, self._squeeze, self._next, self._next_keys, self._drop, chunk_rows)
        if self._open_tail:
            self._warn(
                "the last episode has no terminated/truncated flag and the source has no next "
                f"observations: kept as an open episode; its last row (row {self._n - 1}) has no next "
                "observation, so it is stored but not sampled"
            )


def _rows_differ(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per row: do ``a`` and ``b`` (same shape) differ in any byte, both in the dtype
    that holds either's values?

    Bytes, not values: ``0.0 == -0.0``, and deriving would store the one in place of
    the other; a NaN equals a NaN of the same bits. Each row is compared as one
    ``V<bytes>`` item: one pass, about as fast as copying the rows.

    >>> _rows_differ(np.array([[0.0, 1.0], [np.nan, 2.0]]), np.array([[-0.0, 1.0], [np.nan, 2.0]])).tolist()
    [True, False]
    >>> _rows_differ(np.array([[0.1], [0.5]], np.float32), np.array([[0.1], [0.5]], np.float64)).tolist()
    [True, False]
    """
    common = np.result_type(a, b)  # float32 against float64: the float32 values widened, exactly
    row = int(np.prod(a.shape[1:], dtype=np.int64)) * common.itemsize
    if row == 0 or len(a) == 0:
        return np.zeros(len(a), bool)
    a, b = (np.ascontiguousarray(x, dtype=common).reshape(len(x), -1).view(f"V{row}").reshape(-1) for x in (a, b))
    return np.asarray(a != b)
