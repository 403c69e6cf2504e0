"""The one store writer of the converters: :func:`write_store` writes any reader into a new store.

A converter is two separate things:

* a **reader** (:class:`Reader`, one per source format; the contract is in
  :mod:`._reader`) that yields the source in order as chunks ``(steps, final_obs)``;
* :func:`write_store` (this module), which writes any reader into a new store,
  shows a progress bar, checks what it wrote against what it read and returns a
  summary. It is a :class:`._frame.Writer` run by :func:`._frame.write_and_verify`.

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
import os
import time
import zlib
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ..._feed.threads import Producer
from ...buffer import Buffer
from ...opening import create
from ...schema import PriorityConfig
from .frame import SEGMENT_BYTES, Writer, as_bytes, crc_hex, mismatch, progress_bar, write_and_verify
from .lanes import balanced, check_layout, runs
from .readback import ReadBack
from .reader import FLAGS, Chunk, Reader, Schema, default_chunk_rows, jsonable, reader_error

__all__ = ["DROP_BEHIND_CHUNKS", "write_store"]

#: A converter drops a chunk from the page cache this many chunks after writing it
#: (by then the kernel has written it back; pages still dirty are never dropped).
DROP_BEHIND_CHUNKS = 3


class _Tally:
    """Running CRC-32 per column, of final observations and of episode lengths."""

    def __init__(self, schema: Schema) -> None:
        self.crc: dict[str, int] = {k: 0 for k in (*schema.columns, *FLAGS)}
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


def _check_chunk(reader: Reader, schema: Schema, chunk: Chunk, done: np.ndarray) -> None:
    steps, final = chunk
    n = len(done)
    for name in (*schema.columns, *FLAGS):
        if name not in steps:
            raise reader_error(reader, f"reader produced no column {name!r}", name)
        arr = steps[name]
        shape = schema.columns[name][0] if name in schema.columns else ()
        if arr.shape != (n, *shape):
            raise reader_error(
                reader,
                f"column {name!r}: expected rows of shape {(n, *shape)}, got {arr.shape}", name
            )
    extra = set(steps) - set(schema.columns) - set(FLAGS)
    if extra:
        raise reader_error(reader, f"reader produced undeclared columns {sorted(extra)}")
    n_ends = int(done.sum())
    for name in schema.next_keys:
        got = final.get(name)
        shape = schema.columns[name][0]
        if n_ends == 0 and got is None:
            continue
        if got is None or got.shape != (n_ends, *shape):
            raise reader_error(
                reader,
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
    capacity: int | None = None,
    num_streams: int | None = None,
    priorities: PriorityConfig | None = None,
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
    capacity, num_streams, priorities
        The new store's geometry, as for :func:`mmbuffer._ledger.create` (defaults: the
        source's rows, one stream, no priorities): room to grow, one lane per
        environment of an online collector, a priority tree usable at once (rows
        start at the largest priority, as fresh rows do). Episodes are dealt to
        the streams in contiguous runs of about ``rows / num_streams`` rows
        (:mod:`._lanes`); a capacity smaller than the source is refused before
        anything is written, one whose lanes cannot hold their run as soon as
        that is seen (nothing is left behind).

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
    InvalidArgumentError
        ``capacity`` smaller than the source (or than a stream's share of it),
        not a multiple of ``num_streams``; ``priorities`` not a ``PriorityConfig``.
    """
    t0 = time.perf_counter()
    writer = StoreWriter(reader, compression=compression, chunk_rows=chunk_rows, progress=progress,
                         verify=verify, layout=dict(capacity=capacity, num_streams=num_streams,
                                                    priorities=priorities))
    dst_path = write_and_verify(writer, dst, overwrite=overwrite, verify=verify)
    summary = writer.summary(dst_path, verified=verify)
    seconds = time.perf_counter() - t0
    nbytes = writer.schema.row_bytes() * writer.tally.rows
    summary.update(
        seconds=round(seconds, 3),
        write_seconds=round(writer.t_write - t0, 3),
        rows_per_s=round(writer.tally.rows / seconds, 1) if seconds else None,
        mb_per_s=round(nbytes / seconds / 1e6, 1) if seconds else None,
        bytes=nbytes,
    )
    return summary


class StoreWriter(Writer):
    """Write a :class:`Reader`'s chunks into a new store (the :func:`write_store` steps)."""

    def __init__(self, reader: Reader, *, compression: str | None, chunk_rows: int | None,
                 progress: bool, verify: bool, layout: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.layout_options = dict(layout or {})
        self.reader = reader
        self.compression = compression
        self.chunk_rows = chunk_rows
        self.progress = progress
        self.readback = verify
        self.out: Buffer | None = None
        self.t_write = 0.0

    def open(self) -> None:
        self.schema = self.reader.schema
        if self.schema.num_rows < 1:
            raise reader_error(self.reader, "the source holds no rows")
        self.rows_per_chunk = default_chunk_rows(self.schema, self.chunk_rows)
        self.tally = _Tally(self.schema)
        opts = self.layout_options
        self.layout = check_layout(self.schema.num_rows, capacity=opts.get("capacity"),
                                   num_streams=opts.get("num_streams"), priorities=opts.get("priorities"))

    def write(self, partial: Path) -> None:
        reader, schema, tally = self.reader, self.schema, self.tally
        attrs = dict(schema.attrs)
        segment_rows = max(self.rows_per_chunk, SEGMENT_BYTES // max(1, schema.row_bytes()))
        layout = self.layout
        buf = self.out = create(
            str(partial),
            columns={k: schema.specs.get(k, (tuple(s), str(d))) for k, (s, d) in schema.columns.items()},
            capacity=layout.capacity,
            num_streams=layout.num_streams,
            compression=self.compression,
            priorities=layout.priorities,
            next_keys=tuple(schema.next_keys),
            attrs=jsonable(attrs),
        )
        since_release = 0
        readback = ReadBack(partial) if self.readback else None
        behind: deque[list[tuple[int, int]]] = deque(maxlen=DROP_BEHIND_CHUNKS)  # row ranges of the last chunks
        source = _prepared(reader, schema, tally, self.rows_per_chunk)
        dealer = _Dealer(schema.num_rows, layout.num_streams)
        with progress_bar(schema.num_rows, f"convert {reader.format}", self.progress) as bar, \
                Producer(source, depth=2, name="mmbuffer-convert-read") as chunks:
            for steps, final, n in chunks:
                ranges = []
                for lane, piece, piece_final in dealer.split(steps, final):
                    m = len(piece["terminated"])
                    [(row, _)] = layout.take(lane, m, f"the source's rows from {dealer.done_rows - m}")  # lanes from 0
                    buf.extend(piece, stream=lane, final_obs=(piece_final if schema.next_keys else None))
                    if readback is not None:
                        readback.check(buf, row, piece, piece_final)
                    ranges.append((row, row + m))
                # write behind: start writing this chunk to disk, and drop the
                # earlier ones, written by now, from the page cache (2-3x faster
                # on the dev VM, where fresh page-cache pages are slow to get)
                behind.append(ranges)
                for start, stop in (r for chunk_ranges in behind for r in chunk_ranges):
                    buf.drop_cache(start, stop)
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
                raise reader_error(reader, f"the source declared {schema.num_rows} rows but yielded {tally.rows}")
            if schema.num_episodes is not None and schema.num_episodes != tally.episodes:
                raise reader_error(
                    reader,
                    f"the source declares {schema.num_episodes} episodes but {tally.episodes} "
                    "end with a terminated or truncated flag",
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
                "checksums": {k: crc_hex(v) for k, v in tally.crc.items()},
                "final_obs_checksums": {k: crc_hex(v) for k, v in tally.final_crc.items()},
                "notes": list(reader.notes),
                "stats": dict(reader.stats),  # what the reader counted, dropped or changed, as asked
            }
        _set_attrs(buf, attrs)
        buf.commit()
        buf.close()
        self.out = None

    def abort(self) -> None:
        if self.out is not None:
            self.out.close()

    def close(self) -> None:
        self.reader.close()
        self.t_write = time.perf_counter()

    def verify(self, partial: Path) -> None:
        verify_store(partial, self.tally, self.schema)

    def summary(self, dst: Path, *, verified: bool) -> dict[str, Any]:
        """The summary dict of :func:`write_store` (without the timings)."""
        reader, tally, schema = self.reader, self.tally, self.schema
        return {
            "format": reader.format,
            "source": str(reader.path),
            "store": str(dst),
            "rows": tally.rows,
            "episodes": tally.episodes,
            "open_episode_rows": tally.open_rows,
            "nan_rewards": tally.nan_rewards,
            "columns": {k: [list(s), str(d)] for k, (s, d) in schema.columns.items()},
            "checksums": {k: crc_hex(v) for k, v in tally.crc.items()},
            "final_obs_checksums": {k: crc_hex(v) for k, v in tally.final_crc.items()},
            "verified": verified,
            **{k: v for k, v in reader.stats.items()},
            "warnings": list(reader.notes),
        }


class _Dealer:
    """Splits the source's chunks into per-stream pieces by the rule of :mod:`._lanes`.

    An episode goes to stream ``min(S - 1, first_row * S // N)``; the stream of
    a row is that of the episode it belongs to, so a chunk splits into at most
    ``S`` contiguous pieces (no loop over rows or episodes).
    """

    def __init__(self, total: int, num_streams: int) -> None:
        self.total, self.num_streams = total, num_streams
        self.episode_start = 0  # source row where the current episode began
        self.done_rows = 0

    def split(
        self, steps: dict[str, np.ndarray], final: dict[str, np.ndarray]
    ) -> Iterator[tuple[int, dict[str, np.ndarray], dict[str, np.ndarray]]]:
        n = len(steps["terminated"])
        a0 = self.done_rows
        self.done_rows += n
        if self.num_streams == 1:
            yield 0, steps, final
            return
        done = steps["terminated"] | steps["truncated"]
        begins = np.zeros(n, bool)
        begins[1:] = done[:-1]
        first = np.where(begins, a0 + np.arange(n, dtype=np.int64), -1)
        first[0] = self.episode_start
        first = np.maximum.accumulate(first)  # the first source row of each row's episode
        ends = np.flatnonzero(done)
        if len(ends):
            self.episode_start = a0 + int(ends[-1]) + 1
        lanes = balanced(first, self.total, self.num_streams)
        ended = np.cumsum(done) - done  # episodes ended before each row
        for lane, a, b in runs(lanes):
            e0, e1 = int(ended[a]), int(ended[b - 1] + done[b - 1])
            yield lane, {k: v[a:b] for k, v in steps.items()}, {k: v[e0:e1] for k, v in final.items()}


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
            raise reader_error(reader, f"the source yielded more rows than the {schema.num_rows} it declared")
        for name, arr in steps.items():
            tally.add_rows(name, arr)
        for name, arr in final.items():
            tally.add_final(name, arr)
        tally.add_flags(done)
        reward = steps.get("reward")
        if reward is not None and reward.dtype.kind == "f":
            tally.nan_rewards += int(np.isnan(reward).sum())
        yield steps, final, n


def _native(schema: Schema, name: str) -> np.dtype:
    if name in FLAGS:
        return np.dtype(np.bool_)
    return np.dtype(schema.columns[name][1]).newbyteorder("=")


def _set_attrs(buf: Any, attrs: dict[str, Any]) -> None:
    clean = jsonable(attrs)
    json.dumps(clean)  # fail here, not at commit
    target = buf.attrs
    target.update(clean)



def verify_store(path: Path, tally: _Tally, schema: Schema) -> None:
    """Reopen the store at ``path`` read-only and compare its episodes with ``tally``."""
    with Buffer(path, mode="r") as buf:
        # the last row of an open episode has no next observation yet, so a store
        # with next-derived columns does not count it as live (store.py)
        live = tally.rows - (1 if tally.open_rows and schema.next_keys else 0)
        if len(buf) != live:
            raise mismatch(path, "live rows", live, len(buf))
        if buf.num_episodes != tally.episodes:
            raise mismatch(path, "episodes", tally.episodes, buf.num_episodes)
        starts, lengths = buf.episodes()
        lane_size = int(buf.lane_size)
        starts_np = starts.numpy().astype(np.int64)
        lengths_np = lengths.numpy().astype(np.int64)
    # streams are filled in source order, so episodes sorted by row are in source order
    order = np.argsort(starts_np, kind="stable")
    starts_np, lengths_np = starts_np[order], lengths_np[order]
    len_crc = zlib.crc32(lengths_np.tobytes())
    if len_crc != tally.len_crc:
        raise mismatch(path, "episode lengths checksum", crc_hex(tally.len_crc), crc_hex(len_crc))
    # each stream's episodes are contiguous from the first row of its lane
    lane_size = max(1, lane_size)
    lanes = starts_np // lane_size
    first = np.ones(len(lanes), bool)
    first[1:] = lanes[1:] != lanes[:-1]
    expected = np.where(first, lanes * lane_size, np.concatenate([[0], (starts_np + lengths_np)[:-1]])[: len(lanes)])
    if not np.array_equal(starts_np, expected):
        raise mismatch(path, "episode starts", "contiguous from the first row of each stream", starts_np[:8].tolist())
