"""Published stores on object storage: immutable snapshots behind one pointer object.

Layout under the URL (a Zarr v3 group)::

    URL/zarr.json                 group metadata
    URL/current.json              {"format": "mmbuffer-remote", "version": 3, "snapshot": ID, ...}
    URL/snapshots/ID/...          the objects this snapshot sent, never modified once written
    URL/snapshots/ID/objects.json its object table: size and digest of every object of the
                                  store, and for an object sent before, the snapshot holding it
                                  (the pointer holds the table's digest: ``_objects.py``); the
                                  chunks' entries in parts, named with their digests
    URL/snapshots/ID/parts/...    the parts this snapshot sent (``_parts.py``)

Publishing uploads the objects whose digest differs from the previous snapshot's (the
raw arrays as chunks, ``_dense.py``), the table naming where the others are (only its
parts that changed: ``_parts.py``), the manifest last, then replaces ``current.json``
with one PUT (atomic on S3, GCS, Azure): a reader sees the old snapshot or the new one,
never a half-written store. The first
snapshot holds every object: zarr-python, xarray or tensorstore read it directly;
later ones are whole through their table (or publish with ``engine="icechunk"``, whose
store zarr reads at every commit). A pointer of version 2 (every snapshot complete,
dense raw arrays: mmbuffer before 2026-11-25) is still read, and a publish on top of it
names its objects instead of sending them again. One publisher per URL at a time (nothing arbitrates two here;
``engine="icechunk"``, ``_icechunk.py``, refuses the second). A reader pins the snapshot it opened; ``refresh()`` moves to
the newest. Publishing keeps the ``keep`` newest snapshots and drops older ones it
wrote (their ``manifest.json`` first: a reader that finds it gone after a read knows
its data may be missing and raises instead of returning zeros, see ``check_alive``),
then deletes every object of theirs that no kept snapshot names.

The small parts of a snapshot (manifest, episode index, priority tree, final
observations; everything but the columns' chunks) are fetched whole into a local
*mirror* directory under ``cache_dir`` and opened by the ordinary store code, with all
its checks. The done flags (``terminated``/``truncated``, a byte a row) are laid out
there as holes and fetched chunk by chunk when a read first needs them (``_filled.py``),
so what a new reader fetches before its first sample does not grow with the rows.
Snapshots are immutable, so a mirror is reused by every process on the machine
(DataLoader workers, ranks).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from .. import errors
from .._disk import format as fmt
from .._disk.files import fsync_dir, fsync_tree, parse_json
from .._disk.urls import join
from ._cache import Cache, disk_bytes, write_file
from ._dense import held_bytes, rebuild, shard_rel
from ._filled import FILLED, PRESENT, laid_bytes, lay_out
from ._objects import (
    OBJECTS,
    FetchMany,
    Table,
    digest,
    parse_table,
    remote_errors,
    store_objects,
)
from ._parts import fetcher, load_parts, load_table, part_key, part_rel, remember, split

__all__ = ["POINTER", "cache_base", "cache_root", "check_alive", "check_pointer", "fetch_objects", "mirror", "object_fetch",
           "prune", "publish_dir", "read_later", "read_pointer", "upload_snapshot"]

POINTER = "current.json"
_MIRROR_LAYOUT = "#flags-filled"  # in the cache folder's name (cache_root)
SNAPSHOTS = "snapshots"
_FORMAT = "mmbuffer-remote"
_VERSION = 3  # 3: objects held by earlier snapshots, raw arrays as chunks (object table version 2)
_READS = (2, 3)
_ID = re.compile(r"^[0-9]{10}-[0-9a-f]{12}$")
_REL = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*(/[A-Za-z0-9_][A-Za-z0-9_.\-]*)*$")
_DATA_CHUNKS = re.compile(r"^columns/([^/]+)/c(/|$)")
_POINTER_LIMIT = 1 << 16
_GROUP = {"zarr_format": 3, "node_type": "group", "attributes": {}}


def read_pointer(fs: Any, root: str, url: str) -> dict[str, Any]:
    """The checked pointer object of the store at ``url``."""
    where = f"{url}/{POINTER}"
    try:
        with remote_errors(url):
            raw = fs.cat_file(join(root, POINTER), start=0, end=_POINTER_LIMIT + 1)
    except FileNotFoundError:
        raise errors.StoreNotFoundError(f"{where}: expected a store published by mmbuffer (mb.convert.copy(src, url)), found no pointer") from None
    return check_pointer(parse_json(raw, where, _POINTER_LIMIT), where)


def check_pointer(obj: Any, where: str) -> dict[str, Any]:
    """``obj`` if it is a valid pointer (``where`` names it in the errors)."""
    if not isinstance(obj, dict) or obj.get("format") != _FORMAT:
        raise errors.CorruptStoreError(f"{where}: format: expected {_FORMAT!r}, got {obj.get('format') if isinstance(obj, dict) else obj!r}")
    snap, seq = obj.get("snapshot"), obj.get("sequence")
    if not isinstance(snap, str) or not _ID.match(snap):
        raise errors.CorruptStoreError(f"{where}: snapshot: expected an id like 0000000001-0123456789ab, got {snap!r}")
    if not isinstance(seq, int) or isinstance(seq, bool) or seq != int(snap[:10]):
        raise errors.CorruptStoreError(f"{where}: sequence: expected {int(snap[:10])} (the snapshot's), got {seq!r}")
    if obj.get("version") not in _READS:
        raise errors.FormatVersionError(f"{where}: version: expected one of {list(_READS)} (2: object checksums, 3: "
                                        f"incremental), got {obj.get('version')!r}; upgrade mmbuffer or publish again")
    objects = obj.get("objects")
    if not isinstance(objects, str) or not re.match(r"^[0-9a-f]{32}$", objects):
        raise errors.CorruptStoreError(f"{where}: objects: expected the BLAKE2b-128 of the object table, got {objects!r}")
    return obj


def check_alive(fs: Any, root: str, snapshot: str, url: str) -> None:
    """Raise ``StoreNotFoundError`` if ``snapshot`` was deleted by a newer publish.

    Deletion removes ``manifest.json`` first. Every object read is verified against the
    snapshot's table, so a chunk gone is never zeros (``CorruptStoreError``, or this
    error when the snapshot went); the check tells a reader its snapshot is gone:
    after each block the pool fetches, in the same batch of requests as the chunks of an
    exact read (``fetch_objects(probe=True)``), and whenever an object is missing.
    Rows a reader already holds (verified) are still served.
    """
    try:  # a ranged GET, never a cached listing
        with remote_errors(url):
            fs.cat_file(join(root, SNAPSHOTS, snapshot, fmt.MANIFEST), start=0, end=1)
    except FileNotFoundError:
        raise errors.StoreNotFoundError(
            f"{url}: snapshot {snapshot} was removed by a newer publish while it was read; "
            "call refresh() (or publish with a larger keep=)"
        ) from None


def cache_base(cache_dir: str | os.PathLike[str] | None) -> Path:
    """``cache_dir`` (default ``$MMBUFFER_CACHE_DIR`` or ``~/.cache/mmbuffer``)."""
    return Path(cache_dir if cache_dir is not None else os.environ.get("MMBUFFER_CACHE_DIR") or Path.home() / ".cache" / "mmbuffer")


def cache_root(base: Path, url: str) -> Path:
    """The folder of ``url``'s mirrors and pools: ``cache_dir/<hash of url and mirror layout>``.
    The layout's tag keeps these mirrors, whose flags are filled on demand (``_filled.py``),
    from mmbuffer before it, which would read their holes as ``False`` (and this code from
    its mirrors)."""
    return base / hashlib.sha256(f"{url.rstrip('/')}{_MIRROR_LAYOUT}".encode()).hexdigest()[:20]


def _ranges(root: str, table: Table, rels: list[str]) -> tuple[list[str], list[int | None], list[int | None]]:
    """Paths and byte ranges of ``rels``: each object asked for with one ranged GET of the
    size the table records (fsspec's whole-object read asks for the size with a HEAD
    first: two requests per object); an empty object whole."""
    paths, starts, ends = [], [], []
    for rel in rels:
        entry = table.get(rel)
        paths.append(join(root, SNAPSHOTS, table.holder(rel), rel))
        starts.append(0 if entry is not None and entry[0] else None)
        ends.append(entry[0] if entry is not None and entry[0] else None)
    return paths, starts, ends


def object_fetch(fs: Any, root: str, table: Table) -> Callable[[str], bytes]:
    """``rel -> `` the bytes of one object of ``table``'s snapshot, by one ranged GET from
    the snapshot that holds it (``FileNotFoundError`` if missing)."""

    def fetch(rel: str) -> bytes:
        (path,), (start,), (end,) = _ranges(root, table, [rel])
        data: bytes = fs.cat_file(path, start=start, end=end)
        return data

    return fetch


def fetch_objects(fs: Any, root: str, table: Table, url: str) -> FetchMany:
    """Fetch a batch of a snapshot's objects concurrently, each from the snapshot that
    holds it, one ranged GET each (None: missing; then ``StoreNotFoundError`` if the
    snapshot was pruned). ``probe=True``: the existence check of the snapshot (its
    manifest, :func:`check_alive`) goes in the same concurrent batch, so a snapshot
    removed before the batch began is a ``StoreNotFoundError`` at no extra round trip."""
    snapshot = table.snapshot

    def fetch(rels: list[str], probe: bool = False) -> dict[str, bytes | None]:
        paths, starts, ends = _ranges(root, table, rels)
        if probe:
            paths, starts, ends = paths + [join(root, SNAPSHOTS, snapshot, fmt.MANIFEST)], starts + [0], ends + [1]
        with remote_errors(url):
            got = fs.cat_ranges(paths, starts, ends, on_error="return") if paths else []
            for data in got:  # a refused request or an unreachable server: typed here, never "missing"
                if isinstance(data, BaseException) and _transport(data):
                    raise data
        out: dict[str, bytes | None] = {}
        for rel, data in zip(rels, got):
            if isinstance(data, OSError) and data.errno == errno.EINVAL:
                data = b""  # a range past the end: an object shorter than the table says (size check refuses it)
            out[rel] = data if isinstance(data, bytes) else None
        if (probe and not isinstance(got[-1], bytes)) or any(v is None for v in out.values()):
            check_alive(fs, root, snapshot, url)
        return out

    return fetch


def _transport(exc: BaseException) -> bool:
    """An exception of the transport (refused credentials, a server out of reach), not of one object."""
    if isinstance(exc, FileNotFoundError):
        return False
    return isinstance(exc, (PermissionError, ConnectionError, TimeoutError)) or type(exc).__module__.split(".", 1)[0] in (
        "botocore", "aiobotocore", "aiohttp", "urllib3", "requests")


def _data_chunk(rel: str) -> bool:
    """Whether ``rel`` is a chunk of a data column (read remotely, never mirrored)."""
    m = _DATA_CHUNKS.match(rel)
    return m is not None and m.group(1) not in fmt.RESERVED_NAMES


def read_later(key: str) -> bool:
    """Whether the part ``key`` of a table (``_parts``) names objects a reader fetches when
    it reads them (a data column's chunks, the flags filled on demand), not at open for
    the mirror: a new reader loads such a part when a read first names one of its objects."""
    array = key.rsplit("/", 1)[0]
    return array in FILLED or _data_chunk(f"{array}/c/")


def mirror(fetch: Callable[[list[str]], dict[str, bytes | None]], snapshot: str, url: str, folder: Path, cache: Cache,
           table: Table, extra: Mapping[str, bytes] | None = None, previous: tuple[Path, Table] | None = None) -> Path:
    """The local mirror of ``snapshot``'s small parts (fetched once per host, verified, then
    reused); call with the snapshot pinned (``folder/<snapshot>.pin``). ``extra``: files
    the commit itself holds (Icechunk: the manifest, the root group). ``previous``: the
    mirror open now and its table (pinned): a file whose digest did not change is hard
    linked from it, not fetched (a refresh fetches what changed). ``cache.mirror_bytes``
    counts the bytes fetched."""
    final = folder / snapshot
    if (final / fmt.MANIFEST).is_file() and not final.is_symlink():
        return final
    with cache.locked(f"locks/{snapshot}"):  # one download per host: the others wait, then reuse it
        if (final / fmt.MANIFEST).is_file() and not final.is_symlink():
            return final
        packed = {array: shard_rel(array, rec) for array, rec in table.packed.items()}
        for array in packed:
            if not _REL.match(array) or any(p in (".", "..") for p in array.split("/")):
                raise errors.CorruptStoreError(f"{url}: packed array {array!r}: expected a name inside the snapshot")
        parts = tuple(f"{a}/" for a in packed)
        rels = []
        for rel in sorted(table.entries):
            if not _REL.match(rel) or any(p in (".", "..") for p in rel.split("/")):
                raise errors.CorruptStoreError(f"{url}: object {rel!r}: expected a name inside the snapshot")
            if rel == fmt.LOCK or rel == OBJECTS or _data_chunk(rel) or rel.startswith(parts):
                continue  # data chunks are read remotely, a stale LOCK means nothing here, packed arrays are rebuilt
            rels.append(rel)
        blobs: dict[str, bytes] = dict(extra or {})
        same = [r for r in rels if previous is not None and previous[1].get(r) == table.get(r)
                and (previous[0] / r).is_file()]
        todo = [r for r in rels if r not in set(same)]
        plans: list[tuple[str, str, dict[str, bytes], frozenset[str], Path | None]] = []
        laid: list[tuple[str, frozenset[str], Path | None]] = []  # the flags: filled on demand (_filled.py)
        for array, shard in packed.items():  # unchanged: linked; else rebuilt from the chunks that changed
            rec = table.packed[array]
            before, old = None, None
            present = f"{array}/{PRESENT}"
            if previous is not None:
                before, old = previous[1].packed.get(array), previous[0] / shard
                if before is None or before.meta != rec.meta or not old.is_file():
                    old = None
                elif before == rec and (previous[0] / array / "zarr.json").is_file() \
                        and (array not in FILLED or (previous[0] / present).is_file()):
                    same += [f"{array}/zarr.json", shard] + ([present] if array in FILLED else [])
                    continue
            chunks = [r for r in table.entries if r.startswith(f"{array}/c/")]
            kept = frozenset(r for r in chunks if old is not None and previous is not None
                             and previous[1].get(r) == table.get(r))
            blobs[f"{array}/zarr.json"] = rec.meta.encode()
            if array in FILLED:
                holds = previous is not None and (previous[0] / present).is_file()
                laid.append((array, kept if holds else frozenset(), previous[0] if holds and previous else None))
                continue
            plans.append((array, shard, _fetch_checked(fetch, table, [r for r in chunks if r not in kept], cache),
                          kept, old if kept else None))
        blobs.update(_fetch_checked(fetch, table, todo, cache))

        def write() -> None:
            tmp = Path(tempfile.mkdtemp(prefix=f".{snapshot}.partial-", dir=folder))
            try:
                for rel, data in blobs.items():
                    write_file(tmp / rel, data, cache.base)
                for array, kept, old in laid:
                    lay_out(tmp, array, table.packed[array], old, kept)
                for array, shard, got, kept, old in plans:  # rebuilt one chunk at a time, then checked whole
                    (tmp / shard).parent.mkdir(parents=True, exist_ok=True)
                    with open(tmp / shard, "wb") as out, (open(old, "rb") if old else contextlib.nullcontext()) as prev:
                        rebuild(array, table.packed[array], table.entries, got.get, out, old=prev, same=kept)
                for rel in same:  # immutable files of the pinned previous mirror: linked (copied across devices)
                    assert previous is not None
                    (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                    try:
                        os.link(previous[0] / rel, tmp / rel)
                    except OSError:
                        shutil.copyfile(previous[0] / rel, tmp / rel)
                # durable before it is named: a mirror found after a crash is reused unchecked
                fsync_tree(tmp)
                os.rename(tmp, final)
                fsync_dir(folder)
            finally:
                if tmp.exists():
                    shutil.rmtree(tmp)

        # linked files take no new space; counted anyway (the next scan counts each inode once);
        # a rebuilt shard counts its chunks that hold something (the rest are holes)
        cache.admit(sum(len(b) for b in blobs.values())
                    + sum(held_bytes(a, table.packed[a], len(got) + len(kept)) for a, _, got, kept, _ in plans)
                    + sum(laid_bytes(a, table.packed[a], len(kept)) for a, kept, _ in laid)
                    + sum(disk_bytes(os.lstat(previous[0] / r)) for r in same if previous is not None), write)
    return final


def _fetch_checked(fetch: Callable[[list[str]], dict[str, bytes | None]], table: Table, rels: list[str],
                   cache: Cache) -> dict[str, bytes]:
    """``rels`` fetched 64 at a time (concurrently), each checked against ``table``."""
    out: dict[str, bytes] = {}
    for start in range(0, len(rels), 64):
        for rel, data in fetch(rels[start:start + 64]).items():
            if data is None:
                raise table.missing(rel)
            table.check(rel, data)
            out[rel] = data
            cache.mirror_bytes += len(data)
    return out


def publish_dir(fs: Any, root: str, url: str, store: Path, *, keep: int, generation: int,
                digests: Mapping[str, tuple[int, str]] | None = None, memo: Path | None = None) -> dict[str, Any]:
    """Upload the local store ``store`` as the next snapshot of ``url``; point to it; prune.

    Only objects that differ from the previous snapshot's are sent; the others are
    named in the table with the snapshot that holds them. Raw arrays go as chunks
    (:mod:`._dense`). Refuses (``StoreExistsError``, nothing changed) a URL that holds
    objects but no mmbuffer pointer. ``digests``: ``rel -> (size, digest)`` of files of
    ``store`` known already (not read again: ``_objects.FileDigests``); ``memo``: a folder
    keeping the parts of the table published last (``_parts.remember``), so the next
    publish reads none of them back.
    """
    fs.invalidate_cache()
    try:
        with remote_errors(url):
            previous: dict[str, Any] | None = read_pointer(fs, root, url)
    except errors.StoreNotFoundError:
        previous = None
        if fs.exists(root) and fs.find(root, maxdepth=None):
            raise errors.StoreExistsError(
                f"{url}: expected an empty prefix or a store mmbuffer published, got other objects; nothing was changed"
            ) from None
    pointer, summary = upload_snapshot(fs, root, url, store, previous, generation=generation, digests=digests, memo=memo)
    write_pointer(fs, root, pointer)
    summary["pruned"] = prune(fs, root, keep, pointer["snapshot"])
    return summary


def upload_snapshot(fs: Any, root: str, url: str, store: Path, previous: Mapping[str, Any] | None, *,
                    generation: int, digests: Mapping[str, tuple[int, str]] | None = None, memo: Path | None = None
                    ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Upload ``store`` as the snapshot after ``previous`` (a checked pointer, or None):
    its pointer (not written) and the summary. The snapshot is whole once this returns.
    The object table goes in parts (``_parts.py``): only those that changed are sent."""
    before: Table | None = None
    if previous is not None:
        try:
            before = load_table(fs, root, url, str(previous["snapshot"]), str(previous["objects"]), memo=memo)
        except (errors.CorruptStoreError, errors.StoreNotFoundError):
            before = None  # a damaged previous snapshot: this one sends everything, and is whole by itself
    seq = 1 if previous is None else int(previous["sequence"]) + 1
    snapshot = f"{seq:010d}-{uuid.uuid4().hex[:12]}"
    snap_root = join(root, SNAPSHOTS, snapshot)
    local, entries, packed = store_objects(store, digests)
    holders = {rel: before.holder(rel) for rel in entries
               if before is not None and rel != fmt.MANIFEST and before.get(rel) == entries[rel]}
    table, parts, part_digests = split(entries, holders, packed, snapshot, before)
    # new objects, the table's new parts and its root, then the manifest last, so a snapshot
    # without it is never taken for a whole one
    new = sorted((rel for rel in entries if rel not in holders and rel != fmt.MANIFEST))
    paths = [r for r in new if isinstance(local[r], Path)]
    fs.put([str(local[r]) for r in paths], [join(snap_root, r) for r in paths])
    blobs = {join(snap_root, r): local[r] for r in new if isinstance(local[r], bytes)}
    blobs.update({join(snap_root, r): raw for r, (_, raw) in parts.items()})
    if blobs:
        fs.pipe(blobs)
    fs.pipe_file(join(snap_root, OBJECTS), table)
    fs.put(str(local[fmt.MANIFEST]), join(snap_root, fmt.MANIFEST))
    if memo is not None:
        remember(memo, dict(parts.values()), keep=part_digests)
    group = json.dumps(_GROUP).encode()
    if previous is None:
        fs.pipe({join(root, "zarr.json"): group, join(root, SNAPSHOTS, "zarr.json"): group})
    pointer = {"format": _FORMAT, "version": _VERSION, "snapshot": snapshot, "sequence": seq, "generation": generation,
               "objects": digest(table)}
    table_written = len(table) + sum(len(raw) for _, raw in parts.values())
    return pointer, {"url": url, "snapshot": snapshot, "sequence": seq, "pruned": [],
                     "objects_written": len(new) + len(parts) + 2,
                     "bytes_written": sum(entries[r][0] for r in new) + entries[fmt.MANIFEST][0] + table_written,
                     "table_bytes_written": table_written}


def write_pointer(fs: Any, root: str, pointer: dict[str, Any]) -> None:
    """Replace ``current.json``: one PUT, the instant a publish becomes visible."""
    fs.pipe_file(join(root, POINTER), json.dumps(pointer).encode())


def prune(fs: Any, root: str, keep: int, current: str) -> list[str]:
    """Drop all but ``current`` and the ``keep - 1`` snapshots published before it, and
    any snapshot never pointed to (a publish that failed before its pointer); only ids
    mmbuffer writes. A dropped snapshot loses its ``manifest.json`` first (so its readers
    raise instead of reading zeros), then every object no kept snapshot names; what a
    kept snapshot names stays in the dropped one's folder. What it reads of the kept
    tables: their roots, and only the parts naming objects the dropped folders hold."""
    base = join(root, SNAPSHOTS)
    ids = sorted(name for name in (str(p).rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(base, detail=False)) if _ID.match(name))
    older = [i for i in ids if int(i[:10]) < int(current[:10])]
    kept = set(older[len(older) - (keep - 1):] if keep > 1 else []) | {current}
    old = [i for i in ids if i not in kept]
    if not old:
        return old
    held = {snap: [str(p)[len(join(base, snap)) + 1:] for p in fs.find(join(base, snap))] for snap in old}
    keys = {k for rels in held.values() for r in rels if (k := part_key(r)) is not None and not r.startswith("parts/")}
    named: set[str] = set()  # objects of kept snapshots, as paths under base
    fetch = fetcher(fs, root, root)
    before = None  # the kept table loaded last: its parts of the same digest are not fetched again
    for snap in sorted(kept):
        try:
            raw = fs.cat_file(join(base, snap, OBJECTS))
            table = parse_table(raw, join(base, snap, OBJECTS), "", snap)
            load_parts(table, fetch, before, keys=keys & set(table.parts))
        except (FileNotFoundError, errors.MMBufferError):
            if snap != current:
                continue  # not a whole snapshot (a failed publish): it names nothing
            raise
        before = table
        named.update(f"{table.holder(rel)}/{rel}" for rel in table.entries)
        named.update(f"{holder}/{part_rel(key)}" for key, (_, _, holder) in table.parts.items())
        named.update((f"{snap}/{OBJECTS}", f"{snap}/{fmt.MANIFEST}"))
    for snap in old:
        try:
            fs.rm_file(join(base, snap, fmt.MANIFEST))
        except FileNotFoundError:
            pass
    for snap in old:
        drop = [join(base, snap, rel) for rel in held[snap] if f"{snap}/{rel}" not in named and rel != fmt.MANIFEST]
        if drop:
            fs.rm(drop)
    fs.invalidate_cache()
    return old

