"""The writer contract: write, verify by read-back, rename into place.

Every output of this package (a store from a converter, a re-encoded store
from :func:`~mmbuffer.convert.copy`, a D4RL file or a Minari dataset from an
export) is produced by a :class:`Writer` driven by :func:`write_and_verify`,
which owns the frame around it:

1. refuse an existing destination unless ``overwrite`` and it is an output of
   the writer's ``kind`` (:func:`._dest.check_destination`);
2. :meth:`Writer.open` the source and refuse what cannot be written (nothing
   on disk has changed yet);
3. remove a stale ``DST.partial`` of that kind, then :meth:`Writer.write`
   everything into ``DST.partial``, streamed a chunk at a time (a writer may
   read each chunk back as it goes); on any error the partial output is
   removed, unless the error is a :class:`Mismatch` (kept for inspection);
4. :meth:`Writer.close` the source;
5. :meth:`Writer.verify` the finished partial output by reading it back (a
   :class:`Mismatch` leaves it in place);
6. rename it to ``DST`` (:func:`._dest.replace_destination`, which replaces an
   older output of the same kind safely).

The module also holds the checksum and progress helpers the writers share.
"""

from __future__ import annotations

import os
import warnings
import zlib
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import ConversionError, StoreExistsError
from ..._disk.urls import local_path
from .dest import check_destination, partial_path, remove_partial, replace_destination
from .reader import ConversionWarning

__all__ = [
    "SEGMENT_BYTES",
    "Mismatch",
    "Writer",
    "as_bytes",
    "crc_hex",
    "crc_update",
    "mismatch",
    "progress_bar",
    "same_bytes",
    "write_and_verify",
]

#: Rows written (or read) between two ``Buffer.release_memory`` calls: the pages
#: touched through the maps are unmapped, so resident memory stays about this size.
SEGMENT_BYTES = 256 << 20


class Mismatch(ConversionError):
    """The output does not hold what the source held (the partial output is kept);
    ``problem``: the message without that remark."""

    def __init__(self, problem: str) -> None:
        super().__init__(f"{problem} (the partial store is left for inspection)")
        self.problem = problem


def mismatch(path: Path, what: str, expected: Any, got: Any) -> Mismatch:
    """A :class:`Mismatch` naming ``path``, what differs, and the expected and received value."""
    return Mismatch(f"{path}: verification failed: {what}: expected {expected}, got {got}")


class Writer(ABC):
    """One output being produced; :func:`write_and_verify` calls the steps in order.

    ``kind`` is the output's kind for :mod:`._dest` (``"store"``, ``"d4rl"``,
    ``"minari"``): which existing outputs ``overwrite`` may replace.
    """

    kind: str = "store"

    def __init__(self) -> None:
        #: Issued as :class:`ConversionWarning` after writing, before verifying.
        self.notes: list[str] = []

    def open(self) -> None:  # noqa: B027 - optional step
        """Open the source and refuse what cannot be written; nothing on disk changes."""

    @abstractmethod
    def write(self, partial: Path) -> None:
        """Write the whole output at ``partial``, streamed; close what it opened there."""

    def abort(self) -> None:  # noqa: B027 - optional step
        """After an error in :meth:`write`: close the output, if still open."""

    def close(self) -> None:  # noqa: B027 - optional step
        """Close the source (idempotent)."""

    @abstractmethod
    def verify(self, partial: Path) -> None:
        """Read the finished output at ``partial`` back; raise :class:`Mismatch` on a difference."""


def write_and_verify(
    writer: Writer, dst: str | os.PathLike[str], *, overwrite: bool, verify: bool
) -> Path:
    """Run ``writer`` in the frame of the module docstring; return the destination path.

    Raises
    ------
    StoreExistsError
        ``dst`` exists and ``overwrite`` is false, or it (or ``DST.partial``)
        holds something this package did not write.
    ConversionError
        From the writer: bad input, or a verification :class:`Mismatch`.
    """
    try:
        dst_path = check_destination(local_path(dst, "dst", hint="publish stores to URLs with mb.convert.copy"), overwrite, writer.kind)
        partial = partial_path(dst_path)
        writer.open()
        remove_partial(partial, writer.kind)
        try:
            writer.write(partial)
        except BaseException as exc:
            _discard(writer, partial, exc)
            raise
    finally:
        writer.close()
    for note in writer.notes:
        warnings.warn(note, ConversionWarning, stacklevel=3)
    if verify:
        writer.verify(partial)
    replace_destination(partial, dst_path, writer.kind, overwrite=overwrite)
    return dst_path


def _discard(writer: Writer, partial: Path, exc: BaseException) -> None:
    """After ``exc``: close the output and delete it, unless ``exc`` is a :class:`Mismatch`."""
    try:
        writer.abort()
    except Exception:
        pass  # exc is the error to report
    if not isinstance(exc, Mismatch):
        try:
            remove_partial(partial, writer.kind)
        except StoreExistsError:
            pass  # not recognisably ours any more: left alone; exc is the error to report


# -- shared helpers ------------------------------------------------------------------------
def progress_bar(total: int, desc: str, enabled: bool) -> Any:
    """A tqdm bar of ``total`` rows on stderr (a silent one unless ``enabled``)."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="row", unit_scale=True, disable=not enabled, leave=False)


def as_bytes(arr: np.ndarray) -> memoryview | bytes:
    """The bytes of ``arr`` in C order, for a checksum (no copy when already contiguous)."""
    a = np.ascontiguousarray(arr)
    if a.size == 0:
        return b""
    return a.data.cast("B")


def crc_update(crc: dict[str, int], name: str, arr: np.ndarray) -> None:
    """Add ``arr``'s bytes to the running CRC-32 ``crc[name]``."""
    crc[name] = zlib.crc32(as_bytes(arr), crc.get(name, 0))


def crc_hex(v: int) -> str:
    """A CRC-32 as 8 hex digits."""
    return f"{v & 0xFFFFFFFF:08x}"


def same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two C-contiguous arrays hold the same bytes (NaN payloads included)."""
    x, y = a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8)
    if len(x) != len(y):
        return False
    k = len(x) // 8 * 8  # eight bytes a comparison: about 10 GB/s
    return bool(np.array_equal(x[:k].view(np.uint64), y[:k].view(np.uint64)) and np.array_equal(x[k:], y[k:]))
