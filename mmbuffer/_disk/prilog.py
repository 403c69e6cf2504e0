"""The priority log: a commit's changed leaf values, appended to one file per checkpoint.

Format version 5 (``format.py``). A commit that changed priorities and is not a
*checkpoint* (``_ledger/touched.py``: the commit that writes the tree's pages) appends
one record to ``priority/log-<checkpoint>`` and fdatasyncs it before the manifest's
rename; ``manifest.json`` names the checkpoint and how many bytes of that file count
(``"priority_log": {"checkpoint": c, "bytes": n}``). Bytes past ``n`` (a commit killed
before its rename) are ignored and overwritten by the next record. A record::

    header  32 bytes, little-endian: magic b"MBPL", count (uint32), checkpoint (uint64),
            generation (uint64: the commit that wrote it), crc32 of the payload
            (uint32), crc32 of the header's first 28 bytes (uint32)
    payload count int64 row ids, then count float32 leaf values

The values are the leaves' absolute values at that commit, so replaying a range of
records in order (``tree.update(rows, values)``, duplicates resolve to the last) onto
the checkpoint's tree gives the committed tree, whatever was applied before.

A store is untrusted input: a record that is cut short, has another magic or
checkpoint, or whose checksums or row ids are wrong inside the committed range, and a
committed length past the file's end, are ``CorruptStoreError`` naming the file, the
byte offset, the expected and the received value.

>>> import tempfile, numpy as np
>>> from pathlib import Path
>>> root = Path(tempfile.mkdtemp()); (root / "priority").mkdir()
>>> rec = encode(0, 7, np.array([3, 5]), np.array([0.5, 2.0], np.float32))
>>> append(root, 0, 0, rec)
>>> rows, values = read(root, 0, 0, len(rec), capacity=8)
>>> rows.tolist(), values.tolist()
([3, 5], [0.5, 2.0])
"""

from __future__ import annotations

import errno
import os
import re
import struct
import zlib
from pathlib import Path

import numpy as np

from . import files as _files, rawio as _rawio, safe_io as _safe_io
from .. import errors

MAGIC = b"MBPL"
HEADER = struct.Struct("<4sIQQII")
PAIR_BYTES = 12  # an int64 row id and a float32 value
MAX_COUNT = (1 << 32) - 1
_NAME = re.compile(r"^log-[0-9]+$")


def name(checkpoint: int) -> str:
    """The log file of ``checkpoint``, relative to the store."""
    return f"priority/log-{checkpoint}"


def record_bytes(count: int) -> int:
    """Bytes of a record of ``count`` pairs."""
    return HEADER.size + PAIR_BYTES * count


def encode(checkpoint: int, generation: int, rows: np.ndarray, values: np.ndarray) -> bytes:
    """One record: the header, then the row ids (int64) and the values (float32)."""
    count = len(rows)
    if count > MAX_COUNT:
        raise errors.CapacityError(f"priority log: expected at most {MAX_COUNT} pairs per record, got {count}")
    payload = np.ascontiguousarray(rows, dtype="<i8").tobytes() + np.ascontiguousarray(values, dtype="<f4").tobytes()
    head = HEADER.pack(MAGIC, count, checkpoint, generation, zlib.crc32(payload), 0)[:-4]
    return head + struct.pack("<I", zlib.crc32(head)) + payload


def append(root: Path, checkpoint: int, offset: int, record: bytes) -> None:
    """Write ``record`` at byte ``offset`` of the checkpoint's log file (created if
    missing, its directory then synced) and fdatasync it: durable before it returns."""
    rel = name(checkpoint)
    created = not _safe_io.lexists(root, rel)
    fd = _safe_io.open_file(root, rel, os.O_WRONLY | os.O_CREAT)
    try:
        _rawio.pwrite_all(fd, record, offset)
        os.fdatasync(fd)
    finally:
        os.close(fd)
    if created:
        _files.fsync_dir(root / "priority")


def open_log(root: Path, checkpoint: int, nbytes: int) -> int | None:
    """A descriptor of the checkpoint's log that should hold ``nbytes`` (None when
    ``nbytes`` is 0): a reader keeps it, so a log the writer removes after a newer
    checkpoint still reads whole."""
    if nbytes == 0:
        return None
    rel = name(checkpoint)
    try:
        fd = _safe_io.open_file(root, rel)
    except errors.CorruptStoreError:
        if not _safe_io.lexists(root, rel):
            raise errors.CorruptStoreError(
                f"{root / rel}: expected the priority log the manifest names ({nbytes} committed bytes), got no file"
            ) from None
        raise
    return fd  # its length is checked when read (read_fd): a reader that samples uniformly never reads it


def read_fd(fd: int, where: str, checkpoint: int, start: int, stop: int, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """The (rows, values) of the records in bytes ``[start, stop)`` of an open log, in
    order, checked (see the module docstring)."""
    data = bytearray(stop - start)
    got = _rawio.pread_into(fd, memoryview(data), start)
    if got < len(data):
        raise errors.CorruptStoreError(f"{where}: expected at least {stop} bytes (the manifest's committed length), got {start + got}")
    rows: list[np.ndarray] = []
    values: list[np.ndarray] = []
    at = 0
    while at < len(data):
        off = start + at
        if len(data) - at < HEADER.size:
            raise errors.CorruptStoreError(f"{where}: record at byte {off}: expected a {HEADER.size}-byte header, got {len(data) - at} bytes")
        magic, count, ckpt, _gen, crc, head_crc = HEADER.unpack_from(data, at)
        if magic != MAGIC:
            raise errors.CorruptStoreError(f"{where}: record at byte {off}: expected magic {MAGIC!r}, got {bytes(magic)!r}")
        if zlib.crc32(data[at : at + HEADER.size - 4]) != head_crc:
            raise errors.CorruptStoreError(f"{where}: record at byte {off}: expected header crc32 {head_crc:#010x}, got another")
        if ckpt != checkpoint:
            raise errors.CorruptStoreError(f"{where}: record at byte {off}: expected checkpoint {checkpoint}, got {ckpt}")
        end = at + record_bytes(count)
        if end > len(data):
            raise errors.CorruptStoreError(
                f"{where}: record at byte {off}: expected {record_bytes(count)} bytes inside the committed length {stop}, got {len(data) - at}"
            )
        payload = memoryview(data)[at + HEADER.size : end]
        if zlib.crc32(payload) != crc:
            raise errors.CorruptStoreError(f"{where}: record at byte {off}: expected payload crc32 {crc:#010x}, got {zlib.crc32(payload):#010x}")
        r = np.frombuffer(payload[: 8 * count], dtype="<i8").astype(np.int64)
        v = np.frombuffer(payload[8 * count :], dtype="<f4").astype(np.float32)
        bad = (r < 0) | (r >= capacity) | ~np.isfinite(v) | (v < 0)
        if bad.any():
            k = int(np.flatnonzero(bad)[0])
            raise errors.CorruptStoreError(
                f"{where}: record at byte {off}: expected row ids in [0, {capacity}) and finite values >= 0, got row {r[k]} value {v[k]}"
            )
        rows.append(r)
        values.append(v)
        at = end
    if not rows:
        return np.empty(0, np.int64), np.empty(0, np.float32)
    return np.concatenate(rows), np.concatenate(values)


def read(root: Path, checkpoint: int, start: int, stop: int, *, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """The (rows, values) of bytes ``[start, stop)`` of the checkpoint's log (see
    :func:`read_fd`); nothing to read when ``stop`` is 0."""
    fd = open_log(root, checkpoint, stop)
    if fd is None:
        return np.empty(0, np.int64), np.empty(0, np.float32)
    try:
        return read_fd(fd, str(root / name(checkpoint)), checkpoint, start, stop, capacity)
    finally:
        os.close(fd)


def remove_others(root: Path, keep: int) -> None:
    """Remove the log files of checkpoints other than ``keep`` (only names this module
    writes, ``log-<digits>``, regular files: nothing else in ``priority/``)."""
    try:
        names = os.listdir(root / "priority")
    except OSError:
        return
    for n in names:
        if _NAME.match(n) and n != f"log-{keep}":
            try:
                if _safe_io.lexists(root, f"priority/{n}"):
                    os.unlink(root / "priority" / n)
            except (OSError, errors.CorruptStoreError) as exc:
                if getattr(exc, "errno", None) not in (None, errno.ENOENT):
                    raise
