"""A snapshot's object table in parts, so a publish writes what changed, not the table.

An object table names every object of a store (``_objects.py``): one entry per chunk,
so it grows with the rows (~1M objects, 60-100 MB at 1e10 rows), and a table written
and read whole made every publish and every refresh cost that much, however few rows
were new. Version 4 keeps in ``objects.json`` (the *root*) only the objects that are
not chunks (metadata, the manifest) and, per *part*, its size, digest and the snapshot
holding it. A part is the entries of up to ``PART`` consecutive chunks of one array
(``columns/obs/c/512/0`` .. ``c/767/...`` make the part ``columns/obs/2``), each
``[size, digest, holding snapshot]``, stored as ``snapshots/<holder>/parts/<key>.json``.
Every entry names its holder, so a part whose chunks did not change is byte-identical
from one snapshot to the next: a publish sends the parts whose digest changed (the new
rows' few), names the others where they are, and a reader moving to a newer snapshot
fetches only those. A new reader fetches the root and the parts its mirror needs; a data
column's part when a read first names one of its chunks (``load_table(later=)``). The
pointer names the root's digest and the root names each part's, so the chain pointer ->
root -> part -> object stays checked end to end.

>>> from mmbuffer.remote._objects import parse_table
>>> e = {f"columns/x/c/{i}": (3, "0" * 32) for i in range(300)} | {"zarr.json": (5, "1" * 32)}
>>> first = split(e, {}, {}, "0000000001-0123456789ab", None)
>>> t = parse_table(first.root, "t", "u", "0000000001-0123456789ab")
>>> sorted(first.send), sorted(t.parts)
(['parts/columns/x/0.json', 'parts/columns/x/1.json'], ['columns/x/0', 'columns/x/1'])
>>> second = split(e | {"columns/x/c/299": (4, "2" * 32)}, {r: t.snapshot for r in e}, {},
...                "0000000002-0123456789ab", t)
>>> sorted(second.send)  # the first part did not change: the second snapshot names it
['parts/columns/x/1.json']
"""

from __future__ import annotations

import errno
import json
import re
import threading
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

from .. import errors
from .._disk.files import parse_json
from ._dense import Packed
from ._objects import (
    HASH,
    OBJECTS,
    Table,
    digest,
    load_root,
    parse_entries,
    remote_errors,
    table_bytes,
)

__all__ = ["PART", "Fetch", "Split", "fetcher", "load_parts", "load_table", "part_key", "part_rel", "remember", "split"]

PART = 256
"""Chunks per part."""
_FORMAT = "mmbuffer-objects-part"
_CHUNK = re.compile(r"^(.+)/c/([0-9]+)(/.*)?$")
_LIMIT = 1 << 28
Fetch = Callable[[Mapping[str, int]], dict[str, bytes | None]]


def part_key(rel: str) -> str | None:
    """The part holding the entry of object ``rel``: its array and its first chunk number
    over ``PART``; None for an object that is not a chunk (the root holds it)."""
    m = _CHUNK.match(rel)
    return None if m is None else f"{m.group(1)}/{int(m.group(2)) // PART}"


def part_rel(key: str) -> str:
    """Where part ``key`` is in the folder of the snapshot holding it."""
    return f"parts/{key}.json"


class Split(NamedTuple):
    """A table of version 4 to publish: its ``root`` (``objects.json``), the parts to send
    (``part_rel`` -> (digest, bytes)) and the digests of all its parts (sent or named)."""

    root: bytes
    send: dict[str, tuple[str, bytes]]
    digests: set[str]


def split(entries: Mapping[str, tuple[int, str]], holders: Mapping[str, str], packed: Mapping[str, Packed],
          snapshot: str, before: Table | None) -> Split:
    """The table of ``snapshot`` holding ``entries`` (``holders``: the earlier snapshot
    holding an object not sent again): its root, and the parts whose digest differs from
    ``before``'s part of the same key, to send."""
    root: dict[str, tuple[int, str]] = {}
    groups: dict[str, dict[str, list[Any]]] = {}
    for rel, (size, dg) in sorted(entries.items()):
        key = part_key(rel)
        if key is None:
            root[rel] = (size, dg)
        else:
            groups.setdefault(key, {})[rel] = [int(size), dg, holders.get(rel, snapshot)]
    parts: dict[str, list[Any]] = {}
    send: dict[str, tuple[str, bytes]] = {}
    for key, objects in groups.items():
        raw = json.dumps({"format": _FORMAT, "hash": HASH, "key": key, "objects": objects}, separators=(",", ":")).encode()
        dg = digest(raw)
        old = before.parts.get(key) if before is not None else None
        if old is not None and old[1] == dg:
            parts[key] = [len(raw), dg, old[2]]
        else:
            parts[key] = [len(raw), dg, snapshot]
            send[part_rel(key)] = (dg, raw)
    table = table_bytes(root, {rel: h for rel, h in holders.items() if rel in root}, packed, parts)
    return Split(table, send, {dg for _, dg, _ in parts.values()})


def load_table(fs: Any, root: str, url: str, snapshot: str, want: str, before: Table | None = None,
               memo: Path | None = None, alive: Callable[[], None] | None = None,
               later: Callable[[str], bool] | None = None) -> Table:
    """The table of ``snapshot`` (its root checked against ``want``, the pointer's digest)
    with its parts loaded (:func:`load_parts`), but for those ``later(key)`` picks and
    ``before`` did not load: each of those is fetched when a read first names one of its
    objects (``Table.loader``), so a new reader of a large store fetches the root and the
    parts it reads, not the whole table."""
    table = load_root(fs, root, url, snapshot, want)
    fetch = fetcher(fs, root, url)
    keys = None
    if later is not None:
        held = before.loaded if before is not None else set()
        keys = {k for k in table.parts if not later(k) or k in held}  # a refresh keeps what was read
        table.loader = _Loader(table, fetch, alive)
    load_parts(table, fetch, before, keys=keys, memo=memo, alive=alive)
    return table


class _Loader:
    """``Table.loader`` of a table loaded in part: the parts naming the objects asked for
    that are not loaded yet, fetched at once. Readers share the table: a part another
    thread is loading is waited for, not fetched again, and loaded here if that failed
    (so its error is raised here too, never taken for an object not published)."""

    def __init__(self, table: Table, fetch: Fetch, alive: Callable[[], None] | None) -> None:
        self.table, self.fetch, self.alive = table, fetch, alive
        self.lock = threading.Lock()
        self.coming: dict[str, threading.Event] = {}  # part key -> set once its load ended

    def __call__(self, rels: Iterable[str] | None) -> None:
        table = self.table
        keys = set(table.parts) if rels is None else {k for r in rels if (k := part_key(r)) is not None
                                                       and k in table.parts}
        while keys - table.loaded:
            with self.lock:
                missing = keys - table.loaded
                todo = {k for k in missing if k not in self.coming}
                waits = {id(e): e for k in missing if (e := self.coming.get(k)) is not None}
                ended = threading.Event()
                self.coming.update(dict.fromkeys(todo, ended))
            try:
                if todo:
                    load_parts(table, self.fetch, keys=todo, alive=self.alive)
            finally:
                with self.lock:
                    for k in todo:
                        del self.coming[k]
                ended.set()
            for e in waits.values():
                e.wait()


def load_parts(table: Table, fetch: Fetch, before: Table | None = None,
               keys: set[str] | None = None, memo: Path | None = None, alive: Callable[[], None] | None = None) -> None:
    """Add to ``table`` the entries of its parts (``keys``: only those), each taken from
    ``before`` where it holds a part of the same digest, else from ``memo`` (a folder of
    parts by digest: a publisher's, :func:`remember`), the others fetched at once
    (``fetch``, :func:`fetcher`: paths under the URL -> bytes); every part read is
    checked: one missing, changed or naming an object of another part is
    ``CorruptStoreError`` (``alive()`` first raises ``StoreNotFoundError`` if a missing
    part went with its snapshot, pruned by a newer publish)."""
    todo = {k: v for k, v in sorted(table.parts.items()) if (keys is None or k in keys) and v[1] not in table.part_rels}
    held = before.part_rels if before is not None else {}
    known = {k: _recalled(memo, dg) for k, (_, dg, _) in todo.items() if dg not in held}
    missing = [k for k, raw in known.items() if raw is None]
    got = fetch({f"snapshots/{todo[k][2]}/{part_rel(k)}": todo[k][0] for k in missing}) if missing else {}
    for key, (size, dg, holder) in todo.items():
        if before is not None and dg in held:  # the same bytes: the same entries, shared with ``before``
            rels = held[dg]
            for rel in rels:
                holder_ = before.holder(rel)
                if holder_ != table.snapshot:
                    table.holders[rel] = holder_
                table.entries[rel] = before.entries[rel]  # after its holder: a reader that finds it finds both
            table.part_rels[dg] = rels
        else:
            where = f"{table.url}/snapshots/{holder}/{part_rel(key)}"
            raw = known.get(key)  # from the memo: checked there
            if raw is None:
                raw = got.get(f"snapshots/{holder}/{part_rel(key)}")
                if raw is None:
                    if alive is not None:
                        alive()
                    raise errors.CorruptStoreError(f"{where}: expected the part of {OBJECTS} its snapshot names, "
                                                   "found nothing")
                if len(raw) != size or digest(raw) != dg:
                    raise errors.CorruptStoreError(f"{where}: expected {size} bytes of BLAKE2b-128 {dg} (named by the "
                                                   f"table), got {len(raw)} bytes of {digest(raw)} (a changed or swapped part)")
                if memo is not None:
                    remember(memo, {dg: raw})
            objects = _parse_part(raw, where, key)
            for rel, (size_, dg_, holder_) in objects.items():
                if holder_ != table.snapshot:
                    table.holders[rel] = holder_
                table.entries[rel] = (size_, dg_)
            table.part_rels[dg] = tuple(objects)
        table.loaded.add(key)


def _recalled(memo: Path | None, dg: str) -> bytes | None:
    """Part ``dg`` from ``memo`` if it is there whole (its digest checked); else None."""
    if memo is None:
        return None
    try:
        raw = (memo / dg).read_bytes()
    except OSError:
        return None
    return raw if digest(raw) == dg else None


def remember(memo: Path, parts: Mapping[str, bytes], keep: set[str] | None = None) -> None:
    """Save ``parts`` (digest -> bytes) in ``memo``; ``keep``: then drop every other part
    not named there (the parts of the table published last). A cache: never synced,
    every part read back is checked against its digest."""
    memo.mkdir(parents=True, exist_ok=True)
    for dg, raw in parts.items():
        tmp = memo / f".{dg}.partial"
        tmp.write_bytes(raw)
        tmp.replace(memo / dg)
    if keep is not None:
        for path in memo.iterdir():
            if path.name not in keep and re.fullmatch(r"[0-9a-f]{32}", path.name):
                path.unlink(missing_ok=True)


def _parse_part(raw: bytes, where: str, key: str) -> dict[str, tuple[int, str, str]]:
    body = parse_json(raw, where, _LIMIT)
    if not isinstance(body, dict) or body.get("format") != _FORMAT or body.get("hash") != HASH or body.get("key") != key:
        raise errors.CorruptStoreError(f"{where}: expected format {_FORMAT!r} with hash {HASH!r} and key {key!r}")
    objects = body.get("objects")
    if not isinstance(objects, dict):
        raise errors.CorruptStoreError(f"{where}: objects: expected a JSON object")
    entries, holders = parse_entries(objects, where, (3,))
    for rel in entries:
        if part_key(rel) != key:
            raise errors.CorruptStoreError(f"{where}: {rel}: expected objects of part {key!r} only")
    return {rel: (size, dg, holders[rel]) for rel, (size, dg) in entries.items()}


def fetcher(fs: Any, root: str, url: str) -> Fetch:
    """Fetch objects under ``root`` at once, each by one ranged GET of the size the table
    names (path -> size; no HEAD first): path -> bytes (an object shorter than its size is
    what there is; the caller's size check refuses it), None where missing; a refusal or
    an unreachable server is ``RemoteAccessError`` naming ``url``."""

    def fetch(sizes: Mapping[str, int]) -> dict[str, bytes | None]:
        rels, out = list(sizes), {}
        with remote_errors(url):
            got = fs.cat_ranges([f"{root}/{r}" for r in rels], [0] * len(rels), [sizes[r] for r in rels],
                                on_error="return")
            for rel, data in zip(rels, got):
                if isinstance(data, OSError) and data.errno == errno.EINVAL:
                    data = b""  # a range past the end: shorter than named (refused by the size check)
                elif isinstance(data, BaseException) and not isinstance(data, FileNotFoundError):
                    raise data  # a refusal or an unreachable server is typed, never taken for a missing part
                out[rel] = data if isinstance(data, bytes) else None
        return out

    return fetch
