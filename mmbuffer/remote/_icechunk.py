"""Publishing through Icechunk: incremental, transactional, one publisher at a time.

``mb.convert.publish(src, url, engine="icechunk")`` keeps the store at ``url`` as an
Icechunk repository (Zarr on object storage, serializable commits by conditional PUT).
A publish compresses the store locally (``copy``), packs the raw arrays (index, flags,
tree) into zstd chunks (``_dense.py``), compares each object's BLAKE2b-128 digest with
the table of the previous commit, writes only the objects that changed (new rows'
chunks, the index and tree chunks they touched) into one writable session,
and commits it: readers see the previous commit or the new one, never a mix. The
commit names its parent, so a second publisher that began from the same commit gets
:class:`~mmbuffer.errors.LockedError` (Icechunk's ``ConflictError``) and changes
nothing; a killed publisher leaves the last commit readable.

What a commit holds, besides the store's own Zarr keys: the root group's attributes
``mmbuffer`` (the store's manifest, sequence, generation, and the digest of the object
table), and the array ``mmbuffer_objects`` (the table: each object's size and digest,
JSON bytes), which the reader checks every object against (``_objects.py``), since
Icechunk does not checksum native chunks. ``zarr.open_group(session.store)`` reads
the published store without mmbuffer.

>>> import tempfile, numpy as np, mmbuffer as mb
>>> d = tempfile.mkdtemp()
>>> with mb.create(d + "/local", {"x": ((), "float32")}, capacity=64, next_keys=()) as buf:
...     buf.extend({"x": np.arange(40), "terminated": np.arange(40) % 10 == 9})
>>> url = "file://" + d + "/repo"
>>> mb.convert.publish(d + "/local", url, engine="icechunk", progress=False)["sequence"]
1
>>> with mb.open(url, mode="r", cache_dir=d + "/cache") as ro:
...     ro.num_episodes
4
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from .. import errors
from .._disk import format as fmt
from ._objects import OBJECTS, FetchMany, Table, digest, parse_table, remote_errors, store_objects, table_bytes

__all__ = ["BRANCH", "Repo", "get", "head_attrs", "is_repo", "list_dir", "load", "open_for_publish", "publish_repo", "put", "expire",
           "stage", "storage"]

BRANCH = "main"
TABLE = "mmbuffer_objects"
_ATTR = "mmbuffer"


def load() -> Any:
    try:
        import icechunk
    except ImportError:  # pragma: no cover - the "cloud" extra
        raise errors.InvalidArgumentError("engine: expected the 'cloud' extra (pip install 'mmbuffer[cloud]') for Icechunk") from None
    return icechunk


def storage(url: str, storage_options: Mapping[str, Any] | None) -> Any:
    """The Icechunk storage of ``url`` (``s3://`` with ``storage_options``/``AWS_*``, or ``file://``)."""
    ic = load()
    scheme, _, rest = url.partition("://")
    opts = dict(storage_options or {})
    if scheme in ("file", "local"):
        return ic.local_filesystem_storage(str(Path("/" + rest.lstrip("/"))))
    if scheme not in ("s3", "s3a"):
        raise errors.InvalidArgumentError(f"url: expected s3:// or file:// for engine='icechunk', got {url!r}")
    bucket, _, prefix = rest.partition("/")
    client = dict(opts.get("client_kwargs") or {})
    endpoint = opts.get("endpoint_url") or client.get("endpoint_url") or os.environ.get("AWS_ENDPOINT_URL_S3") \
        or os.environ.get("AWS_ENDPOINT_URL")
    region = client.get("region_name") or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    kw: dict[str, Any] = dict(bucket=bucket, prefix=prefix.rstrip("/") or None, region=region)
    if endpoint:
        kw.update(endpoint_url=endpoint, allow_http=str(endpoint).startswith("http://"), force_path_style=True)
    if opts.get("anon"):
        kw["anonymous"] = True
    elif opts.get("key") and opts.get("secret"):
        kw.update(access_key_id=opts["key"], secret_access_key=opts["secret"], session_token=opts.get("token"))
    else:
        kw["from_env"] = True
    return ic.s3_storage(**kw)


def _sync(coro: Any) -> Any:
    from zarr.core.sync import sync

    return sync(coro)


def get(store: Any, key: str) -> bytes | None:
    from zarr.core.buffer import default_buffer_prototype

    buf = _sync(store.get(key, default_buffer_prototype()))
    return None if buf is None else bytes(buf.to_bytes())


def put(store: Any, key: str, value: Any) -> None:
    """``store[key] = value`` (a zarr buffer) in a writable session's store."""
    _sync(store.set(key, value))


def list_dir(store: Any, prefix: str) -> list[str]:
    """The names directly under ``prefix`` (ending in ``/``) in a session's store."""
    async def names() -> list[str]:
        return [k async for k in store.list_dir(prefix)]

    return list(_sync(names()))


def is_repo(url: str, storage_options: Mapping[str, Any] | None) -> bool:
    """Whether ``url`` holds an Icechunk repository."""
    with remote_errors(url):
        return bool(load().Repository.exists(storage(url, storage_options)))


class Repo:
    """The commits of an Icechunk repository at ``url``, as a reader sees them."""

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None, *, prefix: str = "",
                 repo: Any = None) -> None:
        self.url, self.prefix = url, prefix  # prefix: a writer's folder in a writer group's repository
        if repo is None:
            with remote_errors(url):
                repo = load().Repository.open(storage(url, storage_options))
        self.repo = repo
        self._sessions: dict[str, Any] = {}
        self._commits: dict[str, str] = {}  # a group writer's snapshot label -> the commit it is read at

    def pointer(self) -> dict[str, Any]:
        """The tip of ``main``: ``snapshot`` (Icechunk's id), ``sequence``, ``objects``, ``manifest``."""
        with remote_errors(self.url):
            snap = str(self.repo.lookup_branch(BRANCH))
            session = self.repo.readonly_session(snapshot_id=snap)
        raw = get(session.store, "zarr.json")
        attrs = (json.loads(raw).get("attributes") or {}).get(_ATTR) if raw else None
        if not isinstance(attrs, dict) or not isinstance(attrs.get("manifest"), dict):
            raise errors.StoreNotFoundError(f"{self.url}: expected a store published by mmbuffer (engine='icechunk'), "
                                            f"found a repository without one")
        self._sessions = {snap: session}
        return {"snapshot": snap, "sequence": int(attrs["sequence"]), "objects": str(attrs["objects"]),
                "manifest": attrs["manifest"], "generation": int(attrs.get("generation", 0))}

    def session(self, snapshot: str) -> Any:
        if snapshot not in self._sessions:
            with self.reading(snapshot):
                self._sessions[snapshot] = self.repo.readonly_session(snapshot_id=self._commits.get(snapshot, snapshot))
        return self._sessions[snapshot]

    @contextlib.contextmanager
    def reading(self, snapshot: str) -> Iterator[None]:
        """Icechunk's errors typed (``remote_errors``); one that leaves ``snapshot`` unreadable
        because a newer publish expired its commit is ``StoreNotFoundError`` (:meth:`check_alive`)."""
        try:
            with remote_errors(self.url):
                yield
        except errors.CorruptStoreError:
            self.check_alive(snapshot)
            raise

    def table(self, pointer: Mapping[str, Any]) -> Table:
        snap = str(pointer["snapshot"])
        if "commit" in pointer:  # a group writer's: its label is read at that commit
            self._commits[snap] = str(pointer["commit"])
        with self.reading(snap):
            raw = _read_table(self.session(snap).store, self.prefix)
        if raw is None or digest(raw) != pointer["objects"]:
            raise errors.CorruptStoreError(f"{self.url}@{snap}/{TABLE}: expected BLAKE2b-128 {pointer['objects']} "
                                           f"(named by the commit), got {None if raw is None else digest(raw)}")
        table = parse_table(raw, f"{self.url}@{snap}/{TABLE}", self.url, snap)
        if table.holders:
            raise errors.CorruptStoreError(f"{self.url}@{snap}/{TABLE}: expected no objects held elsewhere in a repository")
        return table

    def follow(self, snapshot: str, commit: str) -> None:
        """Read ``snapshot`` (a group writer's label, unchanged) at ``commit`` from now on: a
        newer commit that still holds it (an older one may be expired by a publish)."""
        if self._commits.get(snapshot, commit) != commit:
            self._commits[snapshot] = commit
            self._sessions.pop(snapshot, None)  # reads in flight keep the session they hold

    def check_alive(self, snapshot: str) -> None:
        """``StoreNotFoundError`` when the commit ``snapshot`` is read at is no longer in the
        branch's history: a newer publish expired it (``keep``) and its objects may be
        deleted, so a missing one is not an error of the store; ``refresh()`` moves on."""
        commit = self._commits.get(snapshot, snapshot)
        with remote_errors(self.url):
            kept = {str(c.id) for c in self.repo.ancestry(branch=BRANCH)}
        if commit not in kept:
            raise errors.StoreNotFoundError(
                f"{self.url}@{snapshot}: expected the commit this reader opened, got none: a newer publish expired it "
                "(publish's keep); call refresh()")

    def fetch_many(self, snapshot: str) -> FetchMany:
        """Fetch a batch of objects of ``snapshot`` concurrently (one request each through
        Icechunk's store, all in flight at once): name -> bytes, None where missing.
        ``probe`` asks nothing more (a missing object asks whether the commit was expired)."""
        from zarr.core.buffer import default_buffer_prototype

        proto = default_buffer_prototype()

        def fetch(rels: list[str], probe: bool = False) -> dict[str, bytes | None]:
            store = self.session(snapshot).store

            async def every() -> list[Any]:
                return list(await asyncio.gather(*(store.get(self.prefix + rel, proto) for rel in rels)))

            with self.reading(snapshot):
                got = _sync(every())
            if any(b is None for b in got):
                self.check_alive(snapshot)
            return {rel: None if b is None else bytes(b.to_bytes()) for rel, b in zip(rels, got)}

        return fetch

    def fetch(self, snapshot: str, rel: str) -> bytes:
        with self.reading(snapshot):
            data = get(self.session(snapshot).store, self.prefix + rel)
        if data is None:
            raise FileNotFoundError(rel)
        return data


def _read_table(store: Any, prefix: str = "") -> bytes | None:
    meta = get(store, f"{prefix}{TABLE}/zarr.json")
    if meta is None:
        return None
    n = int(json.loads(meta)["shape"][0])
    return (get(store, f"{prefix}{TABLE}/c/0") or b"")[:n] if n else b""


def _table_meta(n: int) -> bytes:
    return json.dumps({"zarr_format": 3, "node_type": "array", "shape": [n], "data_type": "uint8",
                       "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [max(n, 1)]}},
                       "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
                       "fill_value": 0, "codecs": [{"name": "bytes"}], "attributes": {}}).encode()


def open_for_publish(url: str, storage_options: Mapping[str, Any] | None) -> Any:
    """The Icechunk repository at ``url``, created if the prefix is empty (``StoreExistsError``
    if it holds other objects)."""
    ic = load()
    with remote_errors(url):
        where = storage(url, storage_options)
        if not ic.Repository.exists(where):
            from .._disk.urls import filesystem

            fs, root = filesystem(url, storage_options)
            if fs.exists(root) and fs.find(root):
                raise errors.StoreExistsError(
                    f"{url}: expected an empty prefix or an Icechunk repository mmbuffer published, got other objects "
                    "(a store published with engine='snapshots'?); nothing was changed")
        return ic.Repository.open_or_create(where)


def head_attrs(session: Any, prefix: str = "") -> tuple[bool, dict[str, Any] | None]:
    """Whether ``prefix`` holds a group in ``session``, and its ``mmbuffer`` attributes
    (a store published there; None if none)."""
    head = get(session.store, f"{prefix}zarr.json")
    if head is None:
        return False, None
    attrs = (json.loads(head).get("attributes") or {}).get(_ATTR)
    return True, attrs if isinstance(attrs, dict) else None


def stage(session: Any, store: Path, attrs: Mapping[str, Any], prefix: str = "", *, previous: bool,
          digests: Mapping[str, tuple[int, str]] | None = None) -> tuple[int, int]:
    """Write into ``session`` the local ``store`` under ``prefix``: its objects whose digest
    differs from the table published there before (``previous``), its root ``zarr.json``
    with ``attrs`` and the new table's digest as attributes ``mmbuffer``, the table, and
    deletions of objects it no longer has. Returns (objects written, bytes written).
    ``digests``: ``rel -> (size, digest)`` of files known already (``_objects.FileDigests``)."""
    from zarr.core.buffer import default_buffer_prototype

    proto = default_buffer_prototype()
    old: dict[str, list[Any]] = {}
    if previous:
        raw = _read_table(session.store, prefix)
        old = json.loads(raw)["objects"] if raw else {}
    paths, entries, packed = store_objects(store, digests)  # raw arrays as chunks: only changed ones go
    entries = {rel: e for rel, e in entries.items() if rel not in (fmt.MANIFEST, "zarr.json", OBJECTS)}
    table = table_bytes(entries, None, packed)
    root = json.loads((store / "zarr.json").read_bytes())
    root.setdefault("attributes", {})[_ATTR] = {**attrs, "objects": digest(table)}
    # parents before children (Icechunk refuses a node whose group does not exist), then the chunks
    changed = sorted((rel for rel in entries if old.get(rel) != list(entries[rel])),
                     key=lambda r: (not r.endswith("zarr.json"), r.count("/"), r))
    writes = [("zarr.json", json.dumps(root).encode())] + [(rel, b"") for rel in changed] + [
        (f"{TABLE}/zarr.json", _table_meta(len(table))), (f"{TABLE}/c/0", table)]
    sent = 0
    for key, data in writes:
        if not data:
            value = paths[key]
            data = value if isinstance(value, bytes) else value.read_bytes()
        put(session.store, prefix + key, proto.buffer.from_bytes(data))
        sent += len(data)
    for rel in sorted(set(old) - set(entries), reverse=True):
        _sync(session.store.delete(prefix + rel))
    return len(changed), sent


def expire(repo: Any, url: str, keep: int, grace: float = 0.0) -> list[str]:
    """Once ``main`` holds ``2 * keep`` commits, expire those older than its ``keep`` newest
    and delete the objects no commit left holds (Icechunk's ``expire_snapshots`` and
    ``garbage_collect``; every ``keep`` publishes, so the scan is amortized). Objects
    written in the last ``grace`` seconds stay whatever holds them (another writer's
    publish under way). A repository with other branches or tags (someone else's history)
    is left as it is. Returns the expired commits' ids."""
    import datetime

    with remote_errors(url):
        commits = [c for c in repo.ancestry(branch=BRANCH)][:-1]  # the last: the repository's first, empty
        if len(commits) < 2 * keep or set(repo.list_branches()) != {BRANCH} or repo.list_tags():
            return []
        cutoff = commits[keep - 1].written_at
        expired = repo.expire_snapshots(older_than=cutoff)
        now = datetime.datetime.now(datetime.timezone.utc)
        repo.garbage_collect(min(cutoff, now - datetime.timedelta(seconds=grace)))
    return sorted(str(e) for e in expired)


def publish_repo(url: str, store: Path, storage_options: Mapping[str, Any] | None, *, generation: int,
                 keep: int = 3, digests: Mapping[str, tuple[int, str]] | None = None) -> dict[str, Any]:
    """Commit the local store ``store`` as the next version at ``url``: only changed objects are
    written; the ``keep`` newest commits stay readable (:func:`expire`). ``digests``: as
    :func:`stage`'s."""
    ic = load()
    repo = open_for_publish(url, storage_options)
    with remote_errors(url):
        session = repo.writable_session(BRANCH)
    exists, prev_attrs = head_attrs(session)
    if exists and prev_attrs is None:
        raise errors.StoreExistsError(f"{url}: expected an empty repository or one mmbuffer published; nothing was changed")
    seq = int(prev_attrs["sequence"]) + 1 if prev_attrs else 1
    manifest = json.loads((store / fmt.MANIFEST).read_bytes())
    written, sent = stage(session, store, {"manifest": manifest, "sequence": seq, "generation": generation},
                          previous=prev_attrs is not None, digests=digests)
    try:
        with remote_errors(url):
            snap = session.commit(f"mmbuffer publish {seq} (generation {generation})")
    except ic.ConflictError as exc:
        raise errors.LockedError(
            f"{url}: expected to be the only publisher, got a commit by another one since this publish began "
            f"({exc}); nothing was changed by this publish") from None
    return {"url": url, "snapshot": str(snap), "sequence": seq, "pruned": expire(repo, url, keep),
            "objects_written": written, "bytes_written": sent}
