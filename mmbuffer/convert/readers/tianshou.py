"""Tianshou replay buffers saved with ``save_hdf5`` (``ReplayBuffer``, ``VectorReplayBuffer``, ...).

Layout read (Tianshou 0.5 to 2.x, ``tianshou/data/utils/converter.py::to_hdf5``
applied to the buffer's ``__dict__``)::

    /_meta                  group, attrs __data_type__ = "Batch": the storage, maxsize rows
        obs, act, rew, terminated, truncated, done, obs_next   datasets [maxsize, ...]
        obs/<key> ...       a Batch group for dict observations (also obs_next/<key>)
        info/<key>, policy/<key>   optional
    attrs maxsize, _size, _insertion_idx   (ReplayBuffer: its ring)
    /last_index             [1] (ReplayBuffer) or [buffer_num] (vector buffers)
    /_offset, /_extend_offset, /_lengths   vector buffers (ReplayBufferManager): sub-buffer j
                            is rows [_offset[j], _extend_offset[j + 1]), holding _lengths[j]
                            rows, its latest at last_index[j]
    /_random_state, /buffers, /weight ...  pickled objects: never read

Rows are read in age order: a sub-buffer that has wrapped starts after its latest
row. Sub-buffers are read one after the other (``num_streams`` deals the
episodes to streams, see :mod:`._lanes`). ``obs -> obs`` (next-derived; each
episode's final observation is its last ``obs_next``, zeros when the buffer was
made with ``ignore_obs_next``), ``act -> action``, ``rew -> reward``,
``terminated``, ``truncated``; ``info/<key>`` and ``policy/<key>`` leaves as
``infos/<key>`` and ``policy/<key>``, any other key of the Batch under its own
name. A sub-buffer whose latest episode is unfinished gets ``truncated=True``
on its latest row (the data stops there; counted in ``forced_truncations``;
every such row, none left out, in ``attrs["tianshou"]["forced_truncation_rows"]``
(rows in read order: the store's rows in the same order, stream after stream) and
its row in ``_meta`` in ``attrs["tianshou"]["forced_truncation_source_rows"]``:
the source's flags are recoverable exactly, ``truncated`` was ``False`` there and
nothing else changed); the oldest
episode of a wrapped ring starts mid-episode (its first rows were overwritten
by Tianshou) and is kept as it is.

**Lossless by default.** What the buffer holds that the store cannot derive:
``obs_next`` where it differs from the following row inside an episode (a
buffer filled by hand, or reset observations): kept as an explicit
``next/obs`` column, as for D4RL (:mod:`~mmbuffer.convert.readers.d4rl`;
``derive_next=True`` derives anyway); ``info`` and ``policy`` leaves: kept
(``drop_infos=True`` leaves them out); a leaf that is not a numeric array (an
object, a string): refused naming it, unless ``drop_unsupported=True``
(``drop_infos=True`` for one under ``info``/``policy``). ``done`` is
``terminated | truncated`` in Tianshou and is not stored. Rows outside each
sub-buffer's live range are not data.

Nothing is ever unpickled: only datasets whose ``__data_type__`` is
``ndarray`` or ``Tensor`` and whose dtype is numeric are read; a required key
stored any other way is refused with :class:`~mmbuffer.errors.ConversionError`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from ...schema import PriorityConfig
from .._pipeline.flat import FlatReader, next_mode
from .._pipeline.reader import Reader, as_flag
from .._pipeline.sniff import HDF5, expect
from .._pipeline.write import write_store
from .d4rl import infos_option

__all__ = ["TianshouReader", "convert_tianshou"]

_REQUIRED = {"obs": "obs", "act": "action", "rew": "reward"}


class _Segments:
    """Rows of ``base`` in age order over its sub-buffers: ``segs`` = (first base row, rows, ring size, shift)."""

    def __init__(self, base: Any, segs: list[tuple[int, int, int, int]]) -> None:
        self.base = base
        self.segs = segs
        self.shape = (sum(s[1] for s in segs), *base.shape[1:])
        self.dtype = base.dtype
        self._cum = np.cumsum([0, *(s[1] for s in segs)])

    def base_rows(self, a: int, b: int) -> np.ndarray:
        pos = np.arange(a, b, dtype=np.int64)
        k = np.searchsorted(self._cum, pos, side="right") - 1
        first = np.array([s[0] for s in self.segs], np.int64)[k]
        size = np.array([s[2] for s in self.segs], np.int64)[k]
        shift = np.array([s[3] for s in self.segs], np.int64)[k]
        rows: np.ndarray = first + (pos - self._cum[k] + shift) % size
        return rows

    def __getitem__(self, idx: slice) -> np.ndarray:
        a, b, _ = idx.indices(self.shape[0])
        rows = self.base_rows(a, max(a, b))
        if not len(rows):
            return np.empty((0, *self.shape[1:]), self.dtype)
        cuts = np.flatnonzero(np.diff(rows) != 1) + 1
        parts = [np.asarray(self.base[int(r[0]) : int(r[-1]) + 1]) for r in np.split(rows, cuts)]
        return parts[0] if len(parts) == 1 else np.concatenate(parts)


class _Closed:
    """A flag array with ``True`` forced at ``rows`` (the latest row of an unfinished sub-buffer)."""

    def __init__(self, base: Any, rows: np.ndarray) -> None:
        self.base, self.rows = base, rows
        self.shape: tuple[int, ...] = (int(base.shape[0]),)
        self.dtype = np.dtype(bool)

    def __getitem__(self, idx: slice) -> np.ndarray:
        a, b, _ = idx.indices(self.shape[0])
        out = as_flag(self.base[a:b]).copy()
        inside = self.rows[(self.rows >= a) & (self.rows < b)]
        out[inside - a] = True
        return out


class TianshouReader(FlatReader):
    """Read a Tianshou ``save_hdf5`` file (see the module docstring).

    Parameters
    ----------
    path
        The ``.hdf5`` file.
    drop_infos
        Leave ``info/<key>`` and ``policy/<key>`` leaves out (kept by default).
    drop_unsupported
        Leave out leaves that are not numeric arrays instead of refusing them.
    derive_next, keep_next_obs
        As for :class:`~mmbuffer.convert.D4RLReader` (``obs_next``).
    keep_infos
        Deprecated: ``True`` is the default, ``False`` is ``drop_infos=True``.
    """

    def __init__(self, path: str | os.PathLike[str], *, drop_infos: bool = False, drop_unsupported: bool = False,
                 derive_next: bool = False, keep_next_obs: bool = False, keep_infos: bool | None = None) -> None:
        import h5py

        Reader.__init__(self, path)
        p = self.path
        expect(p, (HDF5,), "a Tianshou replay buffer saved with save_hdf5 (an .hdf5 file)")
        try:
            f = self._h5 = h5py.File(p, "r")
        except OSError as exc:
            raise self._error(f"unreadable HDF5 file ({exc})") from exc
        if "_meta" not in f or not isinstance(f["_meta"], h5py.Group):
            raise self._error("expected a group _meta (a Tianshou buffer saved with save_hdf5), got "
                              f"{sorted(f.keys())[:8]}", "_meta")
        meta = f["_meta"]
        maxsize = self._int_attr(f, "maxsize")
        segs = self._segments(f, maxsize)
        leaves: dict[str, Any] = {}
        mode = next_mode(derive_next, keep_next_obs, str(p))
        self._drop_infos, self._drop_unsupported = infos_option(self, keep_infos, drop_infos), drop_unsupported
        self._dropped: list[str] = []
        self._unsupported: list[Exception] = []
        self._leaves(meta, "", leaves)
        for key in (*_REQUIRED, "terminated", "truncated"):
            if key not in leaves and not any(k.startswith(key + "/") for k in leaves):
                raise self._error(f"expected a numeric dataset {key!r} in _meta (stored as an ndarray), "
                                  f"got {sorted(leaves)[:8]}", f"_meta/{key}")
        if self._unsupported:
            raise self._unsupported[0]
        for key, ds in leaves.items():
            if not ds.shape or int(ds.shape[0]) != maxsize:
                raise self._error(f"expected {maxsize} rows (maxsize), got shape {ds.shape}", f"_meta/{key}")
        columns: dict[str, Any] = {}
        nxt: dict[str, Any] = {}
        keys: dict[str, str] = {}
        for key, ds in leaves.items():
            top, _, rest = key.partition("/")
            if top in ("terminated", "truncated", "done"):
                continue
            if top == "obs_next":
                nxt["obs" + (f"/{rest}" if rest else "")] = _Segments(ds, segs)
                continue
            name = (_REQUIRED.get(top) or ("infos" if top == "info" else top)) + (f"/{rest}" if rest else "")
            columns[name] = _Segments(ds, segs)
            keys[name] = f"_meta/{key}"
        term, trunc = _Segments(leaves["terminated"], segs), _Segments(leaves["truncated"], segs)
        # the latest row of each sub-buffer whose latest episode has no end: closed as truncated
        ends = np.cumsum([s[1] for s in segs])[[i for i, s in enumerate(segs) if s[1]]] - 1
        done_at_end = np.array([bool(as_flag(term[e : e + 1])[0] or as_flag(trunc[e : e + 1])[0]) for e in ends], bool)
        forced = ends[~done_at_end] if len(ends) else np.zeros(0, np.int64)
        obs_keys = tuple(k for k in columns if k == "obs" or k.startswith("obs/"))
        attrs = {"source_format": "tianshou",
                 "tianshou": {"maxsize": maxsize, "sub_buffers": len(segs),
                              "rows": [s[1] for s in segs], "forced_truncations": len(forced),
                              "forced_truncation_rows": [int(r) for r in forced],
                              "forced_truncation_source_rows": [int(term.base_rows(int(r), int(r) + 1)[0])
                                                                for r in forced]}}
        notes, dropped = self.notes, self._dropped
        super().__init__(p, fmt="tianshou", columns=columns, terminated=term, truncated=_Closed(trunc, forced),
                         next_arrays={k: v for k, v in nxt.items() if k in columns}, next_keys=obs_keys,
                         keys=keys, attrs=attrs, next_mode=mode)
        self.notes = notes + self.notes
        if dropped:  # only as asked (drop_infos / drop_unsupported): listed in the summary
            self.stats["dropped_keys"] = dropped
        if len(forced):
            self.stats["forced_truncations"] = len(forced)
            self._warn(f"{len(forced)} sub-buffer(s) end inside an episode: their latest row is marked truncated "
                       f"(rows {[int(r) for r in forced[:8]]}; all of them in "
                       "attrs['tianshou']['forced_truncation_rows'])")

    def _int_attr(self, f: Any, name: str) -> int:
        value = f.attrs.get(name)
        if value is None or np.ndim(value) or not float(value).is_integer() or int(value) < 0:
            raise self._error(f"expected a non-negative integer attribute {name!r}, got {value!r}", name)
        return int(value)

    def _array(self, f: Any, name: str) -> np.ndarray:
        import h5py

        ds = f.get(name)
        if not isinstance(ds, h5py.Dataset) or ds.dtype.kind not in "iu" or ds.ndim != 1 or ds.shape[0] > 1 << 20:
            raise self._error(f"expected a 1-d integer dataset {name!r}, got {ds!r}", name)
        return np.asarray(ds[()], np.int64)

    def _segments(self, f: Any, maxsize: int) -> list[tuple[int, int, int, int]]:
        """(first row, rows, ring size, shift) of each sub-buffer, checked against each other."""
        last = self._array(f, "last_index")
        if "_offset" in f:  # ReplayBufferManager / VectorReplayBuffer
            off, ext, lengths = self._array(f, "_offset"), self._array(f, "_extend_offset"), self._array(f, "_lengths")
            n = len(off)
            ok = (len(ext) == n + 1 and len(lengths) == n and len(last) == n and int(ext[-1]) == maxsize
                  and np.array_equal(ext[:-1], off) and bool(np.all(np.diff(ext) > 0)) and int(off[0]) == 0)
            if not ok:
                raise self._error(f"inconsistent sub-buffers: _offset {off[:8].tolist()}, _extend_offset "
                                  f"{ext[:9].tolist()}, _lengths {lengths[:8].tolist()}, last_index "
                                  f"{last[:8].tolist()}, maxsize {maxsize}", "_offset")
            segs = []
            for j in range(n):
                size, rows = int(ext[j + 1] - off[j]), int(lengths[j])
                if not 0 <= rows <= size or (rows and not off[j] <= last[j] < ext[j + 1]):
                    raise self._error(f"sub-buffer {j}: expected 0 <= _lengths <= {size} and last_index in "
                                      f"[{off[j]}, {ext[j + 1]}), got {rows} and {last[j]}", "_lengths")
                shift = (int(last[j] - off[j]) + 1) % size if rows == size else 0
                segs.append((int(off[j]), rows, size, shift))
            return segs
        size, at = self._int_attr(f, "_size"), self._int_attr(f, "_insertion_idx")
        if size > maxsize or at >= max(maxsize, 1) or (size < maxsize and at != size):
            raise self._error(f"expected _size <= maxsize and _insertion_idx < maxsize (= _size until the "
                              f"ring is full), got _size {size}, _insertion_idx {at}, maxsize {maxsize}", "_size")
        return [(0, size, max(maxsize, 1), at if size == maxsize else 0)]

    def _leaves(self, g: Any, prefix: str, out: dict[str, Any]) -> None:
        import h5py

        for name in g:
            node = g[name]
            key = f"{prefix}{name}"
            top = key.split("/", 1)[0]
            optional = top not in (*_REQUIRED, "terminated", "truncated", "obs_next")
            if top == "done":
                continue  # terminated | truncated in Tianshou
            if self._drop_infos and top in ("info", "policy"):
                self._dropped.append(f"_meta/{key}")
                continue
            if isinstance(node, h5py.Group):
                self._leaves(node, key + "/", out)
                continue
            kind = node.attrs.get("__data_type__", "ndarray")
            kind = kind.decode() if isinstance(kind, bytes) else str(kind)
            if kind not in ("ndarray", "Tensor") or node.dtype.kind not in "biuf":
                if optional and self._drop_unsupported:
                    self._dropped.append(f"_meta/{key}")
                    continue
                accept = ("" if not optional else " (a store holds numeric columns only; drop_unsupported=True "
                          "(--drop-unsupported) converts without it" + (", drop_infos=True (--drop-infos) without "
                          "info/policy" if top in ("info", "policy") else "") + ")")
                rows = node.shape[0] if node.shape else 0
                error = self._error(f"expected a numeric array of {rows} rows, got {kind} of dtype {node.dtype} "
                                    f"(pickled data is never loaded){accept}", f"_meta/{key}")
                if not optional:
                    raise error
                self._unsupported.append(error)  # raised once the required keys are checked
                continue
            out[key] = node

    def close(self) -> None:
        h5 = getattr(self, "_h5", None)
        if h5 is not None:
            h5.close()
            self._h5 = None


def convert_tianshou(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    drop_infos: bool = False,
    drop_unsupported: bool = False,
    derive_next: bool = False,
    keep_next_obs: bool = False,
    keep_infos: bool | None = None,
    overwrite: bool = False,
    compression: str | None = None,
    chunk_rows: int | None = None,
    progress: bool = True,
    verify: bool = True,
    capacity: int | None = None,
    num_streams: int | None = None,
    priorities: PriorityConfig | None = None,
) -> dict[str, Any]:
    """Convert a Tianshou ``save_hdf5`` replay buffer file into a new store at ``dst``.

    Options and the returned summary are those of :func:`~mmbuffer.convert.write_store`.
    ``convert_tianshou(path, dst, num_streams=buffer_num, capacity=...)`` keeps a
    vector buffer's environments apart as streams when they hold about as many rows each.

    Raises
    ------
    ConversionError
        Not an HDF5 file saved by Tianshou, a required key missing or pickled,
        counters (``_size``, ``_lengths``, ``last_index``) that contradict each other.
    StoreExistsError
        ``dst`` exists and ``overwrite`` is false.
    """
    from .._pipeline.dest import check_destination

    check_destination(dst, overwrite)
    reader = TianshouReader(Path(src).expanduser(), drop_infos=drop_infos, drop_unsupported=drop_unsupported,
                            derive_next=derive_next, keep_next_obs=keep_next_obs, keep_infos=keep_infos)
    return write_store(
        reader, dst, overwrite=overwrite, compression=compression, chunk_rows=chunk_rows,
        progress=progress, verify=verify, capacity=capacity, num_streams=num_streams, priorities=priorities,
    )
