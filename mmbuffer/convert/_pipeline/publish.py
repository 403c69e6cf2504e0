"""Copies that cross a URL: publish a store to object storage, or fetch a published one.

The one place where a URL meets ``copy``: :func:`copy` sends a URL here and a pair of
local paths to :func:`~.copy.copy_local`; :mod:`mmbuffer.remote` only reads published
snapshots and uploads directories (``_snapshot``), and never calls back into convert.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ... import errors
from ..._disk.urls import filesystem, is_url
from ..._ledger.manifest import load_manifest
from ...opening import open as open_buffer
from ...remote import _group, _icechunk, _icegroup, _snapshot
from ...remote._objects import remote_errors
from ...schema import PriorityConfig
from .copy import copy_local
from .staged import staged_copy
from .staged import work_dir as work_dir_for

__all__ = ["copy", "copy_store", "copy_url", "publish"]

_SNAPSHOTS_KEPT = 3


def copy(
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
    writer: str | None = None,
) -> dict[str, Any]:
    """Copy a store into a new one with another encoding, size, streams or priorities.

    ``compression=None`` gives a raw memory-mapped store (for training),
    ``"zstd"`` / ``"lz4"`` a compressed archive. Columns, next keys and
    ``attrs`` are kept; by default capacity, streams and priority settings too,
    and then every lane's live episodes are written to the same lane, oldest
    first, then its open episode, so the copy samples the same data with the
    same probabilities (its rows start at row 0 of each lane; each row keeps its
    stored priority). Built at ``dst + ".partial"``, verified, then renamed.

    With another ``num_streams`` the episodes (lane by lane, oldest first) are
    dealt to the new streams in contiguous runs of about ``rows / num_streams``
    rows, each open episode last in its stream (:mod:`._lanes`); a store with
    more open episodes than new streams is refused. A ``capacity`` whose lanes
    cannot hold their episodes is refused before anything is written
    (:class:`~mmbuffer.errors.InvalidArgumentError` naming ``capacity``).

    From a store path (opened read-only) whose writer, in another process, reaches rows
    while they are copied, the copy is made again from the newer state (three tries in
    all), then refused (``RowNotLiveError`` naming the stream; nothing is left at ``dst``);
    from an open read-only ``Buffer``, at once: copy from the writer's own ``Buffer``.

    Parameters
    ----------
    src
        A store path or an open ``mb.Buffer``.
    dst
        The new store's path, or a URL (``s3://bucket/prefix/store``, any fsspec URL):
        the copy is published there as a new snapshot (:func:`publish`;
        ``compression=None`` means ``"zstd"`` there). ``src`` may be such a URL too.
    compression
        ``None``, ``"zstd"`` or ``"lz4"``.
    chunk_rows
        Rows per read and ``extend`` (default: about 32 MiB of rows).
    verify
        Read every written piece back and compare it; reopen the copy and
        compare its episodes.
    capacity, num_streams
        The copy's rows over all streams and its streams (default: the source's;
        with only ``num_streams`` given, the source's capacity rounded up to a
        multiple of it).
    priorities
        ``"keep"`` (default: the source's settings, stored priorities copied
        exactly), ``None`` (no priority tree) or an ``mb.PriorityConfig``: when
        it differs from the source's, every row starts at its largest priority
        (the stored values were computed with other settings).
    codec
        ``"keep"`` (default: each column keeps its ``mb.Column`` codec), ``None``
        (every column raw, memory-mapped: decoded once, for training) or a mapping
        such as ``{"pixels": "zstd:5"}`` changing the named columns (``None``: raw);
        an unknown column or codec is refused by name before anything is written.
    writer
        Only with a URL ``dst``: publish as this writer of the writer group at ``dst``
        (:func:`publish`).

    Returns
    -------
    dict
        Summary: ``rows``, ``episodes``, ``open_episode_rows``, ``checksums``
        (``"<lane>:<column>"`` -> CRC-32 of the source rows), ``verified``,
        ``seconds``, ``rows_per_s``, ``mb_per_s``.

    Examples
    --------
    >>> import tempfile, numpy as np, mmbuffer as mb
    >>> d = tempfile.mkdtemp()
    >>> with mb.create(d + "/raw", {"x": ((), "float32")}, capacity=8, next_keys=()) as buf:
    ...     buf.extend({"x": np.arange(5), "terminated": np.arange(5) == 2})
    >>> copy(d + "/raw", d + "/zst", compression="zstd", progress=False)["verified"]
    True
    >>> mb.open(d + "/zst", mode="r").get(np.arange(5))["x"].tolist()
    [0.0, 1.0, 2.0, 3.0, 4.0]
    """
    options: dict[str, Any] = dict(compression=compression, chunk_rows=chunk_rows, overwrite=overwrite, progress=progress,
                                   verify=verify, capacity=capacity, num_streams=num_streams, priorities=priorities,
                                   codec=codec)
    if writer is not None:
        if not is_url(dst):
            raise errors.InvalidArgumentError(f"writer: expected it only with a URL dst (a writer group), got dst={dst!r}")
        options["writer"] = writer
    if is_url(src) or is_url(dst):  # object storage: published / fetched here
        return copy_url(src, dst, **options)
    return copy_local(src, dst, **options)


def publish(src: Any, url: str, *, compression: str | None = "zstd", storage_options: Mapping[str, Any] | None = None,
            keep: int = _SNAPSHOTS_KEPT, tmp_dir: str | os.PathLike[str] | None = None, engine: str | None = None,
            writer: str | None = None, lease: float = 300.0, work_dir: str | os.PathLike[str] | bool | None = None,
            **copy_options: Any) -> dict[str, Any]:
    """Publish the store ``src`` (a path or an open ``Buffer``) at ``url`` as its next snapshot.

    The store is copied (``mb.convert.copy``, verified) with ``compression``, every row and episode slot where the source has it (also once
    its ring has wrapped: rows that stayed are the same chunks as in the last snapshot;
    with another ``capacity`` or ``num_streams`` the episodes start at row 0 of each
    lane). That copy is kept for the next publish of ``src`` to ``url`` in ``work_dir``
    (default ``cache_dir/publish/<key>``: ``$MMBUFFER_CACHE_DIR`` or ``~/.cache/mmbuffer``;
    about the store's compressed size on disk; removed by a later publish once unused for
    two weeks), which then appends only the rows written
    since (``summary["incremental"]``, ``"rows_copied"``; :mod:`.staged` says when it
    copies whole instead); ``work_dir=False`` copies into a temporary directory (under
    ``tmp_dir``) removed after the publish. The objects whose digest differs from the previous snapshot's
    are uploaded under ``url/snapshots/<id>/`` (the table names where the others are),
    and ``url/current.json`` is then replaced in one request; the ``keep`` newest
    snapshots stay. The raw arrays (index, flags, tree) go as chunks
    (``mmbuffer.remote._dense``). Returns the copy's summary with ``url``, ``snapshot``,
    ``sequence``, ``pruned``, ``objects_written``, ``bytes_written`` and
    ``lossy_shards_kept`` (JPEG shard files sent as the source holds them:
    :func:`keep_lossy_shards`).

    ``engine="icechunk"`` (``mmbuffer.remote._icechunk``) commits to an Icechunk
    repository instead: only the objects that changed since the last commit are
    written, the commit is atomic, and a concurrent second publisher gets
    ``LockedError``; once the branch holds ``2 * keep`` commits, those older than the
    ``keep`` newest are expired and the objects only they held deleted (``pruned``:
    their ids; in a writer group, objects younger than ``lease`` always stay). ``engine=None`` keeps what the URL holds (an Icechunk repository
    stays one), else ``"snapshots"``.

    ``writer="host-3"`` publishes as that writer of the *writer group* at ``url``
    (s3:// or file://): the store goes under ``url/writers/host-3/``, so writers on many
    hosts publish side by side and ``mb.open_group(url)`` samples their union
    (:class:`mmbuffer.groups.GroupBuffer`). With engine ``"snapshots"``
    (``mmbuffer.remote._group``) ``url/group.json`` is swapped by compare-and-swap; the
    summary adds ``group_sequence``. With ``"icechunk"`` (``mmbuffer.remote._icegroup``)
    the group is one Icechunk repository and each publish one commit, rebased over other
    writers' commits. A second publisher of the same name (another host, or another
    store) while this one's ``lease`` (seconds, renewed at each publish) runs, or one
    whose publish overlaps this one's, gets ``LockedError``; the summary adds ``writer``
    and ``epoch``. ``engine=None`` keeps what the URL holds, else ``"snapshots"``.
    """
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise errors.InvalidArgumentError(f"keep: expected an integer >= 1, got {keep!r}")
    if engine not in (None, "snapshots", "icechunk"):
        raise errors.InvalidArgumentError(f"engine: expected None, 'snapshots' or 'icechunk', got {engine!r}")
    fs, root = filesystem(url, storage_options)
    holder = ""
    if writer is not None:
        _group.check_writer(writer)
        holder = _group.holder_of(src)
        engine = "icechunk-group" if (engine or _held(fs, root, url, _group.GROUP, storage_options)) == "icechunk" \
            else "group"
    if engine is None:
        engine = _held(fs, root, url, _snapshot.POINTER, storage_options)
    work = None if work_dir is False else (
        work_dir_for(src, url, _snapshot.cache_base(None)) if work_dir is None or work_dir is True else Path(work_dir))
    with staged_copy(src, work, tmp_dir=tmp_dir, compression=compression, **copy_options) as staged:
        store, summary = staged.path, staged.summary
        summary["lossy_shards_kept"] = keep_lossy_shards(src, store, since=staged.since)
        generation = load_manifest(store).generation
        digests, memo = staged.digests(), staged.memo()
        if engine == "group":
            summary.update(_group.publish_writer(fs, root, url.rstrip("/"), store, writer=str(writer),
                                                 holder=holder, lease=lease, keep=keep, generation=generation,
                                                 digests=digests, memo=memo))
        elif engine == "icechunk-group":
            summary.update(_icegroup.publish_writer_repo(url.rstrip("/"), store, storage_options,
                                                         writer=str(writer), holder=holder, lease=lease,
                                                         generation=generation, keep=keep, digests=digests))
        elif engine == "icechunk":
            summary.update(_icechunk.publish_repo(url.rstrip("/"), store, storage_options,
                                                  generation=generation, keep=keep, digests=digests))
        else:
            summary.update(_snapshot.publish_dir(fs, root, url.rstrip("/"), store, keep=keep,
                                                 generation=generation, digests=digests, memo=memo))
        staged.keep()
    summary["out"] = url
    return summary


def _held(fs: Any, root: str, url: str, marker: str, storage_options: Mapping[str, Any] | None) -> str:
    """The engine of what ``url`` holds: ``"icechunk"`` for an Icechunk repository, else
    ``"snapshots"`` (``marker``, its pointer or ``group.json``, is there; or nothing is)."""
    if url.split("://", 1)[0] not in ("s3", "s3a", "file", "local"):
        return "snapshots"
    with remote_errors(url):  # requests with the caller's settings (Icechunk's own retries take seconds)
        if fs.exists(f"{root}/{marker}"):
            return "snapshots"
        fs.invalidate_cache(root)  # another process may have published since this process last listed it
        try:
            empty = not fs.ls(root)
        except FileNotFoundError:
            empty = True
    if empty or not _icechunk_installed():
        return "snapshots"
    return "icechunk" if _icechunk.is_repo(url.rstrip("/"), storage_options) else "snapshots"


def keep_lossy_shards(src: Any, dst: Path, since: int | None = None) -> int:
    """Put the source's own shard files of its lossy (JPEG) columns into the copy ``dst``
    where the copy holds every row where the source does (same geometry and cursors: a
    publish keeps the source's rows, ``copy_local(keep_rows=True)``), so a published frame
    is the local store's, not a re-encoding of its decode (JPEG loses a little at each
    encode). Each file is taken only if its header names the shard the copy's names;
    returns how many were taken (elsewhere the copy's re-encoded files stay: a publish
    with another ``capacity`` or ``num_streams`` is re-encoded). ``since``: only the copy's
    files written at or after that time (``time.time_ns()``; a copy appended to, whose
    older files were taken before).

    >>> import tempfile, numpy as np, mmbuffer as mb
    >>> d = tempfile.mkdtemp()
    >>> mb.create(d + "/s", {"x": ((), "int64")}, capacity=8, next_keys=()).close()
    >>> _ = mb.convert.copy(d + "/s", d + "/c", progress=False)
    >>> keep_lossy_shards(d + "/s", Path(d + "/c"))  # no JPEG column: nothing to keep
    0
    """
    from ..._disk import safe_io as _safe_io
    from ..._disk.columns.sharding import shard_header
    from ..._disk.format import parse_codec

    where = getattr(src, "path", src) if not is_url(getattr(src, "path", src)) else None
    if where is None or getattr(src, "remote", None) is not None:
        return 0
    try:
        before, after = load_manifest(Path(where)), load_manifest(dst)
    except errors.MMBufferError:
        return 0
    if (before.capacity, before.num_streams, tuple(before.lanes)) != (after.capacity, after.num_streams, tuple(after.lanes)):
        return 0
    taken = 0
    for name, codec in after.codecs.items():
        if before.codecs.get(name) != codec or parse_codec(name, codec)[0] != "jpeg":
            continue
        for mine in sorted((dst / "columns" / name / "c").rglob("*")):
            rel = mine.relative_to(dst).as_posix()
            if not mine.is_file() or not _safe_io.lexists(Path(where), rel):
                continue
            if since is not None and mine.stat().st_mtime_ns < since:
                continue
            fd = _safe_io.open_file(Path(where), rel)  # no link followed; one read: a live writer replaces files whole
            with os.fdopen(fd, "rb") as f:
                data = f.read()
            with open(mine, "rb") as f:
                head = f.read(16)
            if shard_header(data) is not None and shard_header(data) == shard_header(head):
                tmp = mine.with_name(mine.name + ".partial")
                tmp.write_bytes(data)
                os.replace(tmp, mine)
                taken += 1
    return taken


def copy_url(src: Any, dst: Any, *, storage_options: Mapping[str, Any] | None = None,
             cache_dir: str | os.PathLike[str] | None = None, **copy_options: Any) -> dict[str, Any]:
    """``mb.convert.copy`` when ``src`` or ``dst`` is a URL: publish to a URL, or copy a
    published store (read exactly, chunk by chunk) into a local store."""
    if is_url(src):
        buf = open_buffer(str(src), mode="r", cache_dir=cache_dir, storage_options=storage_options, pool=None)
        try:
            if is_url(dst):
                return copy_url(buf, dst, storage_options=storage_options, **copy_options)
            return copy_local(buf, dst, **copy_options)
        finally:
            buf.close()
    if copy_options.get("compression") is None:  # raw arrays are sparse files: never upload them dense
        copy_options["compression"] = "zstd"
    return publish(src, str(dst), storage_options=storage_options, **copy_options)


#: Alias that does not shadow the standard library's ``copy`` in ``from ... import *``.
copy_store = copy


def _icechunk_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("icechunk") is not None
