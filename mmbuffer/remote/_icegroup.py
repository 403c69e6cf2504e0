"""Writer groups in one Icechunk repository: many hosts commit side by side, a reader
samples every writer at one commit.

Layout of the repository (``publish(src, url, writer=NAME, engine="icechunk")``)::

    zarr.json                    a group; attributes ``mmbuffer_group`` (format, version)
    writers/zarr.json            a group
    writers/NAME/...             writer NAME's store, as ``_icechunk.py`` publishes one at the
                                 root (its ``zarr.json`` attributes ``mmbuffer`` also hold the
                                 lease: ``holder``, ``epoch``, ``expires``)

Each writer writes only under ``writers/NAME/``. A commit that lost the race to another
writer's is rebased with Icechunk's ``ConflictDetector``: different writers touch
different nodes, so it applies and commits. Two publishers of one name both change
``writers/NAME/zarr.json``: the rebase of the later one fails (a metadata double
update) and it gets :class:`~mmbuffer.errors.LockedError`, its session dropped, the
repository unchanged by it: one publisher per name, enforced by Icechunk's
compare-and-swap of the branch tip, not by convention. The lease (as in ``_group.py``)
refuses a second holder between publishes too. A killed publisher commits nothing.

A reader (``mb.open_group(url)``) reads the branch tip once and opens each writer's
store there: one consistent commit for all. A writer's snapshot label is its table's
digest, so a refresh after another writer published reuses the unchanged writers'
mirrors and buffers.

>>> import tempfile, numpy as np, mmbuffer as mb
>>> d = tempfile.mkdtemp()
>>> for w in ("host-0", "host-1"):
...     with mb.create(f"{d}/{w}", {"x": ((), "float32")}, capacity=64, next_keys=()) as buf:
...         buf.extend({"x": np.arange(40), "terminated": np.arange(40) % 10 == 9})
...     _ = mb.convert.publish(f"{d}/{w}", f"file://{d}/repo", writer=w, engine="icechunk", progress=False)
>>> with mb.open_group(f"file://{d}/repo", cache_dir=d + "/cache") as g:
...     g.writers, g.num_episodes
(('host-0', 'host-1'), 8)
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .. import errors
from .._disk import format as fmt
from . import _icechunk as icechunk_repo
from ._group import WRITERS, check_writer, writer_url
from ._objects import remote_errors

__all__ = ["ATTR", "GroupRepo", "is_group_repo", "publish_writer_repo"]

ATTR = "mmbuffer_group"
_FORMAT = {"format": "mmbuffer-group", "version": 1}
_TRIES = 50


def _group_meta(attrs: Mapping[str, Any]) -> bytes:
    return json.dumps({"zarr_format": 3, "node_type": "group", "attributes": dict(attrs)}).encode()


def _kind(session: Any, url: str) -> bool:
    """Whether the repository already is a writer group (False: empty); anything else is
    ``StoreExistsError``."""
    raw = icechunk_repo.get(session.store, "zarr.json")
    if raw is None:
        return False
    attrs = json.loads(raw).get("attributes") or {}
    if attrs.get(ATTR) != _FORMAT:
        raise errors.StoreExistsError(f"{url}: expected an empty repository or a writer group, got "
                                      f"{'a store published without writer=' if 'mmbuffer' in attrs else 'other data'}; "
                                      "nothing was changed")
    return True


def publish_writer_repo(url: str, store: Path, storage_options: Mapping[str, Any] | None, *, writer: str,
                        holder: str, lease: float, generation: int, keep: int = 3,
                        digests: Mapping[str, tuple[int, str]] | None = None) -> dict[str, Any]:
    """Commit the local ``store`` as writer ``writer``'s next version in the group repository
    at ``url`` (created if the prefix is empty): only its changed objects are written; the
    ``keep`` newest commits of the group stay readable, and objects younger than ``lease``
    (another writer's publish under way) are never deleted (``_icechunk.expire``). ``digests``:
    as ``_icechunk.stage``'s."""
    ic = icechunk_repo.load()
    name = check_writer(writer)
    if not lease > 0:
        raise errors.InvalidArgumentError(f"lease: expected seconds > 0, got {lease!r}")
    repo = icechunk_repo.open_for_publish(url, storage_options)
    prefix = f"{WRITERS}/{name}/"
    manifest = json.loads((store / fmt.MANIFEST).read_bytes())
    for _ in range(_TRIES):
        with remote_errors(url):
            session = repo.writable_session(icechunk_repo.BRANCH)
        new = not _kind(session, url)
        prev = icechunk_repo.head_attrs(session, prefix)[1]
        now = time.time()
        if prev is not None and prev.get("holder") != holder and float(prev.get("expires", 0)) > now:
            raise errors.LockedError(
                f"{url}: writer {name!r}: expected no other publisher, got {prev.get('holder')!r} holding it for "
                f"{float(prev['expires']) - now:.0f} s more (its lease); nothing was changed")
        epoch = 1 if prev is None else int(prev.get("epoch", 0)) + (prev.get("holder") != holder)
        seq = 1 if prev is None else int(prev["sequence"]) + 1
        if new:
            from zarr.core.buffer import default_buffer_prototype

            proto = default_buffer_prototype().buffer
            icechunk_repo.put(session.store, "zarr.json", proto.from_bytes(_group_meta({ATTR: _FORMAT})))
            icechunk_repo.put(session.store, f"{WRITERS}/zarr.json", proto.from_bytes(_group_meta({})))
        attrs = {"manifest": manifest, "sequence": seq, "generation": generation, "holder": holder, "epoch": epoch,
                 "expires": now + lease}
        written, sent = icechunk_repo.stage(session, store, attrs, prefix, previous=prev is not None, digests=digests)
        message = f"mmbuffer publish {name} {seq} (generation {generation})"
        try:
            with remote_errors(url):
                snap = _commit(ic, session, message)
        except ic.RebaseFailedError as exc:
            paths = [str(c.path) for c in exc.conflicts]
            if any(p == f"/{WRITERS}/{name}" or p.startswith(f"/{WRITERS}/{name}/") for p in paths):
                raise errors.LockedError(
                    f"{url}: writer {name!r}: expected to be its only publisher (holder {holder!r}), got a commit "
                    f"of the same writer since this publish began ({', '.join(paths[:3])}); nothing was changed "
                    "by this publish") from None
            continue  # another writer created the group's nodes first: begin again on its commit
        return {"url": url, "snapshot": str(snap), "sequence": seq, "pruned": icechunk_repo.expire(repo, url, keep, lease),
                "objects_written": written, "bytes_written": sent, "writer": name, "epoch": epoch}
    raise errors.LockedError(f"{url}: expected to commit writer {name!r}, got {_TRIES} conflicts in a row")


def _commit(ic: Any, session: Any, message: str) -> str:
    """Commit, rebasing over the commits of other writers meanwhile (``RebaseFailedError``
    when one of them changed a node this session changed too)."""
    while True:
        try:
            return str(session.commit(message))
        except ic.ConflictError:
            session.rebase(ic.ConflictDetector())


class GroupRepo:
    """The writer group in the Icechunk repository at ``url``, as a reader sees it."""

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None) -> None:
        self.url = url
        self.root = icechunk_repo.Repo(url, storage_options)

    def read(self) -> dict[str, Any]:
        """The branch tip: ``{"sequence": publishes held, "writers": {name: pointer}}``, each
        pointer as ``Repo.table`` reads it (label, commit, sequence, objects, manifest)."""
        with remote_errors(self.url):
            commit = str(self.root.repo.lookup_branch(icechunk_repo.BRANCH))
            session = self.root.repo.readonly_session(snapshot_id=commit)
        if not _kind(session, self.url):
            raise errors.StoreNotFoundError(f"{self.url}: expected a writer group, found an empty repository")
        writers: dict[str, Any] = {}
        for name in sorted(icechunk_repo.list_dir(session.store, f"{WRITERS}/")):
            if name == "zarr.json":
                continue
            try:
                check_writer(name)
            except errors.InvalidArgumentError:
                raise errors.CorruptStoreError(f"{self.url}/{WRITERS}: expected writer names, got {name!r}") from None
            attrs = icechunk_repo.head_attrs(session, f"{WRITERS}/{name}/")[1]
            if attrs is None:
                continue  # a folder without a published store
            where = f"{self.url}/{WRITERS}/{name}/zarr.json"
            try:
                seq, objects, manifest = int(attrs["sequence"]), str(attrs["objects"]), attrs["manifest"]
                generation = int(attrs.get("generation", 0))
            except (KeyError, TypeError, ValueError):
                raise errors.CorruptStoreError(f"{where}: expected sequence, objects and manifest attributes") from None
            if not isinstance(manifest, dict) or not objects.isalnum():
                raise errors.CorruptStoreError(f"{where}: expected a manifest object and a hex digest")
            writers[name] = {"snapshot": f"s{seq}-{objects}", "commit": commit, "sequence": seq, "objects": objects,
                             "manifest": manifest, "generation": generation}
        return {"sequence": sum(p["sequence"] for p in writers.values()), "writers": writers}

    def writer(self, name: str) -> icechunk_repo.Repo:
        """A reader of writer ``name``'s store (its own sessions, the repository shared)."""
        return icechunk_repo.Repo(writer_url(self.url, name), None, prefix=f"{WRITERS}/{name}/",
                                  repo=self.root.repo)


def is_group_repo(url: str, storage_options: Mapping[str, Any] | None) -> bool:
    """Whether ``url`` holds an Icechunk repository that is a writer group."""
    if not icechunk_repo.is_repo(url, storage_options):
        return False
    try:
        GroupRepo(url, storage_options).read()
    except (errors.StoreNotFoundError, errors.StoreExistsError):
        return False
    return True
