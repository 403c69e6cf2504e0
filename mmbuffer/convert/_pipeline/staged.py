"""The copy a publish keeps between publishes, brought up to date by the rows written since.

A publish uploads the objects of a compressed copy of the store whose digests changed
(``publish.py``). Making that copy whole is the part of a publish that grows with the
store (every row compressed and read back). So the copy of the last publish stays in a
*work directory* (``cache_dir/publish/<key>/store``, the key naming the source store's
path and the URL), and the next publish appends to it, lane by lane, only the rows the
source wrote since, with their episode ends and final observations, then copies the
stored priorities of every live row (4 bytes a row) and the ``attrs``. The copy keeps the
source's rows (``copy_local(keep_rows=True)``), so what it holds is what a whole copy
would hold, and only the chunks of new rows change.

Appending needs the copy to be an earlier state of this source. It is checked before
anything is written: the same schema and options, every lane of the copy at or behind
the source's and not lapped by it, the source's oldest live episode starting at an
episode start of the copy, the same episode ends between there and the copy's end, and
the copy's last rows (up to 64 a lane) byte-equal to the source's (but a JPEG column's). Otherwise (the first
publish, other options, a source rewritten or replaced, a damaged copy, a store made
before store ids) the copy is made whole again, as before this module. A JPEG column's
shard files the append wrote (re-encoded from the decode) are then replaced by the
source's own, as after a whole copy (``publish.keep_lossy_shards(since=...)``).
Episodes that the copy kept but the source's readers left out (a live writer had
reserved their rows) are left out of the copy's readers the same way: its reservation
is raised to the source's oldest live episode plus a lane (``progress.raise_reservation``).
A second publish of the same store to the same URL at the same time (the work directory
is locked), or one whose cache directory cannot be written, copies into a temporary
directory instead. Work directories no publish used for two weeks are removed by the
next publish (:func:`prune_unused`).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ... import errors
from ..._disk.files import atomic_write_json
from ..._disk.format import parse_codec
from ..._ledger import progress
from ..._ledger.manifest import load_manifest
from ...buffer import Buffer
from ...opening import open as open_buffer
from ...remote._objects import FileDigests
from .copy import CopyWriter, copy_local, verify_episodes, writer_options
from .frame import Mismatch
from .reader import jsonable
from .walk import Plan

__all__ = ["Staged", "TailWriter", "prune_unused", "staged_copy", "work_dir"]

_CHECKED_ROWS = 64  # the copy's last rows per lane compared with the source's
_DIGESTS = "digests.json"  # beside the copy: the memo of its files' digests
_TABLE_PARTS = "table-parts"  # beside the copy: the parts of the object table published last
_SOURCE = "source.json"  # beside the copy: the store_id of the store it copies
_OURS = {"LOCK", "store", "store.partial", _DIGESTS, _SOURCE, _DIGESTS + ".partial", _SOURCE + ".partial"}
_NAME = re.compile(r"^[0-9a-f]{20}$")
_UNUSED_FOR = 14 * 86400.0  # a work directory no publish used for two weeks is removed


class _Stale(Exception):
    """The work directory's copy is not an earlier state of the source: copy whole."""


def work_dir(src: Any, url: str, base: Path) -> Path | None:
    """``base/publish/<key>`` for the local store ``src`` (a path or an open ``Buffer``)
    published to ``url``; None for a source that is not a local store."""
    where = getattr(src, "path", src)
    if not isinstance(where, (str, os.PathLike)) or "://" in str(where) or getattr(src, "remote", None) is not None:
        return None
    key = hashlib.sha256(f"{Path(where).resolve()}\0{url.rstrip('/')}".encode()).hexdigest()[:20]
    return base / "publish" / key


@dataclass
class Staged:
    """An up-to-date copy for a publish: its ``path``, the copy's ``summary``, and the work
    directory it stays in (None: a temporary copy)."""

    path: Path
    summary: dict[str, Any]
    work: Path | None
    #: when the rows appended began to be written (``time.time_ns()``); None: a whole copy
    since: int | None = None
    _digests: FileDigests | None = field(default=None, init=False, repr=False)

    def digests(self) -> FileDigests | None:
        """``rel -> (size, digest)`` of the copy's files, each read again only where it
        changed since the last publish (``_objects.FileDigests``; :meth:`keep` saves the
        memo in the work directory); None for a temporary copy (the engines read every file)."""
        if self.work is None:
            return None
        where = self.work / _DIGESTS
        try:
            memo = json.loads(where.read_bytes()) if where.is_file() else {}
        except ValueError:
            memo = {}
        self._digests = FileDigests(self.path, memo if isinstance(memo, dict) else {})
        return self._digests

    def memo(self) -> Path | None:
        """Where a publish keeps the parts of the object table it published last, so the
        next one reads none of them back (``_parts.remember``); None for a temporary copy."""
        return None if self.work is None else self.work / _TABLE_PARTS

    def keep(self) -> None:
        """Save the digests asked for (after a publish that used them)."""
        if self.work is not None and self._digests is not None:
            atomic_write_json(self.work / _DIGESTS, self._digests.memo(), durable=False)  # lost: files read once more


@contextlib.contextmanager
def staged_copy(src: Any, work: Path | None, *, tmp_dir: Any, **options: Any) -> Iterator[Staged]:
    """An up-to-date copy of ``src`` for a publish (module docstring): in ``work`` when it is
    given and free, else in a temporary directory removed on exit. ``options`` are
    :func:`copy_local`'s; the summary adds ``incremental`` (rows appended to the last
    publish's copy) and ``rows_copied``."""
    lock = _lock(work) if work is not None else None
    if lock is None:
        with tempfile.TemporaryDirectory(prefix="mmbuffer-publish-", dir=tmp_dir) as tmp:
            summary = copy_local(src, Path(tmp) / "store", keep_rows=True, **options)
            yield Staged(Path(tmp) / "store", {**summary, "incremental": False, "rows_copied": summary["rows"]}, None)
        return
    assert work is not None
    try:
        prune_unused(work.parent)
        store = work / "store"
        since = time.time_ns() - 1_000_000_000  # file times are coarse: a second early (older files taken again)
        summary = _bring_up_to_date(src, store, options)
        yield Staged(store, summary, work, since if summary["incremental"] else None)
    finally:
        os.close(lock)


def prune_unused(folder: Path, unused_for: float = _UNUSED_FOR) -> list[Path]:
    """Remove the work directories in ``folder`` (``cache_dir/publish``) that no publish
    has used for ``unused_for`` seconds (each publish touches its ``LOCK``) and none holds
    now; only what this module makes (a 20-hex-digit name holding only its own files) is
    ever removed. Returns those removed."""
    gone = []
    cutoff = time.time() - unused_for
    for work in folder.iterdir() if folder.is_dir() else ():
        try:
            if (not _NAME.match(work.name) or work.is_symlink() or not work.is_dir()
                    or not set(os.listdir(work)) <= _OURS or (work / "LOCK").stat().st_mtime > cutoff):
                continue
        except OSError:
            continue
        lock = _lock(work, touch=False)
        if lock is not None:
            try:
                shutil.rmtree(work)
                gone.append(work)
            finally:
                os.close(lock)
    return gone


def _lock(work: Path, touch: bool = True) -> int | None:
    """An exclusive lock on ``work`` (made if missing; ``touch``: its ``LOCK`` marked used
    now), or None when another publish holds it, the directory was just removed as unused
    (:func:`prune_unused`), or it cannot be made (a read-only cache: the publish copies to a
    temporary directory, as without a work directory)."""
    try:
        work.mkdir(parents=True, exist_ok=True)
        fd = os.open(work / "LOCK", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.fstat(fd).st_ino != os.stat(work / "LOCK", follow_symlinks=False).st_ino:
            raise FileNotFoundError  # pruned between the open and the lock
        if touch:
            os.utime(fd)
    except OSError:
        os.close(fd)
        return None
    return fd


def _bring_up_to_date(src: Any, store: Path, options: Mapping[str, Any]) -> dict[str, Any]:
    """Append to ``store`` what ``src`` wrote since, or copy it whole there."""
    source = store.parent / _SOURCE  # the store_id of the store the copy is of
    if store.is_dir():
        verify = bool(options.get("verify", True))
        writer = TailWriter(src, store, copied=_read_id(source), **writer_options(**options))
        try:
            writer.open()
            try:
                writer.write(store)
                if verify:
                    writer.verify(store)
            except BaseException as exc:
                writer.abort()
                shutil.rmtree(store)  # half appended, or not what the source holds
                if isinstance(exc, Mismatch):  # not kept for inspection, as a whole copy's output is
                    raise errors.ConversionError(f"{exc.problem} (the publish's copy was removed: the next "
                                                 "publish copies the store whole)") from exc
                if not isinstance(exc, errors.RowNotLiveError):
                    raise  # the next publish copies whole; rows the source's writer lapped: now, below
            else:
                return {**writer.summary, "out": str(store), "verified": verify}
        except _Stale:
            shutil.rmtree(store)  # this module's own copy, not an earlier state of the source
        finally:
            writer.close()
    # read before the copy: a store replaced meanwhile then has another id than the one recorded
    store_id = src.store.manifest.store_id if isinstance(src, Buffer) else load_manifest(Path(src)).store_id
    summary = copy_local(src, store, keep_rows=True, **options)
    atomic_write_json(source, {"store_id": store_id})
    return {**summary, "incremental": False, "rows_copied": summary["rows"]}


def _read_id(path: Path) -> str:
    """The ``store_id`` recorded in ``path`` ("" when none can be read)."""
    try:
        got = json.loads(path.read_bytes()).get("store_id", "")
    except (OSError, ValueError, AttributeError):
        return ""
    return got if isinstance(got, str) else ""


class TailWriter(CopyWriter):
    """Appends to ``onto`` (a copy of an earlier state of ``src`` that kept its rows) the
    rows written since; refuses with :class:`_Stale` before writing when it is not one."""

    def __init__(self, src: Any, onto: Path, *, copied: str, **options: Any) -> None:
        super().__init__(src, keep_rows=True, **options)
        self.onto = onto
        self.copied = copied  # the store_id of the store ``onto`` is a copy of
        self.whole: Plan | None = None
        self.whole_lanes: np.ndarray | None = None
        self.ends = np.zeros(0, np.int64)  # the absolute end of each episode of the whole plan
        self.drop_below: list[int] = []

    def open(self) -> None:
        super().open()
        buf, view = self.buf, self.view
        if not self.copied or buf.store.manifest.store_id != self.copied:
            raise _Stale  # another store (or one made before store ids): no earlier state of this one
        if self.starts is None:
            raise _Stale
        try:
            old = open_buffer(str(self.onto), mode="r")
        except errors.MMBufferError:
            raise _Stale from None
        self.ends = _absolute_ends(self.plan, view)
        with old:
            self._check_schema(old)
            cut = [int(w) for w in old.view().written]
            self._check_lanes(old, cut)
        self.whole, self.whole_lanes = self.plan, self.lanes
        self.plan = _since(self.plan, self.ends, np.asarray(cut, np.int64), buf.layout)
        self.lanes = self.plan.lanes
        self.layout.starts[:] = cut
        self.drop_below = [int(lv.first_start) for lv in view.lanes]

    def _check_schema(self, old: Buffer) -> None:
        buf, layout = self.buf, self.layout
        same = (
            {k: (tuple(c.shape), str(c.dtype), c.codec) for k, c in old.columns.items()}
            == {k: (tuple(c.shape), str(c.dtype), self.codecs.get(k, c.codec)) for k, c in buf.columns.items()}
            and (old.capacity, old.num_streams) == (layout.capacity, layout.num_streams)
            and tuple(old.next_keys) == tuple(buf.next_keys)
            and old.compression == self.compression
            and old.priorities == layout.priorities
        )
        if not same:
            raise _Stale

    def _check_lanes(self, old: Buffer, cut: list[int]) -> None:
        """Each lane of ``old`` an earlier state of the source's (module docstring)."""
        buf, view, plan = self.buf, self.view, self.plan
        old_view = old.view()
        old_starts, old_lengths = old.episode_bounds(old_view)
        old_lanes = old.layout.lane(old_starts)
        # a JPEG column's rows read losslessly while staged, decoded once their shard is
        # written: the copy's and the source's may differ until both move on (not compared)
        lossless = [k for k, c in buf.columns.items() if c.codec is None or parse_codec(k, c.codec)[0] != "jpeg"]
        for lane, (lv, olv) in enumerate(zip(view.lanes, old_view.lanes)):
            first, end = int(lv.first_start), cut[lane]
            if not first <= end <= int(view.written[lane]):
                raise _Stale
            ends = self.ends[(plan.lanes == lane) & plan.complete]  # the source's complete episodes
            theirs = int(olv.first_start) + np.cumsum(old_lengths[old_lanes == lane])
            if first != int(olv.first_start) and first not in set(theirs.tolist()):
                raise _Stale
            if not np.array_equal(ends[ends <= end], theirs[theirs > first]):
                raise _Stale
            m = min(_CHECKED_ROWS, end - first)
            rows = buf.layout.rows(lane, np.arange(end - m, end))
            for name in lossless:
                if not np.array_equal(old.read(name, rows), buf.read(name, rows)):
                    raise _Stale

    def target(self, partial: Path, columns: dict[str, Any]) -> Buffer:
        return Buffer(self.onto, "a")

    def settle(self, out: Buffer) -> None:
        """Every live row's stored priority and the ``attrs``, as the source has them now."""
        buf, view = self.buf, self.view
        out.attrs = jsonable(dict(buf.attrs))
        if self.copy_leaves:
            rows = np.concatenate([buf.layout.rows(lane, np.arange(lv.first_start, w))
                                   for lane, (lv, w) in enumerate(zip(view.lanes, view.written.tolist()))])
            out.set_leaf_priorities(rows, buf.leaf_priorities(rows))

    def write(self, partial: Path) -> None:
        super().write(partial)
        lanes = load_manifest(self.onto).lanes
        if any(st.first_start < keep for st, keep in zip(lanes, self.drop_below)):
            ls = self.layout.lane_size
            progress.raise_reservation(self.onto, [max(st.written, keep + ls) for st, keep in zip(lanes, self.drop_below)])
        assert self.whole is not None
        self.summary.update(rows_copied=self.summary["rows"], rows=self.whole.rows, incremental=True,
                            episodes=int(self.whole.complete.sum()),
                            open_episode_rows=int(self.whole.lengths[~self.whole.complete].sum()))

    def verify(self, partial: Path) -> None:
        assert self.whole is not None and self.whole_lanes is not None
        verify_episodes(partial, self.whole, self.whole_lanes)


def _absolute_ends(plan: Plan, view: Any) -> np.ndarray:
    """The absolute end row of each episode of ``plan`` (each lane's from its
    ``view.first_start`` on, in order)."""
    cum = np.cumsum(plan.lengths)
    lanes, first = np.unique(plan.lanes, return_index=True)
    before = (cum - plan.lengths)[first]  # rows planned before each lane's first episode
    at = np.searchsorted(lanes, plan.lanes)
    out: np.ndarray = cum - before[at] + view.first_starts[plan.lanes]
    return out


def _since(plan: Plan, ends: np.ndarray, cut: np.ndarray, layout: Any) -> Plan:
    """The part of ``plan`` (episodes ending at absolute rows ``ends``) after absolute row
    ``cut[lane]`` of each lane: the episode holding it begins there."""
    keep = ends > cut[plan.lanes]
    same_lane = np.r_[False, plan.lanes[1:] == plan.lanes[:-1]]
    head = keep & ~(same_lane & np.r_[False, keep[:-1]])  # each lane's first episode kept
    starts, lengths = plan.starts.copy(), plan.lengths.copy()
    lanes = plan.lanes[head]
    lengths[head] = ends[head] - cut[lanes]
    starts[head] = layout.rows(lanes, cut[lanes])
    return Plan(starts[keep], lengths[keep], plan.complete[keep], plan.lanes[keep], plan.lane_size)
