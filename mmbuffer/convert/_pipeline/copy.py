"""Re-encode a store: raw memory-mapped <-> zstd/lz4 archive.

:func:`copy` keeps the geometry (capacity, streams, priority settings), the
``attrs``, every lane's open episode and each column's codec (``mb.Column(...,
codec=...)``), and changes the encoding (``compression`` for the columns without a
codec; ``codec`` changes or drops the codec of named columns, or of all). It
walks the source like the exporters (:mod:`._walk`: lane by lane, live complete
episodes oldest first, then the open episode) and is written by a
:class:`CopyWriter` in the frame of :mod:`._frame`, and verifies like the
converters (:mod:`._readback`): every written piece is read back from the new
store's files and compared byte for byte, and the reopened copy must hold the
same episodes. The stored priorities of a prioritized store are
copied exactly (:meth:`~mmbuffer.Buffer.set_leaf_priorities`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..._disk.checks import check_column_codec
from ...buffer import Buffer
from ...errors import InvalidArgumentError, RowNotLiveError
from ..._ledger.create import create_store
from ..._ledger.index import Lane
from ...opening import open as open_buffer
from ...schema import Column, PriorityConfig
from .frame import SEGMENT_BYTES, Writer, crc_hex, crc_update, mismatch, progress_bar, same_bytes, write_and_verify
from .lanes import check_layout, deal, lane_rows_fit, runs
from .readback import ReadBack
from .reader import FLAGS, jsonable
from .walk import OpenedStore, Plan, chunk_rows_for, data_columns, plan_episodes, row_bytes, walk

__all__ = ["CopyWriter", "column_codecs", "copy_local", "verify_episodes", "writer_options"]

_TRIES = 3  # copies of a store path whose writer laps the rows being read (each from a newer state)


def copy_local(
    src: Any,
    dst: str | os.PathLike[str],
    *,
    compression: str | None = None,
    chunk_rows: int | None = None,
    overwrite: bool = False,
    progress: bool = True,
    verify: bool = True,
    capacity: int | None = None,
    num_streams: int | None = None,
    priorities: PriorityConfig | None | str = "keep",
    codec: Mapping[str, str | None] | None | str = "keep",
    keep_rows: bool = False,
) -> dict[str, Any]:
    """:func:`mmbuffer.convert.copy` between two local paths (or from an open ``Buffer``).

    ``keep_rows``: where the copy's capacity and streams are the source's, every row and
    episode slot stays where it is in the source (each lane begins at the source's oldest
    live episode, not at row 0), so a copy of a ring that moved on differs from the last
    copy only where rows were written since: what a publish sends (``publish.py``).

    ``codec``: ``"keep"`` (each column keeps its codec), ``None`` (every column raw,
    memory-mapped: decoded once for training) or a mapping column -> codec (``None``
    for raw) changing the named columns, the others kept (:func:`column_codecs`).

    A store path whose writer (another process) reached rows while they were read
    (``RowNotLiveError``, :meth:`CopyWriter._check_intact`) is copied again from its
    newer state, up to ``_TRIES`` times in all.
    """
    t0 = time.perf_counter()
    options = writer_options(compression=compression, chunk_rows=chunk_rows, progress=progress, verify=verify,
                             capacity=capacity, num_streams=num_streams, priorities=priorities, codec=codec)
    for attempt in range(1, _TRIES + 1):
        writer = CopyWriter(src, keep_rows=keep_rows, **options)
        try:
            dst_path = _write_to(writer, dst, overwrite=overwrite, verify=verify)
            break
        except RowNotLiveError:
            if attempt == _TRIES or not isinstance(src, (str, os.PathLike)):
                raise  # an open Buffer keeps the state it has: copying again would meet the same
    summary = writer.summary
    summary["out"] = str(dst_path)
    summary["verified"] = verify
    plan = writer.plan
    seconds = time.perf_counter() - t0
    summary.update(
        seconds=round(seconds, 3),
        rows_per_s=round(plan.rows / seconds, 1) if seconds else None,
        mb_per_s=round(writer.nbytes / seconds / 1e6, 1) if seconds else None,
    )
    return summary


def writer_options(*, compression: str | None = None, chunk_rows: int | None = None, progress: bool = True,
                   verify: bool = True, capacity: int | None = None, num_streams: int | None = None,
                   priorities: PriorityConfig | None | str = "keep", codec: Mapping[str, str | None] | None | str = "keep",
                   overwrite: bool = False) -> dict[str, Any]:
    """The :class:`CopyWriter` options of :func:`copy_local` called with these arguments
    (``overwrite`` is where the copy goes, not how it is written)."""
    return {"compression": compression, "chunk_rows": chunk_rows, "progress": progress, "verify": verify, "codec": codec,
            "layout": {"capacity": capacity, "num_streams": num_streams, "priorities": priorities}}


def _write_to(writer: CopyWriter, dst: str | os.PathLike[str], *, overwrite: bool, verify: bool) -> Path:
    """Where a local copy goes (a URL destination is published by ``publish.copy``
    before this is reached)."""
    return write_and_verify(writer, dst, overwrite=overwrite, verify=verify)


class CopyWriter(Writer):
    """Writes a store's episodes into a new store (the :func:`copy` steps)."""

    def __init__(self, src: Any, *, compression: str | None, chunk_rows: int | None, progress: bool,
                 verify: bool, layout: dict[str, Any] | None = None,
                 codec: Mapping[str, str | None] | None | str = "keep", keep_rows: bool = False) -> None:
        super().__init__()
        self.keep_rows = keep_rows
        self.starts: list[Lane] | None = None
        self.view: Any = None  # the source's state the plan was made from
        self.layout_options = dict(layout or {})
        self.codec_option = codec
        self.codecs: dict[str, str | None] = {}
        self.src = src
        self.opened = OpenedStore(src)
        self.compression = compression
        self.chunk_rows = chunk_rows
        self.progress = progress
        self.readback = verify
        self.out: Buffer | None = None
        self.summary: dict[str, Any] = {}

    def open(self) -> None:
        buf = self.buf = self.opened.open()
        self.rows_per = min(chunk_rows_for(buf, self.chunk_rows), int(buf.lane_size))
        self.codecs = column_codecs(buf, self.codec_option)  # refused here: nothing written yet
        self.plan, _ = plan_episodes(buf, "all")
        plan, opts = self.plan, self.layout_options
        src_priorities = getattr(buf, "priorities", None)
        priorities = opts.get("priorities", "keep")
        if isinstance(priorities, str):
            if priorities != "keep":
                raise InvalidArgumentError(
                    f"priorities: expected 'keep', None or mb.PriorityConfig, got {priorities!r}")
            priorities = src_priorities
        src_streams = int(buf.num_streams)
        streams = opts.get("num_streams")
        same_lanes = streams is None or streams == src_streams
        self.layout = check_layout(
            plan.rows, capacity=opts.get("capacity"), num_streams=streams, priorities=priorities,
            default_capacity=int(buf.capacity), default_streams=src_streams)
        # each episode's lane in the copy: its own, or dealt out anew (_lanes)
        self.lanes = plan.lanes if same_lanes else deal(plan.lengths, plan.complete, self.layout.num_streams)
        lane_rows_fit(self.lanes, plan.lengths, self.layout)
        self.copy_leaves = src_priorities is not None and priorities == src_priorities
        self.view = buf.view()
        if self.keep_rows and same_lanes and self.layout.capacity == int(buf.capacity):
            self._keep_rows(self.view)

    def _keep_rows(self, view: Any) -> None:
        """Begin each lane where the source's oldest planned episode is (its row and its
        episode number), where ``view`` is the state the plan was made from (a writer in
        another process may have moved on since: then the copy starts at row 0)."""
        starts = [Lane(lv.first_start, lv.ep_head, lv.ep_head, lv.first_start) for lv in view.lanes]
        lanes, first = np.unique(self.plan.lanes, return_index=True)  # each lane's first planned episode
        if not np.array_equal(self.plan.starts[first], self.buf.layout.rows(lanes, view.first_starts[lanes])):
            return
        self.starts = starts
        self.layout.starts[:] = view.first_starts

    def _runs(self, episode: np.ndarray) -> Iterator[tuple[int, int, int, int]]:
        """``(lane, a, b, first row)`` of each run of a piece's rows ``[a, b)`` that goes to
        one lane of the copy in one contiguous run of rows (split where a ring ends)."""
        for lane, a, b in runs(self.lanes[episode]):
            for row, n in self.layout.take(lane, b - a, "the source's episodes"):
                yield lane, a, a + n, row
                a += n

    def write(self, partial: Path) -> None:
        buf, plan, rows_per = self.buf, self.plan, self.rows_per
        cols = data_columns(buf)
        keys = [*cols, *FLAGS]
        crc: dict[str, int] = {}
        columns: dict[str, Any] = {k: Column(tuple(buf.columns[k].shape), buf.columns[k].dtype, self.codecs[k])
                                   for k in cols}
        out = self.out = self.target(partial, columns)
        readback = ReadBack(partial) if self.readback else None
        segment = max(rows_per, SEGMENT_BYTES // max(1, row_bytes(buf)))
        since = 0
        at = self._first_rows()  # per lane, the absolute row of the next piece
        with progress_bar(plan.rows, "copy", self.progress) as bar:
            for piece in walk(buf, plan, keys, rows_per, release=self.opened.owned):
                self._check_intact(piece.lane, int(at[piece.lane]))
                at[piece.lane] += len(piece.rows)
                for name in keys:
                    crc_update(crc, f"{piece.lane}:{name}", piece.data[name])
                ended = np.cumsum(piece.last) - piece.last  # complete episodes ended before each row
                for lane, a, b, row in self._runs(piece.episode):
                    data = {k: v[a:b] for k, v in piece.data.items()}
                    e0, e1 = int(ended[a]), int(ended[b - 1] + piece.last[b - 1])
                    final = {k: v[e0:e1] for k, v in piece.final.items()}
                    n = b - a
                    out.extend(data, stream=lane, final_obs=final or None)
                    if self.copy_leaves:  # the stored priorities, exactly
                        leaves, rows = buf.leaf_priorities(piece.rows[a:b]), np.arange(row, row + n)
                        out.set_leaf_priorities(rows, leaves)
                        if readback is not None and not same_bytes(out.leaf_priorities(rows), leaves):
                            raise mismatch(partial, f"priorities of rows [{row}, {row + n})", "the source's", "others")
                    if readback is not None:
                        readback.check(out, row, data, final)
                bar.update(len(piece.rows))
                since += len(piece.rows)
                if since >= segment:  # unmap what was written through the maps (flat memory)
                    out.release_memory()
                    since = 0
        self.settle(out)
        out.commit()
        out.close()
        self.out = None
        self.summary = {
            "format": "copy",
            "store": str(getattr(buf, "path", self.src)),
            "out": "",
            "compression": self.compression,
            "codecs": {k: c for k, c in self.codecs.items() if c is not None},
            "rows": plan.rows,
            "episodes": int(plan.complete.sum()),
            "open_episode_rows": int(plan.lengths[~plan.complete].sum()),
            "checksums": {k: crc_hex(v) for k, v in crc.items()},
            "verified": False,
        }
        self.nbytes = row_bytes(buf) * plan.rows

    def _first_rows(self) -> np.ndarray:
        """Per lane, the absolute row of the plan's first row there (lanes without rows to
        copy: their cursor)."""
        written = np.array(self.view.written, dtype=np.int64)
        lanes, first = np.unique(self.plan.lanes, return_index=True)
        written[lanes] = self.buf.layout.absolute(self.plan.starts[first], written)
        return written

    def _check_intact(self, lane: int, first: int) -> None:
        """After a piece of ``lane`` from absolute row ``first`` on was read from a store
        opened read-only: refuse it if the store's writer (another process) has reserved
        its rows meanwhile (they may have been rewritten while read; ``writer.py``)."""
        buf = self.buf
        if buf.mode != "r":
            return
        reserved = int(buf.reservation()[lane])
        if reserved - int(buf.lane_size) > first:
            raise RowNotLiveError(
                f"{getattr(buf, 'path', self.src)}: stream {lane}: expected the rows from {first} on to stay while they "
                f"were copied, got the writer's reservation at {reserved} (it rewrites rows below "
                f"{reserved - int(buf.lane_size)}); nothing was kept: copy again, or from the writer's own Buffer")

    def target(self, partial: Path, columns: dict[str, Any]) -> Buffer:
        """The store the rows go to: a new one at ``partial``, open for writing."""
        layout, buf = self.layout, self.buf
        create_store(str(partial), columns, layout.capacity, num_streams=layout.num_streams,
                     compression=self.compression, priorities=layout.priorities, next_keys=tuple(buf.next_keys),
                     attrs=jsonable(dict(buf.attrs)), starts=self.starts)
        return Buffer(partial, "a")

    def settle(self, out: Buffer) -> None:
        """After the last row, before the commit (:mod:`._staged` copies the priorities here)."""

    def abort(self) -> None:
        if self.out is not None:
            self.out.close()

    def close(self) -> None:
        self.opened.close()

    def verify(self, partial: Path) -> None:
        verify_episodes(partial, self.plan, self.lanes)


def column_codecs(buf: Any, codec: Mapping[str, str | None] | None | str) -> dict[str, str | None]:
    """Each column's codec in the copy of ``buf``: ``"keep"`` the source's, ``None``
    none (raw), or a mapping that changes the named columns (``None``: raw) and keeps
    the others. An unknown column or codec is refused by name.

    >>> import tempfile, mmbuffer as mb
    >>> buf = mb.create(tempfile.mkdtemp() + "/s", {"px": mb.Column((4,), "uint8", codec="zstd"),
    ...                 "a": ((), "int64")}, capacity=8, next_keys=())
    >>> column_codecs(buf, "keep"), column_codecs(buf, None), column_codecs(buf, {"a": "lz4"})
    ({'a': None, 'px': 'zstd'}, {'a': None, 'px': None}, {'a': 'lz4', 'px': 'zstd'})
    >>> buf.close()
    """
    kept: dict[str, str | None] = {k: buf.columns[k].codec for k in data_columns(buf)}
    if codec is None:
        return dict.fromkeys(kept)
    if isinstance(codec, str):
        if codec != "keep":
            raise InvalidArgumentError(f"codec: expected 'keep', None or a mapping column -> codec, got {codec!r}")
        return kept
    if not isinstance(codec, Mapping):
        raise InvalidArgumentError(f"codec: expected 'keep', None or a mapping column -> codec, got {codec!r}")
    for name, value in codec.items():
        if name not in kept:
            raise InvalidArgumentError(f"codec: expected column names among {sorted(kept)}, got {name!r}")
        if value is not None:
            check_column_codec(name, value, buf.columns[name].shape, buf.columns[name].dtype)  # SchemaError naming it
    return {**kept, **codec}


def verify_episodes(path: Path, plan: Plan, lanes: np.ndarray) -> None:
    """The reopened copy holds the plan's episodes, stream by stream, in order."""
    with open_buffer(str(path), mode="r") as new:
        got, _ = plan_episodes(new, "all")
    if got.rows != plan.rows:
        raise mismatch(path, "rows", plan.rows, got.rows)
    if int(got.complete.sum()) != int(plan.complete.sum()):
        raise mismatch(path, "episodes", int(plan.complete.sum()), int(got.complete.sum()))
    order = np.argsort(lanes, kind="stable")  # the plan's episodes in the copy's order
    if not (np.array_equal(got.lengths, plan.lengths[order]) and np.array_equal(got.lanes, lanes[order])):
        raise mismatch(path, "episode lengths by stream", plan.lengths[order][:8].tolist(), got.lengths[:8].tolist())

