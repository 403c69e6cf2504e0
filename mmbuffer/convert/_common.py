"""The shared half of every converter: the reader contract and the one store writer.

A converter is two separate things:

* a **reader** (:class:`Reader`) that knows one source format. It declares a
  :class:`Schema` (columns, next-derived keys, row count, attributes) and yields
  the source in order as chunks ``(steps, final_obs)``: ``steps`` maps each column
  to ``[T, *shape]`` numpy rows, ``final_obs`` maps each next-derived column to
  one row per episode that *ends* inside the chunk (terminated or truncated), in
  order. A reader never holds more than about one chunk of the source in memory.
* :func:`write_store`, which writes any reader into a new store, shows a progress
  bar, checks what it wrote against what it read and returns a summary.

Crash safety: the store is built at ``DST + ".partial"`` and renamed to ``DST``
only after the final commit and a successful verification pass, so an interrupted
conversion never leaves a half store under the name asked for. An existing
``DST`` is refused (:class:`~mmbuffer.errors.StoreExistsError`) unless
``overwrite=True`` and it is an mmbuffer store (never a directory holding anything
else, a plain file or a symbolic link); a stale ``DST.partial`` from an
interrupted run is replaced. The rules and the swap are in :mod:`._dest`.

Verification: a CRC-32 of every column (native byte order, row order), of the
final observations and of the episode lengths is accumulated from the chunks the
reader produced and recorded in the store's ``attrs["convert"]``. Every chunk is
read back from the store's files right after it is written (``pread``, while its
pages are still in the page cache) and compared byte for byte with the chunk the
reader produced, final observations included: equal bytes give equal checksums,
and a mismatch names the column and rows. After the last commit the store is
reopened read-only; its row count, episode count, episode starts and episode
lengths must agree with the source. Any difference raises
:class:`~mmbuffer.errors.ConversionError` and leaves the ``.partial`` directory
for inspection. (A separate pass re-reading the whole store after the commit
cost more than the write itself: a 2 GB store fell out of the page cache of the
dev VM, and the maps fault one page at a time.)
"""

from __future__ import annotations

import json
import math
import os
import time
import warnings
import zlib
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from ..errors import ConversionError, StoreExistsError
from ._dest import check_destination, partial_path, remove_partial, replace_destination

__all__ = [
    "Chunk",
    "ConversionWarning",
    "Reader",
    "Schema",
    "write_store",
    "DEFAULT_CHUNK_BYTES",
]

#: Target size of one chunk (all columns together) when ``chunk_rows`` is not given.
DEFAULT_CHUNK_BYTES = 32 << 20
#: Rows written between two ``Buffer.release_memory`` calls of a conversion (the pages
#: written through the maps are unmapped: resident memory stays about this size).
SEGMENT_BYTES = 256 << 20
#: A converter drops a chunk from the page cache this many chunks after writing it
#: (by then the kernel has written it back; pages still dirty are never dropped).
DROP_BEHIND_CHUNKS = 3

_FLAGS = ("terminated", "truncated")


class ConversionWarning(UserWarning):
    """Something in a source was kept but changed or is suspicious (open episode, ...)."""


class Chunk(NamedTuple):
    """One piece of a source, in order.

    ``steps``: column -> ``[T, *shape]`` array (``terminated``/``truncated`` bool
    ``[T]`` always present). ``final_obs``: next-derived column -> ``[E, *shape]``,
    one row per episode that ends inside ``steps``.
    """

    steps: dict[str, np.ndarray]
    final_obs: dict[str, np.ndarray]


@dataclass(frozen=True)
class Schema:
    """What a reader will produce.

    ``columns`` maps a store column name to ``(shape, dtype)`` (without the two
    flag columns, which every store has). ``next_keys`` are the columns whose next
    value is derived by the store (their final observation comes in
    ``Chunk.final_obs``). ``num_rows`` is the exact number of rows the reader
    yields; ``num_episodes`` the number of ended episodes when the source tells it
    up front (``None`` otherwise). ``attrs`` are JSON-serializable store attributes.
    """

    columns: dict[str, tuple[tuple[int, ...], str]]
    next_keys: tuple[str, ...]
    num_rows: int
    attrs: dict[str, Any] = field(default_factory=dict)
    num_episodes: int | None = None

    def row_bytes(self) -> int:
        total = 2  # the two flags
        for shape, dtype in self.columns.values():
            total += int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        return total


class Reader(ABC):
    """A source format opened for streaming; see the module docstring.

    Subclasses set ``format`` and implement :attr:`schema` and :meth:`chunks`.
    ``notes`` collects the warnings raised while reading (they also go through
    :mod:`warnings` as :class:`ConversionWarning`).
    """

    format: str = "?"

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.notes: list[str] = []
        self.stats: dict[str, int] = {}

    @property
    @abstractmethod
    def schema(self) -> Schema:
        """The columns, next keys, row count and attributes of the source."""

    @abstractmethod
    def chunks(self, chunk_rows: int) -> Iterator[Chunk]:
        """Yield the whole source in order, at most about ``chunk_rows`` rows at a time."""

    def close(self) -> None:  # noqa: B027 - optional hook, most readers hold no file
        """Release open files (idempotent)."""

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _warn(self, message: str) -> None:
        self.notes.append(message)
        warnings.warn(f"{self.path}: {message}", ConversionWarning, stacklevel=3)

    def _error(self, message: str, key: str | None = None) -> ConversionError:
        where = f"{self.path}" + (f" [{key}]" if key else "")
        return ConversionError(f"{where}: {message}")


# -- small helpers shared by the readers ------------------------------------------------------
def jsonable(value: Any, *, max_items: int = 4096) -> Any:
    """Turn numpy / bytes / nested values into JSON-serializable ones (big arrays are summarized)."""
    if isinstance(value, Mapping):
        return {str(k): jsonable(v, max_items=max_items) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [jsonable(v, max_items=max_items) for v in value]
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    if isinstance(value, np.ndarray):
        if value.size > max_items:
            return {"shape": list(value.shape), "dtype": str(value.dtype), "omitted": True}
        if value.dtype.kind in "SO":
            return jsonable(value.tolist(), max_items=max_items)
        return jsonable(value.tolist(), max_items=max_items)
    if isinstance(value, np.generic):
        return jsonable(value.item(), max_items=max_items)
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def as_flag(arr: np.ndarray) -> np.ndarray:
    """A flag array of any numeric dtype and shape ``[T]`` or ``[T, 1]`` as bool ``[T]``."""
    a = np.asarray(arr)
    if a.ndim == 2 and a.shape[1] == 1:
        a = a[:, 0]
    if a.dtype != np.bool_:
        a = a != 0
    return a


def default_chunk_rows(schema: Schema, chunk_rows: int | None) -> int:
    if chunk_rows is not None:
        if int(chunk_rows) < 1:
            raise ConversionError(f"chunk_rows: expected a positive integer, got {chunk_rows!r}")
        return int(chunk_rows)
    return max(1024, DEFAULT_CHUNK_BYTES // max(1, schema.row_bytes()))


class ChunkAssembler:
    """Collect episode pieces and hand them back as chunks of about ``chunk_rows`` rows.

    Used by episode-structured readers (Minari, TD-MPC2): each piece is part of one
    episode; pieces are concatenated column-wise once ``chunk_rows`` rows are pending.
    """

    def __init__(self, chunk_rows: int) -> None:
        self.chunk_rows = chunk_rows
        self._steps: list[dict[str, np.ndarray]] = []
        self._final: list[dict[str, np.ndarray]] = []
        self._rows = 0

    def add(self, steps: dict[str, np.ndarray], final: dict[str, np.ndarray] | None) -> Chunk | None:
        self._steps.append(steps)
        if final:
            self._final.append(final)
        self._rows += len(steps["terminated"])
        if self._rows >= self.chunk_rows:
            return self.flush()
        return None

    def flush(self) -> Chunk | None:
        if not self._steps:
            return None
        if len(self._steps) == 1:
            steps = self._steps[0]
        else:
            steps = {k: np.concatenate([s[k] for s in self._steps]) for k in self._steps[0]}
        final: dict[str, np.ndarray] = {}
        if self._final:
            final = {k: np.stack([f[k] for f in self._final]) for k in self._final[0]}
        self._steps, self._final, self._rows = [], [], 0
        return Chunk(steps, final)


# -- checksums ------------------------------------------------------------------------------
class _Tally:
    """Running CRC-32 per column, of final observations and of episode lengths."""

    def __init__(self, schema: Schema) -> None:
        self.crc: dict[str, int] = {k: 0 for k in (*schema.columns, *_FLAGS)}
        self.final_crc: dict[str, int] = {k: 0 for k in schema.next_keys}
        self.len_crc = 0
        self.rows = 0
        self.episodes = 0
        self.open_rows = 0  # rows of the episode being written
        self.nan_rewards = 0

    def add_rows(self, name: str, arr: np.ndarray) -> None:
        self.crc[name] = zlib.crc32(as_bytes(arr), self.crc[name])

    def add_final(self, name: str, arr: np.ndarray) -> None:
        self.final_crc[name] = zlib.crc32(as_bytes(arr), self.final_crc[name])

    def add_flags(self, done: np.ndarray) -> None:
        ends = np.flatnonzero(done)
        n = len(done)
        if len(ends):
            lengths = np.diff(ends, prepend=-1).astype(np.int64)
            lengths[0] += self.open_rows
            self.len_crc = zlib.crc32(lengths.tobytes(), self.len_crc)
            self.episodes += len(ends)
            self.open_rows = n - 1 - int(ends[-1])
        else:
            self.open_rows += n
        self.rows += n


def as_bytes(arr: np.ndarray) -> memoryview | bytes:
    """The bytes of ``arr`` in C order, for a checksum (no copy when already contiguous)."""
    a = np.ascontiguousarray(arr)
    if a.size == 0:
        return b""
    return a.data.cast("B")


def _hex(v: int) -> str:
    return f"{v & 0xFFFFFFFF:08x}"


# -- writing ----------------------------------------------------------------------------------
def abandon(store: Any, partial: Path, exc: BaseException) -> None:
    """After ``exc``: close ``store`` (if open) and delete the partial output, unless
    the verification found a mismatch (the partial output is left for inspection)."""
    if store is not None:
        try:
            store.close()
        except Exception:
            pass  # exc is the error to report
    if not isinstance(exc, _Mismatch):
        try:
            remove_partial(partial)
        except StoreExistsError:
            pass  # not recognisably ours any more: left alone; exc is the error to report


def progress_bar(total: int, desc: str, enabled: bool) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="row", unit_scale=True, disable=not enabled, leave=False)


def _check_chunk(reader: Reader, schema: Schema, chunk: Chunk, done: np.ndarray) -> None:
    steps, final = chunk
    n = len(done)
    for name in (*schema.columns, *_FLAGS):
        if name not in steps:
            raise reader._error(f"reader produced no column {name!r}", name)
        arr = steps[name]
        shape = schema.columns[name][0] if name in schema.columns else ()
        if arr.shape != (n, *shape):
            raise reader._error(
                f"column {name!r}: expected rows of shape {(n, *shape)}, got {arr.shape}", name
            )
    extra = set(steps) - set(schema.columns) - set(_FLAGS)
    if extra:
        raise reader._error(f"reader produced undeclared columns {sorted(extra)}")
    n_ends = int(done.sum())
    for name in schema.next_keys:
        got = final.get(name)
        shape = schema.columns[name][0]
        if n_ends == 0 and got is None:
            continue
        if got is None or got.shape != (n_ends, *shape):
            raise reader._error(
                f"final observation {name!r}: expected shape {(n_ends, *shape)}, "
                f"got {None if got is None else got.shape}",
                name,
            )


def write_store(
    reader: Reader,
    dst: str | os.PathLike[str],
    *,
    overwrite: bool = False,
    compression: str | None = None,
    chunk_rows: int | None = None,
    progress: bool = True,
    verify: bool = True,
) -> dict[str, Any]:
    """Write everything ``reader`` yields into a new store at ``dst``.

    Parameters
    ----------
    reader
        An opened :class:`Reader` (it is closed on return).
    dst
        Path of the store to create. Built at ``dst + ".partial"`` and renamed at
        the end.
    overwrite
        Replace an existing ``dst`` (only after the new store is verified).
    compression
        ``None`` (raw, memory-mapped: for training), ``"zstd"`` or ``"lz4"``.
    chunk_rows
        Rows read and written at a time (default: about 32 MiB of rows).
    progress
        Show a tqdm progress bar on stderr.
    verify
        Reopen the store and compare counts and checksums with the source.

    Returns
    -------
    dict
        The summary: ``format, source, store, rows, episodes, open_episode_rows,
        nan_rewards, checksums`` (column -> crc32 hex), ``final_obs_checksums``,
        ``verified``, ``seconds``, ``rows_per_s``, ``mb_per_s``, ``warnings``
        (plus reader statistics such as ``forced_truncations``).

    Raises
    ------
    StoreExistsError
        ``dst`` exists and ``overwrite`` is false.
    ConversionError
        The source is inconsistent, or the verification pass found a difference.
    """
    import mmbuffer as mb

    t0 = time.perf_counter()
    with reader:
        dst_path = check_destination(dst, overwrite)
        schema = reader.schema
        if schema.num_rows < 1:
            raise reader._error("the source holds no rows")
        rows_per_chunk = default_chunk_rows(schema, chunk_rows)
        partial = partial_path(dst_path)
        remove_partial(partial)
        tally = _Tally(schema)
        attrs = dict(schema.attrs)
        segment_rows = max(rows_per_chunk, SEGMENT_BYTES // max(1, schema.row_bytes()))
        buf = None
        try:
            buf = mb.create(
                str(partial),
                columns={k: (tuple(s), str(d)) for k, (s, d) in schema.columns.items()},
                capacity=schema.num_rows,
                num_streams=1,
                compression=compression,
                next_keys=tuple(schema.next_keys),
                attrs=jsonable(attrs),
            )
            since_release = 0
            row = 0  # one lane, no wrap: the store's row numbers are the source's
            readback = _ReadBack(partial) if verify else None
            starts = deque([0] * DROP_BEHIND_CHUNKS, maxlen=DROP_BEHIND_CHUNKS)  # of the last chunks
            source = _prepared(reader, schema, tally, rows_per_chunk)
            with progress_bar(schema.num_rows, f"convert {reader.format}", progress) as bar, \
                    _Prefetch(source, depth=2) as chunks:
                for steps, final, n in chunks:
                    buf.extend(steps, stream=0, final_obs=(final if schema.next_keys else None))
                    if readback is not None:
                        readback.check(buf, row, steps, final)
                    # write behind: start writing this chunk to disk, and drop the
                    # earlier ones, written by now, from the page cache (2-3x faster
                    # on the dev VM, where fresh page-cache pages are slow to get)
                    starts.append(row)
                    buf.drop_cache(starts[0], row + n)
                    row += n
                    bar.update(n)
                    since_release += n
                    if since_release >= segment_rows:
                        # unmap the pages written through the maps (final
                        # observations, index): they would otherwise stay resident
                        # in this process for the whole conversion. No commit: the
                        # store is renamed into place only after the last one
                        buf.release_memory()
                        since_release = 0
                if tally.rows != schema.num_rows:
                    raise reader._error(
                        f"the source declared {schema.num_rows} rows but yielded {tally.rows}"
                    )
                if schema.num_episodes is not None and schema.num_episodes != tally.episodes:
                    raise reader._error(
                        f"the source declares {schema.num_episodes} episodes but {tally.episodes} "
                        "end with a terminated or truncated flag"
                    )
                if tally.open_rows:
                    reader.stats.setdefault("open_episode_rows", tally.open_rows)
                attrs["convert"] = {
                    "format": reader.format,
                    "source": str(reader.path),
                    "rows": tally.rows,
                    "episodes": tally.episodes,
                    "open_episode_rows": tally.open_rows,
                    "nan_rewards": tally.nan_rewards,
                    "checksums": {k: _hex(v) for k, v in tally.crc.items()},
                    "final_obs_checksums": {k: _hex(v) for k, v in tally.final_crc.items()},
                    "notes": list(reader.notes),
                }
            _set_attrs(buf, attrs)
            buf.commit()
            buf.close()
            buf = None
        except BaseException as exc:
            abandon(buf, partial, exc)
            raise
    t_write = time.perf_counter() - t0
    summary: dict[str, Any] = {
        "format": reader.format,
        "source": str(reader.path),
        "store": str(dst_path),
        "rows": tally.rows,
        "episodes": tally.episodes,
        "open_episode_rows": tally.open_rows,
        "nan_rewards": tally.nan_rewards,
        "columns": {k: [list(s), str(d)] for k, (s, d) in schema.columns.items()},
        "checksums": {k: _hex(v) for k, v in tally.crc.items()},
        "final_obs_checksums": {k: _hex(v) for k, v in tally.final_crc.items()},
        "verified": False,
        **{k: v for k, v in reader.stats.items()},
        "warnings": list(reader.notes),
    }
    if verify:
        verify_store(partial, tally, schema)
        summary["verified"] = True
    replace_destination(partial, dst_path, overwrite=overwrite)
    seconds = time.perf_counter() - t0
    nbytes = schema.row_bytes() * tally.rows
    summary.update(
        seconds=round(seconds, 3),
        write_seconds=round(t_write, 3),
        rows_per_s=round(tally.rows / seconds, 1) if seconds else None,
        mb_per_s=round(nbytes / seconds / 1e6, 1) if seconds else None,
        bytes=nbytes,
    )
    return summary


def _prepared(
    reader: Reader, schema: Schema, tally: _Tally, chunk_rows: int
) -> Iterator[tuple[dict[str, np.ndarray], dict[str, np.ndarray], int]]:
    """The reader's chunks, checked, in native dtypes, and added to ``tally``."""
    for chunk in reader.chunks(chunk_rows):
        steps = {k: np.ascontiguousarray(v, dtype=_native(schema, k)) for k, v in chunk.steps.items()}
        final = {k: np.ascontiguousarray(v, dtype=_native(schema, k)) for k, v in chunk.final_obs.items()}
        for k in schema.next_keys:  # no episode ended in this chunk
            if k not in final:
                final[k] = np.zeros((0, *schema.columns[k][0]), _native(schema, k))
        done = steps["terminated"] | steps["truncated"]
        _check_chunk(reader, schema, Chunk(steps, final), done)
        n = len(done)
        if n == 0:
            continue
        if tally.rows + n > schema.num_rows:
            raise reader._error(f"the source yielded more rows than the {schema.num_rows} it declared")
        for name, arr in steps.items():
            tally.add_rows(name, arr)
        for name, arr in final.items():
            tally.add_final(name, arr)
        tally.add_flags(done)
        reward = steps.get("reward")
        if reward is not None and reward.dtype.kind == "f":
            tally.nan_rewards += int(np.isnan(reward).sum())
        yield steps, final, n


class _Prefetch:
    """Run an iterator in a background thread, ``depth`` items ahead of the consumer.

    Reading the source and checksumming (which release the GIL in h5py, zlib and
    numpy copies) overlap with the store's writes. Exceptions raised by the
    iterator are re-raised in the consumer; leaving the ``with`` block early
    stops the thread.
    """

    _END = object()

    def __init__(self, iterable: Any, depth: int = 2) -> None:
        import queue
        import threading

        self._it = iterable
        self._queue: Any = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mmbuffer-convert-read", daemon=True)

    def _put(self, item: Any) -> bool:
        import queue

        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        try:
            for item in self._it:
                if not self._put((None, item)):
                    return
        except BaseException as exc:  # handed to the consumer
            self._put((exc, None))
            return
        self._put((None, self._END))

    def __enter__(self) -> Iterator[Any]:
        self._thread.start()
        return self._iter()

    def _iter(self) -> Iterator[Any]:
        while True:
            exc, item = self._queue.get()
            if exc is not None:
                raise exc
            if item is self._END:
                return
            yield item

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        close = getattr(self._it, "close", None)
        if close is not None:
            close()


def _native(schema: Schema, name: str) -> np.dtype:
    if name in _FLAGS:
        return np.dtype(np.bool_)
    return np.dtype(schema.columns[name][1]).newbyteorder("=")


def _set_attrs(buf: Any, attrs: dict[str, Any]) -> None:
    clean = jsonable(attrs)
    json.dumps(clean)  # fail here, not at commit
    target = buf.attrs
    target.update(clean)


# -- verification -----------------------------------------------------------------------------
class _Mismatch(ConversionError):
    """The store does not hold what the source held (the partial store is kept)."""


def _mismatch(path: Path, what: str, expected: Any, got: Any) -> _Mismatch:
    return _Mismatch(
        f"{path}: verification failed: {what}: expected {expected}, got {got} "
        "(the partial store is left for inspection)"
    )


def same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two C-contiguous arrays hold the same bytes (NaN payloads included)."""
    x, y = a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8)
    if len(x) != len(y):
        return False
    k = len(x) // 8 * 8  # eight bytes a comparison: about 10 GB/s
    return bool(np.array_equal(x[:k].view(np.uint64), y[:k].view(np.uint64)) and np.array_equal(x[k:], y[k:]))


class _ReadBack:
    """Reads each written chunk back from the store's files and compares its bytes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._scratch: dict[str, np.ndarray] = {}  # reused: no fresh pages per chunk

    def _out(self, buf: Any, name: str, rows: int) -> np.ndarray:
        out = self._scratch.get(name)
        if out is None or len(out) < rows:
            col = buf.columns[name]
            out = self._scratch[name] = np.empty((rows, *col.shape), dtype=np.dtype(col.dtype).newbyteorder("<"))
        return out[:rows]

    def check(self, buf: Any, row: int, steps: Mapping[str, np.ndarray], final: Mapping[str, np.ndarray]) -> None:
        n = len(steps["terminated"])
        for name, arr in steps.items():
            back = buf.read_range(name, row, row + n, out=self._out(buf, name, n))
            src = np.ascontiguousarray(arr, dtype=back.dtype)
            if not same_bytes(back, src):
                differs = back.reshape(n, -1).view(np.uint8) != src.reshape(n, -1).view(np.uint8)
                bad = int(np.flatnonzero(differs.any(axis=1))[0])
                raise _mismatch(self.path, f"column {name!r} at row {row + bad}", src[bad], back[bad])
        ends = row + np.flatnonzero(steps["terminated"] | steps["truncated"])
        for name, arr in final.items():
            if len(arr):
                back = buf.read(f"final/{name}", ends)
                if not same_bytes(np.ascontiguousarray(back), np.ascontiguousarray(arr, dtype=back.dtype)):
                    raise _mismatch(self.path, f"final observations {name!r} of the episodes ending in "
                                    f"rows [{row}, {row + n})", "the source's", "other values")


def verify_store(path: Path, tally: _Tally, schema: Schema) -> None:
    """Reopen the store at ``path`` read-only and compare its episodes with ``tally``."""
    from ..buffer import Buffer

    with Buffer(path, mode="r") as buf:
        # the last row of an open episode has no next observation yet, so a store
        # with next-derived columns does not count it as live (store.py)
        live = tally.rows - (1 if tally.open_rows and schema.next_keys else 0)
        if len(buf) != live:
            raise _mismatch(path, "live rows", live, len(buf))
        if buf.num_episodes != tally.episodes:
            raise _mismatch(path, "episodes", tally.episodes, buf.num_episodes)
        starts, lengths = buf.episodes()
        starts_np = starts.numpy().astype(np.int64)
        lengths_np = lengths.numpy().astype(np.int64)
    len_crc = zlib.crc32(lengths_np.tobytes())
    if len_crc != tally.len_crc:
        raise _mismatch(path, "episode lengths checksum", _hex(tally.len_crc), _hex(len_crc))
    expected_starts = np.concatenate([[0], np.cumsum(lengths_np)[:-1]]) if len(lengths_np) else lengths_np
    if not np.array_equal(starts_np, expected_starts):
        raise _mismatch(path, "episode starts", "contiguous from row 0", starts_np[:8].tolist())
