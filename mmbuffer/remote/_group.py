"""Writer groups: stores published by many hosts under one URL, read as one snapshot.

Layout under the group's URL::

    URL/group.json              {"format": "mmbuffer-group", "version": 1, "sequence": N,
                                 "writers": {NAME: {"pointer": P, "holder": H, "epoch": E, "expires": T}}}
    URL/writers/NAME/snapshots/ID/...   each writer's snapshots (``_snapshot.py``), disjoint prefixes

Each writer publishes its own local store under ``writers/NAME/`` with the ordinary
snapshot machinery (only changed objects sent, immutable snapshots), then replaces
``group.json`` by **compare-and-swap**: a conditional PUT (``If-Match`` the ETag read,
``If-None-Match: *`` for the first) on S3, a compare under an exclusive ``flock`` and an
atomic rename on ``file://``. A CAS lost to *another* writer is retried on the new
``group.json`` (different names never conflict); ``P`` is the writer's snapshot pointer,
so one GET of ``group.json`` gives a reader one consistent set of snapshots, all whole
(each is uploaded before ``group.json`` names it).

One publisher per writer name: a publish first *claims* the name by CAS (``holder``: the
host and the local store's path; ``expires``: now + ``lease`` seconds, renewed at every
publish). A claim by another holder while the lease runs, or a pointer update after
another holder took the name over (``epoch`` changed) or after another process published
the same name meanwhile, is a conflict the publisher cannot win: a
:class:`~mmbuffer.errors.LockedError`, and ``group.json`` is unchanged by it. A killed
publisher leaves ``group.json`` naming its last whole snapshot; the same holder (same
host, same store) resumes at once, another one after the lease. Leases compare the
hosts' clocks: keep them within a fraction of ``lease``, and ``lease`` above the
duration of one publish.

>>> import tempfile, numpy as np, mmbuffer as mb
>>> d = tempfile.mkdtemp()
>>> with mb.create(d + "/a", {"x": ((), "float32")}, capacity=64, next_keys=()) as buf:
...     buf.extend({"x": np.arange(40), "terminated": np.arange(40) % 10 == 9})
>>> mb.convert.publish(d + "/a", "file://" + d + "/group", writer="host-0", progress=False)["writer"]
'host-0'
>>> sorted(read_group(*_local(d + "/group"))[0]["writers"])
['host-0']
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import random
import re
import socket
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from .. import errors
from .._disk.files import parse_json
from .._disk.urls import join
from . import _snapshot
from ._objects import digest, remote_errors

__all__ = ["GROUP", "WRITERS", "check_writer", "holder_of", "is_group", "publish_writer", "read_group", "writer_url"]

GROUP = "group.json"
WRITERS = "writers"
_FORMAT = "mmbuffer-group"
_VERSION = 1
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")
_LIMIT = 1 << 22
_TRIES = 200
_CONFLICT = ("PreconditionFailed", "ConditionalRequestConflict")


def check_writer(name: object) -> str:
    """``name`` if it is a valid writer name (letters, digits, ``_.-``; at most 64)."""
    if not isinstance(name, str) or not _NAME.match(name) or ".." in name:
        raise errors.InvalidArgumentError(f"writer: expected a name of letters, digits, '_', '.', '-' "
                                          f"(at most 64, starting with a letter or digit), got {name!r}")
    return name


def writer_url(url: str, name: str) -> str:
    return f"{url.rstrip('/')}/{WRITERS}/{name}"


def holder_of(src: Any) -> str:
    """Who publishes: this host and the local store's resolved path."""
    path = getattr(src, "path", src)
    return f"{socket.gethostname()}:{os.path.realpath(os.fspath(path))}"


def _local(path: str) -> tuple[Any, str, str]:  # for the doctest: (fs, root, url) of a local group
    from .._disk.urls import filesystem

    url = "file://" + path
    fs, root = filesystem(url, None)
    return fs, root, url


# -- compare-and-swap of group.json ----------------------------------------------------------
def _is_s3(fs: Any) -> bool:
    proto = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return "s3" in proto


def _is_local(fs: Any) -> bool:
    proto = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return "file" in proto or "local" in proto


def _read_raw(fs: Any, root: str, url: str) -> tuple[bytes | None, str | None]:
    """``group.json``'s bytes and the token a CAS compares (S3: its ETag; local: its digest)."""
    path = join(root, GROUP)
    with remote_errors(url):
        if _is_s3(fs):
            from fsspec.asyn import sync

            bucket, key, _ = fs.split_path(path)
            try:
                resp = fs.call_s3("get_object", Bucket=bucket, Key=key)  # body and ETag of one version
            except FileNotFoundError:
                return None, None
            body = resp["Body"]
            raw, token = bytes(sync(fs.loop, body.read, _LIMIT + 1)), str(resp["ETag"])
            body.close()
            return raw, token
        try:
            raw = fs.cat_file(path, start=0, end=_LIMIT + 1)
        except FileNotFoundError:
            return None, None
        return raw, digest(raw)


def _put(fs: Any, root: str, url: str, data: bytes, token: str | None) -> bool:
    """Write ``group.json`` if its token is still ``token`` (None: if it does not exist);
    False when another write came first."""
    path = join(root, GROUP)
    if _is_s3(fs):
        bucket, key, _ = fs.split_path(path)
        cond = {"IfNoneMatch": "*"} if token is None else {"IfMatch": token}
        try:
            with remote_errors(url):
                fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data, **cond)
        except OSError as exc:
            code = getattr(exc.__cause__, "response", {}).get("Error", {}).get("Code")
            if code in _CONFLICT or (isinstance(exc, FileExistsError) and token is None):
                return False
            raise
        return True
    with _flock(Path(root)):
        try:
            now: str | None = digest(Path(path).read_bytes())
        except FileNotFoundError:
            now = None
        if now != token:
            return False
        tmp = Path(path + f".{os.getpid()}.partial")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return True


@contextlib.contextmanager
def _flock(root: Path) -> Iterator[None]:
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root / (GROUP + ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _transact(fs: Any, root: str, url: str, change: Callable[[dict[str, Any] | None], dict[str, Any]]) -> dict[str, Any]:
    """Apply ``change`` to ``group.json`` by compare-and-swap, re-reading and re-applying
    it after each CAS lost (``change`` raises for a conflict it cannot win)."""
    for attempt in range(_TRIES):
        raw, token = _read_raw(fs, root, url)
        body = None if raw is None else parse_group(raw, f"{url}/{GROUP}")
        if body is None and fs.exists(root):
            # group.json may have appeared since the read (another writer's first publish):
            # then the swap below is lost and retried on it
            ours = (join(root, WRITERS) + "/", join(root, GROUP))
            if any(not str(p).startswith(ours) and not str(p).endswith(".lock") for p in fs.find(root)):
                raise errors.StoreExistsError(f"{url}: expected an empty prefix or a writer group, got other objects "
                                              "(a store published without writer=?); nothing was changed")
        new = change(body)
        if _put(fs, root, url, json.dumps(new, separators=(",", ":")).encode(), token):
            return new
        time.sleep(random.uniform(0, min(0.5, 0.005 * 2 ** min(attempt, 7))))
    raise errors.LockedError(f"{url}/{GROUP}: expected to update it, got {_TRIES} compare-and-swaps lost in a row")


# -- reading ------------------------------------------------------------------------------
def parse_group(raw: bytes, where: str) -> dict[str, Any]:
    """The checked body of a ``group.json`` (untrusted: every field checked)."""
    body = parse_json(raw, where, _LIMIT)
    if not isinstance(body, dict) or body.get("format") != _FORMAT:
        raise errors.CorruptStoreError(f"{where}: format: expected {_FORMAT!r}")
    if body.get("version") != _VERSION:
        raise errors.FormatVersionError(f"{where}: version: expected {_VERSION}, got {body.get('version')!r}; upgrade mmbuffer")
    seq, writers = body.get("sequence"), body.get("writers")
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0 or not isinstance(writers, dict):
        raise errors.CorruptStoreError(f"{where}: expected an integer sequence and a writers object")
    for name, e in writers.items():
        if not isinstance(name, str) or not _NAME.match(name) or ".." in name:
            raise errors.CorruptStoreError(f"{where}: writers: expected writer names, got {name!r}")
        if (not isinstance(e, dict) or not isinstance(e.get("holder"), str) or not isinstance(e.get("epoch"), int)
                or not isinstance(e.get("expires"), (int, float))):
            raise errors.CorruptStoreError(f"{where}: writers.{name}: expected holder, epoch and expires, got {str(e)[:200]}")
        if e.get("pointer") is not None:
            _snapshot.check_pointer(e["pointer"], f"{where}: writers.{name}.pointer")
    return body


def read_group(fs: Any, root: str, url: str) -> tuple[dict[str, Any], str]:
    """The checked ``group.json`` at ``url`` and its token (``StoreNotFoundError``: none)."""
    raw, token = _read_raw(fs, root, url)
    if raw is None or token is None:
        raise errors.StoreNotFoundError(f"{url}/{GROUP}: expected a writer group (mb.convert.publish(src, url, "
                                        "writer=...)), found none")
    return parse_group(raw, f"{url}/{GROUP}"), token


def is_group(fs: Any, root: str, url: str) -> bool:
    with remote_errors(url):
        return bool(fs.exists(join(root, GROUP)))


# -- publishing ---------------------------------------------------------------------------
def _check_cas(fs: Any, url: str) -> None:
    if not (_is_s3(fs) or _is_local(fs)):
        raise errors.InvalidArgumentError(f"url: expected s3:// or file:// for a writer group (they offer "
                                          f"compare-and-swap), got {url!r}")


def publish_writer(fs: Any, root: str, url: str, store: Path, *, writer: str, holder: str, lease: float, keep: int,
                   generation: int, digests: Mapping[str, tuple[int, str]] | None = None,
                   memo: Path | None = None) -> dict[str, Any]:
    """Publish the local ``store`` as writer ``writer``'s next snapshot in the group at
    ``url``: claim the name, upload, swap the pointer into ``group.json``, prune
    (``digests``, ``memo``: as ``_snapshot.upload_snapshot``'s)."""
    _check_cas(fs, url)
    name = check_writer(writer)
    if not lease > 0:
        raise errors.InvalidArgumentError(f"lease: expected seconds > 0, got {lease!r}")
    fs.invalidate_cache()
    claimed: dict[str, Any] = {}

    def claim(body: dict[str, Any] | None) -> dict[str, Any]:
        body = body or {"format": _FORMAT, "version": _VERSION, "sequence": 0, "writers": {}}
        entry, now = body["writers"].get(name), time.time()
        if entry is not None and entry["holder"] != holder and entry["expires"] > now:
            raise errors.LockedError(
                f"{url}: writer {name!r}: expected no other publisher, got {entry['holder']!r} holding it for "
                f"{entry['expires'] - now:.0f} s more (its lease); nothing was changed")
        epoch = 1 if entry is None else entry["epoch"] + (entry["holder"] != holder)
        new = {"pointer": None if entry is None else entry.get("pointer"), "holder": holder, "epoch": epoch,
               "expires": now + lease}
        claimed.clear()
        claimed.update(new)
        return {**body, "sequence": body["sequence"] + 1, "writers": {**body["writers"], name: new}}

    _transact(fs, root, url, claim)
    base = claimed["pointer"]
    w_root, w_url = join(root, WRITERS, name), writer_url(url, name)
    pointer, summary = _snapshot.upload_snapshot(fs, w_root, w_url, store, base, generation=generation, digests=digests,
                                                 memo=memo)

    def point(body: dict[str, Any] | None) -> dict[str, Any]:
        entry = None if body is None else body["writers"].get(name)
        if entry is None or body is None or entry["holder"] != holder or entry["epoch"] != claimed["epoch"] or (
                entry.get("pointer") or {}).get("snapshot") != (base or {}).get("snapshot"):
            got = "nothing" if entry is None else f"holder {entry['holder']!r}, epoch {entry['epoch']}"
            raise errors.LockedError(
                f"{url}: writer {name!r}: expected to be its only publisher (holder {holder!r}, epoch "
                f"{claimed['epoch']}), got {got} and another snapshot published since this publish began; "
                f"snapshot {pointer['snapshot']} is not published")
        new = {**entry, "pointer": pointer, "expires": time.time() + lease}
        return {**body, "sequence": body["sequence"] + 1, "writers": {**body["writers"], name: new}}

    body = _transact(fs, root, url, point)
    summary["pruned"] = _snapshot.prune(fs, w_root, keep, pointer["snapshot"])
    summary.update(url=url, writer=name, epoch=claimed["epoch"], group_sequence=body["sequence"])
    return summary


def entries(body: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The published writers of a group body: name -> snapshot pointer (sorted by name)."""
    return {n: dict(e["pointer"]) for n, e in sorted(body["writers"].items()) if e.get("pointer") is not None}
