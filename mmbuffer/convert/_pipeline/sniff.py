"""What a source path holds, told from its first bytes, for "expected X, found Y" errors.

Readers call :func:`expect` before handing a file to a parser (h5py, zipfile,
``torch.load``), so a wrong-format input gets a one-line
:class:`~mmbuffer.errors.ConversionError` that says what was expected and what
was found, not a parser's traceback (``KeyError: 101`` from ``torch.load`` on a
text file) or a misleading message ("untrusted pickle" for an HDF5 file).

>>> import tempfile, pathlib
>>> p = pathlib.Path(tempfile.mkdtemp()) / "notes.txt"
>>> _ = p.write_text("hello")
>>> sniff(p)
'a text file'
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from ...errors import ConversionError

__all__ = ["sniff", "expect", "HDF5", "ZIP", "PICKLE"]

HDF5 = "hdf5"
ZIP = "zip"
PICKLE = "pickle"
_SIGNATURES = (
    (b"\x89HDF\r\n\x1a\n", HDF5, "an HDF5 file"),
    (b"PK\x03\x04", ZIP, "a zip archive (a torch.save file or an .npz)"),
    (b"PK\x05\x06", ZIP, "an empty zip archive"),
    (b"\x93NUMPY", "npy", "a .npy array file"),
    (b"PAR1", "parquet", "a Parquet file"),
    (b"ARROW1", "arrow", "an Arrow file"),
    (b"\x1f\x8b", "gzip", "a gzip file"),
    (b"\x28\xb5\x2f\xfd", "zstd", "a zstd file"),
    (b"\x80", PICKLE, "a pickle (a legacy torch.save file?)"),
)


def kind_of(path: Path) -> str:
    """A short name for what ``path`` holds: ``hdf5``, ``zip``, ``pickle``, ``json``, ``text``, ..."""
    return _look(path)[0]


def sniff(path: str | os.PathLike[str]) -> str:
    """What ``path`` holds, in words (``"an HDF5 file"``, ``"a directory"``, ``"a text file"``...)."""
    return _look(Path(path))[1]


def _look(path: Path) -> tuple[str, str]:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return "missing", "nothing (no such file or directory)"
    if stat.S_ISLNK(st.st_mode):
        try:
            st = os.stat(path)
        except OSError:
            return "link", "a broken symbolic link"
    if stat.S_ISDIR(st.st_mode):
        return "directory", "a directory"
    if not stat.S_ISREG(st.st_mode):
        return "special", "a special file"
    if st.st_size == 0:
        return "empty", "an empty file"
    try:
        with open(path, "rb") as f:
            head = f.read(512)
    except OSError as exc:
        return "unreadable", f"an unreadable file ({exc.strerror})"
    for magic, kind, words in _SIGNATURES:
        if head.startswith(magic):
            return kind, words
    text = head.lstrip()
    if text[:1] in (b"{", b"["):
        return "json", "a JSON file"
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.start < len(head) - 4:  # not just a character cut at the 512th byte
            return "binary", "a binary file of unknown format"
    return "text", "a text file" if not head.startswith(b"\x00") else "a binary file of unknown format"


def expect(path: Path, kinds: tuple[str, ...], expected: str) -> str:
    """The kind of ``path`` if it is one of ``kinds``; else a ConversionError "expected ..., found ...".

    ``kinds`` may hold ``"file"`` (any regular file) or ``"directory"``.
    """
    kind, words = _look(path)
    regular = kind not in ("missing", "link", "directory", "special")
    if kind in kinds or ("file" in kinds and regular):
        return kind
    raise ConversionError(f"{path}: expected {expected}, found {words}")
