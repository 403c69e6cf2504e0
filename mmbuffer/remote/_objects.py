"""What a snapshot holds, object by object: sizes and checksums recorded at publish.

Every published snapshot carries ``objects.json`` (``OBJECTS``): for each object of the
snapshot (relative name) its size and BLAKE2b-128 digest, computed from the local files
before upload. Version 2 of the table adds, per object, the earlier snapshot that holds
it when this one did not send it again (``holders``: an unchanged object is never sent
twice), and the raw arrays published as chunks (``packed``: :mod:`._dense`); version 3
records a packed array's digest over its chunks' digests (:mod:`._dense`); version 4
keeps the chunks' entries in parts, each named with its digest (:mod:`._parts`: a publish
writes the parts that changed, not the table). Tables of versions 1 (every object in its
own snapshot, no packed arrays) to 3 read as before. The pointer (``current.json``)
records the digest of ``objects.json`` itself, so the chain pointer -> table -> object
is checked end to end: a flipped, truncated, missing or swapped-in object (one from
another snapshot) is a :class:`~mmbuffer.errors.CorruptStoreError` naming the object
and its column, never rows. An object the table does not name is never read (zarr's fill value is what a
chunk never written means; an object added behind mmbuffer's back is ignored).

>>> t = Table({"columns/x/c/0": (3, digest(b"abc"))}, "s3://b/store", "0000000001-0123456789ab")
>>> t.check("columns/x/c/0", b"abc")
>>> t.check("columns/x/c/0", b"abd")  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
mmbuffer.errors.CorruptStoreError: s3://b/store/snapshots/0000000001-0123456789ab/columns/x/c/0 (column x): expected BLAKE2b-128 ..., got ... (a changed or swapped object)
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

from .. import errors
from .._disk import format as fmt
from .._disk.files import parse_json
from ._dense import Packed, pack

__all__ = ["HASH", "OBJECTS", "FetchMany", "Table", "digest", "load_root", "parse_entries", "parse_table", "remote_errors",
           "store_objects", "table_bytes"]

OBJECTS = "objects.json"
_FORMAT = "mmbuffer-objects"
HASH = "blake2b-128"  # the digest every table records (and the parts of version 4: ``_parts.py``)
_HEX = re.compile(r"^[0-9a-f]{32}$")
_LIMIT = 1 << 30
_SNAPSHOT = re.compile(r"^[0-9]{10}-[0-9a-f]{12}$")


def digest(data: bytes | memoryview) -> str:
    """The BLAKE2b-128 hex digest of ``data`` (what the tables record)."""
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def file_digest(path: Path) -> tuple[int, str]:
    """``(size, digest)`` of a local file, read in 8 MiB pieces."""
    h = hashlib.blake2b(digest_size=16)
    size = 0
    with open(path, "rb") as f:
        while piece := f.read(8 << 20):
            h.update(piece)
            size += len(piece)
    return size, h.hexdigest()


def store_objects(store: Path, digests: Mapping[str, tuple[int, str]] | None = None) -> tuple[
        dict[str, Path | bytes], dict[str, tuple[int, str]], dict[str, Packed]]:
    """What a publish of the local ``store`` sends: each file by its path (no link, no
    ``LOCK``), the raw arrays as chunks instead (:func:`._dense.pack`); the (size, digest)
    of each, read from the file unless ``digests`` knows it (:class:`FileDigests`); and
    the packed arrays' records."""
    files = {p.relative_to(store).as_posix(): p for p in store.rglob("*")
             if p.is_file() and not p.is_symlink() and p.name != fmt.LOCK}
    sent, packed, replaced = pack(store, sorted(files))
    local: dict[str, Path | bytes] = {rel: p for rel, p in files.items() if rel not in replaced}
    local.update(sent)
    known = digests if digests is not None else {}
    entries = {rel: (len(v), digest(v)) if isinstance(v, bytes) else known.get(rel) or file_digest(v)
               for rel, v in local.items()}
    return local, entries, packed


class FileDigests(Mapping[str, tuple[int, str]]):
    """``rel -> (size, digest)`` of the files under ``root``, each read when first asked for,
    unless its size, modification and change times and inode are those ``memo`` recorded
    (``rel -> [size, mtime_ns, ctime_ns, ino, digest]``, from a publish before); ``memo()``
    is then the record of the files asked for."""

    def __init__(self, root: Path, memo: Mapping[str, Any]) -> None:
        self._root, self._old = root, memo
        self._seen: dict[str, list[Any]] = {}

    def __getitem__(self, rel: str) -> tuple[int, str]:
        if rel not in self._seen:
            try:
                st = os.stat(self._root / rel, follow_symlinks=False)
            except (FileNotFoundError, NotADirectoryError):
                raise KeyError(rel) from None
            key = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
            known = self._old.get(rel)
            if isinstance(known, list) and len(known) == 5 and known[:4] == key and isinstance(known[4], str):
                self._seen[rel] = known
            else:
                self._seen[rel] = [*key, file_digest(self._root / rel)[1]]
        size, *_, hexdigest = self._seen[rel]
        return int(size), str(hexdigest)

    def __iter__(self) -> Iterator[str]:
        return iter(self._seen)

    def __len__(self) -> int:
        return len(self._seen)

    def memo(self) -> dict[str, list[Any]]:
        return dict(self._seen)


class FetchMany(Protocol):
    """Fetch a batch of a snapshot's objects at once (concurrent requests): name -> bytes,
    None where missing; ``probe``: check in the same batch that the snapshot still exists."""

    def __call__(self, rels: list[str], probe: bool = False) -> dict[str, bytes | None]: ...


def table_bytes(entries: Mapping[str, tuple[int, str]], holders: Mapping[str, str] | None = None,
                packed: Mapping[str, Packed] | None = None, parts: Mapping[str, list[Any]] | None = None) -> bytes:
    """The ``objects.json`` of a snapshot holding ``entries`` (relative name -> (size,
    digest)); ``holders``: objects kept in an earlier snapshot (name -> its id);
    ``packed``: raw arrays published as chunks (:mod:`._dense`); ``parts``: the root of a
    table of version 4, naming its parts (key -> [size, digest, holder]: ``_parts.split``)."""
    held = dict(holders or {})
    body: dict[str, Any] = {
        "format": _FORMAT, "version": 3 if parts is None else 4, "hash": HASH,
        "objects": {k: [int(s), d] + ([held[k]] if k in held else []) for k, (s, d) in sorted(entries.items())},
        "packed": {k: v.to_json() for k, v in sorted((packed or {}).items())}}
    if parts is not None:
        body["parts"] = dict(parts)
    return json.dumps(body, separators=(",", ":")).encode()


def column_of(rel: str) -> str:
    """The column an object belongs to (``columns/<name>/...``), or the object's name."""
    parts = rel.split("/")
    return parts[1] if len(parts) > 2 and parts[0] == "columns" else rel


class Table:
    """The checked object table of one snapshot of ``url``. ``parts`` (version 4,
    :mod:`._parts`): part key -> (size, digest, holding snapshot) of the parts whose
    objects ``entries`` holds once they are loaded (``loaded``: their keys). ``loader``
    (set by ``_parts.load_table``; None: nothing left to load): ``loader(rels)`` loads the
    parts naming ``rels`` (None: all), so a part is fetched when a read first names it."""

    def __init__(self, entries: dict[str, tuple[int, str]], url: str, snapshot: str,
                 holders: dict[str, str] | None = None, packed: dict[str, Packed] | None = None,
                 parts: dict[str, tuple[int, str, str]] | None = None) -> None:
        self.entries = entries
        self.url = url
        self.snapshot = snapshot
        self.holders = holders or {}  # objects an earlier snapshot holds: name -> its id
        self.packed = packed or {}  # raw arrays published as chunks: array -> record (_dense.py)
        self.parts = parts or {}
        self.part_rels: dict[str, tuple[str, ...]] = {}  # loaded parts by digest: the names of their objects
        self.loaded: set[str] = set()
        self.loader: Callable[[Iterable[str] | None], None] | None = None

    def need(self, rels: Iterable[str] | None = None) -> None:
        """Load the parts naming ``rels`` (None: every part) that are not loaded yet, at once."""
        if self.loader is not None:
            self.loader(rels)

    def holder(self, rel: str) -> str:
        """The snapshot whose folder holds ``rel`` (this one, or an earlier one)."""
        return self.holders.get(rel, self.snapshot)

    def where(self, rel: str) -> str:
        return f"{self.url}/snapshots/{self.holder(rel)}/{rel} (column {column_of(rel)})"

    def get(self, rel: str) -> tuple[int, str] | None:
        """``rel``'s (size, digest), its part loaded first if need be; None: not published."""
        entry = self.entries.get(rel)
        if entry is None and self.loader is not None:
            self.loader((rel,))
            entry = self.entries.get(rel)
        return entry

    def check(self, rel: str, data: bytes | memoryview) -> None:
        """Raise ``CorruptStoreError`` unless ``data`` is the object the table names."""
        size, want = self.entries[rel]
        if len(data) != size:
            raise errors.CorruptStoreError(
                f"{self.where(rel)}: expected {size} bytes, got {len(data)} (a truncated or swapped object)")
        got = digest(data)
        if got != want:
            raise errors.CorruptStoreError(
                f"{self.where(rel)}: expected BLAKE2b-128 {want}, got {got} (a changed or swapped object)")

    def missing(self, rel: str) -> errors.CorruptStoreError:
        return errors.CorruptStoreError(f"{self.where(rel)}: expected the object the snapshot names, found nothing")


def load_root(fs: Any, root: str, url: str, snapshot: str, want: str) -> Table:
    """Fetch and check the table of ``snapshot`` against ``want`` (the pointer's digest);
    a table of version 4 without its parts (``_parts.load_table`` loads them)."""
    where = f"{url}/snapshots/{snapshot}/{OBJECTS}"
    with remote_errors(url):
        try:
            raw = fs.cat_file(f"{root}/snapshots/{snapshot}/{OBJECTS}", start=0, end=_LIMIT + 1)
        except FileNotFoundError:
            raise errors.StoreNotFoundError(f"{where}: expected the snapshot's object table, found nothing "
                                            "(removed by a newer publish, or never completed)") from None
    if digest(raw) != want:
        raise errors.CorruptStoreError(f"{where}: expected BLAKE2b-128 {want} (named by the pointer), got {digest(raw)}")
    return parse_table(raw, where, url, snapshot)


def parse_table(raw: bytes, where: str, url: str, snapshot: str) -> Table:
    """The table in ``raw`` (its digest already checked), every field checked; a table of
    version 4 with its parts named, not loaded (``_parts.load_table`` loads them)."""
    body = parse_json(raw, where)
    if not isinstance(body, dict) or body.get("format") != _FORMAT or body.get("hash") != HASH:
        raise errors.CorruptStoreError(f"{where}: expected format {_FORMAT!r} with hash {HASH!r}")
    version = body.get("version")
    if version not in (1, 2, 3, 4):
        raise errors.FormatVersionError(f"{where}: version: expected 1, 2, 3 or 4, got {version!r}; upgrade mmbuffer")
    objects, packed, parts = body.get("objects") or {}, body.get("packed") or {}, body.get("parts") or {}
    if not isinstance(objects, dict) or not isinstance(packed, dict) or (version == 1 and packed) \
            or not isinstance(parts, dict) or (version < 4 and parts):
        raise errors.CorruptStoreError(f"{where}: expected objects (and, from version 2, packed; from version 4, "
                                       "parts) as JSON objects")
    entries, holders = parse_entries(objects, where, (2,) if version == 1 else (2, 3))
    named: dict[str, tuple[int, str, str]] = {}
    for key, value in parts.items():
        if not (isinstance(value, list) and len(value) == 3 and _size_digest(value) and isinstance(value[2], str)
                and _SNAPSHOT.match(value[2])):
            raise errors.CorruptStoreError(f"{where}: part {key}: expected [size, digest, snapshot id], got {value!r}")
        named[str(key)] = (value[0], value[1], value[2])
    records = {str(k): Packed.from_json(f"{where}: packed {k}", v, chunked=version >= 3) for k, v in packed.items()}
    return Table(entries, url, snapshot, holders, records, named)


def _size_digest(value: list[Any]) -> bool:
    return isinstance(value[0], int) and not isinstance(value[0], bool) and value[0] >= 0 \
        and isinstance(value[1], str) and bool(_HEX.match(value[1]))


def parse_entries(objects: Mapping[str, Any], where: str, lengths: tuple[int, ...]) -> tuple[
        dict[str, tuple[int, str]], dict[str, str]]:
    """``rel -> (size, digest)`` and ``rel -> holding snapshot`` of a table's ``objects``,
    each ``[size, digest]`` or ``[size, digest, snapshot id]`` as ``lengths`` allows."""
    entries: dict[str, tuple[int, str]] = {}
    holders: dict[str, str] = {}
    for rel, value in objects.items():
        n = len(value) if isinstance(value, list) else 0
        if n not in lengths or not _size_digest(value) or (n == 3 and not (isinstance(value[2], str)
                                                                           and _SNAPSHOT.match(value[2]))):
            want = " or ".join(("[size, digest]", "[size, digest, snapshot id]")[k - 2] for k in lengths)
            raise errors.CorruptStoreError(f"{where}: {rel}: expected {want}, got {value!r}")
        entries[str(rel)] = (value[0], value[1])
        if n == 3:
            holders[str(rel)] = value[2]
    return entries, holders


@contextlib.contextmanager
def remote_errors(url: str) -> Iterator[None]:
    """Turn an unreachable endpoint or refused credentials into ``RemoteAccessError``
    naming ``url`` (botocore's, aiohttp's and fsspec's own exceptions are not typed for us)."""
    try:
        yield
    except errors.MMBufferError:
        raise
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        raise
    except PermissionError as exc:
        raise errors.RemoteAccessError(
            f"{url}: expected credentials the server accepts, got a refusal ({exc}); set AWS_ACCESS_KEY_ID/"
            "AWS_SECRET_ACCESS_KEY or storage_options"
        ) from None
    except Exception as exc:  # noqa: BLE001 - sorted by where the exception comes from
        mod = type(exc).__module__.split(".", 1)[0]
        text = str(exc).lower()
        if mod == "icechunk" and type(exc).__name__ not in ("ConflictError", "RebaseFailedError"):
            if not any(w in text for w in ("connect", "dispatch", "credential", "forbidden", "403", "denied", "timeout")):
                raise errors.CorruptStoreError(f"{url}: the repository cannot be read ({str(exc)[:300]})") from None
            mod = "botocore"
        if mod in ("botocore", "aiobotocore", "aiohttp", "urllib3", "requests") or isinstance(
                exc, (ConnectionError, TimeoutError)):
            text = str(exc)
            kind = "credentials" if "credential" in text.lower() or "signature" in text.lower() else "endpoint"
            raise errors.RemoteAccessError(
                f"{url}: expected a reachable endpoint and accepted credentials, got a failure of the {kind} "
                f"({type(exc).__name__}: {text[:300]})"
            ) from None
        raise
