"""What a snapshot holds, object by object: sizes and checksums recorded at publish.

Every published snapshot carries ``objects.json`` (``OBJECTS``): for each object of the
snapshot (relative name) its size and BLAKE2b-128 digest, computed from the local files
before upload. The pointer (``current.json``) records the digest of ``objects.json``
itself, so the chain pointer -> table -> object is checked end to end: a flipped,
truncated, missing or swapped-in object (one from another snapshot) is a
:class:`~mmbuffer.errors.CorruptStoreError` naming the object and its column, never
rows. An object the table does not name is never read (zarr's fill value is what a
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
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from .. import errors

__all__ = ["OBJECTS", "Table", "digest", "load_table", "remote_errors", "table_bytes"]

OBJECTS = "objects.json"
_FORMAT = "mmbuffer-objects"
_HASH = "blake2b-128"
_HEX = re.compile(r"^[0-9a-f]{32}$")
_LIMIT = 1 << 30


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


def table_bytes(entries: Mapping[str, tuple[int, str]]) -> bytes:
    """The ``objects.json`` of a snapshot holding ``entries`` (relative name -> (size, digest))."""
    body = {"format": _FORMAT, "version": 1, "hash": _HASH,
            "objects": {k: [int(s), d] for k, (s, d) in sorted(entries.items())}}
    return json.dumps(body, separators=(",", ":")).encode()


def column_of(rel: str) -> str:
    """The column an object belongs to (``columns/<name>/...``), or the object's name."""
    parts = rel.split("/")
    return parts[1] if len(parts) > 2 and parts[0] == "columns" else rel


class Table:
    """The checked object table of one snapshot of ``url``."""

    def __init__(self, entries: dict[str, tuple[int, str]], url: str, snapshot: str) -> None:
        self.entries = entries
        self.url = url
        self.snapshot = snapshot

    def where(self, rel: str) -> str:
        return f"{self.url}/snapshots/{self.snapshot}/{rel} (column {column_of(rel)})"

    def get(self, rel: str) -> tuple[int, str] | None:
        return self.entries.get(rel)

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


def load_table(fs: Any, root: str, url: str, snapshot: str, want: str) -> Table:
    """Fetch and check the table of ``snapshot`` against ``want`` (the pointer's digest)."""
    where = f"{url}/snapshots/{snapshot}/{OBJECTS}"
    with remote_errors(url):
        try:
            raw = fs.cat_file(f"{root}/snapshots/{snapshot}/{OBJECTS}", start=0, end=_LIMIT + 1)
        except FileNotFoundError:
            raise errors.StoreNotFoundError(f"{where}: expected the snapshot's object table, found nothing "
                                            "(removed by a newer publish, or never completed)") from None
    if digest(raw) != want:
        raise errors.CorruptStoreError(f"{where}: expected BLAKE2b-128 {want} (named by the pointer), got {digest(raw)}")
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # pragma: no cover - the digest matched what mmbuffer wrote
        raise errors.CorruptStoreError(f"{where}: not valid JSON ({exc})") from None
    if not isinstance(body, dict) or body.get("format") != _FORMAT or body.get("hash") != _HASH:
        raise errors.CorruptStoreError(f"{where}: expected format {_FORMAT!r} with hash {_HASH!r}")
    entries: dict[str, tuple[int, str]] = {}
    for rel, value in dict(body.get("objects") or {}).items():
        if (not isinstance(value, list) or len(value) != 2 or not isinstance(value[0], int) or value[0] < 0
                or not isinstance(value[1], str) or not _HEX.match(value[1])):
            raise errors.CorruptStoreError(f"{where}: {rel}: expected [size, digest], got {value!r}")
        entries[str(rel)] = (value[0], value[1])
    return Table(entries, url, snapshot)


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
