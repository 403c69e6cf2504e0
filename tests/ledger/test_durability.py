"""Every durable write is synced before the commit point (issue 22, item 2).

No root, no fault-injection filesystem: the test wraps ``os.fsync``/``os.fdatasync``,
``mmap.mmap`` (its ``flush`` is msync) and the renames, and keeps a model of what a
power cut would leave: a file's bytes are durable as they were at its last
fsync (or, for an msync'ed range, at that msync), a directory's entries as they
were at its last fsync. The model is copied at the commit point (the rename of
``manifest.json``; for ``create`` and ``copy``, the rename of the finished store
into place). Every file of the store must then read, in that copy, exactly what it
holds after the operation: had the power failed just after the commit point, the
store on disk would be the one committed. Exempt, by design: ``LOCK`` (the owner's
name, informative), the root ``zarr.json`` (replaced after the commit point, and
checked durable at the end) and ``manifest.json`` itself (checked durable at the
end). Not durable by design, anywhere: ``LOCK``, ``index/progress`` (trusted only
within the boot that wrote it: ``_ledger/progress.py``) and sampler position files
(``EpochCursor.save``).
"""

from __future__ import annotations

import copy
import dataclasses
import mmap
import os
import stat
from pathlib import Path

import numpy as np
import pytest

import mmbuffer as mb
from mmbuffer._disk import files as _files
from mmbuffer._disk import format as fmt

EXEMPT = {"zarr.json", "manifest.json"}
BY_DESIGN = ("LOCK", "index/progress/c/0", "priority/touched/c/0")  # never synced, wherever they are (module docstring)


def _fd_path(fd: int) -> str:
    return os.readlink(f"/proc/self/fd/{fd}")


class DiskModel:
    """What a power cut leaves: ``files[ino]`` the bytes synced, ``dirs[ino]`` the
    entries synced (name -> ino); ``events`` the syncs and renames, in order."""

    def __init__(self) -> None:
        self.files: dict[int, bytearray] = {}
        self.dirs: dict[int, dict[str, int]] = {}
        self.events: list[tuple[str, str]] = []
        self.at_commit: tuple[dict, dict] | None = None
        self.commit_point: str | None = None  # the path whose rename is the commit point

    # -- what the wrappers record ---------------------------------------------------------
    def sync_path(self, path: str) -> None:
        st = os.lstat(path)
        if stat.S_ISDIR(st.st_mode):
            self.dirs[st.st_ino] = {e.name: e.inode() for e in os.scandir(path)}
        else:
            with open(path, "rb") as f:
                self.files[st.st_ino] = bytearray(f.read())
        self.events.append(("sync", path))

    def sync_range(self, path: str, ino: int, offset: int, size: int) -> None:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read(size)
        cur = self.files.setdefault(ino, bytearray())
        if len(cur) < offset + len(data):
            cur.extend(b"\0" * (offset + len(data) - len(cur)))
        cur[offset : offset + len(data)] = data
        self.events.append(("msync", path))

    def renamed(self, dst: str) -> None:
        self.events.append(("rename", dst))
        if self.commit_point is not None and os.path.realpath(dst) == os.path.realpath(self.commit_point):
            self.at_commit = (copy.deepcopy(self.files), copy.deepcopy(self.dirs))

    # -- the state a test starts from -----------------------------------------------------
    def assume_durable(self, root: Path) -> None:
        """Everything under ``root`` as it is now (the previous commit's state)."""
        for dirpath, _, names in os.walk(root):
            self.sync_path(dirpath)
            for name in names:
                self.sync_path(os.path.join(dirpath, name))
        self.events.clear()

    # -- the check ------------------------------------------------------------------------
    def lost(self, root: Path, model: tuple[dict, dict], exempt: set[str]) -> list[str]:
        """Files and directories under ``root`` whose content or name a power cut at
        ``model`` would lose, walking ``model``'s directory entries from ``root``."""
        files, dirs = model
        bad = []

        def walk(rel: str, ino: int) -> None:
            here = root / rel
            entries = dirs.get(ino)
            if entries is None:
                bad.append(f"{rel or '.'}/ (directory never synced)")
                return
            for e in os.scandir(here):
                sub = f"{rel}/{e.name}" if rel else e.name
                if sub in exempt or any(sub == d or sub.endswith("/" + d) for d in BY_DESIGN):
                    continue
                if entries.get(e.name) != e.inode():
                    bad.append(f"{sub} (its name is not durable in {rel or '.'}/)")
                elif e.is_dir(follow_symlinks=False):
                    walk(sub, e.inode())
                else:
                    data = Path(e.path).read_bytes()
                    got = bytes(files.get(e.inode(), b""))
                    if got != data:
                        diff = next((i for i, (a, b) in enumerate(zip(got, data)) if a != b), min(len(got), len(data)))
                        bad.append(f"{sub} (durable bytes differ from byte {diff}; {len(got)} vs {len(data)} bytes)")

        walk("", os.lstat(root).st_ino)
        return bad


@pytest.fixture
def disk(monkeypatch):
    model = DiskModel()
    real_fsync, real_fdatasync, real_rename, real_replace = os.fsync, os.fdatasync, os.rename, os.replace
    real_noreplace = _files.rename_noreplace

    def fsync(fd):
        real_fsync(fd)
        model.sync_path(_fd_path(fd))

    def fdatasync(fd):
        real_fdatasync(fd)
        model.sync_path(_fd_path(fd))

    def where(path, dir_fd):
        path = os.fsdecode(path)
        return path if dir_fd is None or os.path.isabs(path) else os.path.join(_fd_path(dir_fd), path)

    def rename(src, dst, *, src_dir_fd=None, dst_dir_fd=None):
        real_rename(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
        model.renamed(where(dst, dst_dir_fd))

    def replace(src, dst, *, src_dir_fd=None, dst_dir_fd=None):
        real_replace(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
        model.renamed(where(dst, dst_dir_fd))

    def rename_noreplace(src, dst):
        real_noreplace(src, dst)
        model.renamed(os.fspath(dst))

    class TracedMmap(mmap.mmap):
        def __new__(cls, fileno, length, *args, **kwargs):
            self = super().__new__(cls, fileno, length, *args, **kwargs)
            self.traced = (_fd_path(fileno), os.fstat(fileno).st_ino, kwargs.get("offset", 0))
            return self

        def flush(self, offset=0, size=None):
            out = super().flush(offset, len(self) - offset if size is None else size)
            path, ino, base = self.traced
            model.sync_range(path, ino, base + offset, len(self) - offset if size is None else size)
            return out

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "fdatasync", fdatasync)
    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(_files, "rename_noreplace", rename_noreplace)
    monkeypatch.setattr(mmap, "mmap", TracedMmap)
    return model


def _steps(start, n, lane):
    rows = start + np.arange(n)
    ends = rows % 7 == 6
    return ({"x": rows * 10 + lane, "y": np.stack([rows, -rows], 1).astype(np.float32), "terminated": ends},
            {"x": rows[ends] * 10 + lane + 1})


def _write(buf, blocks, n):
    for k in range(blocks):
        lane = k % buf.num_streams
        w = int(buf.view().written[lane])
        steps, final = _steps(w, n, lane)
        buf.extend(steps, stream=lane, final_obs=final)


@pytest.mark.parametrize("kind", ["raw", "prioritized", "compressed"])
def test_a_commit_syncs_every_file_it_wrote_before_the_manifest_rename(tmp_path, disk, monkeypatch, kind):
    """A store with a commit behind it extends over its ring (rows, final observations,
    episode ends, priorities, several compressed chunks), commits, and a power cut
    just after the rename of ``manifest.json`` would leave every file as committed."""
    monkeypatch.setattr(fmt, "config", dataclasses.replace(fmt.config, chunk_bytes=256))  # compressed: 32 rows per chunk file, several per lane
    path = tmp_path / "s"
    buf = mb.create(path, {"x": ((), "int64"), "y": ((2,), "float32")}, capacity=400, num_streams=2,
                    next_keys=("x",), compression="zstd" if kind == "compressed" else None,
                    priorities=mb.PriorityConfig() if kind == "prioritized" else None, attrs={"run": 1})
    _write(buf, 6, 50)
    buf.commit()
    disk.assume_durable(path)  # the previous commit (its own syncs are this test's subject too)
    disk.commit_point = str(path / "manifest.json")
    _write(buf, 8, 45)  # past a lane of 200 rows: the ring wraps over committed rows
    if kind == "prioritized":
        rows = buf.sample(64).indices
        buf.update_priorities(rows, np.arange(64, dtype=np.float64) + 1)
    buf.attrs = {"run": 2}
    before = dict((p.relative_to(path).as_posix(), p.read_bytes()) for p in path.rglob("*") if p.is_file())
    buf.commit()
    assert disk.at_commit is not None, "the commit never renamed manifest.json"
    after = {p.relative_to(path).as_posix(): p.read_bytes() for p in path.rglob("*") if p.is_file()}
    written = sorted(k for k in after if before.get(k) != after[k] or k not in before)
    # the test reached the state it claims: the commit wrote what it had to
    assert "manifest.json" in written
    data = [k for k in before if k.startswith("columns/x/")]
    assert data, "no column file"
    assert disk.lost(path, disk.at_commit, EXEMPT) == []
    assert disk.lost(path, (disk.files, disk.dirs), set()) == []  # and the manifest, zarr.json at the end
    if kind == "compressed":  # the chunk files were replaced (new inodes) and synced with their directories
        chunks = [k for k in after if k.startswith("columns/x/c/")]
        assert len(chunks) > 4, chunks
        synced = {os.path.relpath(p, path) for e, p in disk.events if e == "sync"}
        assert any(k in synced for k in chunks)
    buf.close()
    with mb.open(path, mode="r") as ro:
        assert ro.attrs == {"run": 2} and len(ro) > 0


def test_create_syncs_every_file_and_directory_before_the_store_appears(tmp_path, disk):
    """``mb.create`` lays a store out in a directory of its own and renames it into
    place: at that rename every file (zarr's metadata, the sparse shard files with
    their shard index, the manifest) and every directory is durable, and the new
    name is synced in the parent afterwards."""
    tmp_path.joinpath("p").mkdir()
    path = tmp_path / "p" / "s"
    disk.assume_durable(tmp_path / "p")
    disk.commit_point = str(path)
    for compression in (None, "zstd"):
        target = path if compression is None else tmp_path / "p" / "z"
        disk.commit_point, disk.at_commit = str(target), None
        mb.create(target, {"x": ((), "int64"), "y": ((2,), "float32")}, capacity=300, num_streams=3,
                  compression=compression, priorities=mb.PriorityConfig()).close()
        assert disk.at_commit is not None, "create never renamed the store into place"
        files = [p for p in target.rglob("*") if p.is_file()]
        assert len(files) > 10
        assert disk.lost(target, disk.at_commit, set()) == []
        assert disk.lost(tmp_path / "p", (disk.files, disk.dirs), set()) == []


def test_copy_syncs_every_file_before_the_copy_appears(tmp_path, disk):
    """``mb.convert.copy`` (raw to zstd and back) writes a store that is durable when
    it is renamed to its destination, and whose name is durable after."""
    src = tmp_path / "src"
    buf = mb.create(src, {"x": ((), "int64"), "y": ((2,), "float32")}, capacity=400, num_streams=2,
                    next_keys=("x",), priorities=mb.PriorityConfig())
    _write(buf, 10, 45)
    buf.close()
    out = tmp_path / "out"
    out.mkdir()
    disk.assume_durable(out)
    for name, compression in (("z", "zstd"), ("r", None)):
        dst = out / name
        disk.commit_point, disk.at_commit = str(dst), None
        mb.convert.copy(src if name == "z" else out / "z", dst, compression=compression, progress=False)
        assert disk.at_commit is not None, "copy never renamed its output into place"
        assert len([p for p in dst.rglob("*") if p.is_file()]) > 10
        assert disk.lost(dst, disk.at_commit, set()) == []
        assert disk.lost(out, (disk.files, disk.dirs), set()) == []
    with mb.open(out / "r", mode="r") as a, mb.open(src, mode="r") as b:
        assert a.episodes()[1].tolist() == b.episodes()[1].tolist()
