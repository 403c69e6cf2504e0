"""``.npz`` archives and directories of ``.npy`` files with D4RL's keys.

The keys are those of :mod:`mmbuffer.convert.readers.d4rl` (``observations, actions,
rewards, terminals, timeouts``, optional ``next_observations``, ``infos/*``,
``metadata/*``); nested keys are ``a/b`` member names in an archive, or
sub-directories (``infos/qpos.npy``) in a directory.

Nothing is ever unpickled: headers are parsed with ``allow_pickle=False`` rules
and an object array is refused. Arrays are streamed: ``.npy`` files and members
stored uncompressed in an ``.npz`` are read with ``pread`` at their data offset;
members compressed with ``np.savez_compressed`` are decompressed sequentially,
one chunk at a time.

**Lossless by default**, as :mod:`mmbuffer.convert.readers.d4rl` (the same
rules): ``next_observations`` that differ from the following row are kept as an
explicit ``next/obs`` column (``derive_next=True`` derives anyway), ``infos/*``
are kept as columns (``drop_infos=True`` leaves them out), a non-numeric array
(a ``str`` array; object arrays are always refused, they need pickle) is
refused unless ``drop_unsupported=True``, and ``metadata/*`` values of more
than 4096 elements are recorded by shape and dtype only
(``attrs["source_metadata_omitted"]``).
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path
from typing import IO, Any

import numpy as np

from ...schema import PriorityConfig
from .d4rl import flat_columns, infos_option
from .._pipeline.flat import FileArray, FlatReader, next_mode
from .._pipeline.reader import Reader, jsonable
from .._pipeline.sniff import ZIP, expect
from .._pipeline.write import write_store

__all__ = ["NpzReader", "convert_npz"]


def _read_header(f: IO[bytes], where: str) -> tuple[tuple[int, ...], bool, np.dtype]:
    from ...errors import ConversionError

    fmt = np.lib.format
    try:
        version = fmt.read_magic(f)
        if version == (1, 0):
            shape, fortran, dtype = fmt.read_array_header_1_0(f)
        elif version in ((2, 0), (3, 0)):
            shape, fortran, dtype = fmt.read_array_header_2_0(f)
        else:  # pragma: no cover - numpy raises first
            raise ValueError(f"unknown .npy version {version}")
    except ValueError as exc:
        raise ConversionError(f"{where}: not a .npy array ({exc})") from exc
    if dtype.hasobject:
        raise ConversionError(
            f"{where}: object arrays need pickle, which is never loaded (allow_pickle=False)"
        )
    return tuple(shape), bool(fortran), dtype


class _ZipMemberArray:
    """A compressed ``.npz`` member, decompressed forward as slices are asked."""

    def __init__(self, archive: Path, name: str, shape: tuple[int, ...], dtype: np.dtype, data_start: int):
        self.archive, self.name = archive, name
        self.shape, self.dtype = shape, dtype
        self._row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize
        self._data_start = data_start
        self._zf: zipfile.ZipFile | None = None
        self._f: Any = None
        self._pos = 0  # next row the stream is at

    def _stream(self, row: int) -> Any:
        if self._f is None or row < self._pos:
            self.close()
            self._zf = zipfile.ZipFile(self.archive)
            self._f = self._zf.open(self.name)
            self._f.read(self._data_start)
            self._pos = 0
        if row > self._pos:
            skip = (row - self._pos) * self._row_bytes
            while skip:
                got = len(self._f.read(min(skip, 1 << 24)))
                if not got:
                    raise EOFError(f"{self.archive}:{self.name}: truncated member")
                skip -= got
            self._pos = row
        return self._f

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
        if self._zf is not None:
            self._zf.close()
            self._zf = None

    def __getitem__(self, idx: Any) -> np.ndarray:
        if not self.shape:
            f = self._stream(0)
            out = np.frombuffer(f.read(self.dtype.itemsize), self.dtype).reshape(())
            self.close()
            return out
        a, b, _ = idx.indices(self.shape[0])
        b = max(a, b)
        out = np.empty((b - a, *self.shape[1:]), self.dtype)
        if b > a:
            f = self._stream(a)
            view = out.data.cast("B")
            n = 0
            while n < len(view):
                got = f.readinto(view[n:])
                if not got:
                    raise EOFError(f"{self.archive}:{self.name}: truncated member")
                n += got
            self._pos = b
        return out


def _open_npz(path: Path, reader: Reader) -> dict[str, Any]:
    from ...errors import ConversionError

    try:
        zf = zipfile.ZipFile(path)
    except zipfile.BadZipFile as exc:
        raise ConversionError(f"{path}: not an .npz archive ({exc})") from exc
    arrays: dict[str, Any] = {}
    with zf, open(path, "rb") as raw:
        for info in zf.infolist():
            if info.is_dir() or not info.filename.endswith(".npy"):
                continue
            key = info.filename[: -len(".npy")]
            where = f"{path}:{info.filename}"
            with zf.open(info) as f:
                shape, fortran, dtype = _read_header(f, where)
                header_len = f.tell()
            if fortran and len(shape) > 1:
                raise ConversionError(f"{where}: Fortran-order arrays cannot be streamed by row")
            if info.compress_type == zipfile.ZIP_STORED:
                # data offset = local header + name + extra + npy header
                raw.seek(info.header_offset)
                local = raw.read(30)
                if local[:4] != b"PK\x03\x04":
                    raise ConversionError(f"{where}: corrupt zip local header")
                name_len = int.from_bytes(local[26:28], "little")
                extra_len = int.from_bytes(local[28:30], "little")
                offset = info.header_offset + 30 + name_len + extra_len + header_len
                arrays[key] = FileArray(path, offset, shape, dtype)
            else:
                arrays[key] = _ZipMemberArray(path, info.filename, shape, dtype, header_len)
    if not arrays:
        raise ConversionError(f"{path}: no .npy members (not an .npz archive of arrays)")
    return arrays


def _open_npy_dir(path: Path) -> dict[str, Any]:
    from ...errors import ConversionError

    arrays: dict[str, Any] = {}
    for file in sorted(path.rglob("*.npy")):
        key = file.relative_to(path).as_posix()[: -len(".npy")]
        with open(file, "rb") as f:
            shape, fortran, dtype = _read_header(f, str(file))
            offset = f.tell()
        if fortran and len(shape) > 1:
            raise ConversionError(f"{file}: Fortran-order arrays cannot be streamed by row")
        arrays[key] = FileArray(file, offset, shape, dtype)
    if not arrays:
        raise ConversionError(f"{path}: no .npy files in the directory")
    return arrays


class NpzReader(FlatReader):
    """Read a ``.npz`` archive or a directory of ``.npy`` files with D4RL keys.

    Parameters
    ----------
    path
        ``file.npz`` or a directory holding ``observations.npy``, ``actions.npy``...
    drop_infos, drop_unsupported, derive_next, keep_next_obs, keep_infos, drop_last_transition
        As for :class:`~mmbuffer.convert.D4RLReader`.
    """

    def __init__(
        self, path: str | os.PathLike[str], *, drop_infos: bool = False, drop_unsupported: bool = False,
        derive_next: bool = False, keep_next_obs: bool = False, keep_infos: bool | None = None,
        drop_last_transition: bool = False,
    ) -> None:
        from ...errors import ConversionError

        Reader.__init__(self, path)
        p = self.path
        if expect(p, (ZIP, "directory"), "an .npz archive or a directory of .npy files") == "directory":
            arrays = _open_npy_dir(p)
        else:
            arrays = _open_npz(p, self)
        self._arrays = arrays
        meta, omitted = {}, {}
        for key, arr in arrays.items():
            if key.startswith("metadata/") or key == "metadata":
                name = key.partition("/")[2] or key
                if int(np.prod(arr.shape, dtype=np.int64)) <= 4096:
                    value = arr[()] if not arr.shape else arr[0 : arr.shape[0]]
                    meta[name] = jsonable(value)
                else:  # recorded by shape and dtype (see the module docstring)
                    omitted[name] = {"shape": list(arr.shape), "dtype": str(arr.dtype)}
        data = {k: v for k, v in arrays.items() if k.split("/", 1)[0] != "metadata"}
        for k, v in data.items():
            if not v.shape:
                raise ConversionError(f"{p} [{k}]: expected an array with one row per step, got a scalar")
        mode = next_mode(derive_next, keep_next_obs, str(p))
        args = flat_columns(self, data, drop_infos=infos_option(self, keep_infos, drop_infos),
                            drop_unsupported=drop_unsupported)
        attrs: dict[str, Any] = {"source_format": "npz", "source_metadata": meta}
        if omitted:
            attrs["source_metadata_omitted"] = omitted
            self.stats["metadata_omitted"] = sorted(omitted)
        notes, stats = self.notes, self.stats
        super().__init__(path, fmt="npz", attrs=attrs, next_mode=mode, drop_last_transition=drop_last_transition, **args)
        self.notes, self.stats = notes + self.notes, {**stats, **self.stats}

    def close(self) -> None:
        for arr in getattr(self, "_arrays", {}).values():
            arr.close()


def convert_npz(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    drop_infos: bool = False,
    drop_unsupported: bool = False,
    derive_next: bool = False,
    keep_next_obs: bool = False,
    keep_infos: bool | None = None,
    drop_last_transition: bool = False,
    overwrite: bool = False,
    compression: str | None = None,
    chunk_rows: int | None = None,
    progress: bool = True,
    verify: bool = True,
    capacity: int | None = None,
    num_streams: int | None = None,
    priorities: PriorityConfig | None = None,
) -> dict[str, Any]:
    """Convert a ``.npz`` archive or a directory of ``.npy`` files (D4RL keys) into a store.

    Never unpickles (``allow_pickle=False`` semantics); streams every array.
    Options and the returned summary are those of :func:`convert_d4rl`.

    Raises
    ------
    ConversionError
        Not an archive of arrays, an object array, a missing key, mismatched lengths.
    StoreExistsError
        ``dst`` exists and ``overwrite`` is false.
    """
    from .._pipeline.dest import check_destination

    check_destination(dst, overwrite)
    reader = NpzReader(src, drop_infos=drop_infos, drop_unsupported=drop_unsupported, derive_next=derive_next,
                       keep_next_obs=keep_next_obs, keep_infos=keep_infos, drop_last_transition=drop_last_transition)
    return write_store(
        reader, dst, overwrite=overwrite, compression=compression, chunk_rows=chunk_rows,
        progress=progress, verify=verify, capacity=capacity, num_streams=num_streams, priorities=priorities,
    )
