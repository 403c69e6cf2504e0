"""Where a converter's output goes: refuse what is not ours, and swap the new output in safely.

Every converter (``convert``, ``copy``, ``export``) builds its output at
``DST.partial`` and moves it to ``DST`` at the end. ``overwrite=True`` replaces
only an output mmbuffer itself could have written there, of the kind being
written (``kind``):

* ``"store"``: a directory (not a link) whose ``manifest.json`` (a regular file)
  says ``"format": "mmbuffer"`` and whose entries are all names a store has
  (``zarr.json``, ``manifest.json``, ``columns``, ``final``, ``index``,
  ``priority``, ``sampler``, ``LOCK``...). A directory that also holds anything
  else (``results.csv``) is not ours: mmbuffer never wrote that file, and
  deleting the directory would delete it. A store whose writer lock is held by
  a live process is refused too.
* ``"d4rl"``: a regular file that starts with the HDF5 signature and holds
  ``observations``, ``actions`` and ``rewards``.
* ``"minari"``: a directory holding only ``data/``, whose ``metadata.json`` is
  a JSON object with ``total_episodes`` and ``total_steps``, next to
  ``main_data.hdf5`` or episode directories and nothing else.
* ``"diffusion_policy"``: a Zarr group directory (``.zgroup`` or ``zarr.json``)
  holding only ``data/``, ``meta/`` and Zarr metadata files, or a zip archive
  (``.zarr.zip``) holding ``meta/episode_ends``.

An empty directory is replaced too (nothing is lost). Anything else at ``DST`` (another kind of file or directory, a symbolic link,
which is never followed for deletion) is refused with
:class:`~mmbuffer.errors.StoreExistsError` naming the path and what was found,
before any work is done, and checked again just before the swap. A stale
``DST.partial`` is removed only when it looks like an interrupted output of the
same kind (the same rules, with the manifest or metadata allowed to be missing).

The swap never leaves ``DST`` half written: a file is moved over the old one with
one ``rename``; a directory is exchanged with the old one atomically
(``renameat2(RENAME_EXCHANGE)``, Linux) and the old one, now at ``DST.partial``,
is deleted afterwards. Where the exchange is not available the old directory is
renamed aside to ``DST.old-<pid>`` first, the new one renamed in, and the old one
deleted (a crash between the two renames leaves both, under those names).
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import stat
from pathlib import Path

from ...errors import StoreExistsError

__all__ = ["check_destination", "partial_path", "remove_partial", "replace_destination", "KINDS"]

#: Output kinds a converter writes.
KINDS = ("store", "d4rl", "minari", "diffusion_policy")

#: Entries of a store directory (``_disk/format.py``), with the temporary names of its writers.
_STORE_ENTRIES = frozenset({
    "zarr.json", "zarr.json.partial", "manifest.json", "manifest.json.partial", "columns", "final", "index",
    "priority", "sampler", "LOCK",
})
_HDF5_MAGIC = b"\x89HDF\r\n\x1a\n"
_D4RL_KEYS = ("observations", "actions", "rewards")
_RENAME_EXCHANGE = 2


def partial_path(dst: Path) -> Path:
    """Where the output ``dst`` is built before it is moved into place."""
    return dst.with_name(dst.name + ".partial")


def check_destination(dst: str | os.PathLike[str], overwrite: bool, kind: str = "store") -> Path:
    """Refuse ``dst`` if it exists, unless ``overwrite`` and it is an output of ``kind``.

    Raises
    ------
    StoreExistsError
        ``dst`` exists and ``overwrite`` is false, or it holds something mmbuffer
        did not write (see the module docstring); nothing is changed.
    """
    path = Path(dst)
    partial = partial_path(path)
    if _lexists(partial):  # removed later; refused now, before any work, if it is not ours
        _check_partial(partial, kind)
    if not _lexists(path):
        return path
    if not overwrite:
        raise StoreExistsError(
            f"{path}: output already exists (pass overwrite=True / --overwrite to replace it)"
        )
    problem = _not_ours(path, kind, partial=False)
    if problem:
        raise StoreExistsError(
            f"{path}: overwrite refused: expected {_WHAT[kind]} as mmbuffer writes it, got {problem}; "
            "nothing was changed (remove or move it yourself)"
        )
    return path


def remove_partial(partial: Path, kind: str = "store") -> None:
    """Delete a stale ``partial`` output of ``kind`` (refuse anything else)."""
    if not _lexists(partial):
        return
    _check_partial(partial, kind)
    _delete(partial)


def replace_destination(partial: Path, dst: Path, kind: str = "store", *, overwrite: bool = True) -> None:
    """Move the finished ``partial`` to ``dst``, replacing an older output there safely."""
    if _lexists(dst):
        check_destination(dst, overwrite, kind)  # again: something may have appeared meanwhile
        if partial.is_dir():
            if _exchange(partial, dst):
                _fsync_dir(dst.parent)
                _delete(partial)  # the old output, now at the partial path
                return
            old = _unused(dst.with_name(f"{dst.name}.old-{os.getpid()}"))
            os.rename(dst, old)
            os.rename(partial, dst)
            _fsync_dir(dst.parent)
            _delete(old)
            return
    os.replace(partial, dst)  # a file replaces a file in one step
    _fsync_dir(dst.parent)


def _check_partial(partial: Path, kind: str) -> None:
    problem = _not_ours(partial, kind, partial=True)
    if problem:
        raise StoreExistsError(
            f"{partial}: expected an unfinished {_WHAT[kind]} from an interrupted mmbuffer run, "
            f"got {problem}; nothing was changed (remove or move it yourself)"
        )


_WHAT = {"store": "an mmbuffer store", "d4rl": "a D4RL HDF5 file", "minari": "a Minari dataset directory",
         "diffusion_policy": "a Diffusion Policy Zarr group"}


def _lexists(path: Path) -> bool:
    return os.path.lexists(path)


def _describe(path: Path) -> str:
    """What sits at ``path``, in words (for messages)."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        return f"a symbolic link to {os.readlink(path)!r} (links are never followed for deletion)"
    if stat.S_ISDIR(st.st_mode):
        return "a directory"
    if stat.S_ISREG(st.st_mode):
        from .sniff import sniff

        return sniff(path)
    return "a special file"


def _not_ours(path: Path, kind: str, *, partial: bool) -> str:
    """Why ``path`` is not an output of ``kind`` ("" when it is)."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
        return _describe(path)
    if kind == "d4rl":
        return _not_d4rl(path, partial=partial)
    if kind == "diffusion_policy" and stat.S_ISREG(st.st_mode):
        return _not_diffusion_zip(path, partial=partial)
    if not stat.S_ISDIR(st.st_mode):
        return _describe(path)
    if not os.listdir(path):
        return ""  # an empty directory: replacing it deletes nothing
    if kind == "store":
        return _not_store(path, partial=partial)
    if kind == "minari":
        return _not_minari(path, partial=partial)
    if kind == "diffusion_policy":
        return _not_diffusion(path, partial=partial)
    raise ValueError(f"kind: expected one of {KINDS}, got {kind!r}")  # pragma: no cover - internal


def _entries(path: Path) -> list[str]:
    return sorted(os.listdir(path))


def _regular_file(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


def _json_object(path: Path) -> dict[str, object] | None:
    if not _regular_file(path):
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as f:
            value = json.loads(f.read(1 << 24))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _not_store(path: Path, *, partial: bool) -> str:
    extra = [e for e in _entries(path) if e not in _STORE_ENTRIES]
    if extra:
        return f"a directory holding {_listing(extra)}, which an mmbuffer store never holds"
    manifest = path / "manifest.json"
    if not partial or _lexists(manifest):
        got = _json_object(manifest)
        if got is None or got.get("format") != "mmbuffer":
            return "a directory with no manifest.json of format 'mmbuffer'"
    if _writer_alive(path / "LOCK"):
        return "a store whose writer lock is held by a running process"
    return ""


def _not_d4rl(path: Path, *, partial: bool) -> str:
    if not _regular_file(path):
        return _describe(path)
    with open(path, "rb") as f:
        head = f.read(len(_HDF5_MAGIC))
    if partial and len(head) < len(_HDF5_MAGIC) and _HDF5_MAGIC.startswith(head):
        return ""  # killed before the signature was written
    if head != _HDF5_MAGIC:
        return _describe(path)
    if partial:
        return ""
    try:
        import h5py

        with h5py.File(path, "r") as f:
            missing = [k for k in _D4RL_KEYS if k not in f]
    except OSError as exc:
        return f"an unreadable HDF5 file ({exc})"
    if missing:
        return f"an HDF5 file without D4RL's {', '.join(missing)} (not a D4RL dataset)"
    return ""


def _not_minari(path: Path, *, partial: bool) -> str:
    extra = [e for e in _entries(path) if e != "data"]
    if extra:
        return f"a directory holding {_listing(extra)}, which a Minari dataset written by mmbuffer never holds"
    data = path / "data"
    if not _lexists(data):
        return "" if partial else "a directory with no data/ (not a Minari dataset)"
    if not stat.S_ISDIR(os.lstat(data).st_mode):
        return f"a directory whose data is {_describe(data)}"
    extra = [e for e in _entries(data) if not _minari_entry(data, e)]
    if extra:
        return f"a Minari-like directory whose data/ also holds {_listing(extra)}"
    meta = data / "metadata.json"
    if partial and not _lexists(meta):
        return ""
    got = _json_object(meta)
    if got is None or "total_episodes" not in got or "total_steps" not in got:
        return "a directory whose data/metadata.json is not Minari metadata (total_episodes, total_steps)"
    return ""


def _not_diffusion(path: Path, *, partial: bool) -> str:
    extra = [e for e in _entries(path) if e not in (".zgroup", ".zattrs", "zarr.json", "data", "meta")]
    if extra:
        return f"a directory holding {_listing(extra)}, which a Diffusion Policy group written by mmbuffer never holds"
    for name in ("data", "meta"):
        sub = path / name
        if _lexists(sub) and not stat.S_ISDIR(os.lstat(sub).st_mode):
            return f"a directory whose {name} is {_describe(sub)}"
    if partial:
        return ""
    if not (_regular_file(path / ".zgroup") or _regular_file(path / "zarr.json")) or not _lexists(path / "meta"):
        return "a directory that is not a Zarr group with meta/ (not a Diffusion Policy dataset)"
    return ""


def _not_diffusion_zip(path: Path, *, partial: bool) -> str:
    import zipfile

    with open(path, "rb") as f:
        head = f.read(4)
    if partial and len(head) < 4:
        return ""  # killed before the first entry was written
    if head not in (b"PK\x03\x04", b"PK\x05\x06"):
        return _describe(path)
    try:
        with zipfile.ZipFile(path) as z:
            names = z.namelist()
    except zipfile.BadZipFile as exc:
        return "" if partial else f"an unreadable zip archive ({exc})"
    if not partial and not any(n.startswith("meta/episode_ends/") for n in names):
        return "a zip archive without meta/episode_ends (not a Diffusion Policy .zarr.zip)"
    return ""


def _minari_entry(data: Path, name: str) -> bool:
    if name in ("metadata.json", "main_data.hdf5"):
        return _regular_file(data / name)
    is_episode = name.isdigit() or (name.startswith("episode_id=") and name[11:].isdigit())
    return is_episode and stat.S_ISDIR(os.lstat(data / name).st_mode)


def _listing(names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:5])
    return shown + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def _writer_alive(lock: Path) -> bool:
    """Whether a process holds the store's writer lock (tested without taking it for long)."""
    import fcntl

    try:
        fd = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing releases the shared lock
    return False


def _unused(path: Path) -> Path:
    n = 0
    candidate = path
    while _lexists(candidate):
        n += 1
        candidate = path.with_name(f"{path.name}.{n}")
    return candidate


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux ``renameat2``); False where it is not available."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    rc = fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, f"renameat2({a}, {b}, RENAME_EXCHANGE): {os.strerror(err)}")


def _delete(path: Path) -> None:
    """Delete a file or a directory tree (links inside are removed, never followed)."""
    if stat.S_ISDIR(os.lstat(path).st_mode):
        shutil.rmtree(path)
    else:
        path.unlink()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
