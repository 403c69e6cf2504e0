"""A mirror's done flags, fetched chunk by chunk when a read first needs them.

``terminated`` and ``truncated`` are a byte a row of capacity, published as zstd chunks
(:mod:`._dense`). Rebuilt whole at open they made a new reader's cold start grow with
the store (11.6 MB of the 13.8 MB mirror at 1e7 rows, 20 GB at 1e10). Instead the
mirror lays out their shard files at full length as holes, with the shard index at the
end (so the store code opens and checks them as ever), and a *present* file beside each
(``array/present``: a byte a chunk). :class:`Filler` is the ``fill`` of the
:class:`~mmbuffer._disk.columns.filled.FilledArray` a reader opens over them: under a
host-wide lock it fetches the missing chunks in one concurrent batch, checks each
against the snapshot's table, writes the pages that hold something, ``fdatasync``\\ s
the file, then marks the chunks present. Every process of the host maps the same
files, so each chunk is fetched once per host, and what a reader fetches before its
first sample grows with its batch, not the store.

A refresh links a mirror's unchanged flags (their files and present bytes shared by
inode); where some chunks changed, the new mirror's file gets the unchanged chunks the
old one holds, copied (:func:`lay_out`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .. import errors
from .._disk import format as fmt
from .._disk.columns.filled import FilledArray
from .._disk.columns.raw import RawArray
from ._cache import Cache, disk_errors
from ._dense import (
    Layout,
    Packed,
    chunk_rels,
    decode_chunk,
    held_bytes,
    layout_of,
    shard_rel,
    shard_tail,
)
from ._objects import FetchMany, Table

__all__ = ["FILLED", "PRESENT", "Filler", "laid_bytes", "lay_out", "open_filled"]

#: the packed arrays a mirror fills on demand
FILLED = frozenset({"columns/terminated", "columns/truncated"})
PRESENT = "present"
_PAGE = 4096
_BATCH = 64  # chunk objects per concurrent fetch


def _pages(data: np.ndarray) -> list[tuple[int, int]]:
    """The runs ``(start, stop)`` of ``data``'s 4 KiB pages that hold a nonzero byte."""
    n = -(-len(data) // _PAGE)
    padded = np.zeros(n * _PAGE, np.uint8)
    padded[: len(data)] = data
    held = np.flatnonzero(padded.reshape(n, _PAGE).any(axis=1))
    if not len(held):
        return []
    cut = np.flatnonzero(np.diff(held) > 1) + 1
    return [(int(run[0]) * _PAGE, min(len(data), (int(run[-1]) + 1) * _PAGE)) for run in np.split(held, cut)]


def _write_pages(fd: int, offset: int, data: np.ndarray, pages: list[tuple[int, int]]) -> None:
    """The ``pages`` of ``data`` (:func:`_pages`) written at ``offset``; the rest stays holes."""
    for a, b in pages:
        view, at = data[a:b].data, offset + a
        while view:
            n = os.pwrite(fd, view, at)
            view, at = view[n:], at + n


def lay_out(folder: Path, array: str, record: Packed, old: Path | None = None,
            kept: frozenset[str] = frozenset()) -> None:
    """Write ``array``'s shard in the mirror being built at ``folder``: holes, then the
    shard index, and its present file (all zero). ``old``: the mirror open now, whose
    chunks named in ``kept`` (unchanged since) are copied where it holds them."""
    layout = layout_of(array, record)
    shard = folder / shard_rel(array, record)
    shard.parent.mkdir(parents=True, exist_ok=True)
    present = np.zeros(layout.chunks, np.uint8)
    with open(shard, "wb") as out:
        out.truncate(layout.chunks * layout.chunk_bytes)
        out.seek(layout.chunks * layout.chunk_bytes)
        out.write(shard_tail(layout))
        if old is not None and kept:
            before = np.fromfile(old / array / PRESENT, np.uint8)
            held = np.flatnonzero(before[: layout.chunks]).tolist()
            with open(old / shard_rel(array, record), "rb") as src:
                for k in held:
                    if chunk_rels(array, k, len(layout.shape)) in kept:
                        data = np.frombuffer(os.pread(src.fileno(), layout.chunk_bytes, k * layout.chunk_bytes), np.uint8)
                        if len(data) == layout.chunk_bytes:
                            _write_pages(out.fileno(), k * layout.chunk_bytes, data, _pages(data))
                            present[k] = 1
            os.fdatasync(out.fileno())  # the copies durable before they are marked present
    present.tofile(folder / array / PRESENT)


def laid_bytes(array: str, record: Packed, kept: int) -> int:
    """At most the disk :func:`lay_out` takes with ``kept`` chunks copied: them, the shard
    index and the present file."""
    layout = layout_of(array, record)
    return held_bytes(array, record, kept) + layout.chunks


@dataclass(frozen=True)
class _Flag:
    """One filled array of a mirror: its layout, shard file and present bytes (mapped, shared)."""

    array: str
    layout: Layout
    shard: Path
    present_path: Path
    present: np.ndarray


class Filler:
    """``fill(chunks)`` of the flag arrays of the mirror ``folder`` of ``table``'s snapshot:
    a chunk of one is fetched with the same chunk of the others (a batch reads both flags),
    in one concurrent batch of requests."""

    def __init__(self, folder: Path, table: Table, fetch: FetchMany, cache: Cache) -> None:
        self.flags: dict[str, _Flag] = {}
        for array in sorted(FILLED & set(table.packed)):
            record, path = table.packed[array], folder / array / PRESENT
            layout = layout_of(array, record)
            size = path.stat().st_size if path.is_file() else None
            if size != layout.chunks:  # never read the holes as False
                raise errors.CorruptStoreError(f"{path}: expected the mirror's record of the {layout.chunks} chunks it "
                                               f"holds, got {size} bytes; remove this snapshot's folder from the cache")
            present = np.asarray(np.memmap(path, np.uint8, "r", shape=(layout.chunks,)))  # shared; no subclass cost
            self.flags[array] = _Flag(array, layout, folder / shard_rel(array, record), path, present)
        self.table, self.fetch, self.cache = table, fetch, cache
        self.lock = f"locks/{table.snapshot}.flags"

    def __call__(self, chunks: np.ndarray) -> None:
        with self.cache.locked(self.lock):  # one fetch per chunk per host: the others wait, then read
            todo = {f.array: [int(k) for k in chunks[f.present[chunks] == 0]] for f in self.flags.values()}
            rels = {(a, k): chunk_rels(a, k, len(self.flags[a].layout.shape)) for a, ks in todo.items() for k in ks}
            if not rels:
                return
            self.table.need(rels.values())  # their parts, at once
            named = [r for r in rels.values() if self.table.get(r) is not None]  # the others are zeros: never published
            got: dict[str, bytes | None] = {}
            for at in range(0, len(named), _BATCH):
                got.update(self.fetch(named[at:at + _BATCH], probe=at == 0))
            decoded: list[tuple[_Flag, int, np.ndarray, list[tuple[int, int]]]] = []
            for (array, k), rel in rels.items():
                if self.table.get(rel) is None:
                    continue
                blob = got.get(rel)
                if blob is None:
                    raise self.table.missing(rel)
                self.table.check(rel, blob)
                self.cache.mirror_bytes += len(blob)
                flag = self.flags[array]
                data = decode_chunk(rel, blob, flag.layout, np.empty(flag.layout.chunk_bytes, np.uint8))
                decoded.append((flag, k, data, _pages(data)))
            need = sum(b - a for *_, pages in decoded for a, b in pages)
            self.cache.admit(need, lambda: self._write(todo, decoded, need))

    def _write(self, todo: dict[str, list[int]], decoded: list[tuple[_Flag, int, np.ndarray, list[tuple[int, int]]]],
               need: int) -> None:
        """The chunks' bytes made durable, then marked present (a crash between leaves them
        absent; a mark lost in a crash only costs a fetch again, so the marks are not synced)."""
        with disk_errors(self.cache.base, need):
            for flag in self.flags.values():
                mine = [(k, data, pages) for f, k, data, pages in decoded if f is flag and pages]
                if mine:  # a chunk of zeros (a flag never set) writes nothing: nothing to sync
                    fd = os.open(flag.shard, os.O_WRONLY | os.O_CLOEXEC)
                    try:
                        for k, data, pages in mine:
                            _write_pages(fd, k * flag.layout.chunk_bytes, data, pages)
                        os.fdatasync(fd)
                    finally:
                        os.close(fd)
            for array, ks in todo.items():
                if ks:
                    fd = os.open(self.flags[array].present_path, os.O_WRONLY | os.O_CLOEXEC)
                    try:
                        for k in ks:
                            os.pwrite(fd, b"\x01", k)
                    finally:
                        os.close(fd)


def open_filled(folder: Path, array: str, expect: fmt.Expect, filler: Filler) -> FilledArray | None:
    """The flag ``array`` of the mirror ``folder``, filled on demand by ``filler``; None where
    the mirror holds it whole (a snapshot that sent it as one object, not as chunks)."""
    flag = filler.flags.get(array)
    if flag is None:
        return None
    raw = RawArray.open(folder, array, writable=False, expect=expect)
    return FilledArray(raw, flag.present, flag.layout.inner, filler)
